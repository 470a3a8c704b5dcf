//! A recording of a host for a bug report (`vfioctl record`): what vfiod reads of the machine,
//! laid out as on the host under a root (`sys/bus/pci/devices/...`, `proc/mounts`), plus a
//! `manifest.json`, written as a gzip'd tarball. `vfiod --simulate --replay` serves it back
//! (`sim::replay`).
//!
//! What is recorded is what the readers of [`super::sysfs`] read, nothing more:
//! - each PCI function's directory (`sys/bus/pci/devices/X` and the `sys/devices/...` directory
//!   it links to): the attributes of [`FUNCTION_ATTRS`], the first [`CONFIG_BYTES`] bytes of
//!   `config`, the links of [`FUNCTION_LINKS`] and every `virtfnN`, the presence of the
//!   write-only [`FUNCTION_PRESENCE`] (`reset`, `reset_subordinate`), and a DFL card's
//!   `fpga_region/*/dfl-fme.N/pr/interface_id` and `dfl-port.N/afu_id`;
//! - the IOMMU groups' `devices/` links and the names of the loaded PCI drivers;
//! - for the host-use check: `proc/mounts` (lines of `/dev/` block devices; the running vfiod's
//!   own table when one runs, since systemd gives it a mount namespace), `proc/swaps` (swap
//!   partitions), the `dev/mapper` links and `sys/class/block` entries they resolve through
//!   (down to the disks under a device-mapper or md device), and the `sys/class/net` entries of
//!   interfaces that are up on a PCI device (`flags`, `operstate`);
//! - for the console GPU: each function's `boot_vga` where it has one, the
//!   `sys/class/vtconsole` entries (`name`, `bind`) and the `sys/class/graphics/fbN` entries
//!   with a device (`name`, `device`);
//! - `proc/sys/kernel/osrelease`.
//!
//! - who holds the host's devices ([`Uses`], `hostuse`'s facts): every `sys/class/block` entry
//!   below a function with its `holders/` (and their `dm/name`), the block devices an exclusive
//!   open finds busy, and the device nodes of functions that processes hold (pid, `comm`, a
//!   QEMU's guest name, the node and its `sys/dev` link).
//!
//! Never read: BARs (`resource*`), the `rom`, config space past 256 bytes, processes' other open
//! files and their command lines; of the running vfiod, only its name and its mount table. [`LEFT_OUT`] says what a recording leaves
//! out, in the manifest itself. Links are kept as the host has them, relative, so the tree
//! resolves under any root; an absolute link is made relative to the recorded root.
//!
//! A read that fails (other than "no such file") is not recorded as content: the manifest lists
//! its path and errno, and the replay fails that read the same way, so the function is broken
//! there with the host's reason.

use super::sysfs::{hostuse, Backend, NodeKind, Sysfs};
use crate::model::pci::PciAddress;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// The manifest's name at the top of a recording.
pub const MANIFEST: &str = "manifest.json";

/// The manifest's format; a replay reads older ones and refuses newer.
pub const FORMAT: u32 = 1;

/// How much of `config` is read: the standard header and capabilities, not the extended space.
pub const CONFIG_BYTES: usize = 256;

/// Text attributes of a function that vfiod reads (`host::sysfs::function`), recorded when present.
pub const FUNCTION_ATTRS: &[&str] = &[
    "uevent",
    "vendor",
    "device",
    "class",
    "subsystem_vendor",
    "subsystem_device",
    "driver_override",
    "numa_node",
    "sriov_totalvfs",
    "sriov_numvfs",
    "sriov_drivers_autoprobe",
    "sriov_vf_device",
    "sriov_offset",
    "sriov_stride",
    "reset_method",
    "aer_dev_correctable",
    "aer_dev_nonfatal",
    "aer_dev_fatal",
];

/// Links of a function that vfiod reads, besides `virtfnN`.
pub const FUNCTION_LINKS: &[&str] = &["driver", "iommu_group", "physfn"];

/// Attributes only some functions have, recorded when present and never missed where absent:
/// `boot_vga` (VGA-class functions only; `host::sysfs::console`).
pub const FUNCTION_OPTIONAL: &[&str] = &["boot_vga"];

/// Write-only attributes whose presence vfiod reads (`host::sysfs::reset`): recorded as empty
/// files, never opened.
pub const FUNCTION_PRESENCE: &[&str] = &["reset", "reset_subordinate"];

/// What a recording leaves out, said in its manifest and in the docs.
pub const LEFT_OUT: &[&str] = &[
    "BAR contents and expansion ROMs (resource*, rom): never read",
    "PCI config space past its first 256 bytes (the extended capabilities)",
    "every sysfs attribute vfiod does not read (see docs/recording.md for the list it does read)",
    "processes and their open files (proc/*/fd), but for the device nodes of PCI functions: which process (pid, comm, a QEMU's guest name) holds which",
    "the host name (unless --with-hostname)",
    "vfiod's configuration and its state database (claims, tasks, history)",
    "mount table lines of anything but /dev block devices, swap files",
    "network interfaces that are down or have no PCI device behind them",
    "the kernel's module index, log and uevents; /dev nodes (vfio, dfl-fme)",
];

/// Largest attribute read: sysfs shows at most a page, this bounds a stray regular file.
const MAX_ATTR_BYTES: u64 = 64 * 1024;

/// How deep a block device is followed through `slaves/` (dm on md on partitions).
const MAX_BLOCK_DEPTH: u8 = 8;

const IFF_UP: u32 = 0x1;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot list the PCI functions in {path} (is {root} the root of a Linux host?)", root = root.display())]
    NoPciBus {
        root: PathBuf,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} exists: choose another file or pass --force to replace it")]
    Exists { path: PathBuf },
    #[error("cannot write the recording to {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot encode the manifest")]
    Manifest(#[source] serde_json::Error),
}

/// One member of a recording, by its path relative to the root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Member {
    Dir,
    File(Vec<u8>),
    /// A symbolic link, relative.
    Link(PathBuf),
}

/// A read that failed on the host: the replay fails it the same way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unreadable {
    /// Relative to the root, as vfiod reads it (`sys/bus/pci/devices/X/config`).
    pub path: String,
    pub errno: i32,
    /// The error's text on the host, for a person reading the manifest.
    pub error: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub functions: usize,
    pub iommu_groups: usize,
    pub files: usize,
    pub links: usize,
    pub directories: usize,
}

/// `manifest.json`: who recorded what, when, and what was left out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// The recorder and its version, e.g. `vfioctl 0.1.0`.
    pub tool: String,
    /// RFC 3339, UTC.
    pub recorded_at: String,
    /// `proc/sys/kernel/osrelease`.
    pub kernel_release: Option<String>,
    /// Only with `--with-hostname`: a host's name can be a secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_name: Option<String>,
    /// The PCI id database compiled into the recorder ([`pci_ids_version`]): vendor and device
    /// names come from the replaying vfiod's own, which may differ.
    pub pci_ids: String,
    /// Whose mount table `proc/mounts` is: the running vfiod's (its mount namespace) or the
    /// recorder's own.
    #[serde(default)]
    pub mount_table: String,
    pub counts: Counts,
    #[serde(default)]
    pub unreadable: Vec<Unreadable>,
    pub left_out: Vec<String>,
    /// Who held the host's devices beside what the tree shows.
    #[serde(default, skip_serializing_if = "Uses::is_empty")]
    pub uses: Uses,
}

/// Who held the host's devices when it was recorded, beside what the tree shows (the block
/// devices' `holders/`, which are recorded as links): the block devices an exclusive open
/// found busy, and the device nodes of PCI functions that processes had open (their pid and
/// `comm`; of a QEMU, its guest name). `sim::replay` answers the same.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Uses {
    /// Block device names (`nvme1n1`).
    #[serde(default)]
    pub busy: Vec<String>,
    #[serde(default)]
    pub open: Vec<OpenRecord>,
}

impl Uses {
    pub fn is_empty(&self) -> bool {
        self.busy.is_empty() && self.open.is_empty()
    }
}

/// One device node a process had open.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenRecord {
    pub pid: u32,
    /// The descriptor's name under `proc/PID/fd`.
    pub fd: String,
    /// The node, as the process had it: `/dev/nvme1n1`, `/dev/vfio/devices/vfio0`,
    /// `/dev/vfio/40`.
    pub node: String,
    /// Its kind and number, `block 259:1`; none for a VFIO group (known by its name).
    pub number: Option<String>,
}

/// What to record besides the tree.
#[derive(Clone, Debug)]
pub struct Options {
    /// The recorder's name and version, for the manifest.
    pub tool: String,
    pub with_hostname: bool,
}

/// A recording in memory: the tree and its manifest.
#[derive(Clone, Debug)]
pub struct Recording {
    members: BTreeMap<PathBuf, Member>,
    pub manifest: Manifest,
}

/// The compiled-in PCI id database, identified by its size and a digest of its content (the
/// `pci-ids` crate does not keep the file's version line): `2272 vendors, 25430 devices,
/// sha256 0123456789abcdef`.
pub fn pci_ids_version() -> String {
    crate::model::pci_name::VERSION.to_string()
}

/// `base` joined with a relative link `target`, resolved lexically (sysfs links point through
/// real directories, so this is where the kernel resolves them too); `None` when it climbs
/// above the root.
fn resolve_lexically(base: &Path, target: &Path) -> Option<PathBuf> {
    let mut out: Vec<Component> = base.components().collect();
    for c in target.components() {
        match c {
            Component::ParentDir => {
                out.pop()?;
            }
            Component::CurDir => {}
            Component::Normal(_) => out.push(c),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out.iter().collect())
}

/// `link`'s target as recorded: relative. An absolute target (`/sys/devices/...`) is made
/// relative to the link's directory, as if the root were `/`.
fn relative_target(link_rel: &Path, target: &Path) -> PathBuf {
    if !target.is_absolute() {
        return target.to_path_buf();
    }
    let depth = link_rel.parent().map_or(0, |p| p.components().count());
    let mut rel = PathBuf::new();
    for _ in 0..depth {
        rel.push("..");
    }
    rel.push(target.strip_prefix("/").unwrap_or(target));
    rel
}

/// Reads at most `limit` bytes of a file: open, read until the limit or the end, close.
fn read_at_most(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let f = std::fs::File::open(path)?;
    let mut buf = Vec::with_capacity(limit.min(4096) as usize);
    f.take(limit).read_to_end(&mut buf)?;
    Ok(buf)
}

fn is_not_found(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
}

/// Builds a recording while the host is read.
struct Recorder<'a> {
    root: &'a Path,
    members: BTreeMap<PathBuf, Member>,
    unreadable: Vec<Unreadable>,
}

impl Recorder<'_> {
    fn abs(&self, rel: &Path) -> PathBuf {
        self.root.join(rel)
    }

    fn dir(&mut self, rel: &Path) {
        // Ancestors first; an existing member (a link on the way) is left as it is.
        let mut p = PathBuf::new();
        for c in rel.components() {
            p.push(c);
            self.members.entry(p.clone()).or_insert(Member::Dir);
        }
    }

    fn put(&mut self, rel: &Path, member: Member) {
        if let Some(parent) = rel.parent() {
            self.dir(parent);
        }
        self.members.insert(rel.to_path_buf(), member);
    }

    fn failed(&mut self, rel: &Path, e: &io::Error) {
        self.unreadable.push(Unreadable {
            path: rel.display().to_string(),
            errno: e.raw_os_error().unwrap_or(libc::EIO),
            error: e.to_string(),
        });
    }

    /// A file of at most `limit` bytes: recorded, or absent (nothing), or unreadable (listed).
    /// `as_read` is the path vfiod reads it by, which the replay's fault uses.
    fn file(&mut self, rel: &Path, as_read: &Path, limit: u64) -> Option<Vec<u8>> {
        match read_at_most(&self.abs(rel), limit) {
            Ok(bytes) => {
                self.put(rel, Member::File(bytes.clone()));
                Some(bytes)
            }
            Err(e) if is_not_found(&e) => None,
            Err(e) => {
                self.failed(as_read, &e);
                None
            }
        }
    }

    /// A symbolic link: recorded (relative), or absent, or unreadable. Returns its target.
    fn link(&mut self, rel: &Path, as_read: &Path) -> Option<PathBuf> {
        match std::fs::read_link(self.abs(rel)) {
            Ok(target) => {
                let target = relative_target(rel, &target);
                self.put(rel, Member::Link(target.clone()));
                Some(target)
            }
            Err(e) if is_not_found(&e) => None,
            // EINVAL: not a link (a tree copied without its links): nothing to record.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => None,
            Err(e) => {
                self.failed(as_read, &e);
                None
            }
        }
    }

    fn list(&self, rel: &Path) -> io::Result<Vec<String>> {
        let mut names: Vec<String> = std::fs::read_dir(self.abs(rel))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        names.sort();
        Ok(names)
    }

    /// A PCI function: its bus link, its directory's attributes and links, its DFL card.
    fn function(&mut self, address: PciAddress) {
        let name = address.to_string();
        let bus_rel = Path::new("sys/bus/pci/devices").join(&name);
        let Some(target) = self.link(&bus_rel, &bus_rel) else {
            return;
        };
        let Some(dir) = resolve_lexically(Path::new("sys/bus/pci/devices"), &target) else {
            self.failed(
                &bus_rel,
                &io::Error::other("the link climbs above the root"),
            );
            return;
        };
        self.dir(&dir);
        let as_read = |attr: &str| bus_rel.join(attr);
        self.file(&dir.join("config"), &as_read("config"), CONFIG_BYTES as u64);
        for attr in FUNCTION_ATTRS {
            self.file(&dir.join(attr), &as_read(attr), MAX_ATTR_BYTES);
        }
        for l in FUNCTION_LINKS {
            self.link(&dir.join(l), &as_read(l));
        }
        let entries = match self.list(&dir) {
            Ok(e) => e,
            Err(e) => {
                self.failed(&bus_rel, &e);
                return;
            }
        };
        for e in &entries {
            if e.strip_prefix("virtfn")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            {
                self.link(&dir.join(e), &as_read(e));
            }
        }
        for name in FUNCTION_OPTIONAL {
            if entries.iter().any(|e| e == name) {
                self.file(&dir.join(name), &as_read(name), MAX_ATTR_BYTES);
            }
        }
        for name in FUNCTION_PRESENCE {
            if entries.iter().any(|e| e == name) {
                self.put(&dir.join(name), Member::File(Vec::new()));
            }
        }
        if entries.iter().any(|e| e == "fpga_region") {
            self.dfl(&dir.join("fpga_region"), &bus_rel.join("fpga_region"));
        }
    }

    /// A DFL card's FME interface id and port AFU id (`host::sysfs::dfl`).
    fn dfl(&mut self, regions: &Path, as_read: &Path) {
        let Ok(names) = self.list(regions) else {
            return;
        };
        for region in names {
            let (r, rr) = (regions.join(&region), as_read.join(&region));
            let Ok(entries) = self.list(&r) else { continue };
            for e in entries {
                if e.starts_with("dfl-fme.") {
                    let f = Path::new(&e).join("pr/interface_id");
                    self.file(&r.join(&f), &rr.join(&f), MAX_ATTR_BYTES);
                } else if e.starts_with("dfl-port.") {
                    let f = Path::new(&e).join("afu_id");
                    self.file(&r.join(&f), &rr.join(&f), MAX_ATTR_BYTES);
                }
            }
        }
    }

    /// Every IOMMU group's `devices/` links.
    fn iommu_groups(&mut self) -> usize {
        let groups = Path::new("sys/kernel/iommu_groups");
        let Ok(names) = self.list(groups) else {
            return 0;
        };
        let mut n = 0;
        for g in names {
            let devices = groups.join(&g).join("devices");
            let Ok(members) = self.list(&devices) else {
                continue;
            };
            n += 1;
            self.dir(&devices);
            for m in members {
                self.link(&devices.join(&m), &devices.join(&m));
            }
        }
        n
    }

    /// The loaded PCI drivers, as empty directories: their names are what vfiod reads.
    fn drivers(&mut self) {
        let drivers = Path::new("sys/bus/pci/drivers");
        if let Ok(names) = self.list(drivers) {
            for d in names {
                self.dir(&drivers.join(d));
            }
        }
    }

    /// The mount table vfiod reads: its own `/proc/self/mounts`, in the mount namespace
    /// systemd's sandbox gives it (`PrivateTmp`, `ProtectSystem`: bind mounts of the host's
    /// file systems at `/tmp`, `/var/lib/vfiod`, ...). So when a vfiod runs (its pid in the
    /// default state directory's lock file, and that process is `vfiod`), its
    /// `proc/PID/mounts` is recorded, else this process's. Returns the path and what it is.
    fn mount_table_source(&self) -> (PathBuf, String) {
        let own = (
            PathBuf::from("proc/mounts"),
            "vfioctl's own (no vfiod running)".into(),
        );
        let lock = crate::config::Settings::default()
            .state_dir
            .join(crate::store::lock::LOCK_FILE_NAME);
        let lock = lock.strip_prefix("/").unwrap_or(&lock).to_path_buf();
        let Some(pid) = read_at_most(&self.abs(&lock), 64)
            .ok()
            .and_then(|b| String::from_utf8_lossy(&b).trim().parse::<u32>().ok())
        else {
            return own;
        };
        let proc = PathBuf::from(format!("proc/{pid}"));
        let is_vfiod = read_at_most(&self.abs(&proc.join("comm")), 64)
            .is_ok_and(|c| String::from_utf8_lossy(&c).trim() == "vfiod");
        if !is_vfiod || !self.abs(&proc.join("mounts")).is_file() {
            return own;
        }
        (
            proc.join("mounts"),
            format!("the running vfiod's (pid {pid}, its mount namespace)"),
        )
    }

    /// `proc/mounts` (as vfiod reads it: [`Recorder::mount_table_source`]) and `proc/swaps`,
    /// kept to `/dev/` block devices; returns their names and where the mount table came from.
    fn mount_tables(&mut self) -> (Vec<String>, String) {
        let mut names = Vec::new();
        let (source, mount_table) = self.mount_table_source();
        if let Ok(text) = read_at_most(&self.abs(&source), 16 << 20) {
            let text = String::from_utf8_lossy(&text);
            let kept: String = text
                .lines()
                .filter(|l| l.starts_with("/dev/"))
                .map(|l| format!("{l}\n"))
                .collect();
            for l in kept.lines() {
                if let Some(n) = l
                    .split_whitespace()
                    .next()
                    .and_then(|s| s.strip_prefix("/dev/"))
                {
                    names.push(n.to_string());
                }
            }
            self.put(Path::new("proc/mounts"), Member::File(kept.into_bytes()));
        }
        if let Ok(text) = read_at_most(&self.abs(Path::new("proc/swaps")), 1 << 20) {
            let text = String::from_utf8_lossy(&text);
            let mut lines = text.lines();
            let mut kept = lines.next().map(|h| format!("{h}\n")).unwrap_or_default();
            for l in lines.filter(|l| l.starts_with("/dev/")) {
                kept.push_str(l);
                kept.push('\n');
                if let Some(n) = l
                    .split_whitespace()
                    .next()
                    .and_then(|s| s.strip_prefix("/dev/"))
                {
                    names.push(n.to_string());
                }
            }
            self.put(Path::new("proc/swaps"), Member::File(kept.into_bytes()));
        }
        names.sort();
        names.dedup();
        (names, mount_table)
    }

    /// A block device as `hostuse` follows it: `dev/mapper/X`, `sys/class/block/X`, the
    /// directory it resolves to, and the `slaves/` of it and of its parent, recursively.
    fn block(&mut self, name: &str, depth: u8, seen: &mut BTreeSet<String>) {
        if depth > MAX_BLOCK_DEPTH || !seen.insert(name.to_string()) {
            return;
        }
        let mut name = name.to_string();
        if let Some(mapped) = name.strip_prefix("mapper/") {
            let rel = Path::new("dev/mapper").join(mapped);
            if let Some(t) = self.link(&rel, &rel) {
                if let Some(n) = t.file_name().and_then(|n| n.to_str()) {
                    name = n.to_string();
                }
            }
        }
        if name.contains('/') || name == ".." || name == "." {
            return;
        }
        let class = Path::new("sys/class/block").join(&name);
        if self.link(&class, &class).is_none() {
            return;
        }
        let Ok(canon) = std::fs::canonicalize(self.abs(&class)) else {
            return;
        };
        let Ok(dir) = canon.strip_prefix(self.root).map(Path::to_path_buf) else {
            return;
        };
        self.dir(&dir);
        for d in [
            dir.clone(),
            dir.parent().map(Path::to_path_buf).unwrap_or_default(),
        ] {
            let slaves = d.join("slaves");
            let Ok(entries) = self.list(&slaves) else {
                continue;
            };
            self.dir(&slaves);
            for s in entries {
                self.link(&slaves.join(&s), &slaves.join(&s));
                self.block(&s, depth + 1, seen);
            }
        }
    }

    /// The console (`host::sysfs::console`): every `sys/class/vtconsole` entry (`name`,
    /// `bind`) and every `sys/class/graphics/fbN` with a device (`name`, the `device` link,
    /// and the device's directory, so that a firmware framebuffer's platform device resolves).
    fn consoles(&mut self) {
        let vt = Path::new("sys/class/vtconsole");
        for name in self.list(vt).unwrap_or_default() {
            let class = vt.join(&name);
            let Some(dir) = self.class_dir(&class) else {
                continue;
            };
            for attr in ["name", "bind"] {
                self.file(&dir.join(attr), &class.join(attr), 256);
            }
        }
        let graphics = Path::new("sys/class/graphics");
        for name in self.list(graphics).unwrap_or_default() {
            if !name.starts_with("fb") {
                continue;
            }
            let class = graphics.join(&name);
            let Ok(device) = std::fs::canonicalize(self.abs(&class.join("device"))) else {
                continue;
            };
            let Some(dir) = self.class_dir(&class) else {
                continue;
            };
            self.file(&dir.join("name"), &class.join("name"), 256);
            self.link(&dir.join("device"), &class.join("device"));
            if let Ok(device) = device.strip_prefix(self.root).map(Path::to_path_buf) {
                self.dir(&device);
            }
        }
    }

    /// A `sys/class` entry: its link recorded, and the directory it resolves to (relative to
    /// the root), made a member.
    fn class_dir(&mut self, class: &Path) -> Option<PathBuf> {
        let canon = std::fs::canonicalize(self.abs(class)).ok()?;
        let dir = canon.strip_prefix(self.root).ok()?.to_path_buf();
        self.link(class, class)?;
        self.dir(&dir);
        Some(dir)
    }

    /// A `sys/class/block` entry as `hostuse` reads it: the link, its directory's
    /// `partition` and `dev`, its `holders/` and each holder's class link, directory and
    /// `dm/name`; for an NVMe multipath head, its subsystem's controller links.
    fn held_block(&mut self, name: &str) {
        let class = Path::new("sys/class/block").join(name);
        if self.link(&class, &class).is_none() {
            return;
        }
        let Some(dir) = self.canonical(&class) else {
            return;
        };
        self.dir(&dir);
        for attr in ["partition", "dev"] {
            self.file(&dir.join(attr), &class.join(attr), 64);
        }
        let holders = dir.join("holders");
        if let Ok(names) = self.list(&holders) {
            self.dir(&holders);
            for h in names {
                self.link(&holders.join(&h), &holders.join(&h));
                let h_class = Path::new("sys/class/block").join(&h);
                if self.link(&h_class, &h_class).is_some() {
                    if let Some(h_dir) = self.canonical(&h_class) {
                        self.dir(&h_dir);
                        self.file(&h_dir.join("dm/name"), &h_class.join("dm/name"), 256);
                        self.file(&h_dir.join("dev"), &h_class.join("dev"), 64);
                    }
                }
            }
        }
        let mut subsystem = PathBuf::new();
        let mut after = false;
        for c in dir.components() {
            subsystem.push(c);
            if after {
                let Ok(entries) = self.list(&subsystem) else {
                    break;
                };
                for e in entries.iter().filter(|e| {
                    e.len() > 4
                        && e.starts_with("nvme")
                        && e[4..].bytes().all(|b| b.is_ascii_digit())
                }) {
                    let link = subsystem.join(e);
                    self.link(&link, &link);
                    if let Some(ctrl) = self.canonical(&link) {
                        self.dir(&ctrl);
                    }
                }
                break;
            }
            after = c.as_os_str() == "nvme-subsystem";
        }
    }

    /// Where a link under the root leads, relative to the root.
    fn canonical(&self, rel: &Path) -> Option<PathBuf> {
        let canon = std::fs::canonicalize(self.abs(rel)).ok()?;
        canon.strip_prefix(self.root).ok().map(Path::to_path_buf)
    }

    /// Who holds the host's devices (`hostuse`'s facts): the block devices below functions
    /// with what `hostuse` reads of them, and the processes holding nodes of functions: their
    /// `comm`, the guest name of a QEMU (as a command line of its own, `qemu -name guest=X`:
    /// nothing else of it), and the `sys/dev` link of each node.
    fn uses(&mut self, backend: &Arc<dyn Backend>) -> Uses {
        use crate::hostuse::Node;
        let sysfs = Sysfs::new(self.root.to_path_buf(), Arc::clone(backend));
        let facts = hostuse::read(&sysfs, hostuse::Scope::All, &[]);
        let mut uses = Uses::default();
        for b in &facts.blocks {
            self.held_block(&b.name);
            if b.busy {
                uses.busy.push(b.name.clone());
            }
        }
        for (i, o) in facts.open.iter().enumerate() {
            let pid = o.process.pid;
            let node = match &o.node {
                Node::Block(n) => format!("/dev/{n}"),
                Node::Char(p) | Node::Vfio(p) => p.clone(),
                Node::VfioGroup(g) => format!("/dev/vfio/{g}"),
            };
            let number = match &o.node {
                Node::VfioGroup(_) => None,
                _ => backend
                    .device_number(&self.abs(Path::new(node.trim_start_matches('/'))))
                    .ok()
                    .flatten(),
            };
            if let Some(n) = number {
                let link = Path::new("sys/dev")
                    .join(n.kind.sys_dev())
                    .join(n.to_string());
                if self.link(&link, &link).is_some() {
                    if let Some(dir) = self.canonical(&link) {
                        self.dir(&dir);
                    }
                }
            }
            let proc_dir = Path::new("proc").join(pid.to_string());
            self.put(
                &proc_dir.join("comm"),
                Member::File(format!("{}\n", o.process.comm).into_bytes()),
            );
            if let Some(guest) = &o.process.guest {
                self.put(
                    &proc_dir.join("cmdline"),
                    Member::File(format!("qemu\0-name\0guest={guest}\0").into_bytes()),
                );
            }
            uses.open.push(OpenRecord {
                pid,
                fd: (3 + i).to_string(),
                node,
                number: number.map(|n| {
                    let kind = match n.kind {
                        NodeKind::Block => "block",
                        NodeKind::Char => "char",
                    };
                    format!("{kind} {n}")
                }),
            });
        }
        uses.busy.sort();
        uses.busy.dedup();
        uses
    }

    /// Interfaces that are up on a PCI device: their `sys/class/net` link, `flags`, `operstate`.
    fn interfaces(&mut self) {
        let net = Path::new("sys/class/net");
        let Ok(names) = self.list(net) else { return };
        for iface in names {
            let class = net.join(&iface);
            let flags = read_at_most(&self.abs(&class.join("flags")), 64)
                .ok()
                .and_then(|b| {
                    let t = String::from_utf8_lossy(&b).trim().to_string();
                    u32::from_str_radix(t.trim_start_matches("0x"), 16).ok()
                })
                .unwrap_or(0);
            if flags & IFF_UP == 0 {
                continue;
            }
            let Ok(canon) = std::fs::canonicalize(self.abs(&class)) else {
                continue;
            };
            if super::sysfs::hostuse::pci_ancestors(&canon).is_empty() {
                continue;
            }
            let Ok(dir) = canon.strip_prefix(self.root).map(Path::to_path_buf) else {
                continue;
            };
            self.link(&class, &class);
            self.dir(&dir);
            self.file(&dir.join("flags"), &class.join("flags"), 64);
            self.file(&dir.join("operstate"), &class.join("operstate"), 64);
        }
    }
}

/// Reads the host under `root` (`/` on a real host) into a recording. Read-only: nothing under
/// `root` is written, and only the files the module header lists are opened.
pub fn record(root: &Path, options: &Options) -> Result<Recording, RecordError> {
    record_with(root, Arc::new(super::sysfs::HostFs), options)
}

/// [`record`], with the device nodes and exclusive opens answered by `backend` (the
/// simulated kernel's own under its root).
pub fn record_with(
    root: &Path,
    backend: Arc<dyn Backend>,
    options: &Options,
) -> Result<Recording, RecordError> {
    let started = std::time::SystemTime::now();
    let devices = root.join("sys/bus/pci/devices");
    let mut addresses: Vec<PciAddress> = std::fs::read_dir(&devices)
        .map_err(|source| RecordError::NoPciBus {
            root: root.to_path_buf(),
            path: devices.clone(),
            source,
        })?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    addresses.sort();
    let mut r = Recorder {
        root,
        members: BTreeMap::new(),
        unreadable: Vec::new(),
    };
    r.dir(Path::new("sys/bus/pci/devices"));
    for a in &addresses {
        r.function(*a);
    }
    let iommu_groups = r.iommu_groups();
    r.drivers();
    let mut seen = BTreeSet::new();
    let (mounted, mount_table) = r.mount_tables();
    for name in mounted {
        r.block(&name, 0, &mut seen);
    }
    r.interfaces();
    r.consoles();
    let uses = r.uses(&backend);
    let osrelease = Path::new("proc/sys/kernel/osrelease");
    let kernel_release = r
        .file(osrelease, osrelease, 256)
        .map(|b| String::from_utf8_lossy(&b).trim().to_string());
    let host_name = if options.with_hostname {
        read_at_most(&root.join("proc/sys/kernel/hostname"), 256)
            .ok()
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
    } else {
        None
    };
    let mut counts = Counts {
        functions: addresses.len(),
        iommu_groups,
        ..Counts::default()
    };
    for m in r.members.values() {
        match m {
            Member::Dir => counts.directories += 1,
            Member::File(_) => counts.files += 1,
            Member::Link(_) => counts.links += 1,
        }
    }
    let manifest = Manifest {
        format: FORMAT,
        tool: options.tool.clone(),
        recorded_at: humantime::format_rfc3339_seconds(started).to_string(),
        kernel_release,
        host_name,
        pci_ids: pci_ids_version(),
        mount_table,
        counts,
        unreadable: r.unreadable,
        left_out: LEFT_OUT.iter().map(|s| s.to_string()).collect(),
        uses,
    };
    Ok(Recording {
        members: r.members,
        manifest,
    })
}

impl Recording {
    /// The members, by relative path, parents before children.
    pub fn members(&self) -> &BTreeMap<PathBuf, Member> {
        &self.members
    }

    /// Writes the recording as a gzip'd tarball: `manifest.json` first, then the tree. Every
    /// member has the recording's time and root's ownership, so the bytes depend on the host
    /// and that time alone.
    pub fn write_tar_gz<W: Write>(&self, out: W) -> Result<W, RecordError> {
        let failed = |source: io::Error| RecordError::Write {
            path: PathBuf::from("<tarball>"),
            source,
        };
        let mtime = humantime::parse_rfc3339(&self.manifest.recorded_at)
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        let header = |kind: tar::EntryType, mode: u32, size: u64| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_size(size);
            h.set_mtime(mtime);
            h.set_uid(0);
            h.set_gid(0);
            h
        };
        let manifest = serde_json::to_vec_pretty(&self.manifest).map_err(RecordError::Manifest)?;
        let mut h = header(tar::EntryType::Regular, 0o444, manifest.len() as u64);
        tar.append_data(&mut h, MANIFEST, manifest.as_slice())
            .map_err(failed)?;
        for (path, m) in &self.members {
            match m {
                Member::Dir => {
                    let mut h = header(tar::EntryType::Directory, 0o755, 0);
                    tar.append_data(&mut h, path, io::empty()).map_err(failed)?;
                }
                Member::File(bytes) => {
                    let mut h = header(tar::EntryType::Regular, 0o444, bytes.len() as u64);
                    tar.append_data(&mut h, path, bytes.as_slice())
                        .map_err(failed)?;
                }
                Member::Link(target) => {
                    let mut h = header(tar::EntryType::Symlink, 0o777, 0);
                    tar.append_link(&mut h, path, target).map_err(failed)?;
                }
            }
        }
        let gz = tar.into_inner().map_err(failed)?;
        gz.finish().map_err(failed)
    }

    /// Writes the tarball to `path` atomically (a temporary file in the same directory, synced,
    /// then renamed): a reader never sees half a recording. An existing `path` is refused unless
    /// `force`. Returns the size written.
    pub fn write_file(&self, path: &Path, force: bool) -> Result<u64, RecordError> {
        let failed = |source: io::Error| RecordError::Write {
            path: path.to_path_buf(),
            source,
        };
        if !force && std::fs::symlink_metadata(path).is_ok() {
            return Err(RecordError::Exists {
                path: path.to_path_buf(),
            });
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let tmp = tempfile::Builder::new()
            .prefix(".vfiod-recording.")
            .suffix(".tmp")
            .tempfile_in(dir)
            .map_err(failed)?;
        let file = self
            .write_tar_gz(io::BufWriter::new(tmp.as_file()))
            .map_err(|e| match e {
                RecordError::Write { source, .. } => failed(source),
                other => other,
            })?;
        file.into_inner()
            .map_err(|e| failed(e.into_error()))?
            .sync_all()
            .map_err(failed)?;
        let size = tmp.as_file().metadata().map_err(failed)?.len();
        // The file keeps tempfile's private mode (0600): a recording is for its maker to share.
        if force {
            tmp.persist(path).map_err(|e| failed(e.error))?;
        } else {
            // No replace even if `path` appeared since the check above.
            tmp.persist_noclobber(path).map_err(|e| {
                if e.error.kind() == io::ErrorKind::AlreadyExists {
                    RecordError::Exists {
                        path: path.to_path_buf(),
                    }
                } else {
                    failed(e.error)
                }
            })?;
        }
        Ok(size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_resolve_lexically_and_absolute_ones_become_relative() {
        let table: &[(&str, &str, Option<&str>)] = &[
            (
                "sys/bus/pci/devices",
                "../../../devices/pci0000:00/0000:00:01.0",
                Some("sys/devices/pci0000:00/0000:00:01.0"),
            ),
            ("sys/bus/pci/devices", "../../../../../etc", None),
            ("a/b", "./c/../d", Some("a/b/d")),
            ("a", "/etc", None),
        ];
        for (base, target, want) in table {
            assert_eq!(
                resolve_lexically(Path::new(base), Path::new(target)),
                want.map(PathBuf::from),
                "{base} + {target}"
            );
        }
        assert_eq!(
            relative_target(
                Path::new("sys/bus/pci/devices/0000:00:01.0"),
                Path::new("/sys/devices/pci0000:00/0000:00:01.0")
            ),
            PathBuf::from("../../../../sys/devices/pci0000:00/0000:00:01.0")
        );
        assert_eq!(
            relative_target(Path::new("a/b"), Path::new("../c")),
            PathBuf::from("../c")
        );
    }

    #[test]
    fn the_pci_ids_version_names_the_database() {
        let v = pci_ids_version();
        assert!(v.contains("vendors") && v.contains("sha256 "), "{v}");
        assert_eq!(v, pci_ids_version());
    }
}
