//! A recorded host served back as the simulated host (`vfiod --simulate --replay`): a
//! recording from `vfioctl record` (`host::record`), or any tree or tarball another tool made
//! that holds a `sys/` directory with `bus/pci/devices` at some depth.
//!
//! Two ways to serve it, by design:
//! - **Read-only** (the default): the recording's tree itself is the sysfs root, read through
//!   [`ReadOnly`], a backend that reads the files as they are and refuses every write with the
//!   error the kernel gives for a read-only attribute (EACCES, which kernfs returns at open for
//!   write, to root too; ENOENT where the recording has no such file). Nothing is interpreted,
//!   so vfiod sees exactly what was recorded: a function whose attributes are missing is
//!   `broken` with the reason a host gives. A read the host failed (listed in the manifest)
//!   fails here with the same errno.
//! - **Writable** (`--replay-writable`): a [`HostModel`] is built from what the read-only view
//!   shows (each function's ids, class, driver, NUMA node, IOMMU group number, SR-IOV capability,
//!   reset methods and `reset_subordinate`, DFL card, and its directory, so paths are the
//!   host's), the simulated kernel boots it, and the
//!   recorded state is then reached by the same sysfs writes an administrator would make
//!   (`driver_override`, `unbind`, `bind`, `sriov_drivers_autoprobe`, `sriov_numvfs`): from there
//!   on the simulated kernel's SR-IOV, binding and reset behaviour applies. Its read faults
//!   reproduce what the recording could not give (missing attributes fail with ENOENT, the
//!   manifest's with their errno), so broken functions stay broken with the same reason; the
//!   host-use files (mount table, block and network classes) are copied from the recording as
//!   they are. What the model cannot carry: VFs take their identity from their PF as the
//!   simulated kernel makes them, drivers bind the ids they were seen bound to, and `vfio-pci`
//!   is there even if the host had not loaded it (vfiod would load it on the host).
//!
//! A tarball (gzip'd or not) is unpacked into a scratch directory first; a directory is read
//! where it is and never written.

use crate::host::record::{self, Manifest, CONFIG_BYTES, FUNCTION_ATTRS};
use crate::host::sysfs::{dfl, hostuse, Backend, RawFunction, Sysfs, SysfsError};
use crate::model::pci::{ClassCode, PciAddress};
use crate::sim::kernel::{
    DflSpec, DriverSpec, FunctionSpec, GroupSpec, HostModel, SimKernel, SriovSpec,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How deep under the given directory `sys/` is looked for.
const MAX_DEPTH: usize = 8;
/// Bounds on what a tarball may unpack to: a recording of 1,000 functions is a few MB.
const MAX_UNPACKED_BYTES: u64 = 1 << 30;
const MAX_MEMBERS: u64 = 2_000_000;

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("cannot read the recording {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot unpack the recording {path}")]
    Unpack {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {what}")]
    Bounds { path: PathBuf, what: String },
    #[error("{path} holds no sys/bus/pci/devices directory (looked {MAX_DEPTH} levels deep)")]
    NoSys { path: PathBuf },
    #[error("bad manifest {path}")]
    Manifest {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{path} is format {found}; this vfiod reads formats up to {}",
        record::FORMAT
    )]
    Format { path: PathBuf, found: u32 },
    #[error("cannot read the recorded PCI functions")]
    Functions(#[source] SysfsError),
    #[error("cannot build the simulated host from the recording in {path}")]
    Build {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A recording ready to serve: its root (the directory holding `sys/`) and its manifest.
#[derive(Debug)]
pub struct Replay {
    root: PathBuf,
    manifest: Option<Manifest>,
    /// Read faults: the reads the recorded host failed, by absolute path.
    faults: HashMap<PathBuf, i32>,
}

impl Replay {
    /// Opens `source`: a directory (used in place, never written) or a tarball, unpacked into
    /// `scratch` (which must be an empty or missing directory).
    pub fn open(source: &Path, scratch: &Path) -> Result<Replay, ReplayError> {
        let meta = std::fs::metadata(source).map_err(|e| ReplayError::Open {
            path: source.to_path_buf(),
            source: e,
        })?;
        let top = if meta.is_dir() {
            source.to_path_buf()
        } else {
            unpack(source, scratch)?;
            scratch.to_path_buf()
        };
        let root = find_root(&top).ok_or_else(|| ReplayError::NoSys {
            path: source.to_path_buf(),
        })?;
        let root = std::fs::canonicalize(&root).map_err(|e| ReplayError::Open {
            path: root.clone(),
            source: e,
        })?;
        let manifest = read_manifest(&root)?;
        let faults = manifest
            .iter()
            .flat_map(|m| &m.unreadable)
            .filter(|u| Path::new(&u.path).is_relative())
            .map(|u| (root.join(&u.path), u.errno))
            .collect();
        Ok(Replay {
            root,
            manifest,
            faults,
        })
    }

    /// The directory that holds `sys/`: the sysfs root of a read-only replay.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `None` for a tree another tool made.
    pub fn manifest(&self) -> Option<&Manifest> {
        self.manifest.as_ref()
    }

    /// The recording, read-only, as vfiod's sysfs.
    pub fn sysfs(&self) -> Sysfs {
        Sysfs::new(
            self.root.clone(),
            Arc::new(ReadOnly {
                faults: self.faults.clone(),
                root: self.root.clone(),
                uses: self
                    .manifest
                    .as_ref()
                    .map(|m| m.uses.clone())
                    .unwrap_or_default(),
            }),
        )
    }

    /// A line for the banner: what is replayed and what may differ.
    pub fn describe(&self) -> String {
        match &self.manifest {
            None => format!("{} (no manifest: another tool's tree)", self.root.display()),
            Some(m) => {
                let mut s = format!(
                    "{} functions recorded {} by {} on kernel {}",
                    m.counts.functions,
                    m.recorded_at,
                    m.tool,
                    m.kernel_release.as_deref().unwrap_or("?")
                );
                if let Some(h) = &m.host_name {
                    s.push_str(&format!(" ({h})"));
                }
                if !m.unreadable.is_empty() {
                    s.push_str(&format!("; {} reads failed there", m.unreadable.len()));
                }
                if m.pci_ids != record::pci_ids_version() {
                    s.push_str(&format!(
                        "; its PCI id database ({}) is not this vfiod's ({}): device names may \
                         differ",
                        m.pci_ids,
                        record::pci_ids_version()
                    ));
                }
                s
            }
        }
    }

    /// Builds a writable simulated host from the recording under `root` (an empty directory):
    /// see the module header. Returns the kernel and what it could not reproduce.
    pub fn build_writable(
        &self,
        root: &Path,
    ) -> Result<(Arc<SimKernel>, Vec<String>), ReplayError> {
        let seen = read_host(&self.sysfs())?;
        let model = model(&seen);
        let build = |source| ReplayError::Build {
            path: root.to_path_buf(),
            source,
        };
        let kernel = SimKernel::build(root, &model).map_err(build)?;
        let mut notes = Vec::new();
        boot_state(&kernel, &seen, &mut notes);
        if let Some(m) = &self.manifest {
            replay_uses(&kernel, &self.root, &m.uses).map_err(build)?;
        }
        copy_host_use(&self.root, kernel.root()).map_err(build)?;
        faults(&kernel, &seen, &self.faults, &self.root);
        for f in &seen.functions {
            if f.all_ones {
                kernel.set_config_all_ones(f.address, true).map_err(build)?;
            }
        }
        kernel.take_write_log();
        Ok((kernel, notes))
    }
}

/// The read-only backend: the recording's files as they are; every write refused. Who held
/// the host's devices comes from the manifest ([`record::Uses`]): an exclusive open of a device
/// recorded busy fails with EBUSY, and the recorded processes hold the recorded nodes.
#[derive(Debug, Default)]
pub struct ReadOnly {
    faults: HashMap<PathBuf, i32>,
    root: PathBuf,
    uses: record::Uses,
}

impl ReadOnly {
    /// The recorded process and descriptor a `proc/PID/fd[/N]` path names.
    fn proc_fd<'a>(&self, path: &'a Path) -> Option<(u32, Option<&'a str>)> {
        let rel = path.strip_prefix(self.root.join("proc")).ok()?;
        let mut parts = rel.iter().filter_map(|c| c.to_str());
        let pid = parts.next()?.parse().ok()?;
        if parts.next()? != "fd" {
            return None;
        }
        Some((pid, parts.next()))
    }

    fn fault(&self, path: &Path) -> io::Result<()> {
        match self.faults.get(path) {
            Some(errno) => Err(io::Error::from_raw_os_error(*errno)),
            None => Ok(()),
        }
    }
}

impl Backend for ReadOnly {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.fault(path)?;
        crate::host::sysfs::read_file(path)
    }

    /// A read-only attribute: EACCES at open, as kernfs answers even root. A file the recording
    /// does not have: ENOENT, as an open without O_CREAT on sysfs.
    fn write(&self, path: &Path, _data: &[u8]) -> io::Result<()> {
        std::fs::symlink_metadata(path)?;
        Err(io::Error::from_raw_os_error(libc::EACCES))
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        self.fault(path)?;
        std::fs::read_link(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>> {
        crate::host::sysfs::HostFs.read_dir(path)
    }

    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        crate::host::sysfs::HostFs.canonicalize(path)
    }

    /// A recording has no FPGA to program.
    fn fpga_port_pr(&self, _: &Path, _: u32, _: &[u8], _: Option<&str>) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EACCES))
    }

    /// The recorded number of a recorded process's node; never the replaying machine's own.
    fn device_number(&self, path: &Path) -> io::Result<Option<crate::host::sysfs::DeviceNumber>> {
        let Some((pid, Some(fd))) = self.proc_fd(path) else {
            return Ok(None);
        };
        Ok(self
            .uses
            .open
            .iter()
            .find(|o| o.pid == pid && o.fd == fd)
            .and_then(|o| parse_number(o.number.as_deref()?)))
    }

    /// EBUSY for a block device the recording found busy; nothing is opened.
    fn probe_exclusive(&self, path: &Path) -> io::Result<()> {
        let name = path
            .strip_prefix(self.root.join("dev"))
            .ok()
            .and_then(|n| n.to_str());
        match name {
            Some(n) if self.uses.busy.iter().any(|b| b == n) => {
                Err(io::Error::from_raw_os_error(libc::EBUSY))
            }
            _ => Ok(()),
        }
    }

    /// The recorded descriptors of a recorded process.
    fn fd_targets(&self, dir: &Path) -> io::Result<Vec<(OsString, PathBuf)>> {
        let Some((pid, None)) = self.proc_fd(dir) else {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        };
        Ok(self
            .uses
            .open
            .iter()
            .filter(|o| o.pid == pid)
            .map(|o| (OsString::from(&o.fd), PathBuf::from(&o.node)))
            .collect())
    }
}

/// The directory under `top` (itself included, breadth first) that has `sys/bus/pci/devices`.
pub fn find_root(top: &Path) -> Option<PathBuf> {
    let mut level = vec![top.to_path_buf()];
    for _ in 0..=MAX_DEPTH {
        let mut next = Vec::new();
        for dir in level {
            if dir.join("sys/bus/pci/devices").is_dir() {
                return Some(dir);
            }
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut subdirs: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                // Real directories only: a recorded tree is full of links back up.
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect();
            subdirs.sort();
            next.extend(subdirs);
        }
        level = next;
    }
    None
}

fn read_manifest(root: &Path) -> Result<Option<Manifest>, ReplayError> {
    let path = root.join(record::MANIFEST);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ReplayError::Open { path, source }),
    };
    // The format first, so that a newer manifest is refused by its number, not by a field.
    #[derive(serde::Deserialize)]
    struct Format {
        format: u32,
    }
    let found = serde_json::from_slice::<Format>(&bytes)
        .map_err(|source| ReplayError::Manifest {
            path: path.clone(),
            source,
        })?
        .format;
    if found > record::FORMAT {
        return Err(ReplayError::Format { path, found });
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| ReplayError::Manifest { path, source })
}

/// Unpacks a tarball (gzip'd when it starts with gzip's magic) into `dst`: directories,
/// regular files and symbolic links only, nothing outside `dst` (tar refuses `..` and absolute
/// members and writes through no link), within [`MAX_UNPACKED_BYTES`] and [`MAX_MEMBERS`].
fn unpack(source: &Path, dst: &Path) -> Result<(), ReplayError> {
    let failed = |e: io::Error| ReplayError::Unpack {
        path: source.to_path_buf(),
        source: e,
    };
    let mut file = std::fs::File::open(source).map_err(|e| ReplayError::Open {
        path: source.to_path_buf(),
        source: e,
    })?;
    let mut magic = [0u8; 2];
    let gz = file.read(&mut magic).map_err(failed)? == 2 && magic == [0x1f, 0x8b];
    let file = std::fs::File::open(source).map_err(failed)?;
    let reader: Box<dyn Read> = if gz {
        Box::new(flate2::read::GzDecoder::new(io::BufReader::new(file)))
    } else {
        Box::new(io::BufReader::new(file))
    };
    std::fs::create_dir_all(dst).map_err(failed)?;
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(false);
    archive.set_overwrite(true);
    let (mut bytes, mut members) = (0u64, 0u64);
    for entry in archive.entries().map_err(failed)? {
        let mut entry = entry.map_err(failed)?;
        members += 1;
        bytes += entry.header().size().unwrap_or(0);
        if members > MAX_MEMBERS || bytes > MAX_UNPACKED_BYTES {
            return Err(ReplayError::Bounds {
                path: source.to_path_buf(),
                what: format!(
                    "unpacks to more than {MAX_MEMBERS} members or {MAX_UNPACKED_BYTES} bytes"
                ),
            });
        }
        use tar::EntryType::*;
        if matches!(entry.header().entry_type(), Directory | Regular | Symlink) {
            entry.unpack_in(dst).map_err(failed)?;
        }
    }
    Ok(())
}

/// One function as the read-only view of the recording shows it.
struct Seen {
    address: PciAddress,
    /// `None` when it could not be read completely (it is broken there).
    raw: Option<RawFunction>,
    all_ones: bool,
    /// Relative to the root, e.g. `sys/devices/pci0000:00/0000:00:10.0/0000:01:00.0`.
    dir: PathBuf,
    reset_methods: Vec<String>,
    aer: bool,
    dfl: Option<DflSpec>,
    /// Vendor, device, subsystem vendor, subsystem device, class: what could be read.
    identity: (u16, u16, u16, u16, u32),
    revision: u8,
    /// A bridge's secondary bus, from its config header (type 1).
    secondary_bus: Option<u8>,
    /// A bridge shows `reset_subordinate`.
    reset_subordinate: bool,
    /// `boot_vga` reads 1.
    boot_vga: bool,
    /// [`FUNCTION_ATTRS`] (and `config`) the recording does not have.
    missing: Vec<&'static str>,
}

struct SeenHost {
    functions: Vec<Seen>,
    drivers: BTreeSet<String>,
}

fn read_host(sysfs: &Sysfs) -> Result<SeenHost, ReplayError> {
    let addresses = sysfs.list_functions().map_err(ReplayError::Functions)?;
    let mut functions = Vec::new();
    for a in addresses {
        let bus_link = sysfs.device_dir(a);
        let dir = sysfs
            .backend()
            .canonicalize(&bus_link)
            .ok()
            .and_then(|c| c.strip_prefix(sysfs.root()).ok().map(Path::to_path_buf))
            .unwrap_or_else(|| {
                PathBuf::from(format!("sys/devices/pci{:04x}:{:02x}", a.domain, a.bus))
                    .join(a.to_string())
            });
        let raw = RawFunction::read(sysfs, a);
        let all_ones = matches!(raw, Err(SysfsError::ConfigAllOnes { .. }));
        let health = RawFunction::read_health(sysfs, a);
        let exists = |attr: &str| std::fs::symlink_metadata(sysfs.device_attr(a, attr)).is_ok();
        let missing: Vec<&'static str> = std::iter::once("config")
            .chain(FUNCTION_ATTRS.iter().copied())
            .filter(|attr| !exists(attr))
            .collect();
        let aer = ["aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal"]
            .iter()
            .all(|f| exists(f));
        let dfl = dfl::read_card(sysfs, a).ok().flatten().map(|c| DflSpec {
            index: c.index,
            interface_id: c.interface_id.unwrap_or_default(),
            afu_id: c.afu_id.unwrap_or_default(),
        });
        let header = sysfs
            .read_bytes(&sysfs.device_attr(a, "config"))
            .unwrap_or_default();
        let header = &header[..header.len().min(CONFIG_BYTES)];
        let (identity, revision) = match &raw {
            Ok(r) => (
                (
                    r.vendor_id,
                    r.device_id,
                    r.subsystem_vendor_id,
                    r.subsystem_device_id,
                    r.class.0,
                ),
                r.revision,
            ),
            Err(_) => best_effort_identity(sysfs, a, header),
        };
        let secondary_bus = match (header.get(0x0e), header.get(0x19)) {
            (Some(t), Some(b)) if t & 0x7f == 1 => Some(*b),
            _ => None,
        };
        functions.push(Seen {
            reset_subordinate: exists("reset_subordinate"),
            boot_vga: sysfs
                .read_text(&sysfs.device_attr(a, "boot_vga"))
                .is_ok_and(|v| v == "1"),
            secondary_bus,
            address: a,
            raw: raw.ok(),
            all_ones,
            dir,
            reset_methods: health.reset_methods,
            aer,
            dfl,
            identity,
            revision,
            missing,
        });
    }
    let drivers = sysfs
        .backend()
        .read_dir(&sysfs.pci_bus_dir().join("drivers"))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|n| n.into_string().ok())
        .collect();
    Ok(SeenHost { functions, drivers })
}

/// What a function that cannot be read completely is, as far as its files tell.
fn best_effort_identity(
    sysfs: &Sysfs,
    a: PciAddress,
    header: &[u8],
) -> ((u16, u16, u16, u16, u32), u8) {
    let hex = |attr: &str| -> Option<u32> {
        let t = sysfs.read_text(&sysfs.device_attr(a, attr)).ok()?;
        u32::from_str_radix(t.trim_start_matches("0x"), 16).ok()
    };
    let word = |i: usize| -> Option<u16> {
        Some(u16::from_le_bytes([*header.get(i)?, *header.get(i + 1)?]))
    };
    let id = |attr: &str, at: usize| -> u16 {
        hex(attr)
            .and_then(|v| u16::try_from(v).ok())
            .or_else(|| word(at))
            .unwrap_or(0)
    };
    let class = hex("class").unwrap_or(0) & 0xff_ffff;
    (
        (
            id("vendor", 0),
            id("device", 2),
            id("subsystem_vendor", 0x2c),
            id("subsystem_device", 0x2e),
            class,
        ),
        header.get(8).copied().unwrap_or(0),
    )
}

/// The model the simulated kernel boots: the recorded functions but the VFs (which it makes
/// from their PF's SR-IOV capability), the recorded drivers with the ids they were seen bound
/// to, the recorded IOMMU group numbers.
fn model(seen: &SeenHost) -> HostModel {
    let by_address: BTreeMap<PciAddress, &Seen> =
        seen.functions.iter().map(|f| (f.address, f)).collect();
    let physfn = |f: &Seen| f.raw.as_ref().and_then(|r| r.physfn);
    let mut functions = Vec::new();
    let mut iommu_groups = BTreeMap::new();
    let mut ids: BTreeMap<String, BTreeSet<(u16, u16)>> = BTreeMap::new();
    let mut sriov_drivers: BTreeSet<String> = BTreeSet::from(["vfio-pci".to_string()]);
    let mut drivers: BTreeSet<String> = seen.drivers.clone();
    drivers.insert("vfio-pci".into());
    for f in &seen.functions {
        let raw = f.raw.as_ref();
        if let Some(g) = raw.and_then(|r| r.iommu_group) {
            iommu_groups.insert(f.address, g);
        }
        let native = raw.and_then(|r| match (&r.driver, &r.driver_override) {
            (Some(d), None) => Some(d.clone()),
            _ => None,
        });
        if let (Some(d), Some(r)) = (&native, raw) {
            ids.entry(d.clone())
                .or_default()
                .insert((r.vendor_id, r.device_id));
        }
        if let Some(d) = raw.and_then(|r| r.driver.clone()) {
            if raw
                .and_then(|r| r.sriov.as_ref())
                .is_some_and(|s| s.total_vfs > 0)
            {
                sriov_drivers.insert(d.clone());
            }
            drivers.insert(d);
        }
        if physfn(f).is_some() {
            continue;
        }
        let (vendor, device, sv, sd, class) = f.identity;
        let mut spec = FunctionSpec::new(&f.address.to_string(), vendor, device, class);
        spec.subsystem_vendor_id = sv;
        spec.subsystem_device_id = sd;
        spec.class = ClassCode(class);
        spec.revision = f.revision;
        spec.numa_node = raw.and_then(|r| r.numa_node).unwrap_or(-1);
        spec.driver = native;
        spec.reset_methods = f.reset_methods.clone();
        spec.aer = f.aer;
        spec.dfl = f.dfl.clone();
        spec.sysfs_dir = Some(f.dir.clone());
        spec.group = if raw.is_some_and(|r| r.iommu_group.is_some()) {
            GroupSpec::Own
        } else {
            GroupSpec::None
        };
        // The nearest recorded function above it: removed with it, as the kernel does.
        spec.parent = hostuse::pci_ancestors(&f.dir)
            .into_iter()
            .rev()
            .skip(1)
            .find(|p| by_address.contains_key(p));
        spec.secondary_bus = f.secondary_bus;
        spec.reset_subordinate = f.reset_subordinate;
        spec.boot_vga = f.boot_vga;
        if let Some(s) = raw.and_then(|r| r.sriov.as_ref()) {
            let vfs: Vec<&Seen> = s
                .vfs
                .iter()
                .filter_map(|v| by_address.get(v).copied())
                .collect();
            let rid = |a: PciAddress| {
                (u32::from(a.bus) << 8) | (u32::from(a.slot) << 3) | u32::from(a.function)
            };
            let gap = |from: PciAddress, to: PciAddress| {
                u16::try_from(rid(to).saturating_sub(rid(from))).ok()
            };
            let offset = s
                .vf_offset
                .or_else(|| vfs.first().and_then(|v| gap(f.address, v.address)))
                .unwrap_or(1);
            let stride = s
                .vf_stride
                .or_else(|| match vfs.as_slice() {
                    [a, b, ..] => gap(a.address, b.address),
                    _ => None,
                })
                .unwrap_or(1);
            let vf_driver = vfs.iter().find_map(|v| {
                let r = v.raw.as_ref()?;
                r.driver_override.is_none().then(|| r.driver.clone())?
            });
            spec.sriov = Some(SriovSpec {
                total_vfs: s.total_vfs,
                vf_device_id: s.vf_device_id.unwrap_or(device),
                vf_driver,
                offset,
                stride,
                initial_vfs: 0,
            });
        }
        functions.push(spec);
    }
    HostModel {
        functions,
        drivers: drivers
            .into_iter()
            .map(|name| {
                let mut d = DriverSpec::new(&name, &[], sriov_drivers.contains(&name));
                d.ids = ids.get(&name).into_iter().flatten().copied().collect();
                d
            })
            .collect(),
        mounts: Vec::new(),
        interfaces: Vec::new(),
        consoles: Vec::new(),
        iommu_groups,
        // A recording does not hold the kernel's modules nor its interrupts: a kernel ready
        // for passthrough.
        kernel: Default::default(),
    }
}

/// Reaches the recorded drivers, overrides and VFs by the writes an administrator would make,
/// so that the simulated kernel's own rules hold from the first moment. What cannot be
/// reached is said in `notes`.
fn boot_state(kernel: &Arc<SimKernel>, seen: &SeenHost, notes: &mut Vec<String>) {
    let root = kernel.root().to_path_buf();
    let write = |rel: String, value: &str, notes: &mut Vec<String>| {
        if let Err(e) = Backend::write(kernel.as_ref(), &root.join(&rel), value.as_bytes()) {
            notes.push(format!(
                "cannot reproduce the recording: {value:?} > {rel}: {e}"
            ));
        }
    };
    let dev = |a: PciAddress, attr: &str| format!("sys/bus/pci/devices/{a}/{attr}");
    let settle = |f: &Seen, notes: &mut Vec<String>| {
        let Some(r) = &f.raw else { return };
        let a = f.address;
        if kernel.driver_override_of(a) != r.driver_override {
            let v = r.driver_override.clone().unwrap_or_else(|| "\n".into());
            write(dev(a, "driver_override"), &v, notes);
        }
        let current = kernel.driver_of(a);
        if current == r.driver {
            return;
        }
        if let Some(c) = current {
            write(
                format!("sys/bus/pci/drivers/{c}/unbind"),
                &a.to_string(),
                notes,
            );
        }
        match &r.driver {
            Some(d) if r.driver_override.as_ref() == Some(d) => {
                write("sys/bus/pci/drivers_probe".into(), &a.to_string(), notes)
            }
            Some(d) => write(
                format!("sys/bus/pci/drivers/{d}/bind"),
                &a.to_string(),
                notes,
            ),
            None => {}
        }
    };
    let is_vf = |f: &Seen| f.raw.as_ref().is_some_and(|r| r.physfn.is_some());
    for f in seen.functions.iter().filter(|f| !is_vf(f)) {
        settle(f, notes);
    }
    for f in &seen.functions {
        let Some(s) = f.raw.as_ref().and_then(|r| r.sriov.as_ref()) else {
            continue;
        };
        if !s.drivers_autoprobe {
            write(dev(f.address, "sriov_drivers_autoprobe"), "0", notes);
        }
        if s.num_vfs > 0 {
            write(
                dev(f.address, "sriov_numvfs"),
                &s.num_vfs.to_string(),
                notes,
            );
        }
    }
    let present: BTreeSet<PciAddress> = kernel.addresses().into_iter().collect();
    for f in seen.functions.iter().filter(|f| is_vf(f)) {
        if !present.contains(&f.address) {
            notes.push(format!(
                "cannot reproduce the recording: VF {} did not appear",
                f.address
            ));
            continue;
        }
        settle(f, notes);
    }
}

/// The simulated kernel's read faults for what the recording could not give.
fn faults(kernel: &SimKernel, seen: &SeenHost, recorded: &HashMap<PathBuf, i32>, from: &Path) {
    let present: BTreeSet<PciAddress> = kernel.addresses().into_iter().collect();
    for f in seen
        .functions
        .iter()
        .filter(|f| present.contains(&f.address))
    {
        for attr in &f.missing {
            let rendered = kernel
                .root()
                .join(format!("sys/bus/pci/devices/{}/{attr}", f.address));
            if std::fs::symlink_metadata(&rendered).is_ok() {
                kernel.make_unreadable(f.address, attr, libc::ENOENT);
            }
        }
    }
    for (path, errno) in recorded {
        let Ok(rel) = path.strip_prefix(from) else {
            continue;
        };
        let parts: Vec<&str> = rel.iter().filter_map(|c| c.to_str()).collect();
        if let ["sys", "bus", "pci", "devices", addr, attr] = parts.as_slice() {
            if let Ok(a) = addr.parse::<PciAddress>() {
                kernel.make_unreadable(a, attr, *errno);
            }
        }
    }
}

/// `block 259:1` as a device number.
fn parse_number(text: &str) -> Option<crate::host::sysfs::DeviceNumber> {
    use crate::host::sysfs::{DeviceNumber, NodeKind};
    let (kind, number) = text.split_once(' ')?;
    let (major, minor) = number.split_once(':')?;
    Some(DeviceNumber {
        kind: match kind {
            "block" => NodeKind::Block,
            "char" => NodeKind::Char,
            _ => return None,
        },
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

/// The recording's holders of the host's devices in the simulated kernel: the devices found
/// busy held exclusively (beside the holders the copied tree shows), the processes holding
/// their nodes, and each node as the simulated kernel's `/dev` shows one (a file naming its
/// number).
/// Runs before the host-use files are copied (the kernel renders its own while it changes).
fn replay_uses(kernel: &SimKernel, from: &Path, uses: &record::Uses) -> io::Result<()> {
    let root = kernel.root();
    for b in &uses.busy {
        let dev = from.join("sys/class/block").join(b).join("dev");
        if let Ok(number) = std::fs::read_to_string(&dev) {
            write_node(
                root,
                &format!("/dev/{b}"),
                &format!("block {}", number.trim()),
            )?;
        }
        kernel.hold_exclusively(b, true)?;
    }
    let mut by_pid: BTreeMap<u32, Vec<&record::OpenRecord>> = BTreeMap::new();
    for o in &uses.open {
        by_pid.entry(o.pid).or_default().push(o);
        if let Some(n) = &o.number {
            write_node(root, &o.node, n)?;
        }
    }
    for (pid, opens) in by_pid {
        let dir = from.join("proc").join(pid.to_string());
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
        kernel.spawn(crate::sim::kernel::ProcessSpec {
            pid,
            comm: comm.trim().to_string(),
            cmdline: String::from_utf8_lossy(&cmdline)
                .split('\0')
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect(),
            nodes: opens.iter().map(|o| o.node.clone()).collect(),
        })?;
    }
    Ok(())
}

/// A simulated `/dev` node file (`block 259:1`) for `node`, unless the kernel made one.
fn write_node(root: &Path, node: &str, number: &str) -> io::Result<()> {
    let file = root.join(node.trim_start_matches('/'));
    if file.exists() {
        return Ok(());
    }
    if let Some(p) = file.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(file, format!("{number}\n"))
}

/// Copies the host-use files from the recording: `proc/mounts`, `proc/swaps`, the `dev/mapper`
/// links, and the `sys/class/block`, `sys/class/net`, `sys/class/graphics` and
/// `sys/class/vtconsole` links with the directories they reach (a disk's `slaves/` included),
/// replacing what the simulated kernel rendered for an empty model.
fn copy_host_use(from: &Path, to: &Path) -> io::Result<()> {
    for f in ["proc/mounts", "proc/swaps"] {
        if from.join(f).is_file() {
            std::fs::create_dir_all(to.join("proc"))?;
            std::fs::copy(from.join(f), to.join(f))?;
        }
    }
    for class in [
        "dev/mapper",
        "sys/class/block",
        "sys/class/net",
        "sys/class/graphics",
        "sys/class/vtconsole",
        "sys/dev/block",
        "sys/dev/char",
    ] {
        let Ok(entries) = std::fs::read_dir(from.join(class)) else {
            continue;
        };
        for e in entries.filter_map(Result::ok) {
            let rel = Path::new(class).join(e.file_name());
            let Ok(target) = std::fs::read_link(e.path()) else {
                continue;
            };
            replace_link(&to.join(&rel), &target)?;
            if class == "dev/mapper" {
                continue;
            }
            let Ok(dir) = std::fs::canonicalize(e.path()) else {
                continue;
            };
            let Ok(dir) = dir.strip_prefix(from).map(Path::to_path_buf) else {
                continue;
            };
            copy_tree(&from.join(&dir), &to.join(&dir))?;
            // A multipath head's subsystem names its controllers beside it.
            if dir.iter().any(|c| c == "nvme-subsystem") {
                if let Some(subsystem) = dir.parent() {
                    copy_tree(&from.join(subsystem), &to.join(subsystem))?;
                    // The controllers it links to, where the host has them.
                    for e in std::fs::read_dir(from.join(subsystem))?.filter_map(Result::ok) {
                        let Ok(ctrl) = std::fs::canonicalize(e.path()) else {
                            continue;
                        };
                        if let Ok(rel) = ctrl.strip_prefix(from) {
                            std::fs::create_dir_all(to.join(rel))?;
                        }
                    }
                }
            }
            if let Some(parent) = dir.parent() {
                let slaves = parent.join("slaves");
                if from.join(&slaves).is_dir() {
                    copy_tree(&from.join(&slaves), &to.join(&slaves))?;
                }
            }
        }
    }
    Ok(())
}

fn replace_link(link: &Path, target: &Path) -> io::Result<()> {
    if let Some(p) = link.parent() {
        std::fs::create_dir_all(p)?;
    }
    match std::fs::remove_file(link) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::fs::symlink(target, link)
}

/// Files, links and directories of `from` into `to` (merged with what is there).
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let t = e.file_type()?;
        if t.is_symlink() {
            replace_link(&dst, &std::fs::read_link(&src)?)?;
        } else if t.is_dir() {
            copy_tree(&src, &dst)?;
        } else if t.is_file() {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_found_at_any_depth_and_not_through_links() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path();
        assert_eq!(find_root(top), None);
        let deep = top.join("a/b/c/host");
        std::fs::create_dir_all(deep.join("sys/bus/pci/devices")).unwrap();
        // A link to it from higher up is not followed: the real directory is the one found.
        std::os::unix::fs::symlink(&deep, top.join("a/shortcut")).unwrap();
        assert_eq!(find_root(top), Some(deep.clone()));
        assert_eq!(find_root(&deep), Some(deep));
    }

    #[test]
    fn a_write_is_refused_as_the_kernel_refuses_a_read_only_attribute() {
        let dir = tempfile::tempdir().unwrap();
        let attr = dir.path().join("sriov_numvfs");
        std::fs::write(&attr, "0\n").unwrap();
        let b = ReadOnly::default();
        let e = b.write(&attr, b"4").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EACCES));
        assert_eq!(std::fs::read(&attr).unwrap(), b"0\n", "nothing written");
        let e = b.write(&dir.path().join("nope"), b"1").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        assert!(!dir.path().join("nope").exists(), "nothing created");
    }
}
