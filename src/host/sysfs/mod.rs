//! The sysfs layer: every read and write of kernel state goes through here, and every path derives
//! from one root (`sysfs_root` in the config), so tests and `--simulate` point it at a temporary
//! tree backed by the simulated kernel.
//!
//! [`Backend`] is the narrow I/O seam: the real host uses [`HostFs`]; the simulated kernel
//! implements the same trait and reacts to writes the way Linux does.

mod function;
pub mod console;
pub mod dfl;
pub mod iommu;
pub mod hostuse;
pub mod reset;
mod writer;

pub use crate::model::pci::config_is_all_ones;
pub use function::{AerCounters, Health, RawFunction, SriovInfo};

use crate::model::pci::PciAddress;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// File-level access to a sysfs-like tree. Paths are absolute (already joined to the root).
pub trait Backend: Send + Sync + 'static {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    fn write(&self, path: &Path, data: &[u8]) -> io::Result<()>;
    fn read_link(&self, path: &Path) -> io::Result<PathBuf>;
    fn read_dir(&self, path: &Path) -> io::Result<Vec<OsString>>;
    /// Resolves symlinks; used to find a block device's or interface's PCI ancestors.
    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf>;

    /// Partial reconfiguration of an FPGA port through its FME node (`/dev/dfl-fme.N`) with
    /// `bitstream`: the `DFL_FPGA_FME_PORT_PR` ioctl on a real host. `afu_id` is what the
    /// image's metadata says the bitstream provides: the hardware ignores it (the bitstream
    /// carries its own), the simulated kernel, which loads nothing, shows it as the port's.
    fn fpga_port_pr(
        &self,
        fme_node: &Path,
        port_id: u32,
        bitstream: &[u8],
        afu_id: Option<&str>,
    ) -> io::Result<()> {
        let _ = afu_id;
        dfl::port_pr_ioctl(fme_node, port_id, bitstream)
    }

    /// The device number of the device node `path` resolves to (`/proc/PID/fd/N`: the file
    /// that process has open, whatever its name in its mount namespace); `None` when it is not
    /// a device node. The simulated kernel answers from its own nodes.
    fn device_number(&self, path: &Path) -> io::Result<Option<DeviceNumber>> {
        device_number_of(path)
    }

    /// Opens block device node `path` exclusively and closes it at once: EBUSY is the kernel
    /// saying someone holds it (mounted in any namespace, swap, ZFS, md, btrfs, an LVM PV, a
    /// process's `O_EXCL`). Read-only and non-blocking: the probe writes nothing and holds
    /// nothing longer than the two system calls.
    fn probe_exclusive(&self, path: &Path) -> io::Result<()> {
        probe_exclusive_open(path)
    }

    /// The links in directory `dir` (`/proc/PID/fd`) and their targets, as (name, target); a
    /// link gone meanwhile is left out.
    fn fd_targets(&self, dir: &Path) -> io::Result<Vec<(OsString, PathBuf)>> {
        fd_targets_of(dir)
    }
}

/// [`Backend::fd_targets`] on a real tree: one open of the directory, then `readlinkat` for
/// each entry, so that no descriptor costs a walk of its whole path (a host has thousands).
pub fn fd_targets_of(dir: &Path) -> io::Result<Vec<(OsString, PathBuf)>> {
    use nix::fcntl::OFlag;
    use std::os::unix::ffi::OsStringExt;
    let mut d = nix::dir::Dir::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(io::Error::from)?;
    let names: Vec<std::ffi::CString> = d
        .iter()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        if let Ok(t) = nix::fcntl::readlinkat(&d, n.as_c_str()) {
            out.push((OsString::from_vec(n.into_bytes()), PathBuf::from(t)));
        }
    }
    Ok(out)
}

/// Character or block device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeKind {
    Char,
    Block,
}

impl NodeKind {
    /// Its directory under `/sys/dev`.
    pub fn sys_dev(self) -> &'static str {
        match self {
            NodeKind::Char => "char",
            NodeKind::Block => "block",
        }
    }
}

/// A device node's number, as `/sys/dev/{char,block}/MAJ:MIN` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceNumber {
    pub kind: NodeKind,
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for DeviceNumber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// [`Backend::device_number`] on the real host: `stat(2)`, following the link.
pub fn device_number_of(path: &Path) -> io::Result<Option<DeviceNumber>> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata(path)?;
    let kind = if m.file_type().is_block_device() {
        NodeKind::Block
    } else if m.file_type().is_char_device() {
        NodeKind::Char
    } else {
        return Ok(None);
    };
    let rdev = m.rdev();
    Ok(Some(DeviceNumber {
        kind,
        major: libc::major(rdev),
        minor: libc::minor(rdev),
    }))
}

/// [`Backend::probe_exclusive`] on the real host: `open(O_RDONLY | O_EXCL | O_NONBLOCK |
/// O_CLOEXEC)`, then close.
pub fn probe_exclusive_open(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map(drop)
}

/// The real filesystem.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostFs;

/// Reads a whole file with open, read until end, close. `std::fs::read` also asks the file's
/// size first, which sysfs does not know (attributes report 4096), so that is one system call
/// per read spent for nothing; scans and read-backs make thousands of these reads.
pub fn read_file(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut buf = Vec::with_capacity(4096);
    loop {
        if buf.len() == buf.capacity() {
            buf.reserve(4096);
        }
        let spare = buf.capacity() - buf.len();
        let start = buf.len();
        buf.resize(start + spare, 0);
        match f.read(&mut buf[start..]) {
            Ok(0) => {
                buf.truncate(start);
                return Ok(buf);
            }
            Ok(n) => buf.truncate(start + n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => buf.truncate(start),
            Err(e) => return Err(e),
        }
    }
}

impl Backend for HostFs {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        read_file(path)
    }
    fn write(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        use std::io::Write;
        // sysfs attributes must be written in one write(2) to an existing file: no create,
        // no truncate, so the kernel sees exactly one store() call.
        let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
        f.write_all(data)
    }
    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
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
}

#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("unexpected content in {path}: {value:?} ({reason})")]
    Parse {
        path: PathBuf,
        value: String,
        reason: String,
    },
    #[error("writing {value:?} to {path} failed")]
    Write {
        path: PathBuf,
        value: String,
        #[source]
        source: io::Error,
    },
    #[error("writing {value:?} to {path} did not finish within {timeout:?}")]
    WriteTimeout {
        path: PathBuf,
        value: String,
        timeout: Duration,
    },
    #[error("{path}: config space reads all-ones (device gone or link down)")]
    ConfigAllOnes { path: PathBuf },
}

impl SysfsError {
    /// The OS error number behind a failed read or write, for errors the caller reports as
    /// "errno and path".
    /// Whether the failure is vfiod's own shortage (no descriptor or memory left for it), not
    /// a fact about the device.
    pub fn is_own_shortage(&self) -> bool {
        matches!(
            self.errno(),
            Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOMEM)
        )
    }

    pub fn errno(&self) -> Option<i32> {
        match self {
            SysfsError::Read { source, .. } | SysfsError::Write { source, .. } => {
                source.raw_os_error()
            }
            _ => None,
        }
    }

    /// True when the thing read does not exist (device removed between listing and reading).
    pub fn is_not_found(&self) -> bool {
        matches!(self, SysfsError::Read { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// Default bound for a sysfs write. An unbind can block while a driver holds the device; the
/// daemon must report that, not freeze.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Handle on one sysfs tree. Cheap to clone.
#[derive(Clone)]
pub struct Sysfs {
    root: PathBuf,
    backend: Arc<dyn Backend>,
    write_timeout: Duration,
    writer: Arc<writer::Writer>,
    /// Set on the handle a [`Sysfs::run_bounded`] job gets: writes go straight to the backend,
    /// watched by the caller.
    inline: Option<Arc<writer::Watch>>,
}

impl std::fmt::Debug for Sysfs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sysfs").field("root", &self.root).finish()
    }
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>, backend: Arc<dyn Backend>) -> Self {
        Sysfs {
            root: root.into(),
            backend,
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            writer: Arc::new(writer::Writer::new()),
            inline: None,
        }
    }

    /// The real kernel under `root` (normally `/`).
    pub fn host(root: impl Into<PathBuf>) -> Self {
        Sysfs::new(root, Arc::new(HostFs))
    }

    pub fn with_write_timeout(mut self, timeout: Duration) -> Self {
        self.write_timeout = timeout;
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// `<root>/<rel>`; `rel` is relative, e.g. `sys/bus/pci`.
    pub fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.root.join(rel)
    }

    pub fn pci_bus_dir(&self) -> PathBuf {
        self.path("sys/bus/pci")
    }

    pub fn pci_devices_dir(&self) -> PathBuf {
        self.path("sys/bus/pci/devices")
    }

    pub fn device_dir(&self, address: PciAddress) -> PathBuf {
        self.pci_devices_dir().join(address.to_string())
    }

    pub fn device_attr(&self, address: PciAddress, attr: &str) -> PathBuf {
        self.device_dir(address).join(attr)
    }

    pub fn driver_dir(&self, driver: &str) -> PathBuf {
        self.pci_bus_dir().join("drivers").join(driver)
    }

    pub fn iommu_group_dir(&self, group: u32) -> PathBuf {
        self.path("sys/kernel/iommu_groups").join(group.to_string())
    }

    /// Every PCI function the kernel lists, sorted by address. Entries that are not PCI
    /// addresses are skipped: they are not ours to interpret.
    pub fn list_functions(&self) -> Result<Vec<PciAddress>, SysfsError> {
        let dir = self.pci_devices_dir();
        let names = self
            .backend
            .read_dir(&dir)
            .map_err(|source| SysfsError::Read { path: dir, source })?;
        let mut out: Vec<PciAddress> = names
            .iter()
            .filter_map(|n| n.to_str()?.parse().ok())
            .collect();
        out.sort();
        Ok(out)
    }

    /// Members of an IOMMU group, sorted.
    pub fn iommu_group_members(&self, group: u32) -> Result<Vec<PciAddress>, SysfsError> {
        let dir = self.iommu_group_dir(group).join("devices");
        let names = self
            .backend
            .read_dir(&dir)
            .map_err(|source| SysfsError::Read { path: dir, source })?;
        let mut out: Vec<PciAddress> = names
            .iter()
            .filter_map(|n| n.to_str()?.parse().ok())
            .collect();
        out.sort();
        Ok(out)
    }

    pub(crate) fn read_bytes(&self, path: &Path) -> Result<Vec<u8>, SysfsError> {
        self.backend.read(path).map_err(|source| SysfsError::Read {
            path: path.to_path_buf(),
            source,
        })
    }

    /// A text attribute, trimmed.
    pub fn read_text(&self, path: &Path) -> Result<String, SysfsError> {
        let bytes = self.read_bytes(path)?;
        String::from_utf8(bytes)
            .map(|s| s.trim().to_string())
            .map_err(|e| SysfsError::Parse {
                path: path.to_path_buf(),
                value: String::from_utf8_lossy(e.as_bytes()).into_owned(),
                reason: "not UTF-8".into(),
            })
    }

    /// The last path element a symlink points to (`driver` -> `nvme`, `iommu_group` -> `12`).
    pub fn read_link_name(&self, path: &Path) -> Result<String, SysfsError> {
        let target = self
            .backend
            .read_link(path)
            .map_err(|source| SysfsError::Read {
                path: path.to_path_buf(),
                source,
            })?;
        target
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
            .ok_or_else(|| SysfsError::Parse {
                path: path.to_path_buf(),
                value: target.display().to_string(),
                reason: "link has no final name".into(),
            })
    }

    /// Like [`Sysfs::read_link_name`] but absent links are `None` (no driver, no IOMMU).
    pub fn read_optional_link_name(&self, path: &Path) -> Result<Option<String>, SysfsError> {
        match self.read_link_name(path) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Write one attribute, bounded by the write timeout. The write runs on another thread
    /// because a blocked sysfs store cannot be interrupted; on timeout that thread is left to
    /// finish on its own and the caller gets [`SysfsError::WriteTimeout`]. Inside a
    /// [`Sysfs::run_bounded`] job the write is made inline and the job's caller keeps the bound.
    pub fn write(&self, path: &Path, value: &str) -> Result<(), SysfsError> {
        let failed = |source| SysfsError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        };
        if let Some(watch) = &self.inline {
            return watch
                .write(self.backend.as_ref(), path, value)
                .map_err(failed);
        }
        let (reply, rx) = std::sync::mpsc::channel();
        let (backend, owned_path, data) = (
            Arc::clone(&self.backend),
            path.to_path_buf(),
            value.as_bytes().to_vec(),
        );
        self.writer
            .submit(Box::new(move |release: &dyn Fn()| {
                let r = backend.write(&owned_path, &data);
                release();
                let _ = reply.send(r);
            }))
            .map_err(failed)?;
        match rx.recv_timeout(self.write_timeout) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(failed(source)),
            Err(_) => Err(SysfsError::WriteTimeout {
                path: path.to_path_buf(),
                value: value.to_string(),
                timeout: self.write_timeout,
            }),
        }
    }

    /// Runs `job` on the writer thread with a handle whose writes are made inline, one hand-off
    /// for a whole program instead of one per write. Each write stays bounded: when one has run
    /// for the write timeout, the job is abandoned (its later writes fail, it is left to finish
    /// on its own) and the caller gets [`SysfsError::WriteTimeout`] for that write. The job can
    /// `post` messages; `on_post` receives them on the caller's thread while the job runs.
    pub fn run_bounded<T, M>(
        &self,
        job: impl FnOnce(&Sysfs, &dyn Fn(M)) -> T + Send + 'static,
        on_post: &mut dyn FnMut(M),
    ) -> Result<T, SysfsError>
    where
        T: Send + 'static,
        M: Send + 'static,
    {
        let watch = Arc::new(writer::Watch::default());
        let inline = Sysfs {
            inline: Some(Arc::clone(&watch)),
            ..self.clone()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        self.writer
            .submit(Box::new(move |release: &dyn Fn()| {
                let post_tx = tx.clone();
                let post = move |m: M| {
                    let _ = post_tx.send(writer::Msg::Post(m));
                };
                let result = job(&inline, &post);
                release();
                let _ = tx.send(writer::Msg::Done(result));
            }))
            .map_err(|source| SysfsError::Write {
                path: self.root.clone(),
                value: String::new(),
                source,
            })?;
        match writer::watch(rx, &watch, self.write_timeout, on_post) {
            writer::Outcome::Done(t) => Ok(t),
            writer::Outcome::Overdue(path, value) => Err(SysfsError::WriteTimeout {
                path,
                value,
                timeout: self.write_timeout,
            }),
            writer::Outcome::Lost => Err(SysfsError::Write {
                path: self.root.clone(),
                value: String::new(),
                source: io::Error::other("the sysfs writer thread ended without a result"),
            }),
        }
    }

    pub fn write_device_attr(
        &self,
        address: PciAddress,
        attr: &str,
        value: &str,
    ) -> Result<(), SysfsError> {
        self.write(&self.device_attr(address, attr), value)
    }

    /// Everything the kernel shows about one function; see [`RawFunction::read`].
    pub fn read_function(&self, address: PciAddress) -> Result<RawFunction, SysfsError> {
        RawFunction::read(self, address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_derive_from_the_root() {
        let s = Sysfs::host("/tmp/x");
        let a: PciAddress = "0000:3b:00.1".parse().unwrap();
        assert_eq!(
            s.device_attr(a, "sriov_numvfs"),
            PathBuf::from("/tmp/x/sys/bus/pci/devices/0000:3b:00.1/sriov_numvfs")
        );
        assert_eq!(
            s.driver_dir("vfio-pci"),
            PathBuf::from("/tmp/x/sys/bus/pci/drivers/vfio-pci")
        );
        assert_eq!(
            s.iommu_group_dir(7),
            PathBuf::from("/tmp/x/sys/kernel/iommu_groups/7")
        );
    }
}
