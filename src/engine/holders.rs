//! The holder index kept fresh: every `[host] holder_refresh_ms`, every process's descriptors
//! are read again on the blocking pool (`Core::refresh_holders`), and when what uses the
//! functions now is not what the records say (a holder came or went), an inventory pass
//! records it, so that `vfioctl list`, claims and the hook's guard agree. The hook's guard reads
//! the index, never this scan (see `host::sysfs::hostuse` for the window it leaves).

use super::Engine;
use std::sync::Arc;
use std::time::Duration;

/// Ends the background refresh when the engine's loop ends (or its future is dropped).
pub(super) struct Refresher(tokio::task::JoinHandle<()>);

impl Drop for Refresher {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Engine {
    /// Starts the background refresh of the holder index; it runs until the returned value
    /// is dropped.
    pub(super) fn start_holder_refresh(self: &Arc<Self>) -> Refresher {
        let engine = Arc::clone(self);
        Refresher(tokio::spawn(async move {
            loop {
                // Read each time: a reload may change it.
                let every = engine.settings().host.holder_refresh_ms;
                tokio::time::sleep(Duration::from_millis(every.into())).await;
                engine.refresh_holders().await;
            }
        }))
    }

    /// One refresh of the holder index, then a pass when the records no longer say what uses
    /// the functions.
    pub async fn refresh_holders(&self) {
        if let Err(e) = self.read(|core| core.refresh_holders()).await {
            tracing::warn!(
                "cannot refresh the holder index: {}",
                crate::error_chain(&e)
            );
            return;
        }
        self.settle_host_use().await;
    }

    /// Before a task on `device` is admitted: when its record says a holder uses it (a QEMU
    /// by hand, a process, a mount), whether that is still so, so that a job asked for once the
    /// holder is gone is not refused for the refresh's window. Cheap otherwise: one read.
    pub(super) async fn settle_protection_of(&self, device: crate::model::pci::PciAddress) {
        let used = self
            .read(move |core| {
                core.store().device(device).ok().flatten().is_some_and(|d| {
                    d.state == crate::model::device::State::Protected
                        && crate::hostuse::is_use_reason(&d.state_reason)
                })
            })
            .await;
        if used.unwrap_or(false) {
            self.settle_host_use().await;
        }
    }

    /// The holder index's generation, moving at each refresh (a pass refreshes it too).
    pub fn subscribe_holders(&self) -> tokio::sync::watch::Receiver<u64> {
        self.core.subscribe_holders()
    }
}
