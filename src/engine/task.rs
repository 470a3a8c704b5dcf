//! The task runner: gives every [`Job`] the same life as a task (see [`super::job`] for the
//! order of the calls). [`begin`] admits the job, creates its task (refused with Busy when the
//! device or its scope is held), prepares and guards it; [`run`] runs it with progress, rolls it
//! back after a failure, and records the outcome. Both block (sysfs, SQLite): call them off the
//! async threads.
//!
//! Each recorded change is handed to `notify` with the task's new record, so that the engine can
//! publish it; the store has committed it before.

use super::context::JobContext;
use super::job::{Job, JobError, Phase, Progress};
use crate::store::{StoreError, TaskRecord};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A change of a task, as `notify` receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Created, started, finished, refused or reset: the devices it covers change with it.
    State,
    /// A new step or percentage: only the task itself changes.
    Progress,
}

/// A job whose task exists, prepared and guarded, ready to [`run`].
pub struct Started {
    pub task: TaskRecord,
    job: Box<dyn Job>,
    phases: Vec<Phase>,
    span: tracing::Span,
}

/// The span every log line of a task carries: its id, device and kind as structured fields.
fn task_span(task: &TaskRecord) -> tracing::Span {
    tracing::info_span!(
        "task",
        task_id = task.id,
        device = %task.address,
        kind = %task.kind
    )
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Runs one call of a job, turning a panic into [`JobError::Internal`]: a bug in one job must
/// not take a worker thread (or the daemon) with it.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, JobError>) -> Result<T, JobError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(JobError::Internal(format!(
            "the job panicked in {what}: {}",
            panic_message(&*p)
        )))
    })
}

/// Admits `job`, creates its task in `prepare`, then prepares and guards it while the task holds
/// the device and its scope. A refusal before the task exists creates nothing; a refusal in
/// prepare or guard ends the task as refused (error, but reset at once: it never holds the
/// device) and is returned too, so the caller learns why.
pub fn begin(
    cx: &JobContext,
    mut job: Box<dyn Job>,
    requested_by: &str,
    notify: &dyn Fn(&TaskRecord, Change),
) -> Result<Started, JobError> {
    let admission = guarded("admit", || job.admit(cx))?;
    let params = match &admission.params {
        serde_json::Value::Object(_) => admission.params.to_string(),
        _ => "{}".to_string(),
    };
    let task = cx.store.create_task_covering(
        job.device(),
        &admission.scope,
        admission.kind,
        &params,
        requested_by,
    )?;
    notify(&task, Change::State);
    let span = task_span(&task);
    let _entered = span.enter();
    tracing::info!(requested_by, "task created");

    let checked = guarded("prepare", || job.prepare(cx))
        .and_then(|kind| guarded("guard", || job.guard(cx)).map(|()| kind));
    match checked {
        Ok(kind) => {
            let task = if kind != task.kind {
                let t = cx.store.task_set_kind(task.id, kind)?;
                notify(&t, Change::Progress);
                t
            } else {
                task
            };
            let phases = job.phases();
            drop(_entered);
            // The span names the kind prepare decided.
            let span = task_span(&task);
            Ok(Started {
                task,
                job,
                phases,
                span,
            })
        }
        Err(refusal) => {
            let message = format!(
                "refused: {}; nothing was changed",
                crate::error_chain(&refusal)
            );
            tracing::warn!("{message}");
            match cx.store.task_refused(task.id, &message) {
                Ok(t) => notify(&t, Change::State),
                Err(e) => tracing::error!("cannot record the refusal: {}", crate::error_chain(&e)),
            }
            Err(refusal)
        }
    }
}

/// Runs a started task to its end and returns its final record: progress through the job's
/// phases, rollback after a failure or a panic, success or error recorded. An error keeps the
/// device until an operator resets the task. `Err` only when the store cannot record the outcome.
///
/// `settle` runs once the job (and any rollback) is done and before the end is recorded: the
/// engine records there what the task changed in the kernel (an inventory pass), so that
/// nobody sees the task ended while the records still show the state before it (a restore's
/// VFs, gone from the kernel, still claimable).
pub fn run(
    cx: &JobContext,
    started: Started,
    notify: &dyn Fn(&TaskRecord, Change),
    settle: &dyn Fn(),
) -> Result<TaskRecord, StoreError> {
    let Started {
        task,
        mut job,
        phases,
        span,
    } = started;
    let _entered = span.enter();
    let id = task.id;
    let first = phases.first().map_or("run", |p| p.name);
    let t = cx.store.task_progress(id, first, 0)?;
    notify(&t, Change::State);

    let mut last_error: Option<StoreError> = None;
    let mut report = |step: &str, pct: u8| match cx.store.task_progress(id, step, pct) {
        Ok(t) => notify(&t, Change::Progress),
        Err(e) => last_error = Some(e),
    };
    let outcome = {
        let mut progress = Progress::new(&phases, &mut report);
        catch_unwind(AssertUnwindSafe(|| job.run(cx, &mut progress))).unwrap_or_else(|p| {
            Err(super::job::JobFailure::new(format!(
                "internal error: the job panicked: {}",
                panic_message(&*p)
            )))
        })
    };
    if let Some(e) = last_error {
        tracing::warn!(
            "a progress report could not be recorded: {}",
            crate::error_chain(&e)
        );
    }
    let t = match outcome {
        Ok(message) => {
            tracing::info!(result = %message, "task succeeded");
            settle();
            cx.store.task_succeeded(id, &message)?
        }
        Err(failure) => {
            tracing::warn!(error = %failure.message, "task failed; rolling back");
            let rollback =
                catch_unwind(AssertUnwindSafe(|| job.rollback(cx))).unwrap_or_else(|p| {
                    Err(super::job::JobFailure::new(format!(
                        "the rollback panicked: {}",
                        panic_message(&*p)
                    )))
                });
            let settled = rollback.is_ok() && job.settles_failures();
            let message = match rollback {
                Ok(done) => format!("{}; rollback {done}", failure.message),
                Err(e) => format!("{}; rollback failed too: {}", failure.message, e.message),
            };
            settle();
            if settled {
                tracing::warn!(result = %message, "task failed; its rollback settled it");
                cx.store.task_settled(id, &message)?
            } else {
                tracing::error!(result = %message, "task failed");
                cx.store.task_failed(id, &message)?
            }
        }
    };
    notify(&t, Change::State);
    Ok(t)
}
