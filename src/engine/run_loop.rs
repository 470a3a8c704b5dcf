//! The loop that keeps the store in step with the kernel: a pass on every burst of uevents, at
//! each poll tick, and a reload (then reconcile) on SIGHUP, until shutdown. Shutdown wins over
//! whatever the loop is doing: a reload stuck on a file or a slow pass never keeps the daemon
//! from stopping.

use super::Engine;
use crate::host::libvirt::LibvirtEvent;
use crate::host::uevent::{EventReceiver, Uevent};
use crate::model::device::{Role, State};
use crate::model::event::EventKind;
use crate::model::pci::PciAddress;
use crate::store::{DeviceChange, NewEvent};
use std::sync::Arc;
use std::time::Duration;

/// How often lapsed claims are looked for (a lease is honoured to within this), and cleans that
/// could not start are tried again.
const LEASE_CHECK: Duration = Duration::from_secs(1);

/// What one turn of the loop does.
enum Work {
    Pass(Vec<Uevent>),
    Libvirt(LibvirtEvent),
    LibvirtClosed,
    Tick,
    Leases,
    Clean,
    Reload,
    UeventsClosed,
}

impl Engine {
    /// Records AER recovery reports; they are health history even when the scan sees no change.
    async fn note_uevents(&self, events: Vec<Uevent>) {
        let notes: Vec<NewEvent> = events
            .iter()
            .filter_map(|ev| {
                let (what, online) = ev.aer_event()?;
                let address = ev.pci_address();
                let message = format!(
                    "AER {what} on {}{}",
                    address
                        .map(|a| a.to_string())
                        .unwrap_or_else(|| ev.devpath.clone()),
                    match online {
                        Some(true) => ", device online",
                        Some(false) => ", device offline",
                        None => "",
                    }
                );
                tracing::warn!("{message}");
                Some(NewEvent::new(address, EventKind::Aer, message))
            })
            .collect();
        if notes.is_empty() {
            return;
        }
        let recorded = self
            .read(move |core| {
                for n in notes {
                    core.store().record_event(n)?;
                }
                Ok::<_, crate::store::StoreError>(())
            })
            .await;
        match recorded {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("cannot record AER event: {}", crate::error_chain(&e)),
            Err(e) => tracing::error!("cannot record AER event: {}", crate::error_chain(&e)),
        }
    }

    /// The main loop, until `shutdown` resolves. `hangups` (SIGHUP: reload) is subscribed by
    /// the caller as early as it can: a SIGHUP before anyone listens would kill the daemon, and one
    /// received while starting is served as soon as the loop runs.
    pub async fn run(
        self: &Arc<Self>,
        mut uevents: Option<EventReceiver>,
        mut hup: Option<tokio::signal::unix::Signal>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut libvirt = self.core.take_libvirt_events();
        let mut interval = self.settings().poll_interval;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let clean_wanted = self.store().clean_wanted();
        let mut leases = tokio::time::interval(LEASE_CHECK);
        leases.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Beside the loop: a scan of every process must not hold up uevents or libvirt's
        // events. Ends with the loop.
        let _holders = self.start_holder_refresh();
        loop {
            let work = tokio::select! {
                _ = &mut shutdown => break,
                ev = async {
                    match uevents.as_mut() {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => match ev {
                    Some(first) => {
                        // A split emits one event per VF; gather the burst into one pass.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let mut burst = vec![first];
                        if let Some(rx) = uevents.as_mut() {
                            while let Ok(more) = rx.try_recv() {
                                burst.push(more);
                            }
                        }
                        Work::Pass(burst)
                    }
                    None => Work::UeventsClosed,
                },
                ev = async {
                    match libvirt.as_mut() {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => match ev {
                    Some(ev) => Work::Libvirt(ev),
                    None => Work::LibvirtClosed,
                },
                _ = tick.tick() => Work::Tick,
                _ = clean_wanted.notified() => Work::Clean,
                _ = leases.tick() => Work::Leases,
                _ = async {
                    match hup.as_mut() {
                        Some(h) => { h.recv().await; }
                        None => std::future::pending().await,
                    }
                } => Work::Reload,
            };
            let turn = async {
                match work {
                    Work::Pass(burst) => {
                        #[cfg(feature = "test-hooks")]
                        let _ = tokio::task::spawn_blocking(|| {
                            super::job::pause_point("loop:uevent-pass")
                        })
                        .await;
                        self.note_uevents(burst).await;
                        self.pass().await;
                    }
                    Work::Tick => self.pass().await,
                    Work::Leases => {
                        if let Err(e) = self.expire_leases().await {
                            tracing::error!(
                                "cannot release lapsed claims: {}",
                                crate::error_chain(&e)
                            );
                        }
                        // Cleans refused a moment ago (a VFIO group still closing) start once
                        // they may.
                        if self.clean_retries.worth_a_look() {
                            self.start_cleans().await;
                        }
                    }
                    Work::Clean => {
                        self.clean_retries.wake();
                        self.start_cleans().await;
                    }
                    Work::Libvirt(ev) => self.libvirt_event(ev).await,
                    Work::LibvirtClosed => libvirt = None,
                    Work::UeventsClosed => {
                        tracing::warn!("uevent source closed; relying on polling");
                        uevents = None;
                    }
                    Work::Reload => {
                        tracing::info!("SIGHUP: reloading configuration");
                        match self.reload().await {
                            Ok(_) => {
                                self.reconcile("reload (SIGHUP)").await;
                            }
                            Err(e) => {
                                tracing::error!("reload failed: {}", crate::error_chain(&e))
                            }
                        }
                    }
                }
            };
            tokio::select! {
                _ = &mut shutdown => break,
                _ = turn => {}
            }
            // A reload (SIGHUP or D-Bus) may have changed the poll interval.
            let new_interval = self.settings().poll_interval;
            if new_interval != interval {
                interval = new_interval;
                tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            }
        }
    }

    /// A domain event goes on to the engine's consumers (hooks act on them); an undefined
    /// domain's claims are released here, a device event may complete a detach, and a stopped
    /// domain's claims are reconciled with what it still has. A connection change is logged;
    /// events during an outage are lost, so the claims are reconciled on `Connected`.
    async fn libvirt_event(self: &Arc<Self>, ev: LibvirtEvent) {
        use crate::host::libvirt::DomainEventKind;
        match ev {
            LibvirtEvent::Domain(d) => {
                tracing::debug!(domain = %d.name, uuid = %d.uuid, "libvirt domain event {:?}", d.kind);
                // Pooled sessions: quiesce at the switchover, resume where the VM runs.
                self.pooled_event(&d);
                match d.kind {
                    DomainEventKind::DeviceRemoved { .. }
                    | DomainEventKind::DeviceRemovalFailed { .. } => self.device_event(&d).await,
                    DomainEventKind::DeviceAdded { .. } => self.device_added(&d).await,
                    // Its live devices are gone with it.
                    DomainEventKind::Stopped => {
                        self.incoming_event(&d).await;
                        self.reconcile_claims(Some(d.uuid.clone())).await;
                    }
                    _ => self.incoming_event(&d).await,
                }
                if d.kind == DomainEventKind::Undefined {
                    if let Err(e) = self.domain_undefined(&d.name, &d.uuid).await {
                        tracing::error!(
                            domain = %d.name,
                            "cannot release the claims of an undefined domain: {}",
                            crate::error_chain(&e)
                        );
                    }
                    // Attached claims go once the domain no longer runs (a running domain that
                    // is undefined lives on as a transient one, with its devices).
                    self.reconcile_claims(Some(d.uuid.clone())).await;
                }
                self.send(super::EngineEvent::Domain(d));
            }
            LibvirtEvent::Connected { uri } => {
                tracing::info!(uri, "connected to libvirt");
                let changed = self.reconcile_claims(None).await;
                if changed > 0 {
                    tracing::info!("reconciled {changed} claim(s) with libvirt's domains");
                }
                // Events missed while vfiod or libvirt was down: pooled sessions of domains
                // that no longer run here.
                self.reconcile_pooled().await;
                // Only now: "connected" tells a client that the claims agree with libvirt.
                self.libvirt_link
                    .set(&uri, super::libvirt_link::LinkState::Connected);
            }
            LibvirtEvent::Disconnected { uri, reason } => {
                self.libvirt_link.set(
                    &uri,
                    super::libvirt_link::LinkState::Disconnected {
                        reason: reason.to_string(),
                    },
                );
                tracing::warn!(
                    uri,
                    "lost the connection to libvirt ({reason:?}); reconnecting"
                )
            }
        }
    }

    /// An inventory pass; then the policy, again, for each function that has just become ready
    /// for it ([`ready_for_policy`]). At boot a PF's driver may bind after vfiod's start-up
    /// reconcile, which left the PF waiting for it ([`crate::mode::policy::Decision::Wait`]); a
    /// hot-plugged function gets its mode too. A function the policy leaves alone, or that is
    /// there already, gets no task.
    async fn pass(self: &Arc<Self>) {
        match self.refresh().await {
            Ok(pass) => {
                for (address, why) in ready_for_policy(&pass.changes) {
                    self.reconcile_device(address, why).await;
                }
            }
            Err(e) => tracing::error!("inventory pass failed: {}", crate::error_chain(&e)),
        }
    }
}

/// The functions other than VFs that a pass saw become ready for the policy, with what made
/// them so (the task's `requested_by`): a driver bound where there was none, added with one
/// (hot-plug), or usable again (no longer protected, broken or being cleaned). Both can come one
/// pass apart: when nvme binds, udev opens the new namespace to probe it, so the pass that sees
/// the driver sees the PF used by the host, and the next one sees it usable. A VF has no mode of
/// its own; one that changes is the work of its PF's task or of a claim.
fn ready_for_policy(changes: &[DeviceChange]) -> Vec<(PciAddress, &'static str)> {
    changes
        .iter()
        .filter_map(|c| match c {
            DeviceChange::Added(d) if d.driver.is_some() => {
                Some((d, "vfiod (a driver bound to it)"))
            }
            DeviceChange::Changed { old, new } if old.driver.is_none() && new.driver.is_some() => {
                Some((new, "vfiod (a driver bound to it)"))
            }
            DeviceChange::Changed { old, new }
                if old.state != State::Usable && new.state == State::Usable =>
            {
                Some((new, "vfiod (it became usable)"))
            }
            _ => None,
        })
        .filter(|(d, _)| d.role != Role::Vf)
        .map(|(d, why)| (d.address, why))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::device::Device;

    fn dev(address: &str, role: Role, driver: Option<&str>) -> Device {
        Device {
            role,
            driver: driver.map(str::to_string),
            ..Device::example(address)
        }
    }

    #[test]
    fn a_pass_reconciles_the_functions_that_became_ready_for_the_policy() {
        let pf = |d| dev("0000:01:00.0", Role::Pf, d);
        let vf = |d| dev("0000:01:00.1", Role::Vf, d);
        let held = |d| Device {
            state: State::Protected,
            ..pf(d)
        };
        let bound = Some("vfiod (a driver bound to it)");
        let usable = Some("vfiod (it became usable)");
        #[rustfmt::skip]
        let table: Vec<(DeviceChange, Option<&str>)> = vec![
            (DeviceChange::Changed { old: pf(None), new: pf(Some("nvme")) }, bound),
            (DeviceChange::Changed { old: pf(Some("nvme")), new: pf(Some("vfio-pci")) }, None),
            (DeviceChange::Changed { old: pf(Some("nvme")), new: pf(None) }, None),
            (DeviceChange::Changed { old: pf(None), new: pf(None) }, None),
            (DeviceChange::Added(pf(Some("nvme"))), bound),
            (DeviceChange::Added(pf(None)), None),
            (DeviceChange::Removed(pf(Some("nvme"))), None),
            // udev's probe of the new namespace, then its end: ready one pass later.
            (DeviceChange::Changed { old: pf(None), new: held(Some("nvme")) }, bound),
            (DeviceChange::Changed { old: held(Some("nvme")), new: pf(Some("nvme")) }, usable),
            (DeviceChange::Changed { old: pf(Some("nvme")), new: held(Some("nvme")) }, None),
            (DeviceChange::Changed { old: vf(None), new: vf(Some("vfio-pci")) }, None),
            (DeviceChange::Added(vf(Some("nvme"))), None),
        ];
        for (change, want) in table {
            let got = ready_for_policy(std::slice::from_ref(&change));
            assert_eq!(got.first().map(|(_, why)| *why), want, "{change:?}");
        }
    }
}
