//! The task state machine as plain data: the states a task row can be in, which changes between
//! them are legal, and which rows keep their device busy. No I/O; the store enforces these rules
//! inside its write transactions, and the engine may ask them before it tries.
//!
//! ```text
//!   create ──> prepare ──> running ──> success          (device idle again; kept as last result)
//!                 │          │  ↺ progress
//!                 └──────────┴───> error ──reset──> error, reset   (idle again)
//! ```
//!
//! `prepare -> success` is refused on purpose: every successful task ran at least one step, so a
//! success always has a `started_ms` and a last step to show. A task with nothing to do reports
//! one step ("already split", 100%) and then succeeds.

use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

/// Where a task is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// Accepted and being validated; no change to the device yet. Blocks the device.
    Prepare,
    /// Working through its steps; `step` and `percent` say where. Blocks the device.
    Running,
    /// Finished as asked. Final; the device is idle again and the task is its last result.
    Success,
    /// Failed, or interrupted by a vfiod stop. Final, but the device stays blocked (the hardware
    /// may be half-changed) until an operator resets the task; the row then keeps this state and
    /// gains `reset_ms`/`reset_by`.
    Error,
}

text_enum!(TaskState as "task state",
    Prepare => "prepare", Running => "running", Success => "success", Error => "error");

impl TaskState {
    /// The task's work is over (success or error): no further progress or outcome is accepted.
    pub fn is_final(self) -> bool {
        matches!(self, TaskState::Success | TaskState::Error)
    }

    /// Whether a task in this state may move to `next`; see [`transition`].
    pub fn can_become(self, next: TaskState) -> bool {
        transition(self, next)
    }
}

/// The legal state changes of a task. `running -> running` is a progress report (new step or
/// percentage). Reset is not a state change (the row stays `error`): see [`can_reset`].
pub fn transition(from: TaskState, to: TaskState) -> bool {
    use TaskState::*;
    matches!(
        (from, to),
        (Prepare, Running)
            | (Prepare, Error)
            | (Running, Running)
            | (Running, Success)
            | (Running, Error)
    )
}

/// Only a task in error that nobody has reset yet can be reset.
pub fn can_reset(state: TaskState, already_reset: bool) -> bool {
    state == TaskState::Error && !already_reset
}

/// Whether a task row keeps its device busy: unfinished, or failed and not yet reset. The store's
/// SQL (`ACTIVE` and the unique index of migration 2) says the same thing; a test keeps them equal.
pub fn is_active(state: TaskState, reset: bool) -> bool {
    match state {
        TaskState::Prepare | TaskState::Running => true,
        TaskState::Error => !reset,
        TaskState::Success => false,
    }
}

#[cfg(test)]
mod tests {
    use super::TaskState::*;
    use super::*;

    #[test]
    fn transitions_table() {
        // Every (from, to) pair, written out: adding a state forces a decision here.
        let table = [
            (Prepare, Prepare, false),
            (Prepare, Running, true),
            (Prepare, Success, false),
            (Prepare, Error, true),
            (Running, Prepare, false),
            (Running, Running, true),
            (Running, Success, true),
            (Running, Error, true),
            (Success, Prepare, false),
            (Success, Running, false),
            (Success, Success, false),
            (Success, Error, false),
            (Error, Prepare, false),
            (Error, Running, false),
            (Error, Success, false),
            (Error, Error, false),
        ];
        assert_eq!(table.len(), TaskState::ALL.len() * TaskState::ALL.len());
        for (from, to, legal) in table {
            assert_eq!(transition(from, to), legal, "{from} -> {to}");
            assert_eq!(from.can_become(to), legal, "{from} -> {to}");
        }
    }

    #[test]
    fn final_states_have_no_way_out() {
        for &from in TaskState::ALL {
            let exits = TaskState::ALL.iter().any(|&to| transition(from, to));
            assert_eq!(from.is_final(), !exits, "{from}");
        }
    }

    #[test]
    fn reset_and_activity() {
        let table = [
            // state, reset, can_reset, is_active
            (Prepare, false, false, true),
            (Running, false, false, true),
            (Success, false, false, false),
            (Error, false, true, true),
            (Error, true, false, false),
        ];
        for (state, reset, resettable, active) in table {
            assert_eq!(can_reset(state, reset), resettable, "{state} reset={reset}");
            assert_eq!(is_active(state, reset), active, "{state} reset={reset}");
        }
    }

    #[test]
    fn states_round_trip_as_text() {
        for &state in TaskState::ALL {
            assert_eq!(state.as_str().parse::<TaskState>().unwrap(), state);
            assert_eq!(
                serde_json::to_string(&state).unwrap(),
                format!("\"{state}\"")
            );
        }
        let err = "done".parse::<TaskState>().unwrap_err();
        assert!(err.contains("prepare, running"), "{err}");
    }
}
