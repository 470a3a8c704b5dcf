//! The `[history]` table: how long the state database keeps events and finished tasks, by age
//! and by count (`src/store/retention.rs` prunes them; docs/config.md says what is never pruned).
//!
//! ```toml
//! [history]
//! events_max_age_days = 30       # events older than this go (0: no age limit)
//! events_max_count = 100000      # at most this many events, the newest (0: no count limit)
//! tasks_max_age_days = 30        # finished tasks that ended longer ago go (0: no age limit)
//! tasks_max_count = 10000        # at most this many finished tasks, the newest (0: no limit)
//! prune_interval_seconds = 300   # how often the limits are applied (and at every start)
//! ```

use super::bounded::Int;
use super::error::{ConfigError, Key};
use super::located::{last_valid, Located};
use serde::Deserialize;
use std::time::Duration;
use toml::Spanned;

/// The longest age limit: a century (0 turns the age limit off).
pub const MAX_HISTORY_DAYS: i64 = 36_500;
/// The fewest events a count limit may keep: a smaller one would prune what a client following
/// the history (`vfioctl events --follow`) has not read yet.
pub const MIN_EVENTS_KEPT: i64 = 100;
/// The fewest finished tasks a count limit may keep.
pub const MIN_TASKS_KEPT: i64 = 10;
/// The largest count limit (0 turns the count limit off).
pub const MAX_HISTORY_COUNT: i64 = 100_000_000;
/// The longest time between two prunes: a day.
pub const MAX_PRUNE_INTERVAL_SECONDS: i64 = 86_400;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawHistory {
    pub events_max_age_days: Option<Spanned<Int>>,
    pub events_max_count: Option<Spanned<Int>>,
    pub tasks_max_age_days: Option<Spanned<Int>>,
    pub tasks_max_count: Option<Spanned<Int>>,
    pub prune_interval_seconds: Option<Spanned<Int>>,
}

/// Validated `[history]`. `None` in a limit: that limit is off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistorySettings {
    /// Events recorded longer ago than this are deleted.
    pub events_max_age: Option<Duration>,
    /// Only the newest this many events are kept.
    pub events_max_count: Option<u64>,
    /// Finished tasks (success, or error after its reset) that ended longer ago are deleted.
    pub tasks_max_age: Option<Duration>,
    /// Only the newest this many finished tasks are kept (a device's last result always stays,
    /// on top of these).
    pub tasks_max_count: Option<u64>,
    /// How often the daemon applies the limits (and once at start).
    pub prune_interval: Duration,
}

const DAY: Duration = Duration::from_secs(86_400);

impl Default for HistorySettings {
    /// 30 days and 100,000 events; 30 days and 10,000 finished tasks; every 5 minutes. At the
    /// rate a busy simulated host records (about 160 events a minute), 100,000 events is some
    /// ten hours of that and some 20 MB of database.
    fn default() -> HistorySettings {
        HistorySettings {
            events_max_age: Some(30 * DAY),
            events_max_count: Some(100_000),
            tasks_max_age: Some(30 * DAY),
            tasks_max_count: Some(10_000),
            prune_interval: Duration::from_secs(300),
        }
    }
}

/// Every `[history]` table of every file; each key's last value wins.
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawHistory>> + Clone,
) -> Result<HistorySettings, ConfigError> {
    let mut out = HistorySettings::default();
    let number = |get: fn(&RawHistory) -> Option<&Spanned<Int>>,
                  key: &'static str,
                  check: fn(Int) -> Result<i64, String>| {
        last_valid(tables.clone().filter_map(move |t| t.field(get)), move |v| {
            v.check(Key::top(key), check(*v.value))
        })
    };
    if let Some(d) = number(
        |h| h.events_max_age_days.as_ref(),
        "history.events_max_age_days",
        days,
    )? {
        out.events_max_age = age(d);
    }
    if let Some(n) = number(
        |h| h.events_max_count.as_ref(),
        "history.events_max_count",
        |v| count(v, MIN_EVENTS_KEPT),
    )? {
        out.events_max_count = limit(n);
    }
    if let Some(d) = number(
        |h| h.tasks_max_age_days.as_ref(),
        "history.tasks_max_age_days",
        days,
    )? {
        out.tasks_max_age = age(d);
    }
    if let Some(n) = number(
        |h| h.tasks_max_count.as_ref(),
        "history.tasks_max_count",
        |v| count(v, MIN_TASKS_KEPT),
    )? {
        out.tasks_max_count = limit(n);
    }
    if let Some(s) = number(
        |h| h.prune_interval_seconds.as_ref(),
        "history.prune_interval_seconds",
        |v| v.in_range(1, MAX_PRUNE_INTERVAL_SECONDS, " seconds"),
    )? {
        out.prune_interval = Duration::from_secs(s.unsigned_abs());
    }
    Ok(out)
}

/// An age in days: 0 (off) or 1..=[`MAX_HISTORY_DAYS`].
fn days(v: Int) -> Result<i64, String> {
    v.in_range(0, MAX_HISTORY_DAYS, " days (0: no age limit)")
}

/// A count: 0 (off) or `min`..=[`MAX_HISTORY_COUNT`].
fn count(v: Int, min: i64) -> Result<i64, String> {
    let n = v.in_range(0, MAX_HISTORY_COUNT, " (0: no count limit)")?;
    if n != 0 && n < min {
        return Err(format!(
            "{n} is too small: keep at least {min} (or 0 for no count limit)"
        ));
    }
    Ok(n)
}

fn age(days: i64) -> Option<Duration> {
    (days > 0).then(|| DAY * u32::try_from(days).unwrap_or(u32::MAX))
}

fn limit(n: i64) -> Option<u64> {
    (n > 0).then_some(n.unsigned_abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_values() {
        for (value, min, wanted) in [
            (Some(0), 100, Ok(0)),
            (Some(100), 100, Ok(100)),
            (Some(99), 100, Err("too small: keep at least 100")),
            (Some(1), 10, Err("too small: keep at least 10")),
            (Some(-1), 10, Err("out of range")),
            (Some(MAX_HISTORY_COUNT + 1), 10, Err("out of range")),
            (None, 10, Err("too large")),
        ] {
            match (count(Int(value), min), wanted) {
                (Ok(got), Ok(w)) => assert_eq!(got, w, "{value:?}"),
                (Err(e), Err(w)) => assert!(e.contains(w), "{value:?}: {e}"),
                (got, w) => panic!("{value:?}: got {got:?}, wanted {w:?}"),
            }
        }
    }

    #[test]
    fn zero_turns_a_limit_off() {
        assert_eq!(age(0), None);
        assert_eq!(age(2), Some(2 * DAY));
        assert_eq!(limit(0), None);
        assert_eq!(limit(500), Some(500));
    }
}
