//! The engine's blocking core: the settings in force and where they come from, the kernel's
//! device tree, the store, and the host questions jobs ask. An inventory pass and a reload are
//! done here; [`super::Engine`] runs them off the async threads and publishes their outcome.

use super::context::{ClaimSteps, JobContext, ModuleLoader};
use super::event::{DeviceTasks, DeviceView};
use super::removals::Removals;
use crate::config::{ConfigError, Settings};
use crate::host::libvirt::{Libvirt, LibvirtEvent};
use crate::host::sysfs::{hostuse, Sysfs, SysfsError};
use crate::hostuse::{HolderIndex, Use};
use crate::inventory;
use crate::model::device::{Device, Role};
use crate::model::event::EventKind;
use crate::model::iommu::{Iommu, NoIommu};
use crate::model::pci::PciAddress;
use crate::store::{DeviceChange, Event, NewEvent, Store, StoreError, TaskRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    #[error("state store failed")]
    Store(#[from] StoreError),
    #[error("cannot list PCI functions")]
    Sysfs(#[from] SysfsError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<tokio::task::JoinError> for EngineError {
    fn from(e: tokio::task::JoinError) -> Self {
        EngineError::Internal(format!("a worker failed: {e}"))
    }
}

/// Where the settings come from, so a reload reads the same files.
#[derive(Clone, Debug)]
pub struct ConfigSource {
    pub main: PathBuf,
    pub dropin_dir: Option<PathBuf>,
    pub main_required: bool,
    /// Applied after every load (e.g. `--simulate` pins the sysfs root and state dir).
    pub pin_sysfs_root: Option<PathBuf>,
    pub pin_state_dir: Option<PathBuf>,
}

impl ConfigSource {
    pub fn load(&self) -> Result<Settings, ConfigError> {
        let mut s = Settings::load(&self.main, self.dropin_dir.as_deref(), self.main_required)?;
        self.pin(&mut s);
        Ok(s)
    }

    /// As [`ConfigSource::load`], with every error found ([`Settings::check`]).
    pub fn check(&self) -> Result<Settings, Vec<ConfigError>> {
        let mut s = Settings::check(&self.main, self.dropin_dir.as_deref(), self.main_required)?;
        self.pin(&mut s);
        Ok(s)
    }

    fn pin(&self, s: &mut Settings) {
        if let Some(r) = &self.pin_sysfs_root {
            s.sysfs_root = r.clone();
        }
        if let Some(d) = &self.pin_state_dir {
            s.state_dir = d.clone();
        }
    }
}

/// The result of one inventory pass.
#[derive(Debug, Default)]
pub struct Pass {
    pub changes: Vec<DeviceChange>,
    pub events: Vec<Event>,
}

/// Logs the configured drivers that no loaded driver, module or built-in provides (a task that
/// needs one will be refused, and the operator should hear it at load, not then) and the
/// `[[select]]` rules an earlier one shadows.
pub fn warn_about_drivers(settings: &Settings) {
    for w in crate::host::modules::driver_warnings(settings, &settings.sysfs_root) {
        tracing::warn!("{w}");
    }
    for w in settings.shadowed_rule_warnings() {
        tracing::warn!("{w}");
    }
}

pub struct Core {
    sysfs: Sysfs,
    store: Arc<Store>,
    settings: RwLock<Arc<Settings>>,
    source: Option<ConfigSource>,
    /// The one connection to libvirt: which running domains use what, domain events.
    libvirt: Libvirt,
    libvirt_events: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<LibvirtEvent>>>,
    modules: Arc<dyn ModuleLoader>,
    removals: Arc<Removals>,
    /// The host's IOMMU as the last inventory pass found it; `None` before the first.
    iommu: std::sync::Mutex<Option<Iommu>>,
    /// Who held which node at the last scan of every process (see
    /// [`crate::host::sysfs::hostuse`]), and its generation for whoever waits for a refresh.
    holders: std::sync::Mutex<Arc<HolderIndex>>,
    holders_built: tokio::sync::watch::Sender<u64>,
    /// One scan of every process at a time (a pass and the background refresh).
    holders_scan: std::sync::Mutex<()>,
}

impl Core {
    pub fn new(
        settings: Settings,
        source: Option<ConfigSource>,
        sysfs: Sysfs,
        store: Arc<Store>,
        modules: Arc<dyn ModuleLoader>,
    ) -> Result<Core, EngineError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let libvirt = Libvirt::start(
            settings.libvirt_uri.clone(),
            settings.sysfs_root.clone(),
            Some(tx),
        )
        .map_err(|e| EngineError::Internal(format!("cannot start the libvirt worker: {e}")))?;
        store.set_clean_policy(crate::store::CleanPolicy::of(&settings));
        let settings = Arc::new(settings);
        store.set_split_policy(crate::mode::policy::split_policy(Arc::clone(&settings)));
        Ok(Core {
            sysfs,
            store,
            settings: RwLock::new(settings),
            source,
            libvirt,
            libvirt_events: std::sync::Mutex::new(Some(rx)),
            modules,
            removals: Arc::default(),
            iommu: std::sync::Mutex::new(None),
            holders: std::sync::Mutex::default(),
            holders_built: tokio::sync::watch::channel(0).0,
            holders_scan: std::sync::Mutex::new(()),
        })
    }

    /// The holder index as the last scan of every process left it (empty before the first:
    /// then every process is new to a bounded read).
    pub fn holders(&self) -> Arc<HolderIndex> {
        Arc::clone(&self.holders.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Scans every process's descriptors into a new holder index, keeps it and says so to
    /// [`Core::subscribe_holders`]. As slow as the host has processes: on the blocking pool,
    /// never on a path that something waits on.
    pub fn refresh_holders(&self) -> Arc<HolderIndex> {
        let _one = self.holders_scan.lock().unwrap_or_else(|p| p.into_inner());
        let generation = self.holders().generation + 1;
        let index = Arc::new(hostuse::index(&self.sysfs, generation));
        *self.holders.lock().unwrap_or_else(|p| p.into_inner()) = Arc::clone(&index);
        self.holders_built.send_replace(generation);
        index
    }

    /// The generation of the holder index, moving at each refresh.
    pub fn subscribe_holders(&self) -> tokio::sync::watch::Receiver<u64> {
        self.holders_built.subscribe()
    }

    /// Every use of every function as the kernel says it now, read through the holder index
    /// (bounded), kept as the inventory counts them ([`crate::hostuse::outside_vfiod`]: a VM's
    /// use of a function no claim of vfiod's holds).
    pub fn uses_now(&self) -> Result<BTreeMap<PciAddress, Vec<Use>>, StoreError> {
        let claimed: BTreeSet<PciAddress> = self
            .store
            .active_claim_records()?
            .into_iter()
            .filter(|c| c.state.holds())
            .flat_map(|c| c.functions)
            .collect();
        let read = hostuse::read_indexed(
            &self.sysfs,
            hostuse::Scope::All,
            &self.settings().host.allow_console_gpu,
            &self.holders(),
        );
        Ok(crate::hostuse::outside_vfiod(
            crate::hostuse::uses(&read.facts),
            &claimed,
        ))
    }

    /// libvirt's domain lifecycle events and connection changes, once (the engine's loop takes
    /// them).
    pub fn take_libvirt_events(
        &self,
    ) -> Option<tokio::sync::mpsc::UnboundedReceiver<LibvirtEvent>> {
        self.libvirt_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    pub fn libvirt(&self) -> &Libvirt {
        &self.libvirt
    }

    pub fn settings(&self) -> Arc<Settings> {
        Arc::clone(&self.settings.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    /// What a job runs with: the settings as they are now, fixed for the job's life.
    pub fn job_context(&self) -> JobContext {
        JobContext {
            sysfs: self.sysfs.clone(),
            store: Arc::clone(&self.store),
            settings: self.settings(),
            domains: Arc::new(self.libvirt.clone()),
            modules: Arc::clone(&self.modules),
            libvirt: self.libvirt.clone(),
            removals: Arc::clone(&self.removals),
            // Published by nobody: the engine's own context ([`super::Engine`]) publishes.
            claims: ClaimSteps::new(
                Arc::clone(&self.store),
                Arc::default(),
                Arc::new(|_: &crate::store::ClaimRecord| {}),
            ),
        }
    }

    /// libvirt's device-removed events, as detach jobs wait for them.
    pub fn removals(&self) -> &Arc<Removals> {
        &self.removals
    }

    /// The host's IOMMU as the last inventory pass found it; `None` before the first.
    pub fn iommu(&self) -> Option<Iommu> {
        *self.iommu.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps what this pass found of the IOMMU, and says so once when it is missing (at the
    /// first pass: vfiod's start) or comes back.
    fn note_iommu(&self, now: Iommu) {
        let before = self
            .iommu
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(now);
        match (before, now) {
            (Some(Iommu::Absent), Iommu::Absent)
            | (None | Some(Iommu::Present), Iommu::Present) => {}
            (None | Some(Iommu::Present), Iommu::Absent) => tracing::warn!("{}", NoIommu),
            (Some(Iommu::Absent), Iommu::Present) => {
                tracing::info!("an IOMMU is there now: passthrough is allowed again")
            }
        }
    }

    /// One inventory pass: scan, diff against the store, commit.
    pub fn refresh(&self) -> Result<Pass, EngineError> {
        self.note_iommu(crate::host::sysfs::iommu::read(&self.sysfs));
        // Every process read again: a pass (a rescan, a poll, a uevent) sees every holder.
        self.refresh_holders();
        let uses = self.uses_now()?;
        let settings = self.settings();
        let previous: BTreeMap<PciAddress, Device> = self
            .store
            .devices()?
            .into_iter()
            .map(|d| (d.address, d))
            .collect();
        let scanned = inventory::with_holds(
            inventory::scan_with(&self.sysfs, &settings, &previous, &uses)?,
            &self.store.clean_holds()?,
        );
        let (changes, mut new_events) = inventory::diff(&previous, &scanned);
        if changes.is_empty() && new_events.is_empty() {
            return Ok(Pass::default());
        }
        new_events.extend(self.claimed_and_broken(&changes)?);
        let events = self.store.apply_changes(&changes, &new_events)?;
        // A function that vanishes or breaks deserves the operator's attention; VFs removed
        // because their PF's VF count went down do not (a restore removes 64 at once).
        let vfs_removed: Vec<PciAddress> = changes
            .iter()
            .filter_map(|c| match c {
                DeviceChange::Removed(d) if d.role == Role::Vf => Some(d.address),
                _ => None,
            })
            .collect();
        for e in &events {
            let expected = e.address.is_some_and(|a| vfs_removed.contains(&a));
            let device = e.address.map(|a| a.to_string()).unwrap_or_default();
            match e.kind {
                EventKind::Broken => tracing::warn!(device, "{}", e.message),
                EventKind::Removed if !expected => tracing::warn!(device, "{}", e.message),
                _ => tracing::info!(device, "{}", e.message),
            }
        }
        Ok(Pass { changes, events })
    }

    /// A claimed device that breaks stays claimed (its VM still has it): said once, when it
    /// breaks, with the VM, so that an operator sees which VM is affected.
    fn claimed_and_broken(&self, changes: &[DeviceChange]) -> Result<Vec<NewEvent>, StoreError> {
        let broken: Vec<PciAddress> = changes
            .iter()
            .filter_map(|c| match c {
                DeviceChange::Changed { old, new }
                    if new.state == crate::model::device::State::Broken
                        && old.state != crate::model::device::State::Broken =>
                {
                    Some(new.address)
                }
                _ => None,
            })
            .collect();
        if broken.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .store
            .active_claims(&broken)?
            .into_iter()
            .map(|(address, vm)| {
                NewEvent::new(
                    Some(address),
                    EventKind::Claim,
                    format!(
                        "{address} broke while claimed by {vm}: the claim stays (the VM still \
                         has the device); it returns to the pool only once released and healthy"
                    ),
                )
            })
            .collect())
    }

    /// Re-reads the config files. A bad file is rejected and the old settings stay in force;
    /// either way the outcome is recorded as an event.
    pub fn reload(&self) -> Result<Arc<Settings>, EngineError> {
        let Some(source) = &self.source else {
            return Ok(self.settings());
        };
        match source.load() {
            Ok(new) => {
                let old = self.settings();
                if new.sysfs_root != old.sysfs_root || new.state_dir != old.state_dir {
                    // Moving the store or the kernel tree under a running daemon would split
                    // its state; those two take effect at restart.
                    tracing::warn!(
                        "sysfs_root and state_dir changes take effect at the next start"
                    );
                }
                let mut effective = new;
                effective.sysfs_root = old.sysfs_root.clone();
                effective.state_dir = old.state_dir.clone();
                let effective = Arc::new(effective);
                if effective.libvirt_uri != old.libvirt_uri {
                    self.libvirt.set_uri(effective.libvirt_uri.clone());
                }
                warn_about_drivers(&effective);
                *self.settings.write().unwrap_or_else(|p| p.into_inner()) = Arc::clone(&effective);
                self.store
                    .set_clean_policy(crate::store::CleanPolicy::of(&effective));
                self.store
                    .set_split_policy(crate::mode::policy::split_policy(Arc::clone(&effective)));
                self.store.record_event(NewEvent::new(
                    None,
                    EventKind::Config,
                    format!(
                        "configuration reloaded from {}",
                        effective
                            .sources
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ))?;
                tracing::info!("configuration reloaded");
                Ok(effective)
            }
            Err(e) => {
                let msg = format!(
                    "configuration reload rejected, previous settings kept: {}",
                    crate::error_chain(&e)
                );
                tracing::error!("{msg}");
                self.store
                    .record_event(NewEvent::new(None, EventKind::Config, msg))?;
                Err(e.into())
            }
        }
    }

    /// The task state of `address`: the task that holds it and its last finished one.
    pub fn device_tasks(&self, address: PciAddress) -> Result<DeviceTasks, StoreError> {
        Ok(DeviceTasks {
            address,
            active: self.store.blocking_task(address)?,
            last: self.store.last_result(address)?,
            health: self.store.reset_health(address)?,
        })
    }

    /// The task state of every device `task` concerns: its own device, each function in its
    /// scope, and its device's VFs (which show their PF's task).
    pub fn covered_by(&self, task: &TaskRecord) -> Result<Vec<DeviceTasks>, StoreError> {
        let mut addresses = vec![task.address];
        addresses.extend(self.store.task_scope(task.id)?);
        addresses.extend(self.store.vfs_of(task.address)?);
        addresses.sort();
        addresses.dedup();
        addresses
            .into_iter()
            .map(|a| self.device_tasks(a))
            .collect()
    }

    /// Every device with its task state: what a consumer starts from.
    pub fn device_views(&self) -> Result<Vec<DeviceView>, StoreError> {
        self.store
            .devices()?
            .into_iter()
            .map(|device| {
                let t = self.device_tasks(device.address)?;
                Ok(DeviceView {
                    device,
                    active: t.active,
                    last: t.last,
                    health: t.health,
                })
            })
            .collect()
    }
}
