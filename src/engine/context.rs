//! What a job may use, and nothing else: the kernel's device tree, the store, a snapshot of the
//! settings taken when its task started, the question "which running domains use what", and a
//! way to load kernel modules. Jobs never see the engine, the D-Bus layer or the loop, so the
//! engine depends on jobs and never the reverse.

use super::removals::Removals;
use crate::claim::lifecycle::Step;
use crate::config::Settings;
use crate::host::libvirt::{DomainQuery, Libvirt};
use crate::host::sysfs::Sysfs;
use crate::store::{ClaimDetails, ClaimRecord, Store, StoreError};
use std::sync::{Arc, Mutex, PoisonError};

/// Loads the kernel module behind a driver name, so that a job binding to `vfio-pci` does not
/// fail half-way through because `drivers_probe` never loads a module.
pub trait ModuleLoader: Send + Sync {
    /// Ok when `driver` is bound-able afterwards (`<sysfs>/bus/pci/drivers/<driver>` exists);
    /// otherwise why not.
    fn ensure_loaded(&self, sysfs: &Sysfs, driver: &str) -> Result<(), String>;
}

/// `modprobe` on the real kernel (sysfs root `/`). Under another root (the simulated kernel, a
/// test tree) nothing is loaded: the driver is there or it is missing.
pub struct Modprobe;

impl ModuleLoader for Modprobe {
    fn ensure_loaded(&self, sysfs: &Sysfs, driver: &str) -> Result<(), String> {
        if sysfs.driver_dir(driver).exists() {
            return Ok(());
        }
        if sysfs.root() != std::path::Path::new("/") {
            return Err(format!("driver {driver} is not loaded"));
        }
        // Module names use underscores where driver names may use dashes (vfio-pci: vfio_pci);
        // modprobe accepts either.
        let out = std::process::Command::new("modprobe")
            .arg("--")
            .arg(driver)
            .output()
            .map_err(|e| {
                format!("driver {driver} is not loaded and modprobe could not run: {e}")
            })?;
        if !out.status.success() || !sysfs.driver_dir(driver).exists() {
            return Err(format!(
                "driver {driver} is not loaded and `modprobe {driver}` did not load it: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        tracing::info!(driver, "loaded the kernel module for a driver");
        Ok(())
    }
}

/// Where a job records a claim's steps: committed, then published in commit order (the engine
/// holds its publishing lock from the commit to the event, as for every other change).
#[derive(Clone)]
pub struct ClaimSteps {
    store: Arc<Store>,
    publishing: Arc<Mutex<()>>,
    publish: Arc<dyn Fn(&ClaimRecord) + Send + Sync>,
}

impl ClaimSteps {
    pub fn new(
        store: Arc<Store>,
        publishing: Arc<Mutex<()>>,
        publish: Arc<dyn Fn(&ClaimRecord) + Send + Sync>,
    ) -> ClaimSteps {
        ClaimSteps {
            store,
            publishing,
            publish,
        }
    }

    /// Takes `step` on claim `id` (see [`Store::step_claim`]) and publishes the claim.
    pub fn step(
        &self,
        id: i64,
        step: Step,
        details: ClaimDetails,
        what: &str,
    ) -> Result<ClaimRecord, StoreError> {
        let _publishing = self
            .publishing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let claim = self.store.step_claim(id, step, details, what)?;
        (self.publish)(&claim);
        Ok(claim)
    }
}

/// The narrow context every job runs with. Cheap to clone.
#[derive(Clone)]
pub struct JobContext {
    pub sysfs: Sysfs,
    pub store: Arc<Store>,
    /// The settings when the task started: a reload during the task does not change its course.
    pub settings: Arc<Settings>,
    pub domains: Arc<dyn DomainQuery>,
    pub modules: Arc<dyn ModuleLoader>,
    /// The one connection to libvirt (attach, detach, domain XML).
    pub libvirt: Libvirt,
    /// libvirt's device-removed events, for a detach to wait on.
    pub removals: Arc<Removals>,
    pub claims: ClaimSteps,
}
