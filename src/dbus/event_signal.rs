//! `Manager.Event`: one signal per event the store commits, in id order. Woken by the store
//! after any write that inserted rows (`store::event_feed`), so every writer's events are
//! signalled, and read back from the store, so a signal is never sent for an event that is not
//! there.

use super::manager::Manager;
use super::{wire, Objects, ROOT_PATH};
use zbus::object_server::SignalEmitter;

/// The most events read from the store at once; a burst larger than this goes out in turns.
const BATCH: usize = 500;

pub(super) async fn run(objects: Objects) {
    let mut newest = match objects
        .engine
        .read(|core| core.store().subscribe_events())
        .await
    {
        Ok(rx) => rx,
        Err(e) => {
            tracing::error!("events will not be signalled: {}", crate::error_chain(&e));
            return;
        }
    };
    let emitter = SignalEmitter::new(&objects.conn, ROOT_PATH).expect("the root path is valid");
    // Events from before this point are history: GetEvents has them.
    newest.borrow_and_update();
    let mut last = match objects
        .engine
        .read(|core| core.store().recent_events(None, None, 1))
        .await
    {
        Ok(Ok(e)) => e.last().map_or(0, |e| e.id),
        Ok(Err(e)) => {
            tracing::error!("events will not be signalled: {}", crate::error_chain(&e));
            return;
        }
        Err(e) => {
            tracing::error!("events will not be signalled: {}", crate::error_chain(&e));
            return;
        }
    };
    while newest.changed().await.is_ok() {
        loop {
            let after = last;
            let batch = match objects
                .engine
                .read(move |core| core.store().events(None, after, BATCH))
                .await
            {
                Ok(Ok(batch)) => batch,
                Ok(Err(e)) => {
                    tracing::warn!(
                        "cannot read new events to signal: {}",
                        crate::error_chain(&e)
                    );
                    break;
                }
                Err(e) => {
                    tracing::warn!(
                        "cannot read new events to signal: {}",
                        crate::error_chain(&e)
                    );
                    break;
                }
            };
            for e in &batch {
                if let Err(err) = Manager::event(&emitter, wire::event(e)).await {
                    tracing::debug!(id = e.id, "event signal not sent: {err}");
                }
                last = e.id;
            }
            if batch.len() < BATCH {
                break;
            }
        }
    }
}
