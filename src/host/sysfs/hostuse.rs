//! Who uses which PCI function, as the kernel says it: the edge that reads the facts
//! ([`read`]) that [`crate::hostuse`] decides from. Mounted block devices and swap (through
//! `dm`/`md` slaves), interfaces that are up, every block device below a function (its
//! `holders/`, an exclusive open that finds it busy), and every device node of a function a
//! process holds (`/proc/*/fd`, by device number through `/sys/dev/{char,block}`), and the boot
//! GPU driving the console ([`super::console`]). Reads only: the exclusive open is closed at once
//! and writes nothing.
//!
//! The processes' descriptors are the costly part: a host has thousands of processes, and no
//! kernel interface says who holds a node short of reading every `/proc/PID/fd`. [`index`] does
//! that whole scan, off any caller that waits (the daemon's inventory pass and a background
//! refresh every `[host] holder_refresh_ms`, on the blocking pool), into a
//! [`crate::hostuse::HolderIndex`]. [`read_indexed`] (the qemu hook's guard, claims, the
//! inventory) then reads only what is cheap and exact at once (mounts, swap, interfaces, the
//! console GPU; every block device's `holders/` and exclusive-open probe) and, of the
//! processes, only those the index found holding a node of the functions asked about (their
//! descriptors read again: a holder that closed it or exited no longer counts) and those
//! started since the index was built (`/proc` lists them now and the index does not; at most
//! [`crate::hostuse::NEW_PIDS_MAX`], the newest).
//!
//! **The window**: a process that was already running when the index was built and opens a
//! node of the function non-exclusively after that (an exclusive open is the probe's, a
//! holder's `holders/` entry is read at once) is seen at the next refresh, at most
//! `holder_refresh_ms` later; so is a pid reused since the refresh, and a new process beyond
//! the cap. The job guards ([`read`]: they take functions away for good) scan every process.

use super::{DeviceNumber, NodeKind, Sysfs};
use crate::hostuse::{
    BlockDevice, BlockHolder, Facts, HolderIndex, Named, Node, OpenNode, Process,
};
use crate::model::pci::PciAddress;
use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path};

/// Why the host needs a function, e.g. "block device nvme0n1p2 is mounted at /".
pub type HostUse = BTreeMap<PciAddress, Vec<String>>;

const IFF_UP: u32 = 0x1;

/// Every PCI address on the canonical sysfs path of a device, outermost first (root port,
/// bridges, ..., the endpoint).
pub fn pci_ancestors(path: &Path) -> Vec<PciAddress> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str()?.parse().ok(),
            _ => None,
        })
        .collect()
}

/// The mount table's block devices: `(device name, mount point)`, e.g. `("nvme0n1p2", "/")`.
/// Reads `<root>/proc/self/mountinfo`'s simpler sibling `<root>/proc/mounts`, plus
/// `<root>/proc/swaps`.
fn mounted_block_devices(sysfs: &Sysfs) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Ok(text) = sysfs.read_text(&sysfs.path("proc/mounts")) {
        for line in text.lines() {
            let mut f = line.split_whitespace();
            let (Some(src), Some(target)) = (f.next(), f.next()) else {
                continue;
            };
            if let Some(name) = src.strip_prefix("/dev/") {
                out.push((name.to_string(), target.replace("\\040", " ")));
            }
        }
    }
    if let Ok(text) = sysfs.read_text(&sysfs.path("proc/swaps")) {
        for line in text.lines().skip(1) {
            if let Some(name) = line
                .split_whitespace()
                .next()
                .and_then(|s| s.strip_prefix("/dev/"))
            {
                out.push((name.to_string(), "swap".to_string()));
            }
        }
    }
    out
}

/// Resolves a `/dev` name to its `sys/class/block` entry. Device-mapper and md names
/// (`mapper/root`, `dm-0`, `md0`) are followed through `slaves/` to the disks beneath.
fn block_endpoints(sysfs: &Sysfs, name: &str, depth: u8) -> Vec<PciAddress> {
    if depth > 8 {
        return Vec::new();
    }
    let mut name = name.to_string();
    if let Some(mapped) = name.strip_prefix("mapper/") {
        // /dev/mapper/X is a link to ../dm-N on a real host; resolve it under the root.
        if let Ok(t) = sysfs
            .backend()
            .read_link(&sysfs.path("dev/mapper").join(mapped))
        {
            if let Some(n) = t.file_name().and_then(|n| n.to_str()) {
                name = n.to_string();
            }
        }
    }
    let class_link = sysfs.path("sys/class/block").join(&name);
    let Some(canon) = resolve(sysfs, &class_link) else {
        return Vec::new();
    };
    let mut found: Vec<PciAddress> = pci_ancestors(&canon)
        .into_iter()
        .last()
        .into_iter()
        .collect();
    // A partition's slaves live on the whole disk; a dm/md device lists its own.
    for dir in [
        canon.clone(),
        canon.parent().map(Path::to_path_buf).unwrap_or_default(),
    ] {
        if let Ok(slaves) = sysfs.backend().read_dir(&dir.join("slaves")) {
            for s in slaves {
                if let Some(s) = s.to_str() {
                    found.extend(block_endpoints(sysfs, s, depth + 1));
                }
            }
        }
    }
    found
}

/// The uses the mount table, swap, network interfaces and the console GPU name, by function; a
/// console GPU in `allow_console_gpu` (`[host]`) is not a use.
fn named(sysfs: &Sysfs, allow_console_gpu: &[PciAddress]) -> Vec<Named> {
    let mut uses: Vec<Named> = super::console::detect(sysfs, allow_console_gpu)
        .into_iter()
        .flat_map(|(function, whys)| {
            whys.into_iter().map(move |why| Named {
                function,
                block: None,
                why,
            })
        })
        .collect();
    for (dev, mountpoint) in mounted_block_devices(sysfs) {
        for addr in block_endpoints(sysfs, &dev, 0) {
            let why = if mountpoint == "swap" {
                format!("block device {dev} is in use as swap")
            } else {
                format!("block device {dev} is mounted at {mountpoint}")
            };
            let block = dev.rsplit('/').next().map(str::to_string);
            uses.push(Named {
                function: addr,
                block,
                why,
            });
        }
    }
    let net = sysfs.path("sys/class/net");
    if let Ok(ifaces) = sysfs.backend().read_dir(&net) {
        for iface in ifaces {
            let Some(iface) = iface.to_str() else {
                continue;
            };
            let dir = net.join(iface);
            let flags = sysfs
                .read_text(&dir.join("flags"))
                .ok()
                .and_then(|t| u32::from_str_radix(t.trim_start_matches("0x"), 16).ok())
                .unwrap_or(0);
            if flags & IFF_UP == 0 {
                continue;
            }
            if let Some(canon) = resolve(sysfs, &dir) {
                if let Some(addr) = pci_ancestors(&canon).into_iter().last() {
                    uses.push(Named {
                        function: addr,
                        block: None,
                        why: format!("network interface {iface} is up"),
                    });
                }
            }
        }
    }
    uses
}

/// Which functions a read looks at.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// Every function (the inventory's pass).
    All,
    /// These (a guard: the functions it is about and their group-mates).
    Only(&'a [PciAddress]),
}

impl Scope<'_> {
    fn keeps(&self, f: &PciAddress) -> bool {
        match self {
            Scope::All => true,
            Scope::Only(fs) => fs.contains(f),
        }
    }

    fn filter(&self, mut fs: Vec<PciAddress>) -> Vec<PciAddress> {
        fs.retain(|f| self.keeps(f));
        fs
    }
}

/// Where sysfs link `link` leads (`sys/class/block/nvme0n1` ->
/// `sys/devices/pci0000:00/.../nvme0n1`): its target joined to its directory, `..` taken
/// lexically, which is what sysfs links mean (relative, through real directories) at one
/// `readlink` rather than a `canonicalize`'s walk of every component. Anything else
/// (an absolute or odd target, not a link) is canonicalized.
fn resolve(sysfs: &Sysfs, link: &Path) -> Option<std::path::PathBuf> {
    if let Ok(target) = sysfs.backend().read_link(link) {
        if target.is_relative() {
            let mut out = link.parent()?.to_path_buf();
            let mut lexical = true;
            for c in target.components() {
                match c {
                    Component::ParentDir => lexical &= out.pop(),
                    Component::Normal(n) => out.push(n),
                    Component::CurDir => {}
                    _ => lexical = false,
                }
            }
            if lexical {
                return Some(out);
            }
        }
    }
    sysfs.backend().canonicalize(link).ok()
}

/// The functions a device's canonical sysfs path lies below: its nearest PCI ancestor, or,
/// for an NVMe multipath head (`sys/devices/virtual/nvme-subsystem/nvme-subsysN/nvmeXnY`, no
/// PCI parent), every controller of the subsystem (`nvme-subsysN/nvmeZ` links to
/// `.../0000:01:00.0/nvme/nvmeZ`).
fn functions_below(sysfs: &Sysfs, canon: &Path) -> Vec<PciAddress> {
    if let Some(f) = pci_ancestors(canon).into_iter().last() {
        return vec![f];
    }
    let mut subsystem = None;
    let mut prefix = std::path::PathBuf::new();
    let mut after = false;
    for c in canon.components() {
        prefix.push(c);
        if after {
            subsystem = Some(prefix.clone());
            break;
        }
        after = c.as_os_str() == "nvme-subsystem";
    }
    let Some(dir) = subsystem else {
        return Vec::new();
    };
    let Ok(entries) = sysfs.backend().read_dir(&dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries {
        let Some(n) = e.to_str() else { continue };
        let is_controller =
            n.len() > 4 && n.starts_with("nvme") && n[4..].bytes().all(|b| b.is_ascii_digit());
        if !is_controller {
            continue;
        }
        if let Some(c) = resolve(sysfs, &dir.join(n)) {
            if let Some(f) = pci_ancestors(&c).into_iter().last() {
                if !out.contains(&f) {
                    out.push(f);
                }
            }
        }
    }
    out
}

/// Every block device below a function in `scope` (namespaces, partitions, multipath heads):
/// its `holders/` and whether an exclusive open finds it busy.
fn block_devices(sysfs: &Sysfs, scope: Scope<'_>) -> Vec<BlockDevice> {
    let class = sysfs.path("sys/class/block");
    let Ok(names) = sysfs.backend().read_dir(&class) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in names {
        let Some(name) = name.to_str() else { continue };
        let Some(canon) = resolve(sysfs, &class.join(name)) else {
            continue;
        };
        let functions = scope.filter(functions_below(sysfs, &canon));
        if functions.is_empty() {
            continue;
        }
        let disk = sysfs
            .backend()
            .read(&canon.join("partition"))
            .ok()
            .and_then(|_| canon.parent()?.file_name()?.to_str().map(str::to_string));
        let holders = sysfs
            .backend()
            .read_dir(&canon.join("holders"))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|h| h.to_str().map(str::to_string))
            .map(|h| BlockHolder {
                dm_name: sysfs
                    .read_text(&class.join(&h).join("dm/name"))
                    .ok()
                    .filter(|n| !n.is_empty()),
                name: h,
            })
            .collect();
        let busy = matches!(
            sysfs.backend().probe_exclusive(&sysfs.path("dev").join(name)),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY)
        );
        out.push(BlockDevice {
            name: name.to_string(),
            disk,
            functions,
            holders,
            busy,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The process `pid` as `/proc/PID` shows it; a process gone meanwhile is `None`.
fn process(sysfs: &Sysfs, pid: u32) -> Option<Process> {
    let dir = sysfs.path("proc").join(pid.to_string());
    let comm = sysfs.read_text(&dir.join("comm")).ok()?;
    let guest = sysfs
        .backend()
        .read(&dir.join("cmdline"))
        .ok()
        .and_then(|b| {
            let text = String::from_utf8_lossy(&b);
            let args: Vec<&str> = text.split('\0').filter(|a| !a.is_empty()).collect();
            crate::hostuse::guest_name(&args)
        });
    Some(Process { pid, comm, guest })
}

/// What a device number is a node of: the functions below it (through
/// `/sys/dev/{char,block}/MAJ:MIN`) and the node's kind.
fn node_of(sysfs: &Sysfs, number: DeviceNumber, target: &str) -> Option<(Node, Vec<PciAddress>)> {
    let link = sysfs
        .path("sys/dev")
        .join(number.kind.sys_dev())
        .join(number.to_string());
    let canon = resolve(sysfs, &link)?;
    let functions = functions_below(sysfs, &canon);
    if functions.is_empty() {
        return None;
    }
    let node = match number.kind {
        NodeKind::Block => Node::Block(canon.file_name()?.to_str()?.to_string()),
        NodeKind::Char
            if canon
                .parent()
                .and_then(|p| p.file_name())
                .is_some_and(|p| p == "vfio-dev") =>
        {
            Node::Vfio(target.to_string())
        }
        NodeKind::Char => Node::Char(target.to_string()),
    };
    Some((node, functions))
}

/// The pids `/proc` lists now; a process that exits meanwhile is the reader's to skip.
fn listed_pids(sysfs: &Sysfs) -> Vec<u32> {
    let Ok(entries) = sysfs.backend().read_dir(&sysfs.path("proc")) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .iter()
        .filter_map(|p| p.to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

/// Every device node of a function in `scope` that one of `pids` holds: `/proc/PID/fd`
/// targets, by device number through `/sys/dev/{char,block}`, and `/dev/vfio/<group>` by the
/// group's members. A process or descriptor that vanishes mid-scan is skipped. Many processes
/// are shared among a few threads: a host has thousands.
fn open_nodes(sysfs: &Sysfs, scope: Scope<'_>, pids: &[u32]) -> Vec<OpenNode> {
    let proc_dir = sysfs.path("proc");
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, SCAN_THREADS);
    let chunk = pids.len().div_ceil(threads).max(PIDS_PER_THREAD);
    let mut out: Vec<OpenNode> = if pids.len() <= chunk {
        open_nodes_of(sysfs, scope, &proc_dir, pids)
    } else {
        std::thread::scope(|s| {
            let workers: Vec<_> = pids
                .chunks(chunk)
                .map(|part| {
                    let proc_dir = &proc_dir;
                    s.spawn(move || open_nodes_of(sysfs, scope, proc_dir, part))
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        })
    };
    out.sort_by_key(|o| o.process.pid);
    out
}

/// At most this many threads scan `/proc`, each at least this many processes.
const SCAN_THREADS: usize = 4;
const PIDS_PER_THREAD: usize = 256;

fn open_nodes_of(sysfs: &Sysfs, scope: Scope<'_>, proc_dir: &Path, pids: &[u32]) -> Vec<OpenNode> {
    let mut out = Vec::new();
    let mut nodes: HashMap<DeviceNumber, Option<(Node, Vec<PciAddress>)>> = HashMap::new();
    let mut groups: HashMap<u32, Vec<PciAddress>> = HashMap::new();
    for &pid in pids {
        let fd_dir = proc_dir.join(pid.to_string()).join("fd");
        let Ok(fds) = sysfs.backend().fd_targets(&fd_dir) else {
            continue;
        };
        let mut held: Vec<(Node, Vec<PciAddress>)> = Vec::new();
        for (fd, target) in fds {
            let Some(target) = target.to_str() else {
                continue;
            };
            // Sockets, pipes, anonymous inodes and files are not device nodes: no stat.
            if !target.starts_with("/dev/") {
                continue;
            }
            let found = if let Some(g) = target
                .strip_prefix("/dev/vfio/")
                .and_then(|g| g.parse::<u32>().ok())
            {
                let members = groups
                    .entry(g)
                    .or_insert_with(|| sysfs.iommu_group_members(g).unwrap_or_default());
                Some((Node::VfioGroup(g), members.clone()))
            } else {
                let Ok(Some(number)) = sysfs.backend().device_number(&fd_dir.join(&fd)) else {
                    continue;
                };
                nodes
                    .entry(number)
                    .or_insert_with(|| node_of(sysfs, number, target))
                    .clone()
            };
            let Some((node, functions)) = found else {
                continue;
            };
            let functions = scope.filter(functions);
            if !functions.is_empty() && !held.iter().any(|(n, _)| *n == node) {
                held.push((node, functions));
            }
        }
        if held.is_empty() {
            continue;
        }
        let Some(p) = process(sysfs, pid) else {
            continue;
        };
        for (node, functions) in held {
            out.push(OpenNode {
                node,
                functions,
                process: p.clone(),
            });
        }
    }
    out
}

/// What the kernel says about who uses the functions in `scope`: the mounts, swap and
/// interfaces it names, every block device below them (holders, exclusive opens) and every
/// node of theirs a process holds (every process's descriptors read now: exact, and as slow as
/// the host has processes), and the console GPU unless `allow_console_gpu` lists it.
/// [`crate::hostuse`] decides from it.
pub fn read(sysfs: &Sysfs, scope: Scope<'_>, allow_console_gpu: &[PciAddress]) -> Facts {
    let pids = listed_pids(sysfs);
    read_with(
        sysfs,
        scope,
        allow_console_gpu,
        open_nodes(sysfs, scope, &pids),
    )
}

fn read_with(
    sysfs: &Sysfs,
    scope: Scope<'_>,
    allow_console_gpu: &[PciAddress],
    open: Vec<OpenNode>,
) -> Facts {
    let mut named = named(sysfs, allow_console_gpu);
    named.retain(|n| scope.keeps(&n.function));
    Facts {
        named,
        blocks: block_devices(sysfs, scope),
        open,
    }
}

/// Every process's descriptors, read now: the holder index (generation `generation`) that
/// [`read_indexed`] starts from. As slow as the host has processes: for the daemon's
/// background refresh and its inventory pass, never for a caller that waits.
pub fn index(sysfs: &Sysfs, generation: u64) -> HolderIndex {
    let seen = listed_pids(sysfs);
    let open = open_nodes(sysfs, Scope::All, &seen);
    HolderIndex {
        open,
        seen,
        generation,
    }
}

/// [`read`], bounded in time by `index` (see the module's header): the facts that are cheap
/// at once, and of the processes only the index's holders of the functions in `scope`, read
/// again, and the processes started since the index was built (at most
/// [`crate::hostuse::NEW_PIDS_MAX`]; how many more there were is said with the facts).
pub fn read_indexed(
    sysfs: &Sysfs,
    scope: Scope<'_>,
    allow_console_gpu: &[PciAddress],
    index: &HolderIndex,
) -> Indexed {
    let only = match scope {
        Scope::All => None,
        Scope::Only(fs) => Some(fs),
    };
    let check = crate::hostuse::pids_to_check(index, &listed_pids(sysfs), only);
    let open = open_nodes(sysfs, scope, &check.pids);
    Indexed {
        facts: read_with(sysfs, scope, allow_console_gpu, open),
        left_to_refresh: check.left_to_refresh,
    }
}

/// What [`read_indexed`] found, and how many new processes it left to the next refresh.
#[derive(Clone, Debug, Default)]
pub struct Indexed {
    pub facts: Facts,
    pub left_to_refresh: usize,
}

/// The host's uses of every function: [`read`] everything, decided by
/// [`crate::hostuse::host_uses`].
pub fn detect(sysfs: &Sysfs, allow_console_gpu: &[PciAddress]) -> HostUse {
    crate::hostuse::host_uses(&read(sysfs, Scope::All, allow_console_gpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_from_a_canonical_path() {
        let p = Path::new(
            "/tmp/r/sys/devices/pci0000:00/0000:00:1d.0/0000:3d:00.0/nvme/nvme0/nvme0n1/nvme0n1p2",
        );
        let a = pci_ancestors(p);
        assert_eq!(
            a,
            vec![
                "0000:00:1d.0".parse::<PciAddress>().unwrap(),
                "0000:3d:00.0".parse().unwrap()
            ]
        );
    }
}
