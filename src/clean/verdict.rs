//! What a clean's failure does to a function: whether it is quarantined (kept out of the pool,
//! shown `broken`, until an operator clears it) or only waits, held, for an operator to reset the
//! clean's task and try again.
//!
//! | what went wrong                            | quarantined                |
//! |--------------------------------------------|----------------------------|
//! | the health check failed (before or after the command) | at once: the device is not what it was |
//! | a reset hung                               | at once: it may hang the host again |
//! | the operator's command failed              | at once: the device is not known clean |
//! | the kernel offers no reset for it          | at once: it can never be reset (a `[[clean]]` entry with `reset = false` and a command cleans it instead) |
//! | every reset method failed, device healthy  | at the second failure in a row |
//!
//! A clean that succeeds clears the count of failures in a row.

use std::fmt;

/// Why a clean failed for a function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Every reset method the kernel lists failed; the device still looks healthy.
    ResetFailed(String),
    /// A reset did not return within its timeout and was abandoned.
    ResetHung(String),
    /// The kernel offers no reset for the function (nor for its bus alone).
    NoReset(String),
    /// The health check found it changed or gone.
    Unhealthy(String),
    /// The operator's `[[clean]]` command failed or timed out.
    CommandFailed(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::ResetFailed(why) => write!(f, "no reset worked: {why}"),
            Failure::ResetHung(why) => write!(f, "the reset hung: {why}"),
            Failure::NoReset(why) => write!(f, "no reset: {why}"),
            Failure::Unhealthy(why) => write!(f, "unhealthy: {why}"),
            Failure::CommandFailed(why) => write!(f, "the clean command failed: {why}"),
        }
    }
}

/// How many failed cleans in a row quarantine a function whose resets fail while it stays
/// healthy: one may be a passing state of the device; two are a pattern.
pub const FAILURES_TO_QUARANTINE: u32 = 2;

/// Whether `failure` quarantines a function that had `failures_in_row` failed cleans before
/// this one.
pub fn quarantines(failure: &Failure, failures_in_row: u32) -> bool {
    match failure {
        Failure::ResetFailed(_) => failures_in_row + 1 >= FAILURES_TO_QUARANTINE,
        Failure::ResetHung(_)
        | Failure::NoReset(_)
        | Failure::Unhealthy(_)
        | Failure::CommandFailed(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_failures_quarantine() {
        let w = || "x".to_string();
        let table = [
            (Failure::ResetFailed(w()), 0, false),
            (Failure::ResetFailed(w()), 1, true),
            (Failure::ResetFailed(w()), 5, true),
            (Failure::ResetHung(w()), 0, true),
            (Failure::NoReset(w()), 0, true),
            (Failure::Unhealthy(w()), 0, true),
            (Failure::CommandFailed(w()), 0, true),
        ];
        for (failure, before, want) in table {
            assert_eq!(
                quarantines(&failure, before),
                want,
                "{failure} after {before}"
            );
        }
    }

    #[test]
    fn failures_say_what_went_wrong() {
        assert_eq!(
            Failure::Unhealthy("config space reads all-ones".into()).to_string(),
            "unhealthy: config space reads all-ones"
        );
        assert_eq!(
            Failure::ResetHung("flr did not return within 10 s".into()).to_string(),
            "the reset hung: flr did not return within 10 s"
        );
    }
}
