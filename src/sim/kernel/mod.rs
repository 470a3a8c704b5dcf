//! The simulated kernel: a sysfs tree under a temporary root that reacts to writes the way
//! Linux does, synchronously, so tests check the resulting state and not the bytes written.
//!
//! It renders real files (so `lspci -A linux-sysfs` can read the same tree), implements the
//! sysfs [`Backend`] (reads come from the files; writes are interpreted), emits uevents through
//! the same channel type as the real netlink source, and injects faults: a write that fails
//! with a chosen errno, a write that hangs, a write held until the test releases it, an
//! attribute that becomes unreadable, a device that vanishes or whose config space reads
//! all-ones.
//!
//! It resets functions as Linux does: `reset` runs the methods `reset_method` lists, in order,
//! falling through on ENOTTY; `reset_method` takes an ordered list of supported names,
//! `default` or nothing; a bridge that shows `reset_subordinate` resets every function below
//! it. What each method does to each function is the model's [`ResetBehaviour`]: it works,
//! fails (after a delay), hangs, leaves config space all-ones, or unbinds the driver.
//!
//! A persistent kernel (`vfiod --simulate --sim-root`) saves its model after every change and
//! survives a SIGKILL: the saved model is the truth, the files are re-rendered from it on open.
//!
//! It backs both the tests and `vfiod --simulate`, so it lives in the library.

pub mod host_model;
mod render;

pub use host_model::{
    ConsoleSpec, DflSpec, DriverSpec, FunctionSpec, GroupSpec, HostModel, InterfaceSpec,
    KernelSpec, MountSpec, ProcessSpec, ResetBehaviour, SriovSpec, REFERENCE_FPGA_AFU,
    REFERENCE_FPGA_INTERFACE,
};

use crate::host::sysfs::{Backend, Sysfs};
use crate::host::uevent::{Action, EventReceiver, Uevent};
use crate::model::pci::PciAddress;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc;

/// What a fault does to a matching write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Fail with this errno; the kernel state does not change.
    Errno(i32),
    /// Block until [`SimKernel::release_hangs`] or the duration passes, then fail with EINTR
    /// (so a write that outlives vfiod's timeout still ends without effect).
    Hang(Duration),
    /// Let the write happen, then make this device vanish (surprise removal).
    VanishAfter(PciAddress),
    /// Let the write happen after this long: a slow driver (e.g. a long `sriov_numvfs`).
    Delay(Duration),
    /// Block (counted in [`SimKernel::hanging`]) until [`SimKernel::release_hangs`], then let
    /// the write happen: a test holds a write at a point it chooses and sees, instead of
    /// timing a window with [`FaultAction::Delay`].
    Hold,
}

/// Which writes a fault applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultTarget {
    /// `<device>/<attr>`, e.g. `(0000:3b:00.0, "sriov_numvfs")`.
    DeviceAttr(PciAddress, String),
    /// `drivers/<driver>/<attr>`, e.g. `("vfio-pci", "bind")`; `None` driver = any driver.
    DriverAttr(Option<String>, String),
    /// `sys/bus/pci/<attr>`, e.g. `drivers_probe`.
    BusAttr(String),
    /// A write naming this device anywhere (bind/unbind/drivers_probe value, or its own attrs).
    AnyFor(PciAddress),
}

#[derive(Clone, Debug)]
struct Fault {
    target: FaultTarget,
    action: FaultAction,
    /// `None` = every matching write; `Some(n)` = the next n.
    remaining: Option<u32>,
}

/// One function's live state.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct SimDevice {
    spec: FunctionSpec,
    /// Path relative to the root, e.g. `sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0`.
    dir: PathBuf,
    driver: Option<String>,
    driver_override: Option<String>,
    group: Option<u32>,
    num_vfs: u32,
    autoprobe: bool,
    physfn: Option<PciAddress>,
    config_all_ones: bool,
    aer: [u64; 3],
    /// What `reset_method` lists now; `None`: the spec's list (nothing written since the
    /// function appeared, or a model saved before resets were simulated).
    #[serde(default)]
    reset_methods: Option<Vec<String>>,
    /// How many times the function was reset (by any method, `reset_subordinate` included).
    #[serde(default)]
    resets: u32,
    /// N of its VFIO device node `/dev/vfio/devices/vfioN` while it is on vfio-pci (Linux 6.6
    /// and later with `VFIO_DEVICE_CDEV`): the lowest free, kept until it leaves vfio-pci.
    #[serde(default)]
    vfio_minor: Option<u32>,
}

impl SimDevice {
    /// The reset methods `reset` tries now, in order.
    fn enabled_resets(&self) -> &[String] {
        self.reset_methods
            .as_deref()
            .unwrap_or(&self.spec.reset_methods)
    }

    fn reset_behaviour(&self, method: &str) -> ResetBehaviour {
        self.spec
            .reset_behaviour
            .get(method)
            .cloned()
            .unwrap_or(ResetBehaviour::Works)
    }
}

/// How long a hanging reset blocks when nobody calls [`SimKernel::release_hangs`]: in effect
/// forever, as a device that never comes back holds the kernel's writer.
const RESET_HANG: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Default)]
struct State {
    devices: BTreeMap<PciAddress, SimDevice>,
    /// Removed through `remove` (or vanished): what a rescan brings back.
    removed: BTreeMap<PciAddress, SimDevice>,
    drivers: BTreeMap<String, DriverSpec>,
    next_group: u32,
    faults: Vec<Fault>,
    /// Absolute path -> errno for reads.
    read_faults: BTreeMap<PathBuf, i32>,
    seqnum: u64,
    /// Every accepted write, in order: (path relative to root, value). For tests that must
    /// prove "zero writes".
    write_log: Vec<(PathBuf, String)>,
    /// Every reset done since boot, in order: (function, method), the method being
    /// `reset_subordinate` for a reset through the upstream bridge. Failed attempts are not in it.
    reset_log: Vec<(PciAddress, String)>,
    /// The host's own use of its devices, rendered under `proc/` and the devices' directories.
    mounts: Vec<MountSpec>,
    interfaces: Vec<InterfaceSpec>,
    /// [`HostModel::consoles`].
    consoles: Vec<ConsoleSpec>,
    /// [`HostModel::iommu_groups`].
    group_hints: BTreeMap<PciAddress, u32>,
    /// Block devices' `holders/`, by the held device's name: (holder, its dm name).
    holders: BTreeMap<String, Vec<(String, Option<String>)>>,
    /// Block devices someone opened exclusively beside what the model mounts or holds (ZFS, a
    /// process's `O_EXCL`): another exclusive open gets EBUSY.
    exclusive: BTreeSet<String>,
    /// Processes holding device nodes open, by pid.
    processes: BTreeMap<u32, ProcessSpec>,
    /// [`HostModel::kernel`].
    kernel: KernelSpec,
}

/// What survives the process when persistence is on: enough to reopen the tree later as the
/// same kernel (faults and subscribers do not survive).
///
/// It is the one source of truth. The files are only its rendering, always written before
/// it is saved, so after a kill they may be ahead of it or half-written: [`SimKernel::open`]
/// throws them away and renders the saved model again.
#[derive(serde::Serialize, serde::Deserialize)]
struct Persisted {
    devices: BTreeMap<PciAddress, SimDevice>,
    removed: BTreeMap<PciAddress, SimDevice>,
    drivers: BTreeMap<String, DriverSpec>,
    next_group: u32,
    seqnum: u64,
    /// Absent from files saved before the host's use was saved; those were all of
    /// `vfiod --simulate --sim-root`, i.e. of the reference host.
    #[serde(default)]
    mounts: Option<Vec<MountSpec>>,
    #[serde(default)]
    interfaces: Option<Vec<InterfaceSpec>>,
    #[serde(default)]
    consoles: Vec<ConsoleSpec>,
    #[serde(default)]
    group_hints: BTreeMap<PciAddress, u32>,
    #[serde(default)]
    holders: BTreeMap<String, Vec<(String, Option<String>)>>,
    #[serde(default)]
    exclusive: BTreeSet<String>,
    #[serde(default)]
    processes: BTreeMap<u32, ProcessSpec>,
    /// Absent from files saved before it was modelled: the default kernel.
    #[serde(default)]
    kernel: KernelSpec,
}

/// Where [`Persisted`] lives under the root.
const STATE_FILE: &str = ".simkernel-state.json";
/// Where it is written before it is renamed over [`STATE_FILE`].
const STATE_TEMP: &str = ".simkernel-state.json.new";

/// A simulated kernel rooted at a directory.
pub struct SimKernel {
    root: PathBuf,
    state: Mutex<State>,
    hang_gate: (Mutex<u64>, Condvar),
    /// Writes blocked in a hang now ([`SimKernel::hanging`]).
    hanging: std::sync::atomic::AtomicUsize,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<Uevent>>>,
    /// Fast path for reads: most of the time no read fault is armed.
    read_faults_armed: AtomicBool,
    /// Save the state after every change, so another process can reopen this kernel (a
    /// restarted `vfiod --simulate`, the kill -9 test). Off by default: tests are faster.
    persistent: AtomicBool,
}

impl std::fmt::Debug for SimKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimKernel")
            .field("root", &self.root)
            .finish()
    }
}

fn err(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

impl SimKernel {
    /// Builds the model's tree under `root` (which should be an empty directory) and boots it:
    /// native drivers bind, initial VFs are enabled.
    pub fn build(root: &Path, model: &HostModel) -> io::Result<Arc<SimKernel>> {
        std::fs::create_dir_all(root)?;
        let root = std::fs::canonicalize(root)?;
        let k = SimKernel {
            root,
            state: Mutex::new(State::default()),
            hang_gate: (Mutex::new(0), Condvar::new()),
            hanging: std::sync::atomic::AtomicUsize::new(0),
            subscribers: Mutex::new(Vec::new()),
            read_faults_armed: AtomicBool::new(false),
            persistent: AtomicBool::new(false),
        };
        {
            let mut st = k.lock();
            st.mounts = model.mounts.clone();
            st.interfaces = model.interfaces.clone();
            st.consoles = model.consoles.clone();
            st.group_hints = model.iommu_groups.clone();
            st.kernel = model.kernel.clone();
            for d in &model.drivers {
                st.drivers.insert(d.name.clone(), d.clone());
            }
            render::skeleton(&k.root, &st)?;
            // Parents first so child directories nest under them.
            let mut specs = model.functions.clone();
            specs.sort_by_key(|s| (s.parent.is_some(), s.address));
            let mut pending: Vec<FunctionSpec> = specs;
            let mut guard = 0;
            while !pending.is_empty() {
                guard += 1;
                if guard > 64 {
                    return Err(io::Error::other(
                        "model has a parent cycle or a missing parent",
                    ));
                }
                let mut rest = Vec::new();
                for spec in pending {
                    if spec.parent.is_none_or(|p| st.devices.contains_key(&p)) {
                        k.add_device(&mut st, spec, None, None, false)?;
                    } else {
                        rest.push(spec);
                    }
                }
                pending = rest;
            }
            let pfs: Vec<(PciAddress, u32)> = st
                .devices
                .values()
                .filter_map(|d| Some((d.spec.address, d.spec.sriov.as_ref()?.initial_vfs)))
                .filter(|(_, n)| *n > 0)
                .collect();
            for (pf, n) in pfs {
                k.enable_vfs(&mut st, pf, n)?;
            }
            render::host_use(&k.root, &st)?;
            render::iommu_units(&k.root, &st)?;
            // A function's config space shows whether its slot is multi-function, which an
            // earlier function rendered before its siblings existed could not know. Rendered
            // again with the whole host: the tree equals the one `open` renders from the model.
            for d in st.devices.values() {
                render::device_config(&k.root, &st, d)?;
            }
            st.write_log.clear();
        }
        Ok(Arc::new(k))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Saves the state now and after every change from here on.
    pub fn make_persistent(&self) -> io::Result<()> {
        self.persistent.store(true, Ordering::SeqCst);
        let st = self.lock();
        self.persist(&st)
    }

    /// Reopens a kernel that [`SimKernel::make_persistent`] saved under `root`. It stays
    /// persistent. The saved model is authoritative: the tree is rendered from it afresh,
    /// whatever a killed process left in the files.
    pub fn open(root: &Path) -> io::Result<Arc<SimKernel>> {
        let root = std::fs::canonicalize(root)?;
        let text = std::fs::read(root.join(STATE_FILE))?;
        let p: Persisted = serde_json::from_slice(&text).map_err(io::Error::other)?;
        let reference = || HostModel::reference();
        let st = State {
            devices: p.devices,
            removed: p.removed,
            drivers: p.drivers,
            next_group: p.next_group,
            seqnum: p.seqnum,
            mounts: p.mounts.unwrap_or_else(|| reference().mounts),
            interfaces: p.interfaces.unwrap_or_else(|| reference().interfaces),
            consoles: p.consoles,
            group_hints: p.group_hints,
            holders: p.holders,
            exclusive: p.exclusive,
            processes: p.processes,
            kernel: p.kernel,
            ..State::default()
        };
        remove_if_exists(&root.join(STATE_TEMP))?;
        render::all(&root, &st)?;
        Ok(Arc::new(SimKernel {
            root,
            state: Mutex::new(st),
            hang_gate: (Mutex::new(0), Condvar::new()),
            hanging: std::sync::atomic::AtomicUsize::new(0),
            subscribers: Mutex::new(Vec::new()),
            read_faults_armed: AtomicBool::new(false),
            persistent: AtomicBool::new(true),
        }))
    }

    /// Reopens the kernel saved under `root`, or, if none was saved there (a first run, or a
    /// run killed before its first save, whose files mean nothing), builds `model` there afresh
    /// and makes it persistent.
    pub fn open_or_build(root: &Path, model: &HostModel) -> io::Result<Arc<SimKernel>> {
        if root.join(STATE_FILE).exists() {
            return Self::open(root);
        }
        render::wipe(root)?;
        let k = Self::build(root, model)?;
        // The state file appears last, whole (rename): its presence marks a finished build.
        k.make_persistent()?;
        Ok(k)
    }

    /// Saves the model, if persistent: to a temporary file, synced, then renamed over the old
    /// one (and the directory synced), so that a kill or a crash leaves either the old model
    /// or the new one, never a torn file. Called with the state locked, after whole operations.
    fn persist(&self, st: &State) -> io::Result<()> {
        if !self.persistent.load(Ordering::SeqCst) {
            return Ok(());
        }
        let p = Persisted {
            devices: st.devices.clone(),
            removed: st.removed.clone(),
            drivers: st.drivers.clone(),
            next_group: st.next_group,
            seqnum: st.seqnum,
            mounts: Some(st.mounts.clone()),
            interfaces: Some(st.interfaces.clone()),
            consoles: st.consoles.clone(),
            group_hints: st.group_hints.clone(),
            holders: st.holders.clone(),
            exclusive: st.exclusive.clone(),
            processes: st.processes.clone(),
            kernel: st.kernel.clone(),
        };
        let text = serde_json::to_vec(&p).map_err(io::Error::other)?;
        let tmp = self.root.join(STATE_TEMP);
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&text)?;
            f.sync_all()?;
        }
        std::fs::rename(tmp, self.root.join(STATE_FILE))?;
        std::fs::File::open(&self.root)?.sync_all()
    }

    /// A sysfs handle backed by this kernel.
    pub fn sysfs(self: &Arc<Self>) -> Sysfs {
        Sysfs::new(self.root.clone(), Arc::clone(self) as Arc<dyn Backend>)
    }

    /// A uevent stream, like the netlink source.
    pub fn subscribe(&self) -> EventReceiver {
        let (tx, rx) = mpsc::unbounded_channel();
        self.subscribers.lock().unwrap().push(tx);
        rx
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ----- fault injection -------------------------------------------------------------

    pub fn inject(&self, target: FaultTarget, action: FaultAction, times: Option<u32>) {
        // simkernel fix: `Some(0)` ("the next 0 writes") never fires. It used to be stored and
        // then decremented below zero on the first matching write (a panic in debug builds,
        // a fault that fires ~forever in release).
        if times == Some(0) {
            return;
        }
        self.lock().faults.push(Fault {
            target,
            action,
            remaining: times,
        });
    }

    pub fn clear_faults(&self) {
        let mut st = self.lock();
        st.faults.clear();
        st.read_faults.clear();
    }

    /// How many writes are blocked in a hang now: a test waits for a task to reach its hang
    /// before it looks at what else was written.
    pub fn hanging(&self) -> usize {
        self.hanging.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Wakes every hanging write.
    pub fn release_hangs(&self) {
        let (m, c) = &self.hang_gate;
        *m.lock().unwrap() += 1;
        c.notify_all();
    }

    /// Makes `<device>/<attr>` fail to read with `errno` (e.g. EIO), as a dying device does.
    pub fn make_unreadable(&self, address: PciAddress, attr: &str, errno: i32) {
        let path = self
            .root
            .join("sys/bus/pci/devices")
            .join(address.to_string())
            .join(attr);
        self.lock().read_faults.insert(path, errno);
        self.read_faults_armed.store(true, Ordering::SeqCst);
    }

    pub fn make_readable(&self, address: PciAddress, attr: &str) {
        let path = self
            .root
            .join("sys/bus/pci/devices")
            .join(address.to_string())
            .join(attr);
        self.lock().read_faults.remove(&path);
    }

    /// The device's config space reads all-ones (link down) or comes back.
    pub fn set_config_all_ones(&self, address: PciAddress, gone: bool) -> io::Result<()> {
        let mut st = self.lock();
        let dev = st
            .devices
            .get_mut(&address)
            .ok_or_else(|| err(libc::ENODEV))?;
        dev.config_all_ones = gone;
        let dev = dev.clone();
        render::device_config(&self.root, &st, &dev)?;
        self.persist(&st)
    }

    /// Surprise removal: the device and its VFs disappear without any driver cooperation.
    /// A rescan brings it back.
    pub fn vanish(&self, address: PciAddress) -> io::Result<()> {
        let mut st = self.lock();
        self.remove_device(&mut st, address)?;
        self.persist(&st)
    }

    /// Loads a driver's module, as `modprobe` does: the driver registers (its directory appears
    /// under `bus/pci/drivers/`) and binds every unbound function it matches, as the kernel's
    /// `driver_attach()` does (a function overridden to another driver, or a VF its PF keeps from
    /// autoprobe, stays unbound). A driver already loaded: EEXIST, nothing changes.
    pub fn load_driver(&self, spec: DriverSpec) -> io::Result<()> {
        let mut st = self.lock();
        if st.drivers.contains_key(&spec.name) {
            return Err(err(libc::EEXIST));
        }
        let name = spec.name.clone();
        st.drivers.insert(name.clone(), spec);
        render::driver(&self.root, &name)?;
        let unbound: Vec<PciAddress> = st
            .devices
            .values()
            .filter(|d| d.driver.is_none())
            .filter(|d| d.driver_override.as_ref().is_none_or(|o| *o == name))
            .filter(|d| Self::matches(&st, d, &name))
            .map(|d| d.spec.address)
            .collect();
        for address in unbound {
            match self.bind(&mut st, address, &name) {
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                other => other?,
            }
        }
        self.persist(&st)
    }

    /// Hot-adds a new function (its parent must exist).
    pub fn hot_add(&self, spec: FunctionSpec) -> io::Result<()> {
        let mut st = self.lock();
        self.add_device(&mut st, spec, None, None, true)?;
        self.persist(&st)
    }

    /// An AER error on the device: bumps its counters and emits the recovery uevents the
    /// kernel's AER driver sends.
    pub fn aer_error(&self, address: PciAddress, fatal: bool, recovered: bool) -> io::Result<()> {
        let mut st = self.lock();
        let dev = st
            .devices
            .get_mut(&address)
            .ok_or_else(|| err(libc::ENODEV))?;
        dev.aer[if fatal { 2 } else { 1 }] += 1;
        let dev = dev.clone();
        render::device_attrs(&self.root, &st, &dev)?;
        self.emit(
            &mut st,
            Action::Change,
            &dev,
            &[("ERROR_EVENT", "BEGIN_RECOVERY"), ("DEVICE_ONLINE", "0")],
        );
        let (ev, online) = if recovered {
            ("SUCCESSFUL_RECOVERY", "1")
        } else {
            ("FAILED_RECOVERY", "0")
        };
        self.emit(
            &mut st,
            Action::Change,
            &dev,
            &[("ERROR_EVENT", ev), ("DEVICE_ONLINE", online)],
        );
        self.persist(&st)
    }

    /// Every write the kernel accepted since boot (or the last [`SimKernel::take_write_log`]).
    pub fn take_write_log(&self) -> Vec<(PathBuf, String)> {
        std::mem::take(&mut self.lock().write_log)
    }

    // ----- read-only views for tests ------------------------------------------------------

    /// Adds namespace `nvme<instance>n1` on NVMe controller `controller` (a multipath head
    /// under its subsystem when `multipath`), with nothing mounted: a disk for holders.
    pub fn add_disk(
        &self,
        controller: PciAddress,
        instance: u32,
        multipath: bool,
    ) -> io::Result<()> {
        let mut st = self.lock();
        st.mounts.push(MountSpec {
            controller,
            instance,
            partitions: Vec::new(),
            multipath,
        });
        self.host_use_changed(&mut st)
    }

    /// Makes `holder` (`dm-0`, `md127`) hold block device `device`, as device-mapper (LVM,
    /// dm-crypt, multipath) or md does: `holders/<holder>` in the device, the holder's
    /// `slaves/`, its `dm/name` when `dm_name` is given; exclusive opens of `device` fail with
    /// EBUSY while it holds it.
    pub fn add_holder(&self, device: &str, holder: &str, dm_name: Option<&str>) -> io::Result<()> {
        let mut st = self.lock();
        let list = st.holders.entry(device.to_string()).or_default();
        if !list.iter().any(|(h, _)| h == holder) {
            list.push((holder.to_string(), dm_name.map(str::to_string)));
        }
        self.host_use_changed(&mut st)
    }

    /// Ends [`SimKernel::add_holder`]'s hold (`dmsetup remove`).
    pub fn remove_holder(&self, device: &str, holder: &str) -> io::Result<()> {
        let mut st = self.lock();
        if let Some(list) = st.holders.get_mut(device) {
            list.retain(|(h, _)| h != holder);
            if list.is_empty() {
                st.holders.remove(device);
            }
        }
        let held_dir = render::block_dir(&self.root, device);
        render::holder_gone(&self.root, held_dir.as_deref(), holder)?;
        self.host_use_changed(&mut st)
    }

    /// Block device `device` opened exclusively by someone the model does not show otherwise
    /// (ZFS, a btrfs member, a process's `O_EXCL` kept apart from its fds) while `held`.
    pub fn hold_exclusively(&self, device: &str, held: bool) -> io::Result<()> {
        let mut st = self.lock();
        if held {
            st.exclusive.insert(device.to_string());
        } else {
            st.exclusive.remove(device);
        }
        self.host_use_changed(&mut st)
    }

    /// Starts a process that holds `spec.nodes` open: `/proc/PID/{comm,cmdline,fd/N}`, each
    /// `fd/N` a link to its node, whose device number this kernel reports.
    pub fn spawn(&self, spec: ProcessSpec) -> io::Result<()> {
        let mut st = self.lock();
        render::process(&self.root, &spec)?;
        st.processes.insert(spec.pid, spec);
        self.persist(&st)
    }

    /// Ends process `pid` of [`SimKernel::spawn`]: its `/proc/PID` goes.
    pub fn end(&self, pid: u32) -> io::Result<()> {
        let mut st = self.lock();
        st.processes.remove(&pid);
        render::process_gone(&self.root, pid)?;
        self.persist(&st)
    }

    /// The VFIO device node of `address` (`/dev/vfio/devices/vfioN`) while it is on vfio-pci.
    pub fn vfio_device_node(&self, address: PciAddress) -> Option<String> {
        let st = self.lock();
        let m = st.devices.get(&address)?.vfio_minor?;
        Some(format!("/dev/vfio/devices/vfio{m}"))
    }

    fn host_use_changed(&self, st: &mut State) -> io::Result<()> {
        render::host_use(&self.root, st)?;
        self.persist(st)
    }

    /// Whether an exclusive open of block device `name` finds it held: mounted, swap, held by
    /// a dm/md device, opened exclusively, or (a whole disk) one of its partitions is.
    fn block_busy(st: &State, name: &str) -> bool {
        if st.holders.contains_key(name) || st.exclusive.contains(name) {
            return true;
        }
        st.mounts.iter().any(|m| {
            let disk = format!("nvme{}n1", m.instance);
            m.partitions.iter().any(|(n, target)| {
                let part = format!("{disk}p{n}");
                let used = !target.is_empty()
                    || st.holders.contains_key(&part)
                    || st.exclusive.contains(&part);
                used && (name == part || name == disk)
            })
        })
    }

    pub fn addresses(&self) -> Vec<PciAddress> {
        self.lock().devices.keys().copied().collect()
    }

    pub fn driver_of(&self, address: PciAddress) -> Option<String> {
        self.lock().devices.get(&address)?.driver.clone()
    }

    pub fn num_vfs(&self, address: PciAddress) -> Option<u32> {
        Some(self.lock().devices.get(&address)?.num_vfs)
    }

    /// The AFU id the port of the DFL card at `address` shows.
    pub fn afu_id_of(&self, address: PciAddress) -> Option<String> {
        self.lock()
            .devices
            .get(&address)
            .and_then(|d| Some(d.spec.dfl.as_ref()?.afu_id.clone()))
    }

    pub fn driver_override_of(&self, address: PciAddress) -> Option<String> {
        self.lock().devices.get(&address)?.driver_override.clone()
    }

    /// The methods of every reset of `address` since boot, in order (`reset_subordinate` for
    /// a reset of the bus it is on); failed attempts are not resets.
    pub fn resets(&self, address: PciAddress) -> Vec<String> {
        self.lock()
            .reset_log
            .iter()
            .filter(|(a, _)| *a == address)
            .map(|(_, m)| m.clone())
            .collect()
    }

    /// How many times the function was reset (kept by a persistent kernel).
    pub fn reset_count(&self, address: PciAddress) -> Option<u32> {
        Some(self.lock().devices.get(&address)?.resets)
    }

    /// What `reset_method` lists now.
    pub fn reset_methods_of(&self, address: PciAddress) -> Option<Vec<String>> {
        Some(self.lock().devices.get(&address)?.enabled_resets().to_vec())
    }

    // ----- reset faults ---------------------------------------------------------------------

    /// From now on, `method` does `behaviour` to the function (its `bus` behaviour is also
    /// what a `reset_subordinate` of its bridge does to it). VFs are created afresh, with FLR
    /// that works, each time SR-IOV is enabled.
    pub fn set_reset_behaviour(
        &self,
        address: PciAddress,
        method: &str,
        behaviour: ResetBehaviour,
    ) -> io::Result<()> {
        let mut st = self.lock();
        let dev = st
            .devices
            .get_mut(&address)
            .ok_or_else(|| err(libc::ENODEV))?;
        dev.spec
            .reset_behaviour
            .insert(method.to_string(), behaviour);
        self.persist(&st)
    }

    // ----- the kernel's behaviour ---------------------------------------------------------

    fn emit(&self, st: &mut State, action: Action, dev: &SimDevice, extra: &[(&str, &str)]) {
        st.seqnum += 1;
        let devpath = format!(
            "/{}",
            dev.dir.strip_prefix("sys").unwrap_or(&dev.dir).display()
        );
        let mut vars = BTreeMap::new();
        vars.insert("ACTION".into(), action.as_str().into());
        vars.insert("DEVPATH".into(), devpath.clone());
        vars.insert("SUBSYSTEM".into(), "pci".into());
        vars.insert("PCI_SLOT_NAME".into(), dev.spec.address.to_string());
        vars.insert(
            "PCI_ID".into(),
            format!("{:04X}:{:04X}", dev.spec.vendor_id, dev.spec.device_id),
        );
        vars.insert("SEQNUM".into(), st.seqnum.to_string());
        if let Some(d) = &dev.driver {
            vars.insert("DRIVER".into(), d.clone());
        }
        for (k, v) in extra {
            vars.insert((*k).into(), (*v).into());
        }
        let ev = Uevent {
            action,
            devpath,
            vars,
        };
        self.subscribers
            .lock()
            .unwrap()
            .retain(|tx| tx.send(ev.clone()).is_ok());
    }

    /// The group `address` gets: its number in the model's hints, else the next number no
    /// hint holds.
    fn alloc_group(st: &mut State, address: PciAddress) -> u32 {
        if let Some(g) = st.group_hints.get(&address) {
            return *g;
        }
        loop {
            let g = st.next_group;
            st.next_group += 1;
            if !st.group_hints.values().any(|h| *h == g) {
                return g;
            }
        }
    }

    fn add_device(
        &self,
        st: &mut State,
        spec: FunctionSpec,
        physfn: Option<PciAddress>,
        group: Option<u32>,
        announce: bool,
    ) -> io::Result<()> {
        if st.devices.contains_key(&spec.address) {
            return Err(err(libc::EEXIST));
        }
        let parent_dir = match spec.parent {
            Some(p) => st
                .devices
                .get(&p)
                .ok_or_else(|| err(libc::ENODEV))?
                .dir
                .clone(),
            None => PathBuf::from(format!(
                "sys/devices/pci{:04x}:{:02x}",
                spec.address.domain, spec.address.bus
            )),
        };
        let address = spec.address;
        let group = match (&spec.group, group) {
            (_, Some(g)) => Some(g),
            (GroupSpec::None, None) => None,
            (GroupSpec::Own, None) => Some(Self::alloc_group(st, address)),
            (GroupSpec::With(peer), None) => match st.devices.get(peer).and_then(|d| d.group) {
                Some(g) => Some(g),
                None => Some(Self::alloc_group(st, address)),
            },
        };
        let dir = match &spec.sysfs_dir {
            Some(d) => d.clone(),
            None => parent_dir.join(spec.address.to_string()),
        };
        let dev = SimDevice {
            dir,
            driver: None,
            driver_override: None,
            group,
            num_vfs: 0,
            autoprobe: true,
            physfn,
            config_all_ones: false,
            aer: [0; 3],
            reset_methods: None,
            resets: 0,
            vfio_minor: None,
            spec,
        };
        let addr = dev.spec.address;
        render::device(&self.root, st, &dev)?;
        st.devices.insert(addr, dev.clone());
        if announce || physfn.is_some() {
            self.emit(st, Action::Add, &dev, &[]);
        }
        // The bus's own autoprobe; a VF is probed only when its PF allows it.
        let may_probe = match physfn {
            Some(pf) => st.devices.get(&pf).is_some_and(|p| p.autoprobe),
            None => true,
        };
        if may_probe {
            self.probe(st, addr)?;
        }
        Ok(())
    }

    fn remove_device(&self, st: &mut State, address: PciAddress) -> io::Result<()> {
        let dev = st
            .devices
            .get(&address)
            .cloned()
            .ok_or_else(|| err(libc::ENODEV))?;
        // Children first: VFs of a PF, functions behind a bridge.
        if dev.num_vfs > 0 {
            self.disable_vfs(st, address)?;
        }
        let children: Vec<PciAddress> = st
            .devices
            .values()
            .filter(|d| d.spec.parent == Some(address))
            .map(|d| d.spec.address)
            .collect();
        for c in children {
            self.remove_device(st, c)?;
        }
        if dev.driver.is_some() {
            self.unbind(st, address)?;
        }
        let dev = st.devices.remove(&address).expect("present");
        render::remove_device(&self.root, st, &dev)?;
        self.emit(st, Action::Remove, &dev, &[]);
        if dev.physfn.is_none() {
            st.removed.insert(address, dev);
        }
        render::refresh_vfio_nodes(&self.root, st)?;
        Ok(())
    }

    fn rescan(&self, st: &mut State) -> io::Result<()> {
        let mut back: Vec<SimDevice> = std::mem::take(&mut st.removed).into_values().collect();
        back.sort_by_key(|d| (d.dir.components().count(), d.spec.address));
        for d in back {
            if d.spec.parent.is_some_and(|p| !st.devices.contains_key(&p)) {
                st.removed.insert(d.spec.address, d);
                continue;
            }
            self.add_device(st, d.spec.clone(), None, d.group, true)?;
        }
        Ok(())
    }

    /// Whether `driver` may bind `dev` (the kernel's driver_match_device).
    fn matches(st: &State, dev: &SimDevice, driver: &str) -> bool {
        match &dev.driver_override {
            Some(o) => o == driver,
            None => st
                .drivers
                .get(driver)
                .is_some_and(|d| d.ids.contains(&(dev.spec.vendor_id, dev.spec.device_id))),
        }
    }

    fn bind(&self, st: &mut State, address: PciAddress, driver: &str) -> io::Result<()> {
        let dev = st.devices.get(&address).ok_or_else(|| err(libc::ENODEV))?;
        // simkernel fix: Linux's bind_store() runs driver_match_device() first (ENODEV), then
        // __driver_probe_device() refuses a bound device (EBUSY), then pci_device_probe()
        // applies pci_device_can_probe() (ENODEV). The match check used to come last, so a
        // non-matching driver on a bound device got EBUSY instead of ENODEV.
        if !st.drivers.contains_key(driver) || !Self::matches(st, dev, driver) {
            return Err(err(libc::ENODEV));
        }
        if dev.driver.is_some() {
            return Err(err(libc::EBUSY));
        }
        // pci_device_can_probe(): a VF whose PF has autoprobe off binds only via override.
        if let Some(pf) = dev.physfn {
            let pf_auto = st.devices.get(&pf).is_some_and(|p| p.autoprobe);
            if !pf_auto && dev.driver_override.is_none() {
                return Err(err(libc::ENODEV));
            }
        }
        let minor = (driver == "vfio-pci").then(|| {
            let used: BTreeSet<u32> = st.devices.values().filter_map(|d| d.vfio_minor).collect();
            (0..).find(|m| !used.contains(m)).expect("a free minor")
        });
        let dev = st.devices.get_mut(&address).expect("present");
        dev.driver = Some(driver.to_string());
        dev.vfio_minor = minor;
        let dev = dev.clone();
        render::device_driver(&self.root, st, &dev)?;
        self.emit(st, Action::Bind, &dev, &[]);
        render::refresh_vfio_nodes(&self.root, st)?;
        Ok(())
    }

    fn unbind(&self, st: &mut State, address: PciAddress) -> io::Result<()> {
        let dev = st.devices.get(&address).ok_or_else(|| err(libc::ENODEV))?;
        let Some(old) = dev.driver.clone() else {
            return Err(err(libc::ENODEV));
        };
        // Unbinding a PF driver tears its VFs down, as sriov drivers do in remove().
        if dev.num_vfs > 0 {
            self.disable_vfs(st, address)?;
        }
        let dev = st.devices.get_mut(&address).expect("present");
        dev.driver = None;
        dev.vfio_minor = None;
        let mut dev = dev.clone();
        render::device_driver_removed(&self.root, &dev, &old)?;
        dev.driver = Some(old);
        self.emit(st, Action::Unbind, &dev, &[]);
        render::refresh_vfio_nodes(&self.root, st)?;
        Ok(())
    }

    /// drivers_probe / autoprobe: bind to the override driver, else the first native match.
    /// Finding no driver is not an error, as in Linux.
    fn probe(&self, st: &mut State, address: PciAddress) -> io::Result<()> {
        let dev = st.devices.get(&address).ok_or_else(|| err(libc::ENODEV))?;
        if dev.driver.is_some() {
            return Ok(());
        }
        let candidates: Vec<String> = match &dev.driver_override {
            Some(o) => vec![o.clone()],
            None => {
                let mut c: Vec<String> = Vec::new();
                if let Some(d) = &dev.spec.driver {
                    c.push(d.clone());
                }
                c.extend(st.drivers.keys().cloned());
                c
            }
        };
        for d in candidates {
            if st.drivers.contains_key(&d) && Self::matches(st, dev, &d) {
                return match self.bind(st, address, &d) {
                    Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
                    other => other,
                };
            }
        }
        Ok(())
    }

    fn vf_address(pf: PciAddress, offset: u16, stride: u16, index: u32) -> Option<PciAddress> {
        let rid = (u32::from(pf.bus) << 8) | (u32::from(pf.slot) << 3) | u32::from(pf.function);
        let vf = rid + u32::from(offset) + u32::from(stride) * index;
        if vf > 0xffff {
            return None;
        }
        Some(PciAddress::new(
            pf.domain,
            (vf >> 8) as u8,
            ((vf >> 3) & 0x1f) as u8,
            (vf & 7) as u8,
        ))
    }

    fn enable_vfs(&self, st: &mut State, pf: PciAddress, n: u32) -> io::Result<()> {
        let pfdev = st
            .devices
            .get(&pf)
            .cloned()
            .ok_or_else(|| err(libc::ENODEV))?;
        let sriov = pfdev.spec.sriov.clone().ok_or_else(|| err(libc::ENOENT))?;
        let mut created = Vec::new();
        for i in 0..n {
            let addr = Self::vf_address(pf, sriov.offset, sriov.stride, i)
                .ok_or_else(|| err(libc::ERANGE))?;
            let mut spec = FunctionSpec::new(
                &addr.to_string(),
                pfdev.spec.vendor_id,
                sriov.vf_device_id,
                pfdev.spec.class.0,
            );
            spec.subsystem_vendor_id = pfdev.spec.subsystem_vendor_id;
            spec.subsystem_device_id = pfdev.spec.subsystem_device_id;
            spec.revision = pfdev.spec.revision;
            spec.numa_node = pfdev.spec.numa_node;
            spec.driver = sriov.vf_driver.clone();
            spec.parent = pfdev.spec.parent;
            spec.reset_methods = vec!["flr".into()];
            spec.aer = false;
            // Beside a PF placed by the model, as the kernel puts VFs.
            if pfdev.spec.sysfs_dir.is_some() {
                spec.sysfs_dir = pfdev.dir.parent().map(|p| p.join(addr.to_string()));
            }
            spec.group = if pfdev.group.is_some() {
                GroupSpec::Own
            } else {
                GroupSpec::None
            };
            if let Err(e) = self.add_device(st, spec, Some(pf), None, true) {
                // Roll back what was created, as sriov_enable() does.
                for a in created.iter().rev() {
                    let _ = self.remove_device(st, *a);
                }
                return Err(e);
            }
            created.push(addr);
            let d = st.devices.get_mut(&pf).expect("pf");
            d.num_vfs = i + 1;
            render::virtfn_link(&self.root, &pfdev.dir, i, addr, true)?;
        }
        let d = st.devices.get(&pf).expect("pf").clone();
        render::device_attrs(&self.root, st, &d)?;
        Ok(())
    }

    fn disable_vfs(&self, st: &mut State, pf: PciAddress) -> io::Result<()> {
        let pfdev = st
            .devices
            .get(&pf)
            .cloned()
            .ok_or_else(|| err(libc::ENODEV))?;
        let sriov = pfdev.spec.sriov.clone().ok_or_else(|| err(libc::ENOENT))?;
        for i in (0..pfdev.num_vfs).rev() {
            if let Some(addr) = Self::vf_address(pf, sriov.offset, sriov.stride, i) {
                if st.devices.contains_key(&addr) {
                    self.remove_device(st, addr)?;
                }
            }
            render::virtfn_link(&self.root, &pfdev.dir, i, pf, false)?;
        }
        let d = st.devices.get_mut(&pf).expect("pf");
        d.num_vfs = 0;
        let d = d.clone();
        render::device_attrs(&self.root, st, &d)?;
        Ok(())
    }

    /// `sriov_numvfs` store, with the kernel's checks in the kernel's order.
    fn set_numvfs(&self, st: &mut State, pf: PciAddress, value: &str) -> io::Result<()> {
        let n: u32 = parse_int(value)?;
        let dev = st.devices.get(&pf).ok_or_else(|| err(libc::ENODEV))?;
        let sriov = dev.spec.sriov.as_ref().ok_or_else(|| err(libc::EACCES))?;
        if n > sriov.total_vfs {
            return Err(err(libc::ERANGE));
        }
        if n == dev.num_vfs {
            return Ok(());
        }
        let Some(driver) = &dev.driver else {
            return Err(err(libc::ENOENT));
        };
        if !st.drivers.get(driver).is_some_and(|d| d.sriov_configure) {
            return Err(err(libc::ENOENT));
        }
        if n == 0 {
            return self.disable_vfs(st, pf);
        }
        if dev.num_vfs != 0 {
            return Err(err(libc::EBUSY));
        }
        self.enable_vfs(st, pf, n)
    }

    fn check_faults(&self, rel: &Path, target: &WriteTarget, value: &str) -> Option<FaultAction> {
        let mut st = self.lock();
        let value_addr: Option<PciAddress> = value.trim().parse().ok();
        let idx = st.faults.iter().position(|f| match (&f.target, target) {
            (FaultTarget::DeviceAttr(a, at), WriteTarget::Device(b, bt)) => a == b && at == bt,
            (FaultTarget::DriverAttr(d, at), WriteTarget::Driver(bd, bt)) => {
                d.as_ref().is_none_or(|d| d == bd) && at == bt
            }
            (FaultTarget::BusAttr(at), WriteTarget::Bus(bt)) => at == bt,
            (FaultTarget::AnyFor(a), WriteTarget::Device(b, _)) => a == b,
            (FaultTarget::AnyFor(a), _) => value_addr == Some(*a),
            _ => false,
        })?;
        let f = &mut st.faults[idx];
        let action = f.action.clone();
        if let Some(n) = f.remaining.as_mut() {
            *n -= 1;
            if *n == 0 {
                st.faults.remove(idx);
            }
        }
        tracing::debug!(path = %rel.display(), ?action, "simulated fault");
        Some(action)
    }

    fn resolve(&self, path: &Path) -> io::Result<(PathBuf, WriteTarget)> {
        // Follow links in the directory part (bus/pci/devices/X -> devices/..., driver -> ...),
        // as the VFS would, then classify what the file belongs to.
        let parent = path.parent().ok_or_else(|| err(libc::ENOENT))?;
        let name = path.file_name().ok_or_else(|| err(libc::ENOENT))?;
        let canon = std::fs::canonicalize(parent)?.join(name);
        let rel = canon
            .strip_prefix(&self.root)
            .map_err(|_| err(libc::EXDEV))?
            .to_path_buf();
        let comps: Vec<&str> = rel.iter().filter_map(|c| c.to_str()).collect();
        let target = match comps.as_slice() {
            ["sys", "bus", "pci", attr] => WriteTarget::Bus(attr.to_string()),
            ["sys", "bus", "pci", "drivers", d, attr] => {
                WriteTarget::Driver(d.to_string(), attr.to_string())
            }
            [.., dev, attr] if dev.parse::<PciAddress>().is_ok() => {
                WriteTarget::Device(dev.parse().expect("checked"), attr.to_string())
            }
            _ => WriteTarget::Other,
        };
        Ok((rel, target))
    }

    fn apply_write(&self, st: &mut State, target: &WriteTarget, value: &str) -> io::Result<()> {
        let addr_value =
            || -> io::Result<PciAddress> { value.trim().parse().map_err(|_| err(libc::ENODEV)) };
        match target {
            WriteTarget::Bus(a) if a == "drivers_probe" => {
                let addr = addr_value()?;
                self.probe(st, addr)
            }
            WriteTarget::Bus(a) if a == "rescan" => {
                parse_int(value)?;
                self.rescan(st)
            }
            WriteTarget::Driver(d, a) if a == "bind" => {
                let addr = addr_value()?;
                self.bind(st, addr, d)
            }
            WriteTarget::Driver(d, a) if a == "unbind" => {
                let addr = addr_value()?;
                if st.devices.get(&addr).and_then(|x| x.driver.as_deref()) != Some(d.as_str()) {
                    return Err(err(libc::ENODEV));
                }
                self.unbind(st, addr)
            }
            WriteTarget::Driver(d, a) if a == "new_id" => {
                // "VVVV DDDD": add the id, then probe every unbound match, exactly the
                // collateral binding that makes new_id dangerous.
                let mut it = value.split_whitespace();
                let (Some(v), Some(dv)) = (it.next(), it.next()) else {
                    return Err(err(libc::EINVAL));
                };
                let v = u16::from_str_radix(v, 16).map_err(|_| err(libc::EINVAL))?;
                let dv = u16::from_str_radix(dv, 16).map_err(|_| err(libc::EINVAL))?;
                let drv = st.drivers.get_mut(d).ok_or_else(|| err(libc::ENODEV))?;
                drv.ids.push((v, dv));
                let matching: Vec<PciAddress> = st
                    .devices
                    .values()
                    .filter(|x| {
                        x.driver.is_none() && x.spec.vendor_id == v && x.spec.device_id == dv
                    })
                    .map(|x| x.spec.address)
                    .collect();
                for a in matching {
                    let _ = self.bind(st, a, d);
                }
                Ok(())
            }
            WriteTarget::Device(a, attr) => match attr.as_str() {
                "sriov_numvfs" => self.set_numvfs(st, *a, value),
                "sriov_drivers_autoprobe" => {
                    let v = parse_int(value)?;
                    let dev = st.devices.get_mut(a).ok_or_else(|| err(libc::ENODEV))?;
                    if dev.spec.sriov.is_none() {
                        return Err(err(libc::EACCES));
                    }
                    dev.autoprobe = v != 0;
                    let dev = dev.clone();
                    render::device_attrs(&self.root, st, &dev)
                }
                "driver_override" => {
                    let v = value.trim_end_matches('\n');
                    if v.len() >= 4096 {
                        return Err(err(libc::EINVAL));
                    }
                    let dev = st.devices.get_mut(a).ok_or_else(|| err(libc::ENODEV))?;
                    dev.driver_override = (!v.is_empty()).then(|| v.to_string());
                    let dev = dev.clone();
                    render::device_attrs(&self.root, st, &dev)
                }
                "remove" => {
                    if parse_int(value)? != 0 {
                        self.remove_device(st, *a)?;
                    }
                    Ok(())
                }
                "rescan" => {
                    parse_int(value)?;
                    self.rescan(st)
                }
                "reset_method" => self.set_reset_methods(st, *a, value),
                _ => Err(err(libc::EACCES)),
            },
            _ => Err(err(libc::EACCES)),
        }
    }

    /// `reset_method` store (Linux 6.x): an empty value disables resets, `default` restores
    /// the kernel's list, otherwise an ordered list of names the function supports; one it does
    /// not support fails the whole write with EINVAL and changes nothing.
    fn set_reset_methods(
        &self,
        st: &mut State,
        address: PciAddress,
        value: &str,
    ) -> io::Result<()> {
        let dev = st
            .devices
            .get_mut(&address)
            .ok_or_else(|| err(libc::ENODEV))?;
        let v = value.trim();
        let methods: Vec<String> = if v == "default" {
            dev.spec.reset_methods.clone()
        } else {
            v.split_whitespace().map(str::to_string).collect()
        };
        if methods.iter().any(|m| !dev.spec.reset_methods.contains(m)) {
            return Err(err(libc::EINVAL));
        }
        dev.reset_methods = Some(methods);
        let dev = dev.clone();
        render::device_attrs(&self.root, st, &dev)
    }

    /// `reset` store: `pci_reset_function()`, which tries the listed methods in order until
    /// one works, moving on only when a method answers ENOTTY (none listed: ENOTTY).
    fn reset(&self, address: PciAddress, value: &str) -> io::Result<()> {
        if parse_int(value)? != 1 {
            return Err(err(libc::EINVAL));
        }
        let methods: Vec<(String, ResetBehaviour)> = {
            let st = self.lock();
            let dev = st.devices.get(&address).ok_or_else(|| err(libc::ENODEV))?;
            dev.enabled_resets()
                .iter()
                .map(|m| (m.clone(), dev.reset_behaviour(m)))
                .collect()
        };
        for (method, behaviour) in methods {
            match behaviour {
                ResetBehaviour::Fails { errno, delay_ms } => {
                    std::thread::sleep(Duration::from_millis(delay_ms));
                    if errno != libc::ENOTTY {
                        return Err(err(errno));
                    }
                }
                ResetBehaviour::Hangs => {
                    self.wait_hang(RESET_HANG);
                    return Err(err(libc::EINTR));
                }
                done => {
                    let mut st = self.lock();
                    return self.after_reset(&mut st, address, &method, &done);
                }
            }
        }
        Err(err(libc::ENOTTY))
    }

    /// `reset_subordinate` store on a bridge: one reset of its secondary bus, which resets
    /// every function below it, each as its `bus` behaviour says. A function that hangs hangs
    /// the whole write (and nothing changes); one that fails makes the write fail with its
    /// errno, after the slowest failure's delay, while the others are reset.
    fn reset_subordinate(&self, bridge: PciAddress, value: &str) -> io::Result<()> {
        if parse_int(value)? == 0 {
            return Ok(());
        }
        let below: Vec<(PciAddress, ResetBehaviour)> = {
            let st = self.lock();
            if !st.devices.contains_key(&bridge) {
                return Err(err(libc::ENODEV));
            }
            Self::below(&st, bridge)
                .into_iter()
                .map(|a| (a, st.devices[&a].reset_behaviour("bus")))
                .collect()
        };
        if below.iter().any(|(_, b)| *b == ResetBehaviour::Hangs) {
            self.wait_hang(RESET_HANG);
            return Err(err(libc::EINTR));
        }
        let slowest = below
            .iter()
            .filter_map(|(_, b)| match b {
                ResetBehaviour::Fails { delay_ms, .. } => Some(*delay_ms),
                _ => None,
            })
            .max();
        if let Some(ms) = slowest {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let mut st = self.lock();
        let mut failed = None;
        for (address, behaviour) in below {
            match behaviour {
                ResetBehaviour::Fails { errno, .. } => {
                    failed.get_or_insert(errno);
                }
                done => self.after_reset(&mut st, address, "reset_subordinate", &done)?,
            }
        }
        match failed {
            Some(errno) => Err(err(errno)),
            None => Ok(()),
        }
    }

    /// Every function below a bridge, at any depth, by address.
    fn below(st: &State, bridge: PciAddress) -> Vec<PciAddress> {
        let mut out = Vec::new();
        let mut parents = vec![bridge];
        while let Some(p) = parents.pop() {
            for d in st.devices.values().filter(|d| d.spec.parent == Some(p)) {
                out.push(d.spec.address);
                parents.push(d.spec.address);
            }
        }
        out.sort();
        out
    }

    /// A reset that happened: counted, logged, and its after-effect applied (config space is
    /// restored and the driver kept, unless the behaviour says otherwise).
    fn after_reset(
        &self,
        st: &mut State,
        address: PciAddress,
        method: &str,
        behaviour: &ResetBehaviour,
    ) -> io::Result<()> {
        let dev = st
            .devices
            .get_mut(&address)
            .ok_or_else(|| err(libc::ENODEV))?;
        dev.resets += 1;
        st.reset_log.push((address, method.to_string()));
        match behaviour {
            ResetBehaviour::AllOnes => {
                let dev = st.devices.get_mut(&address).expect("present");
                dev.config_all_ones = true;
                let dev = dev.clone();
                render::device_config(&self.root, st, &dev)
            }
            ResetBehaviour::Unbinds if st.devices[&address].driver.is_some() => {
                self.unbind(st, address)
            }
            _ => Ok(()),
        }
    }

    fn wait_hang(&self, dur: Duration) {
        use std::sync::atomic::Ordering;
        let (m, c) = &self.hang_gate;
        let guard = m.lock().unwrap();
        let start = *guard;
        self.hanging.fetch_add(1, Ordering::SeqCst);
        let _unused = c
            .wait_timeout_while(guard, dur, |gen| *gen == start)
            .unwrap();
        self.hanging.fetch_sub(1, Ordering::SeqCst);
    }
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn parse_int(value: &str) -> io::Result<u32> {
    let v = value.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => v.parse(),
    };
    parsed.map_err(|_| err(libc::EINVAL))
}

#[derive(Debug)]
enum WriteTarget {
    Bus(String),
    Driver(String, String),
    Device(PciAddress, String),
    Other,
}

impl Backend for SimKernel {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        if self.read_faults_armed.load(Ordering::SeqCst) {
            if let Some(errno) = self.lock().read_faults.get(path) {
                return Err(err(*errno));
            }
        }
        crate::host::sysfs::read_file(path)
    }

    fn write(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let value = String::from_utf8_lossy(data).into_owned();
        let (rel, target) = self.resolve(path)?;
        // simkernel fix: like open(2) without O_CREAT on sysfs, writing an attribute the
        // function does not show (sriov_numvfs of a non-SR-IOV function, `reset` of one that
        // cannot be reset, a misspelt name) fails with ENOENT. It used to reach apply_write
        // and fail with EACCES (or ENOTTY for `reset`), which Linux never returns for these.
        if std::fs::symlink_metadata(self.root.join(&rel)).is_err() {
            return Err(err(libc::ENOENT));
        }
        let mut vanish = None;
        match self.check_faults(&rel, &target, &value) {
            Some(FaultAction::Errno(e)) => return Err(err(e)),
            Some(FaultAction::Hang(d)) => {
                self.wait_hang(d);
                return Err(err(libc::EINTR));
            }
            Some(FaultAction::VanishAfter(a)) => vanish = Some(a),
            Some(FaultAction::Delay(d)) => std::thread::sleep(d),
            Some(FaultAction::Hold) => self.wait_hang(RESET_HANG),
            None => {}
        }
        // A reset runs without the state locked: it may take long or hang, and the rest of
        // the kernel keeps answering meanwhile.
        let result = match &target {
            WriteTarget::Device(a, attr) if attr == "reset" => self.reset(*a, &value),
            WriteTarget::Device(a, attr) if attr == "reset_subordinate" => {
                self.reset_subordinate(*a, &value)
            }
            _ => self.apply_write(&mut self.lock(), &target, &value),
        };
        let mut st = self.lock();
        if result.is_ok() {
            st.write_log.push((rel, value));
            if let Some(a) = vanish {
                let _ = self.remove_device(&mut st, a);
            }
        }
        // Even after a failed write: it may have changed something before failing (as a
        // rolled-back sriov_enable does), and the saved model must be what the tree shows.
        self.persist(&st)?;
        result
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        if self.read_faults_armed.load(Ordering::SeqCst) {
            if let Some(errno) = self.lock().read_faults.get(path) {
                return Err(err(*errno));
            }
        }
        std::fs::read_link(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>> {
        std::fs::read_dir(path)?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    }

    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        std::fs::canonicalize(path)
    }

    /// The number of the node a `/proc/PID/fd/N` link (or a node itself) names: the
    /// simulated `/dev` nodes are files that say it (`block 259:1`).
    fn device_number(&self, path: &Path) -> io::Result<Option<crate::host::sysfs::DeviceNumber>> {
        let node = match std::fs::read_link(path) {
            Ok(target) => self.root.join(target.strip_prefix("/").unwrap_or(&target)),
            Err(_) => path.to_path_buf(),
        };
        Ok(render::read_node(&node))
    }

    /// EBUSY while the block device is mounted, swap, held or opened exclusively; ENOENT for
    /// a node that does not exist; nothing else happens.
    fn probe_exclusive(&self, path: &Path) -> io::Result<()> {
        let rel = path
            .strip_prefix(self.root.join("dev"))
            .map_err(|_| err(libc::ENOENT))?;
        if !path.exists() {
            return Err(err(libc::ENOENT));
        }
        let Some(name) = rel.to_str() else {
            return Err(err(libc::ENOENT));
        };
        if Self::block_busy(&self.lock(), name) {
            return Err(err(libc::EBUSY));
        }
        Ok(())
    }

    /// The simulated `DFL_FPGA_FME_PORT_PR`: the errors the DFL driver gives (ENOENT without
    /// the node, EINVAL for a bad port or an empty bitstream, EBUSY while the port is assigned
    /// to a VF), faults armed on `(card, "dfl-fme-pr")`, and on success the bitstream written
    /// to the node file and `afu_id` shown as the port's. Nothing is loaded: the simulated card
    /// takes its new AFU id from the image's metadata, where real hardware reads it from the
    /// AFU the bitstream configured.
    fn fpga_port_pr(
        &self,
        fme_node: &Path,
        port_id: u32,
        bitstream: &[u8],
        afu_id: Option<&str>,
    ) -> io::Result<()> {
        let rel = fme_node
            .strip_prefix(&self.root)
            .map_err(|_| err(libc::EXDEV))?
            .to_path_buf();
        let index: u32 = rel
            .to_str()
            .and_then(|r| r.strip_prefix("dev/dfl-fme."))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| err(libc::ENOENT))?;
        let address = {
            let st = self.lock();
            st.devices
                .values()
                .find(|d| d.spec.dfl.as_ref().is_some_and(|x| x.index == index))
                .filter(|d| d.driver.as_deref() == Some("dfl-pci"))
                .map(|d| d.spec.address)
                .ok_or_else(|| err(libc::ENOENT))?
        };
        let target = WriteTarget::Device(address, "dfl-fme-pr".into());
        match self.check_faults(&rel, &target, "") {
            Some(FaultAction::Errno(e)) => return Err(err(e)),
            Some(FaultAction::Hang(d)) => {
                self.wait_hang(d);
                return Err(err(libc::EINTR));
            }
            Some(FaultAction::Delay(d)) => std::thread::sleep(d),
            Some(FaultAction::Hold) => self.wait_hang(RESET_HANG),
            Some(FaultAction::VanishAfter(_)) | None => {}
        }
        let mut st = self.lock();
        let dev = st
            .devices
            .get_mut(&address)
            .ok_or_else(|| err(libc::ENODEV))?;
        if port_id != 0 || bitstream.is_empty() {
            return Err(err(libc::EINVAL));
        }
        // The port is released to VF 0 while SR-IOV is on: the FME cannot reconfigure it.
        if dev.num_vfs > 0 {
            return Err(err(libc::EBUSY));
        }
        let afu = afu_id
            .and_then(|a| crate::fpga::image::normalize_uuid(a).ok())
            .ok_or_else(|| err(libc::EINVAL))?;
        if let Some(d) = dev.spec.dfl.as_mut() {
            d.afu_id = afu;
        }
        let dev = dev.clone();
        std::fs::write(fme_node, bitstream)?;
        render::dfl(&self.root, &dev)?;
        st.write_log
            .push((rel, format!("PR port {port_id}: {} bytes", bitstream.len())));
        self.persist(&st)
    }
}

/// Groups whose every non-bridge member is on vfio-pci, pci-stub or no driver, with at least
/// one on vfio-pci: those get a `/dev/vfio/N` node, as the kernel's VFIO does.
fn viable_groups(st: &State) -> BTreeSet<u32> {
    let mut groups: BTreeMap<u32, (bool, bool)> = BTreeMap::new();
    for d in st.devices.values() {
        let Some(g) = d.group else { continue };
        let e = groups.entry(g).or_insert((true, false));
        if d.spec.class.is_bridge() {
            continue;
        }
        match d.driver.as_deref() {
            Some("vfio-pci") => e.1 = true,
            Some("pci-stub") | None => {}
            Some(_) => e.0 = false,
        }
    }
    groups
        .into_iter()
        .filter(|(_, (ok, any))| *ok && *any)
        .map(|(g, _)| g)
        .collect()
}
