//! Whether a run of the hook may still be carried out, decided: its deadline and its order among
//! the runs for the same domain. Pure but for [`Stamp::now`]: every decision takes its moments as
//! arguments.
//!
//! The hook process gives up at its deadline and answers alone (a start it cannot check is
//! refused; a notification passes "not recorded"). A run vfiod carries out after that would
//! contradict the answer libvirt acted on: claims for a VM libvirt never started, or a `release`
//! overtaken by the `prepare` sent before it. So the hook sends, with each run, when it was sent
//! and its deadline on the host's monotonic clock, and vfiod:
//!
//! | when                                                        | what vfiod does                              |
//! |-------------------------------------------------------------|----------------------------------------------|
//! | before it starts: the deadline has passed                   | nothing; answers [`Admit::TooLate`]           |
//! | before it starts: a run for the domain sent later was seen  | nothing; answers [`Admit::Overtaken`]         |
//! | after it has done the work: the deadline has passed         | undoes what this run did, answers refused     |
//! | otherwise                                                   | the work, and its answer                     |
//!
//! libvirt runs a domain's hooks one after the other, waiting for each: two runs for one domain
//! are in flight at once only when the hook gave up on the first. vfiod serves a domain's runs
//! one at a time in the order they reach it, and the stamps say the order they were sent in.

use std::time::Duration;

/// A moment on the host's monotonic clock (`CLOCK_MONOTONIC`), in milliseconds: the hook
/// process and vfiod read the same clock, which the wall clock's jumps do not move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp(pub u64);

impl Stamp {
    /// Now, on the host's monotonic clock.
    pub fn now() -> Stamp {
        Stamp(crate::host::clock::monotonic_ms())
    }

    pub fn after(self, d: Duration) -> Stamp {
        Stamp(
            self.0
                .saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        )
    }

    /// How long from `self` until `later` (zero if it is not later).
    pub fn until(self, later: Stamp) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }
}

/// When a run was sent and when the hook stops waiting for vfiod's answer to it. vfiod's own
/// deadline (`vfiod_deadline`) is a little earlier, so that an answer given in time also reaches
/// the hook in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub sent: Stamp,
    /// The last moment vfiod may answer with work done.
    pub deadline: Stamp,
}

/// How much of a hook's deadline it keeps for vfiod's answer to travel back (and the hook to
/// read it): a tenth, at least 50 ms, at most half a second.
pub fn answer_margin(deadline: Duration) -> Duration {
    (deadline / 10).clamp(Duration::from_millis(50), Duration::from_millis(500))
}

impl Timing {
    /// The timing of a run sent at `sent` by a hook that waits `deadline` for the answer.
    pub fn of(sent: Stamp, deadline: Duration) -> Timing {
        let margin = answer_margin(deadline).min(deadline / 2);
        Timing {
            sent,
            deadline: sent.after(deadline - margin),
        }
    }
}

/// Whether a run may start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Go,
    /// Its deadline passed `late` ago: the hook has answered alone.
    TooLate {
        late: Duration,
    },
    /// A run for the same domain sent after it (at `newer`) was already answered: this one
    /// was given up on.
    Overtaken {
        newer: Stamp,
    },
}

/// Whether a run with `timing` may start at `now`, when the newest run seen for its domain was
/// sent at `newest` (none yet: `None`).
pub fn admit(now: Stamp, timing: Timing, newest: Option<Stamp>) -> Admit {
    if now >= timing.deadline {
        return Admit::TooLate {
            late: timing.deadline.until(now),
        };
    }
    match newest {
        Some(newer) if newer > timing.sent => Admit::Overtaken { newer },
        _ => Admit::Go,
    }
}

/// Whether work done by `now` may still be answered as done: its deadline has not passed.
pub fn in_time(now: Stamp, timing: Timing) -> bool {
    now < timing.deadline
}

/// The newest run seen for a domain once a run sent at `sent` has been seen.
pub fn newest(seen: Option<Stamp>, sent: Stamp) -> Stamp {
    seen.map_or(sent, |s| s.max(sent))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn the_answer_keeps_a_margin_of_the_deadline() {
        // (the hook's deadline, vfiod's deadline after the send)
        for (hook, vfiod) in [
            (10_000, 9_500),
            (3_000, 2_700),
            (1_000, 900),
            (200, 150),
            (100, 50),
            (60_000, 59_500),
        ] {
            let t = Timing::of(Stamp(1000), MS(hook));
            assert_eq!(t.sent, Stamp(1000));
            assert_eq!(
                t.deadline,
                Stamp(1000 + vfiod),
                "a hook deadline of {hook} ms"
            );
        }
    }

    #[test]
    fn a_run_starts_only_in_time_and_in_order() {
        let t = Timing {
            sent: Stamp(1000),
            deadline: Stamp(2000),
        };
        // (now, newest seen for the domain, answer)
        let table = [
            (1000, None, Admit::Go),
            (1999, None, Admit::Go),
            (1999, Some(Stamp(1000)), Admit::Go),
            (1500, Some(Stamp(900)), Admit::Go),
            (2000, None, Admit::TooLate { late: MS(0) }),
            (12_000, None, Admit::TooLate { late: MS(10_000) }),
            // Late and overtaken: late says more (the hook has answered).
            (
                12_000,
                Some(Stamp(1500)),
                Admit::TooLate { late: MS(10_000) },
            ),
            (
                1500,
                Some(Stamp(1200)),
                Admit::Overtaken { newer: Stamp(1200) },
            ),
        ];
        for (now, newest, wanted) in table {
            assert_eq!(
                admit(Stamp(now), t, newest),
                wanted,
                "at {now}, newest {newest:?}"
            );
        }
        assert!(in_time(Stamp(1999), t));
        assert!(!in_time(Stamp(2000), t));
        assert_eq!(newest(None, Stamp(5)), Stamp(5));
        assert_eq!(newest(Some(Stamp(9)), Stamp(5)), Stamp(9));
        assert_eq!(newest(Some(Stamp(3)), Stamp(5)), Stamp(5));
    }
}
