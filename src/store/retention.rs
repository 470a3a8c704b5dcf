//! Retention: the history (`events`, finished `tasks`) kept within `[history]`'s limits of age
//! and count, so that the state database stays bounded on a host that runs for years.
//!
//! What goes is decided by pure functions ([`event_verdict`], [`task_verdicts`]) tested as tables;
//! the store applies them in small batches ([`BATCH`] rows per transaction), each batch taking
//! the connection only for the few milliseconds of its delete and commit, so a hook call or a
//! D-Bus request waits for one batch at most, never for the whole prune. [`Pruner`] runs the
//! prune on the blocking pool at start and every `prune_interval`.
//!
//! Never pruned: a task that is not finished (prepare, running) or that holds its device (error
//! not yet reset); a device's last result (its newest task in success or error: what
//! `vfioctl task`, `vfioctl show` and the device's `LastResult` show, see
//! [`Store::last_result`]); claims, pooled claims, devices, images and everything else. The
//! delete of a task repeats these rules in its SQL, so a task that changed between the read and
//! the delete is kept.
//!
//! Ids are never reused (AUTOINCREMENT), so the acknowledged mark (`integrity`), whose ids come
//! from `sqlite_sequence`, does not move back when rows go; a delete is a row change like any
//! other, counted by the change counter's triggers and acknowledged after its commit by the
//! store's guard. A client paging with `--since ID` or `--before ID` past pruned rows just finds
//! fewer of them.

use super::{Store, StoreError};
use crate::config::HistorySettings;
use crate::store::TaskState;
use rusqlite::params;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Rows deleted per transaction: small enough that the connection is held for milliseconds.
pub const BATCH: usize = 500;

/// Why a row of the history goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prune {
    /// Older than the age limit.
    TooOld,
    /// Beyond the count limit: that many newer rows are kept.
    BeyondCount,
}

/// Why a task row stays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Prepare or running, or in error and not reset: its device depends on it.
    Active,
    /// The newest final task of its device: shown as the device's last result.
    LastResult,
    /// Within every limit.
    Within,
}

/// What retention does with one task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskVerdict {
    Keep(Keep),
    Prune(Prune),
}

/// Whether an event recorded at `time_ms` goes, with `newer` events recorded after it.
/// `None`: it stays.
pub fn event_verdict(
    limits: &HistorySettings,
    now_ms: i64,
    time_ms: i64,
    newer: u64,
) -> Option<Prune> {
    if limits.events_max_count.is_some_and(|max| newer >= max) {
        return Some(Prune::BeyondCount);
    }
    if older_than(limits.events_max_age, now_ms, time_ms) {
        return Some(Prune::TooOld);
    }
    None
}

/// The facts about one task that retention decides on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRow {
    pub id: i64,
    /// The device, as stored (the text is enough to group by).
    pub address: String,
    pub state: TaskState,
    pub reset_ms: Option<i64>,
    pub finished_ms: Option<i64>,
}

/// What retention does with each of `rows` (any order), in the order given.
///
/// The count limit counts finished tasks (success, or error once reset), newest first; a last
/// result is kept beyond it (so up to one more per device). A finished task's age runs from
/// its end, or from its reset for one in error.
pub fn task_verdicts(limits: &HistorySettings, now_ms: i64, rows: &[TaskRow]) -> Vec<TaskVerdict> {
    // The last result of each device: its newest task in success or error (reset or not), as
    // `Store::last_result` reads it.
    let mut last: HashMap<&str, i64> = HashMap::new();
    for r in rows.iter().filter(|r| r.state.is_final()) {
        let id = last.entry(r.address.as_str()).or_insert(r.id);
        *id = (*id).max(r.id);
    }
    let finished = |r: &TaskRow| !super::task_state::is_active(r.state, r.reset_ms.is_some());
    // How many finished tasks are newer than each finished one.
    let mut ids: Vec<i64> = rows.iter().filter(|r| finished(r)).map(|r| r.id).collect();
    ids.sort_unstable_by(|a, b| b.cmp(a));
    let newer: HashMap<i64, u64> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, i as u64))
        .collect();
    rows.iter()
        .map(|r| {
            if !finished(r) {
                return TaskVerdict::Keep(Keep::Active);
            }
            if last.get(r.address.as_str()) == Some(&r.id) {
                return TaskVerdict::Keep(Keep::LastResult);
            }
            let n = newer.get(&r.id).copied().unwrap_or(0);
            if limits.tasks_max_count.is_some_and(|max| n >= max) {
                return TaskVerdict::Prune(Prune::BeyondCount);
            }
            let ended = match (r.finished_ms, r.reset_ms) {
                (Some(f), Some(reset)) => Some(f.max(reset)),
                (f, reset) => f.or(reset),
            };
            match ended {
                Some(t) if older_than(limits.tasks_max_age, now_ms, t) => {
                    TaskVerdict::Prune(Prune::TooOld)
                }
                _ => TaskVerdict::Keep(Keep::Within),
            }
        })
        .collect()
}

/// Whether `time_ms` is more than `max_age` before `now_ms` (never, without a limit).
fn older_than(max_age: Option<Duration>, now_ms: i64, time_ms: i64) -> bool {
    max_age.is_some_and(|age| {
        let age = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
        time_ms < now_ms.saturating_sub(age)
    })
}

/// What one prune deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub events: u64,
    pub tasks: u64,
    /// Transactions it took.
    pub batches: u64,
}

impl Store {
    /// Deletes the events and finished tasks beyond `limits` as of `now_ms`, [`BATCH`] rows per
    /// transaction, letting the connection go between batches. Blocks: call it from the
    /// blocking pool.
    pub fn prune_history(
        &self,
        limits: &HistorySettings,
        now_ms: i64,
    ) -> Result<Pruned, StoreError> {
        self.prune_history_until(limits, now_ms, &AtomicBool::new(false))
    }

    /// As [`Store::prune_history`], and stops between two batches once `stop` is set (the
    /// daemon stops): the rest waits for the next prune.
    pub fn prune_history_until(
        &self,
        limits: &HistorySettings,
        now_ms: i64,
        stop: &AtomicBool,
    ) -> Result<Pruned, StoreError> {
        let stopped = || stop.load(Ordering::Relaxed);
        let mut pruned = Pruned::default();
        // Events: from the oldest, a prefix by id. The first event kept ends the pass (ids
        // follow the order of commits; a clock set back may keep a few too long by age, never
        // beyond the count).
        let action = "prune events";
        let mut total: u64 = {
            let conn = self.lock();
            conn.query_row("SELECT count(*) FROM events", [], |r| r.get::<_, i64>(0))
                .map_err(|e| self.sqlite(action, e))?
                .unsigned_abs()
        };
        while !stopped() {
            // One IMMEDIATE transaction (`write`): the batch's read and its delete see the same
            // rows.
            let deleted = self.write(action, |tx| {
                let mut stmt = tx
                    .prepare_cached("SELECT id, time_ms FROM events ORDER BY id LIMIT ?1")
                    .map_err(|e| self.sqlite(action, e))?;
                let rows = stmt
                    .query_map([BATCH as i64], |r| {
                        Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
                    })
                    .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
                    .map_err(|e| self.sqlite(action, e))?;
                let mut upto = None;
                for (i, (id, time_ms)) in rows.iter().enumerate() {
                    let newer = total.saturating_sub(i as u64 + 1);
                    if event_verdict(limits, now_ms, *time_ms, newer).is_none() {
                        break;
                    }
                    upto = Some(*id);
                }
                let Some(upto) = upto else { return Ok(0) };
                tx.prepare_cached("DELETE FROM events WHERE id <= ?1")
                    .and_then(|mut s| s.execute([upto]))
                    .map_err(|e| self.sqlite(action, e))
            })?;
            if deleted == 0 {
                break;
            }
            pruned.events += deleted as u64;
            pruned.batches += 1;
            total = total.saturating_sub(deleted as u64);
        }

        // Tasks: decided on all of them at once (a few thousand small rows), deleted in batches.
        let action = "prune tasks";
        let rows = {
            let conn = self.lock();
            let mut stmt = conn
                .prepare_cached(
                    "SELECT id, address, state, reset_ms, finished_ms FROM tasks ORDER BY id",
                )
                .map_err(|e| self.sqlite(action, e))?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, Option<i64>>(3)?,
                        r.get::<_, Option<i64>>(4)?,
                    ))
                })
                .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
                .map_err(|e| self.sqlite(action, e))?;
            rows
        };
        let rows: Vec<TaskRow> = rows
            .into_iter()
            // A state this build cannot read is nothing retention decides on.
            .filter_map(|(id, address, state, reset_ms, finished_ms)| {
                Some(TaskRow {
                    id,
                    address,
                    state: state.parse().ok()?,
                    reset_ms,
                    finished_ms,
                })
            })
            .collect();
        let doomed: Vec<i64> = rows
            .iter()
            .zip(task_verdicts(limits, now_ms, &rows))
            .filter(|(_, v)| matches!(v, TaskVerdict::Prune(_)))
            .map(|(r, _)| r.id)
            .collect();
        for chunk in doomed.chunks(BATCH) {
            if stopped() {
                break;
            }
            let deleted = self.write(action, |tx| {
                // The rules again, in SQL: a task that changed since it was read stays.
                let mut stmt = tx
                    .prepare_cached(
                        "DELETE FROM tasks WHERE id = ?1 \
                         AND (state = 'success' OR (state = 'error' AND reset_ms IS NOT NULL)) \
                         AND id <> (SELECT max(t.id) FROM tasks t \
                                    WHERE t.address = tasks.address \
                                    AND t.state IN ('success', 'error'))",
                    )
                    .map_err(|e| self.sqlite(action, e))?;
                let mut n = 0;
                for id in chunk {
                    n += stmt
                        .execute(params![id])
                        .map_err(|e| self.sqlite(action, e))?;
                }
                Ok(n)
            })?;
            pruned.tasks += deleted as u64;
            pruned.batches += 1;
        }
        Ok(pruned)
    }

    /// How many events and tasks the store holds.
    pub fn history_counts(&self) -> Result<(u64, u64), StoreError> {
        let conn = self.lock();
        conn.query_row(
            "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM tasks)",
            [],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?.unsigned_abs(),
                    r.get::<_, i64>(1)?.unsigned_abs(),
                ))
            },
        )
        .map_err(|e| self.sqlite("count the history", e))
    }
}

/// Applies `[history]` beside the daemon: at start, then every `prune_interval`, on the blocking
/// pool. Reads the limits through `limits` at each run, so that a reload takes effect at the
/// next one.
pub struct Pruner {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// Set at the stop: a prune under way ends after its batch.
    stopping: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Pruner {
    pub fn start(
        store: Arc<Store>,
        limits: impl Fn() -> HistorySettings + Send + Sync + 'static,
    ) -> Pruner {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stopping);
        let task = tokio::spawn(async move {
            loop {
                let settings = limits();
                let s = Arc::clone(&store);
                let flag = Arc::clone(&flag);
                let run = tokio::task::spawn_blocking(move || {
                    s.prune_history_until(&settings, super::now_ms(), &flag)
                })
                .await;
                match run {
                    Ok(Ok(p)) if p.events + p.tasks > 0 => tracing::info!(
                        events = p.events,
                        tasks = p.tasks,
                        "pruned the history to [history]'s limits: {} event(s), {} task(s)",
                        p.events,
                        p.tasks
                    ),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => tracing::warn!(
                        "cannot prune the history: {}; trying again in {:?}",
                        crate::error_chain(&e),
                        settings.prune_interval
                    ),
                    Err(e) => tracing::warn!("the history prune did not finish: {e}"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(settings.prune_interval) => {}
                    _ = &mut stopped => return,
                }
            }
        });
        Pruner {
            stop: Some(stop),
            stopping,
            task,
        }
    }

    /// Stops it; a prune under way finishes its batch first.
    pub async fn stop(mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY_MS: i64 = 86_400_000;
    const NOW: i64 = 1_000 * DAY_MS;

    fn limits(
        events: (Option<u64>, Option<u64>),
        tasks: (Option<u64>, Option<u64>),
    ) -> HistorySettings {
        let days = |d: Option<u64>| d.map(|d| Duration::from_secs(d * 86_400));
        HistorySettings {
            events_max_age: days(events.0),
            events_max_count: events.1,
            tasks_max_age: days(tasks.0),
            tasks_max_count: tasks.1,
            prune_interval: Duration::from_secs(300),
        }
    }

    #[test]
    fn event_verdicts() {
        use Prune::*;
        // (age limit days, count limit, event age in ms, newer events) -> verdict
        for (age, count, old_ms, newer, wanted) in [
            (Some(30), Some(100), 0, 0, None),
            (Some(30), Some(100), 30 * DAY_MS, 0, None),
            (Some(30), Some(100), 30 * DAY_MS + 1, 0, Some(TooOld)),
            (Some(30), Some(100), DAY_MS, 99, None),
            (Some(30), Some(100), DAY_MS, 100, Some(BeyondCount)),
            (Some(30), Some(100), 40 * DAY_MS, 100, Some(BeyondCount)),
            // Limits off.
            (None, Some(100), 400 * DAY_MS, 0, None),
            (Some(30), None, DAY_MS, 1_000_000, None),
            (None, None, 400 * DAY_MS, 1_000_000, None),
            // A time in the future (a clock set back since) is young.
            (Some(30), Some(100), -DAY_MS, 0, None),
        ] {
            let l = limits((age, count), (None, None));
            assert_eq!(
                event_verdict(&l, NOW, NOW - old_ms, newer),
                wanted,
                "age {age:?} count {count:?}, {old_ms} ms old, {newer} newer"
            );
        }
    }

    fn row(id: i64, address: &str, state: TaskState, reset: bool, ended_days_ago: i64) -> TaskRow {
        let ended = NOW - ended_days_ago * DAY_MS;
        TaskRow {
            id,
            address: address.into(),
            state,
            reset_ms: reset.then_some(ended),
            finished_ms: state.is_final().then_some(ended),
        }
    }

    #[test]
    fn task_verdicts_table() {
        use Keep::*;
        use Prune::*;
        use TaskState::*;
        use TaskVerdict as V;
        const A: &str = "0000:3b:00.0";
        const B: &str = "0000:af:00.0";
        // Tasks 30 days limit, 10 finished tasks.
        let l = limits((None, None), (Some(30), Some(10)));
        let rows = [
            // An ancient task in error, not reset: its device waits for an operator.
            (row(1, A, Error, false, 400), V::Keep(Active)),
            // Ancient successes of B; 3 is B's last result however old.
            (row(2, B, Success, false, 400), V::Prune(TooOld)),
            (row(3, B, Success, false, 400), V::Keep(LastResult)),
            // A's finished tasks: old ones go, young ones stay.
            (row(4, A, Success, false, 31), V::Prune(TooOld)),
            (row(5, A, Error, true, 29), V::Keep(Within)),
            // Still running or preparing, however old its row.
            (row(6, A, Running, false, 400), V::Keep(Active)),
            (row(7, B, Prepare, false, 400), V::Keep(Active)),
            // A newer failure of A, reset: A's last result (the newest final task).
            (row(8, A, Error, true, 1), V::Keep(LastResult)),
        ];
        let (input, wanted): (Vec<TaskRow>, Vec<TaskVerdict>) = rows.into_iter().unzip();
        assert_eq!(task_verdicts(&l, NOW, &input), wanted);

        // The count: 15 young successes of A and one of B; the newest 10 finished stay, B's
        // last result stays beyond them, and an unreset error of A (newest) makes A's last
        // result itself, not the success before it.
        let mut input: Vec<TaskRow> = (1..=15).map(|id| row(id, A, Success, false, 1)).collect();
        input.insert(0, row(0, B, Success, false, 1));
        input.push(row(16, A, Error, false, 0));
        let got = task_verdicts(&l, NOW, &input);
        let verdict = |id: i64| got[input.iter().position(|r| r.id == id).unwrap()];
        assert_eq!(verdict(16), V::Keep(Active));
        assert_eq!(verdict(0), V::Keep(LastResult));
        for id in 6..=15 {
            assert_eq!(verdict(id), V::Keep(Within), "task {id}");
        }
        for id in 1..=5 {
            assert_eq!(verdict(id), V::Prune(BeyondCount), "task {id}");
        }

        // No limits: everything stays.
        let none = limits((None, None), (None, None));
        assert!(task_verdicts(&none, NOW, &input)
            .iter()
            .all(|v| matches!(v, V::Keep(_))));
    }
}
