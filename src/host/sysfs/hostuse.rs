//! Which PCI functions the host itself uses: the controllers behind mounted block devices (and
//! swap), the devices behind network interfaces that are up, and the boot GPU driving the
//! console (`console`). vfiod must never take these away from the host, whatever its config
//! says.

use super::Sysfs;
use crate::model::pci::PciAddress;
use std::collections::BTreeMap;
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
    let Ok(canon) = sysfs.backend().canonicalize(&class_link) else {
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

/// Scans the mount table, swap, network interfaces and the console GPU under the sysfs root;
/// a console GPU in `allow_console_gpu` (`[host]`) is not a use.
pub fn detect(sysfs: &Sysfs, allow_console_gpu: &[PciAddress]) -> HostUse {
    let mut uses = super::console::detect(sysfs, allow_console_gpu);
    for (dev, mountpoint) in mounted_block_devices(sysfs) {
        for addr in block_endpoints(sysfs, &dev, 0) {
            let why = if mountpoint == "swap" {
                format!("block device {dev} is in use as swap")
            } else {
                format!("block device {dev} is mounted at {mountpoint}")
            };
            uses.entry(addr).or_default().push(why);
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
            if let Ok(canon) = sysfs.backend().canonicalize(&dir) {
                if let Some(addr) = pci_ancestors(&canon).into_iter().last() {
                    uses.entry(addr)
                        .or_default()
                        .push(format!("network interface {iface} is up"));
                }
            }
        }
    }
    uses
}

/// Processes holding `/dev/vfio/<group>` open, per group: a VM (QEMU) using a device through
/// VFIO. Read from `<root>/proc/*/fd`; a process that vanishes mid-scan is skipped.
pub fn vfio_users(sysfs: &Sysfs, groups: &[u32]) -> BTreeMap<u32, Vec<String>> {
    let mut out: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    if groups.is_empty() {
        return out;
    }
    let proc_dir = sysfs.path("proc");
    let Ok(pids) = sysfs.backend().read_dir(&proc_dir) else {
        return out;
    };
    for pid in pids {
        let Some(pid) = pid
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let fd_dir = proc_dir.join(pid).join("fd");
        let Ok(fds) = sysfs.backend().read_dir(&fd_dir) else {
            continue;
        };
        for fd in fds {
            let Ok(target) = sysfs.backend().read_link(&fd_dir.join(&fd)) else {
                continue;
            };
            let t = target.to_string_lossy();
            let Some(g) = t
                .rsplit_once("/dev/vfio/")
                .and_then(|(_, g)| g.parse::<u32>().ok())
            else {
                continue;
            };
            if groups.contains(&g) {
                let comm = sysfs
                    .read_text(&proc_dir.join(pid).join("comm"))
                    .unwrap_or_else(|_| "?".into());
                let who = format!("pid {pid} ({comm})");
                let users = out.entry(g).or_default();
                if !users.contains(&who) {
                    users.push(who);
                }
            }
        }
    }
    out
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
