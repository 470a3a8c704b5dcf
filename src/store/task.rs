//! The durable side of the per-device task engine: the `tasks` rows, their state changes and the
//! events that record them.
//!
//! Every change runs in one `BEGIN IMMEDIATE` transaction that reads the row, checks the change
//! against [`task_state`](super::task_state), writes the row and its event, and commits: two
//! writers (threads of one store, or two processes on one file) cannot both pass the check. The
//! unique index on active tasks stays as the last line of defence.

use super::device_row::{DecodeError, Fields};
use super::task_state::{self, TaskState};
use super::{insert_event, now_ms, NewEvent, Store, StoreError};
use crate::model::event::EventKind;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use rusqlite::{named_params, params, Connection, ErrorCode, OptionalExtension, Row};
use serde::Serialize;

/// One task as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TaskRecord {
    /// Increasing, never reused: the task's D-Bus object is `/org/vfiod/Vfiod1/task/<id>`.
    pub id: i64,
    /// The device the task works on; for a PF's task this covers its VFs too.
    pub address: PciAddress,
    /// What the task does; a mode task may learn it while it prepares.
    pub kind: TaskKind,
    pub state: TaskState,
    /// The step running or last run; empty until the first progress report.
    pub step: String,
    /// 0..=100; 100 once it succeeded, where it stopped once it failed.
    pub percent: u8,
    /// The outcome: why it failed, or what it achieved; empty until final.
    pub message: String,
    /// The request's parameters as a JSON object, e.g. `{"num_vfs":64}`.
    pub params: String,
    /// Who asked: a uid or a D-Bus sender.
    pub requested_by: String,
    /// Unix milliseconds.
    pub created_ms: i64,
    /// When the first step started; `None` for a task that failed in prepare.
    pub started_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    /// When and by whom a task in error was reset, freeing its device.
    pub reset_ms: Option<i64>,
    pub reset_by: Option<String>,
}

impl TaskRecord {
    /// Whether this task keeps its device busy (see [`task_state::is_active`]).
    pub fn is_active(&self) -> bool {
        task_state::is_active(self.state, self.reset_ms.is_some())
    }

    /// "task 12 split on 0000:3b:00.0", the subject of its events and errors.
    fn subject(&self) -> String {
        format!("task {} {} on {}", self.id, self.kind, self.address)
    }

    /// What the task is doing, for a Busy error: "running (enable VFs, 40%)".
    pub(super) fn status(&self) -> String {
        match self.state {
            TaskState::Prepare => "preparing".to_string(),
            TaskState::Running => format!("running ({}, {}%)", self.step, self.percent),
            TaskState::Success => "finished".to_string(),
            TaskState::Error if self.reset_ms.is_some() => "reset after an error".to_string(),
            TaskState::Error => format!("in error ({}) until an operator resets it", self.message),
        }
    }
}

/// The SQL twin of [`task_state::is_active`], derived from it, so the rule is written once (the
/// unique index of migration 3 says the same; a test keeps the two equal).
pub(super) fn active_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| state_predicate(task_state::is_active))
}

/// Rows whose work has not ended (prepare, running): derived from [`TaskState::is_final`].
fn unfinished_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| state_predicate(|state, _| !state.is_final()))
}

/// A SQL condition on `state` and `reset_ms` that holds exactly where `rule(state, reset)` does.
fn state_predicate(rule: impl Fn(TaskState, bool) -> bool) -> String {
    let mut any = Vec::new();
    for &state in TaskState::ALL {
        match (rule(state, false), rule(state, true)) {
            (true, true) => any.push(format!("state = '{state}'")),
            (true, false) => any.push(format!("(state = '{state}' AND reset_ms IS NULL)")),
            (false, true) => any.push(format!("(state = '{state}' AND reset_ms IS NOT NULL)")),
            (false, false) => {}
        }
    }
    if any.is_empty() {
        return "0".into();
    }
    format!("({})", any.join(" OR "))
}

const SELECT: &str = "SELECT id, address, kind, state, step, percent, message, params, \
     requested_by, created_ms, started_ms, finished_ms, reset_ms, reset_by FROM tasks";

fn decode(row: &Row<'_>) -> Result<TaskRecord, DecodeError> {
    let id: i64 = row.get("id").unwrap_or_default();
    let f = Fields {
        row,
        table: "tasks",
        key: id.to_string(),
        columns: &[],
    };
    Ok(TaskRecord {
        id,
        address: f.parse("address")?,
        kind: f.parse("kind")?,
        state: f.parse("state")?,
        step: f.get("step")?,
        percent: f.int("percent")?,
        message: f.get("message")?,
        params: f.get("params")?,
        requested_by: f.get("requested_by")?,
        created_ms: f.get("created_ms")?,
        started_ms: f.get("started_ms")?,
        finished_ms: f.get("finished_ms")?,
        reset_ms: f.get("reset_ms")?,
        reset_by: f.get("reset_by")?,
    })
}

/// A change the store applies to one task row.
enum Change<'a> {
    Progress {
        step: &'a str,
        percent: u8,
    },
    Succeeded {
        message: &'a str,
    },
    Failed {
        message: &'a str,
    },
    /// Refused while it prepared, before any change: it ends in error but does not hold its
    /// device (it is reset at once, by vfiod).
    Refused {
        message: &'a str,
    },
    /// Failed while it ran, and its rollback put everything back (a failed attach gives its
    /// device back): it ends in error but does not hold its device.
    Settled {
        message: &'a str,
    },
}

impl Change<'_> {
    fn target(&self) -> TaskState {
        match self {
            Change::Progress { .. } => TaskState::Running,
            Change::Succeeded { .. } => TaskState::Success,
            Change::Failed { .. } | Change::Refused { .. } | Change::Settled { .. } => {
                TaskState::Error
            }
        }
    }
}

/// The row after `change`, or `None` when the state machine forbids it for `current`. Pure.
fn apply(current: &TaskRecord, change: &Change<'_>, now: i64) -> Option<TaskRecord> {
    if !current.state.can_become(change.target()) {
        return None;
    }
    // A refusal is a verdict of prepare: once a task has run a step, the device may have
    // changed, and only an operator can say it is fine again.
    if matches!(change, Change::Refused { .. }) && current.state != TaskState::Prepare {
        return None;
    }
    let mut next = current.clone();
    next.state = change.target();
    match *change {
        Change::Progress { step, percent } => {
            next.step = step.to_string();
            next.percent = percent;
            next.started_ms.get_or_insert(now);
        }
        Change::Succeeded { message } => {
            next.percent = 100;
            next.message = message.to_string();
            next.finished_ms = Some(now);
        }
        Change::Failed { message } => {
            next.message = message.to_string();
            next.finished_ms = Some(now);
        }
        Change::Refused { message } => {
            next.message = message.to_string();
            next.finished_ms = Some(now);
            next.reset_ms = Some(now);
            next.reset_by = Some(REFUSED_BY.to_string());
        }
        Change::Settled { message } => {
            next.message = message.to_string();
            next.finished_ms = Some(now);
            next.reset_ms = Some(now);
            next.reset_by = Some(SETTLED_BY.to_string());
        }
    }
    Some(next)
}

/// Who "resets" a task refused before any change: nobody needs to, it never held its device.
pub const REFUSED_BY: &str = "vfiod (refused before any change)";

/// Who "resets" a task whose failure its rollback settled: nothing is left to check.
pub const SETTLED_BY: &str = "vfiod (rolled back; nothing left to reset)";

/// The event message of a task that has just reached `task.state`.
fn event_message(task: &TaskRecord) -> String {
    let subject = task.subject();
    let state = task.state;
    match state {
        TaskState::Prepare => format!(
            "{subject}: {state} (requested by {}, params {})",
            task.requested_by, task.params
        ),
        TaskState::Running => format!("{subject}: {state} ({}, {}%)", task.step, task.percent),
        TaskState::Success | TaskState::Error if task.message.is_empty() => {
            format!("{subject}: {state}")
        }
        TaskState::Success | TaskState::Error => format!("{subject}: {state} ({})", task.message),
    }
}

/// The message of a task that was unfinished when vfiod stopped.
fn interrupted_message(task: &TaskRecord) -> String {
    if task.state == TaskState::Prepare || task.step.is_empty() {
        "interrupted (vfiod stopped during prepare)".to_string()
    } else {
        format!("interrupted (vfiod stopped during step {})", task.step)
    }
}

fn invalid(reason: impl Into<String>) -> StoreError {
    StoreError::InvalidArgument {
        reason: reason.into(),
    }
}

fn check_not_empty(what: &str, value: &str) -> Result<(), StoreError> {
    if value.trim().is_empty() {
        return Err(invalid(format!("{what} must not be empty")));
    }
    Ok(())
}

impl Store {
    /// Atomically creates a task in `prepare` for `address`, unless the device already has an
    /// active task (prepare, running, or error not yet reset): then `Busy` carries that task.
    /// Records an event. `params` must be a JSON object (`{}` for none); `kind` and
    /// `requested_by` must not be empty.
    pub fn create_task(
        &self,
        address: PciAddress,
        kind: TaskKind,
        params: &str,
        requested_by: &str,
    ) -> Result<TaskRecord, StoreError> {
        self.create_task_covering(address, &[], kind, params, requested_by)
    }

    /// [`Store::create_task`] for a task that also changes the functions in `covers` (its IOMMU
    /// group, its VFs). Refused with `Busy` when an active task has `address` or any of `covers`
    /// as its device or in its own scope, or has an SR-IOV relative of one of them (a VF's PF,
    /// a PF's VFs, as the inventory recorded them) so; the error names that task.
    pub fn create_task_covering(
        &self,
        address: PciAddress,
        covers: &[PciAddress],
        kind: TaskKind,
        params: &str,
        requested_by: &str,
    ) -> Result<TaskRecord, StoreError> {
        check_not_empty("requested_by", requested_by)?;
        match serde_json::from_str::<serde_json::Value>(params) {
            Ok(serde_json::Value::Object(_)) => {}
            Ok(_) => {
                return Err(invalid(format!(
                    "task params {params:?} are not a JSON object"
                )))
            }
            Err(e) => {
                return Err(invalid(format!(
                    "task params {params:?} are not valid JSON: {e}"
                )))
            }
        }
        let action = "create a task";
        let mut scope: Vec<PciAddress> = covers.iter().copied().filter(|a| *a != address).collect();
        scope.sort();
        scope.dedup();
        self.write(action, |conn| {
            if let Some(active) = self.active_in(conn, action, address)? {
                return Err(busy(address, active));
            }
            if let Some((blocked, active)) = self.active_covering(conn, action, address, &scope)? {
                return Err(busy(blocked, active));
            }
            // A PF's task changes its VFs (a restore removes them), and a VF's task (a clean)
            // works on what its PF's would take away: neither starts while the other runs.
            let functions: Vec<PciAddress> = std::iter::once(address)
                .chain(scope.iter().copied())
                .collect();
            let family = self.sriov_family(conn, action, &functions)?;
            if let Some(active) = self.active_on_any(conn, action, &family)? {
                return Err(busy(address, active));
            }
            let now = now_ms();
            let inserted = conn
                .prepare_cached(
                    "INSERT INTO tasks (address, kind, state, params, requested_by, created_ms) \
                     VALUES (:address, :kind, :state, :params, :requested_by, :now)",
                )
                .and_then(|mut stmt| {
                    stmt.execute(named_params! {
                        ":address": address.to_string(),
                        ":kind": kind.as_str(),
                        ":state": TaskState::Prepare.as_str(),
                        ":params": params,
                        ":requested_by": requested_by,
                        ":now": now,
                    })
                });
            match inserted {
                Ok(_) => {}
                // Unreachable while every writer uses an immediate transaction; should a writer
                // ever not, the index still refuses, and the caller still learns who blocks.
                Err(e) if e.sqlite_error_code() == Some(ErrorCode::ConstraintViolation) => {
                    return match self.active_in(conn, action, address)? {
                        Some(active) => Err(busy(address, active)),
                        None => Err(self.sqlite(action, e)),
                    };
                }
                Err(e) => return Err(self.sqlite(action, e)),
            }
            let task = self.must_read(conn, action, conn.last_insert_rowid())?;
            if !scope.is_empty() {
                let list = json_list(scope.iter().copied());
                conn.prepare_cached(
                    "INSERT INTO task_scope (task_id, address) SELECT ?1, value FROM json_each(?2)",
                )
                .and_then(|mut stmt| stmt.execute(params![task.id, list]))
                .map_err(|e| self.sqlite(action, e))?;
            }
            self.task_event(conn, action, &task, event_message(&task), now)?;
            Ok(task)
        })
    }

    /// The task with this id, in any state.
    pub fn task(&self, id: i64) -> Result<Option<TaskRecord>, StoreError> {
        let conn = self.lock();
        self.read_one(&conn, "read a task", "WHERE id = ?1", params![id])
    }

    /// The task that keeps `address` busy: prepare, running, or error not yet reset.
    pub fn active_task(&self, address: PciAddress) -> Result<Option<TaskRecord>, StoreError> {
        let conn = self.lock();
        self.active_in(&conn, "read the active task", address)
    }

    /// The task that keeps `address` busy, its own or one that covers it (the GPU's task for its
    /// audio function, the PF's for a VF): what the device shows as its current task.
    pub fn blocking_task(&self, address: PciAddress) -> Result<Option<TaskRecord>, StoreError> {
        let action = "read the blocking task";
        let conn = self.lock();
        self.blocking_in(&conn, action, address)
    }

    fn blocking_in(
        &self,
        conn: &Connection,
        action: &'static str,
        address: PciAddress,
    ) -> Result<Option<TaskRecord>, StoreError> {
        if let Some(own) = self.active_in(conn, action, address)? {
            return Ok(Some(own));
        }
        if let Some((_, task)) = self.active_covering(conn, action, address, &[])? {
            return Ok(Some(task));
        }
        match self.parent_pf(conn, action, address)? {
            Some(pf) => self.active_in(conn, action, pf),
            None => Ok(None),
        }
    }

    /// The PF of a VF as the inventory recorded it.
    fn parent_pf(
        &self,
        conn: &Connection,
        action: &'static str,
        address: PciAddress,
    ) -> Result<Option<PciAddress>, StoreError> {
        let text: Option<Option<String>> = conn
            .prepare_cached("SELECT parent_pf FROM devices WHERE address = ?1")
            .and_then(|mut stmt| {
                stmt.query_row([address.to_string()], |r| r.get(0))
                    .optional()
            })
            .map_err(|e| self.sqlite(action, e))?;
        Ok(text.flatten().and_then(|t| t.parse().ok()))
    }

    /// The SR-IOV relatives of `functions` as the inventory recorded them (each VF's PF, each
    /// PF's VFs), but none of `functions` themselves.
    fn sriov_family(
        &self,
        conn: &Connection,
        action: &'static str,
        functions: &[PciAddress],
    ) -> Result<Vec<PciAddress>, StoreError> {
        let list = json_list(functions.iter().copied());
        let mut stmt = conn
            .prepare_cached(
                "SELECT address FROM devices WHERE parent_pf IN (SELECT value FROM json_each(?1)) \
                 UNION SELECT parent_pf FROM devices \
                 WHERE parent_pf IS NOT NULL AND address IN (SELECT value FROM json_each(?1))",
            )
            .map_err(|e| self.sqlite(action, e))?;
        let rows = stmt
            .query_map([list], |r| r.get::<_, String>(0))
            .map_err(|e| self.sqlite(action, e))?;
        let mut out = Vec::new();
        for r in rows {
            if let Ok(a) = r.map_err(|e| self.sqlite(action, e))?.parse() {
                if !functions.contains(&a) && !out.contains(&a) {
                    out.push(a);
                }
            }
        }
        Ok(out)
    }

    /// The oldest active task that has one of `functions` as its device or in its scope.
    fn active_on_any(
        &self,
        conn: &Connection,
        action: &'static str,
        functions: &[PciAddress],
    ) -> Result<Option<TaskRecord>, StoreError> {
        if functions.is_empty() {
            return Ok(None);
        }
        let wanted = json_list(functions.iter().copied());
        self.read_one(
            conn,
            action,
            &format!(
                "WHERE {} AND (address IN (SELECT value FROM json_each(?1)) \
                 OR id IN (SELECT task_id FROM task_scope \
                           WHERE address IN (SELECT value FROM json_each(?1)))) \
                 ORDER BY id LIMIT 1",
                active_sql()
            ),
            params![wanted],
        )
    }

    /// The VFs of `pf` as the inventory recorded them.
    pub fn vfs_of(&self, pf: PciAddress) -> Result<Vec<PciAddress>, StoreError> {
        let action = "read the VFs of a PF";
        let conn = self.lock();
        let mut stmt = conn
            .prepare_cached("SELECT address FROM devices WHERE parent_pf = ?1 ORDER BY address")
            .map_err(|e| self.sqlite(action, e))?;
        let rows = stmt
            .query_map([pf.to_string()], |r| r.get::<_, String>(0))
            .map_err(|e| self.sqlite(action, e))?;
        let mut out = Vec::new();
        for r in rows {
            if let Ok(a) = r.map_err(|e| self.sqlite(action, e))?.parse() {
                out.push(a);
            }
        }
        Ok(out)
    }

    /// The most recent final task of `address` (success, or error whether reset or not).
    pub fn last_result(&self, address: PciAddress) -> Result<Option<TaskRecord>, StoreError> {
        let conn = self.lock();
        self.read_one(
            &conn,
            "read the last task result",
            "WHERE address = ?1 AND state IN ('success', 'error') ORDER BY id DESC LIMIT 1",
            params![address.to_string()],
        )
    }

    /// Tasks of `address` (all devices if `None`), newest first, at most `limit`.
    pub fn tasks(
        &self,
        address: Option<PciAddress>,
        limit: usize,
    ) -> Result<Vec<TaskRecord>, StoreError> {
        let action = "read tasks";
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let conn = self.lock();
        let sql = match address {
            Some(_) => format!("{SELECT} WHERE address = ?2 ORDER BY id DESC LIMIT ?1"),
            None => format!("{SELECT} ORDER BY id DESC LIMIT ?1"),
        };
        let mut stmt = conn
            .prepare_cached(&sql)
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = match address {
            Some(a) => stmt.query(params![limit, a.to_string()]),
            None => stmt.query(params![limit]),
        }
        .map_err(|e| self.sqlite(action, e))?;
        let mut tasks = Vec::new();
        while let Some(row) = rows.next().map_err(|e| self.sqlite(action, e))? {
            tasks.push(decode(row).map_err(|e| self.decode(e))?);
        }
        Ok(tasks)
    }

    /// Reports progress: `prepare -> running` (the first step) or `running -> running` (a new
    /// step or percentage). `step` must not be empty; `percent` is at most 100.
    pub fn task_progress(
        &self,
        id: i64,
        step: &str,
        percent: u8,
    ) -> Result<TaskRecord, StoreError> {
        check_not_empty("task step", step)?;
        if percent > 100 {
            return Err(invalid(format!("task percent {percent} is above 100")));
        }
        self.change(
            id,
            "record task progress",
            Change::Progress { step, percent },
        )
    }

    /// `running -> success`: the device is idle again and this task is its last result.
    pub fn task_succeeded(&self, id: i64, message: &str) -> Result<TaskRecord, StoreError> {
        self.change(id, "record a task success", Change::Succeeded { message })
    }

    /// `prepare -> error` or `running -> error`: the device stays busy until [`Store::reset_task`].
    /// `message` says why and must not be empty.
    pub fn task_failed(&self, id: i64, message: &str) -> Result<TaskRecord, StoreError> {
        check_not_empty("task error message", message)?;
        self.change(id, "record a task failure", Change::Failed { message })
    }

    /// A task refused while it prepared, before it changed anything (the device is in use, a
    /// driver it needs is missing, ...): it ends in `error` with `message` but is reset at once
    /// (by [`REFUSED_BY`]), so it does not hold its device. Only from `prepare`.
    pub fn task_refused(&self, id: i64, message: &str) -> Result<TaskRecord, StoreError> {
        check_not_empty("task refusal message", message)?;
        self.change(id, "record a task refusal", Change::Refused { message })
    }

    /// A task that failed while it ran and whose rollback put everything back: `error` with
    /// `message`, reset at once (by [`SETTLED_BY`]) so that it does not hold its device.
    pub fn task_settled(&self, id: i64, message: &str) -> Result<TaskRecord, StoreError> {
        check_not_empty("task error message", message)?;
        self.change(
            id,
            "record a settled task failure",
            Change::Settled { message },
        )
    }

    /// What a task in `prepare` found it has to do: a mode task asked for VF mode learns there
    /// whether that is a split, a re-split or nothing (a check). No event: the next state change
    /// names the kind.
    pub fn task_set_kind(&self, id: i64, kind: TaskKind) -> Result<TaskRecord, StoreError> {
        let action = "set a task's kind";
        self.write(action, |conn| {
            let task = self
                .read_one(conn, action, "WHERE id = ?1", params![id])?
                .ok_or(StoreError::NoSuchTask(id))?;
            if task.state != TaskState::Prepare {
                return Err(invalid(format!(
                    "task {id} is {}: its kind is fixed once it runs",
                    task.state
                )));
            }
            conn.prepare_cached("UPDATE tasks SET kind = ?2 WHERE id = ?1")
                .and_then(|mut stmt| stmt.execute(params![id, kind.as_str()]))
                .map_err(|e| self.sqlite(action, e))?;
            Ok(TaskRecord { kind, ..task })
        })
    }

    /// An operator's reset of the task in error on `address` (its own, or the one covering it):
    /// the row stays `error` as history, gains `reset_ms`/`reset_by`, and no longer keeps the
    /// device busy. Records an event naming `by`. Refused (`NotInError`) when the device is idle
    /// or its task has not failed.
    pub fn reset_task(&self, address: PciAddress, by: &str) -> Result<TaskRecord, StoreError> {
        check_not_empty("the resetting operator", by)?;
        let action = "reset a task";
        self.write(action, |conn| {
            // The task that blocks the device: its own, or one that covers it (resetting the
            // audio function resets the failed task of its GPU's group, a VF its PF's).
            let Some(task) = self.blocking_in(conn, action, address)? else {
                return Err(StoreError::NotInError {
                    address,
                    state: None,
                });
            };
            if !task_state::can_reset(task.state, task.reset_ms.is_some()) {
                return Err(StoreError::NotInError {
                    address,
                    state: Some(task.state),
                });
            }
            let now = now_ms();
            let mut next = task.clone();
            next.reset_ms = Some(now);
            next.reset_by = Some(by.to_string());
            self.update(conn, action, &task, &next)?;
            let message = format!(
                "{}: reset by {by} (was {}: {})",
                next.subject(),
                next.state,
                next.message
            );
            self.task_event(conn, action, &next, message, now)?;
            // Resetting a failed clean is how an operator clears its quarantine.
            if task.kind == crate::model::task::TaskKind::Clean {
                let mut functions = vec![task.address];
                functions.extend(self.scope_of(conn, action, task.id)?);
                self.release_quarantine_in(conn, action, &functions, by, now)?;
            }
            Ok(next)
        })
    }

    /// At start-up, before any new task: every task left in prepare or running by a vfiod that
    /// stopped becomes `error` with "interrupted (vfiod stopped during step <step>)", and so
    /// keeps its device busy until an operator resets it. Returns them, oldest first.
    ///
    /// Only the daemon calls this, once: a second `Store` on the file (a CLI, a test) must not
    /// interrupt the tasks of a daemon that is running.
    pub fn interrupt_unfinished_tasks(&self) -> Result<Vec<TaskRecord>, StoreError> {
        let action = "interrupt unfinished tasks";
        self.write(action, |conn| {
            let unfinished = self.read_all(
                conn,
                action,
                &format!("WHERE {} ORDER BY id", unfinished_sql()),
            )?;
            let now = now_ms();
            let mut interrupted = Vec::with_capacity(unfinished.len());
            for task in unfinished {
                let message = interrupted_message(&task);
                let change = Change::Failed { message: &message };
                // Prepare and running can always fail; the check stays for uniformity.
                let next = apply(&task, &change, now).ok_or_else(|| illegal(&task, &change))?;
                self.update(conn, action, &task, &next)?;
                self.task_event(conn, action, &next, event_message(&next), now)?;
                interrupted.push(next);
            }
            Ok(interrupted)
        })
    }

    /// Applies `change` to task `id` if the state machine allows it, with its event.
    fn change(
        &self,
        id: i64,
        action: &'static str,
        change: Change<'_>,
    ) -> Result<TaskRecord, StoreError> {
        self.write(action, |conn| {
            let task = self
                .read_one(conn, action, "WHERE id = ?1", params![id])?
                .ok_or(StoreError::NoSuchTask(id))?;
            let now = now_ms();
            let next = apply(&task, &change, now).ok_or_else(|| illegal(&task, &change))?;
            self.update(conn, action, &task, &next)?;
            self.task_event(conn, action, &next, event_message(&next), now)?;
            Ok(next)
        })
    }

    /// Writes the mutable columns of `next`, guarded by the state read in the same transaction.
    fn update(
        &self,
        conn: &Connection,
        action: &'static str,
        current: &TaskRecord,
        next: &TaskRecord,
    ) -> Result<(), StoreError> {
        let changed = conn
            .prepare_cached(
                "UPDATE tasks SET state = :state, step = :step, percent = :percent, \
                     message = :message, started_ms = :started_ms, finished_ms = :finished_ms, \
                     reset_ms = :reset_ms, reset_by = :reset_by \
                 WHERE id = :id AND state = :old_state AND reset_ms IS :old_reset_ms",
            )
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":id": next.id,
                    ":state": next.state.as_str(),
                    ":step": next.step,
                    ":percent": next.percent,
                    ":message": next.message,
                    ":started_ms": next.started_ms,
                    ":finished_ms": next.finished_ms,
                    ":reset_ms": next.reset_ms,
                    ":reset_by": next.reset_by,
                    ":old_state": current.state.as_str(),
                    ":old_reset_ms": current.reset_ms,
                })
            })
            .map_err(|e| self.sqlite(action, e))?;
        // The row was read in this immediate transaction, so nobody can have changed it; should
        // that ever not hold, fail rather than overwrite a change this check did not see.
        if changed != 1 {
            return Err(self.sqlite(action, rusqlite::Error::StatementChangedRows(changed)));
        }
        Ok(())
    }

    fn task_event(
        &self,
        conn: &Connection,
        action: &'static str,
        task: &TaskRecord,
        message: String,
        now: i64,
    ) -> Result<(), StoreError> {
        insert_event(
            conn,
            &NewEvent::new(Some(task.address), EventKind::Task, message),
            now,
        )
        .map(drop)
        .map_err(|e| self.sqlite(action, e))
    }

    fn active_in(
        &self,
        conn: &Connection,
        action: &'static str,
        address: PciAddress,
    ) -> Result<Option<TaskRecord>, StoreError> {
        self.read_one(
            conn,
            action,
            &format!("WHERE address = ?1 AND {}", active_sql()),
            params![address.to_string()],
        )
    }

    /// An active task other than `address`'s own that has `address` or one of `scope` in its
    /// scope, or has one of `scope` as its device; with the function it blocks.
    fn active_covering(
        &self,
        conn: &Connection,
        action: &'static str,
        address: PciAddress,
        scope: &[PciAddress],
    ) -> Result<Option<(PciAddress, TaskRecord)>, StoreError> {
        let wanted: Vec<PciAddress> = std::iter::once(address)
            .chain(scope.iter().copied())
            .collect();
        let Some(task) = self.active_on_any(conn, action, &wanted)? else {
            return Ok(None);
        };
        // Name the function the two tasks share: the request's own device if it is covered.
        let covered = self.scope_of(conn, action, task.id)?;
        let blocked = std::iter::once(address)
            .chain(scope.iter().copied())
            .find(|a| *a == task.address || covered.contains(a))
            .unwrap_or(address);
        Ok(Some((blocked, task)))
    }

    fn scope_of(
        &self,
        conn: &Connection,
        action: &'static str,
        id: i64,
    ) -> Result<Vec<PciAddress>, StoreError> {
        let mut stmt = conn
            .prepare_cached("SELECT address FROM task_scope WHERE task_id = ?1 ORDER BY address")
            .map_err(|e| self.sqlite(action, e))?;
        let rows = stmt
            .query_map([id], |r| r.get::<_, String>(0))
            .map_err(|e| self.sqlite(action, e))?;
        let mut out = Vec::new();
        for r in rows {
            let text = r.map_err(|e| self.sqlite(action, e))?;
            out.push(text.parse().map_err(|e: crate::model::pci::AddressError| {
                StoreError::Decode {
                    path: self.path.clone(),
                    table: "task_scope",
                    key: id.to_string(),
                    column: "address",
                    source: Box::new(e),
                }
            })?);
        }
        Ok(out)
    }

    /// The other functions task `id` changes (see [`Store::create_task_covering`]).
    pub fn task_scope(&self, id: i64) -> Result<Vec<PciAddress>, StoreError> {
        let conn = self.lock();
        self.scope_of(&conn, "read a task's scope", id)
    }

    fn must_read(
        &self,
        conn: &Connection,
        action: &'static str,
        id: i64,
    ) -> Result<TaskRecord, StoreError> {
        self.read_one(conn, action, "WHERE id = ?1", params![id])?
            .ok_or(StoreError::NoSuchTask(id))
    }

    fn read_one(
        &self,
        conn: &Connection,
        action: &'static str,
        filter: &str,
        params: impl rusqlite::Params,
    ) -> Result<Option<TaskRecord>, StoreError> {
        let mut stmt = conn
            .prepare_cached(&format!("{SELECT} {filter}"))
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = stmt.query(params).map_err(|e| self.sqlite(action, e))?;
        match rows.next().map_err(|e| self.sqlite(action, e))? {
            Some(row) => Ok(Some(decode(row).map_err(|e| self.decode(e))?)),
            None => Ok(None),
        }
    }

    fn read_all(
        &self,
        conn: &Connection,
        action: &'static str,
        filter: &str,
    ) -> Result<Vec<TaskRecord>, StoreError> {
        let mut stmt = conn
            .prepare_cached(&format!("{SELECT} {filter}"))
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = stmt.query([]).map_err(|e| self.sqlite(action, e))?;
        let mut tasks = Vec::new();
        while let Some(row) = rows.next().map_err(|e| self.sqlite(action, e))? {
            tasks.push(decode(row).map_err(|e| self.decode(e))?);
        }
        Ok(tasks)
    }
}

fn illegal(task: &TaskRecord, change: &Change<'_>) -> StoreError {
    StoreError::IllegalTransition {
        id: task.id,
        address: task.address,
        kind: task.kind,
        from: task.state,
        to: change.target(),
    }
}

/// Addresses as a JSON array of strings, for `json_each(?)` in a query.
fn json_list(addresses: impl Iterator<Item = PciAddress>) -> String {
    let list: Vec<String> = addresses.map(|a| a.to_string()).collect();
    serde_json::to_string(&list).unwrap_or_else(|_| "[]".into())
}

fn busy(address: PciAddress, task: TaskRecord) -> StoreError {
    StoreError::Busy {
        address,
        task: Box::new(task),
    }
}
