//! How long the reporter waits before it tries the database again: pure policy.
//!
//! Doubling from half a second, capped at the report interval (at least 5 s, at most 60 s), so
//! that a returning database gets a report within about one interval, and a thousand hosts do
//! not hammer a database that is down. A failed report is never queued: the next attempt sends
//! the newest state (the backlog is one report).

use std::time::Duration;

const FIRST: Duration = Duration::from_millis(500);
const CAP_MIN: Duration = Duration::from_secs(5);
const CAP_MAX: Duration = Duration::from_secs(60);

/// The wait after `failures` consecutive failures (1 = the first), for a host reporting every
/// `interval`; `spread` (0..1, e.g. from the host's name) shifts it by up to a quarter so that
/// hosts that failed together do not retry together.
pub fn delay(failures: u32, interval: Duration, spread: f64) -> Duration {
    let cap = interval.clamp(CAP_MIN, CAP_MAX);
    let exp = failures.saturating_sub(1).min(16);
    let base = FIRST.saturating_mul(1u32 << exp).min(cap);
    let spread = spread.clamp(0.0, 1.0);
    base.mul_f64(1.0 - 0.25 * spread)
}

/// A spread in 0..1 derived from a name (stable per host, different between hosts).
pub fn spread_of(name: &str) -> f64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (h % 1000) as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_interval_within_bounds() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        for (failures, interval, wanted) in [
            (0, s(30), ms(500)),
            (1, s(30), ms(500)),
            (2, s(30), s(1)),
            (3, s(30), s(2)),
            (6, s(30), s(16)),
            (7, s(30), s(30)),
            (100, s(30), s(30)),
            // A short interval still backs off to 5 s; a long one stops at a minute.
            (10, s(1), s(5)),
            (20, s(3600), s(60)),
        ] {
            assert_eq!(
                delay(failures, interval, 0.0),
                wanted,
                "{failures} {interval:?}"
            );
        }
        assert_eq!(delay(100, s(30), 1.0), ms(22_500));
        let (a, b) = (spread_of("host-a"), spread_of("host-b"));
        assert!((0.0..1.0).contains(&a) && a != b);
        assert_eq!(a, spread_of("host-a"));
    }
}
