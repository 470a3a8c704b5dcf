//! The stand-in accelerator and the lease clock.
//!
//! One worker task per live session processes its queued items in order: under the session's
//! engine lock it checks that the session runs, takes the oldest item, "computes" for the item
//! time, and commits the result in the same transaction that removes the item. A quiesce takes
//! the engine lock after marking the session quiesced, so it waits for at most the item in
//! progress: at the reply, every item is either completed (its result kept for delivery) or
//! still queued. After a resume the worker starts with the oldest queued item, where it stopped.
//!
//! The lease clock resumes quiesced sessions whose lease ran out, on their last owner, and
//! reaps the workers of released sessions; its cost per tick does not grow with the number
//! of sessions ever made.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Service;
use crate::protocol::{work_value, SessionState, WorkResult};

/// How often a sleeping worker looks at its session even without a wake-up (a safety net: every
/// change that matters rings the engine's bell).
const IDLE_RECHECK: Duration = Duration::from_secs(1);

/// Runs session `id`'s worker until the session is released (or gone) or `stop` turns true.
pub async fn run_worker(service: Arc<Service>, id: String, mut stop: watch::Receiver<bool>) {
    let core = &service.core;
    let engine = core.engine(&id);
    loop {
        if *stop.borrow() {
            return;
        }
        let busy = engine.busy.lock().await;
        let next = {
            let store = core.store();
            match store.session(&id) {
                Ok(Some(rec)) if rec.state == SessionState::Running => store.next_item(&id),
                Ok(Some(rec)) if rec.state == SessionState::Quiesced => Ok(None),
                // Released or gone: the worker's work is over, and its engine goes with it
                // (the session stays in the store, for history only).
                Ok(_) => {
                    drop(store);
                    drop(busy);
                    core.drop_engine(&id);
                    return;
                }
                Err(e) => Err(e),
            }
        };
        match next {
            Ok(Some(item)) => {
                // The stand-in's computation: the time an accelerator would take.
                if !core.settings.item_time.is_zero() {
                    tokio::time::sleep(core.settings.item_time).await;
                }
                let result = WorkResult {
                    seq: item.seq,
                    value: work_value(item.seq, item.payload),
                };
                let completed = core.store().complete(&id, result);
                if let Err(e) = completed {
                    tracing::error!(
                        session = id,
                        "completing item {}: {}",
                        item.seq,
                        crate::error_chain(&e)
                    );
                    drop(busy);
                    tokio::time::sleep(IDLE_RECHECK).await;
                }
            }
            Ok(None) => {
                drop(busy);
                tokio::select! {
                    _ = engine.wake.notified() => {}
                    _ = tokio::time::sleep(IDLE_RECHECK) => {}
                    changed = stop.changed() => if changed.is_err() { return },
                }
            }
            Err(e) => {
                drop(busy);
                tracing::error!(
                    session = id,
                    "reading the queue: {}",
                    crate::error_chain(&e)
                );
                tokio::time::sleep(IDLE_RECHECK).await;
            }
        }
    }
}

/// Every `tick`, resumes the quiesced sessions whose lease ran out and reaps finished workers,
/// until `stop` turns true.
pub async fn run_lease_clock(
    service: Arc<Service>,
    tick: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let core = &service.core;
    loop {
        if let Err(e) = core.expire_leases() {
            tracing::error!("lease expiry: {}", crate::error_chain(&e));
        }
        service.reap_workers();
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            changed = stop.changed() => if changed.is_err() { return },
        }
        if *stop.borrow() {
            return;
        }
    }
}
