//! Who uses a PCI function, decided from what the kernel says (read by
//! `host::sysfs::hostuse`, the edge): the one answer the inventory (a function the host uses is
//! protected), the qemu hook's host guard, every job's guard and the claims ask. Pure.
//!
//! | fact the edge read (below the function: its own sysfs tree, or an NVMe multipath head of its subsystem) | used by | reason |
//! |---|---|---|
//! | a block device mounted (`/proc/mounts`) or swap (`/proc/swaps`), through `dm`/`md` slaves; a network interface that is up | the host | `block device nvme0n1p2 is mounted at /`, `... is in use as swap`, `network interface enp2s0 is up` |
//! | a block device with `holders/` entries (dm, LVM, dm-crypt, multipath, md, bcache) | the host | `block device nvme1n1 is held by dm-0 (vg0-data)` (the dm name from `holders/dm-0/dm/name`) |
//! | a block device an exclusive open finds busy (EBUSY: mounted in any namespace, swap, ZFS, btrfs or md member, an LVM PV in use, a process's `O_EXCL`), unless a mount, swap or holder above says why (a disk: unless a partition of it is busy) | the host | `block device nvme1n1 is held exclusively` |
//! | a block device or a host driver's character node (NVMe `nvme0`, DRM, RDMA, accel) open in a process, QEMU included (a raw disk of a VM is served by the host's driver) | the host | `block device nvme1n1 is open by pid 812 (fio)`, `/dev/nvme1 is open by pid 812 (nvme)` |
//! | the function's VFIO node (`/dev/vfio/devices/vfioN`, `/dev/vfio/<group>`) open in a QEMU (comm `qemu-system-*`, `qemu-kvm`) | VM (its `-name`) | `/dev/vfio/devices/vfio0 is open by pid 900 (qemu-system-x86)`, `IOMMU group 40 is open by pid 900 (qemu-system-x86)` |
//! | the function's VFIO node open in any other process (DPDK, SPDK) | the host | `IOMMU group 40 is open by pid 77 (dpdk-testpmd)` |
//!
//! An IOMMU group moves as a whole: the callers (the inventory's scan, [`crate::hook::host_uses`])
//! extend a use to the function's group-mates.
//!
//! Who holds a node is the costly fact (every process's descriptors): the edge keeps it in a
//! [`HolderIndex`], rebuilt in the background, and a caller that waits (the qemu hook's guard)
//! reads again only the processes [`pids_to_check`] names. The inventory counts a VM's use
//! only where no claim of vfiod's explains it ([`outside_vfiod`]): a QEMU started by hand.

use crate::model::pci::PciAddress;
use std::collections::{BTreeMap, BTreeSet};

/// A block device below one or more functions (a namespace, a partition; a multipath head is
/// below every controller of its subsystem), as the edge found it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockDevice {
    /// Its kernel name, `nvme0n1p2`.
    pub name: String,
    /// The whole disk of a partition.
    pub disk: Option<String>,
    pub functions: Vec<PciAddress>,
    /// Its `holders/` entries.
    pub holders: Vec<BlockHolder>,
    /// Whether an exclusive open of its node failed with EBUSY.
    pub busy: bool,
}

/// One entry of a block device's `holders/`: `dm-0`, with its device-mapper name when it has
/// one (`vg0-root`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockHolder {
    pub name: String,
    pub dm_name: Option<String>,
}

/// A process, as `/proc/PID` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    /// `comm` (at most 15 characters).
    pub comm: String,
    /// The guest name of a QEMU's command line (`-name guest=vm1,...` or `-name vm1`).
    pub guest: Option<String>,
}

impl Process {
    /// Whether it is a VM: QEMU, by the name it runs under.
    pub fn is_vm(&self) -> bool {
        self.comm.starts_with("qemu-system-") || self.comm == "qemu-kvm"
    }

    /// `pid 812 (fio)`.
    pub fn who(&self) -> String {
        format!("pid {} ({})", self.pid, self.comm)
    }
}

/// A device node the edge found open in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// A block device, by kernel name.
    Block(String),
    /// A host driver's character node, by its `/dev` path (`/dev/nvme0`, `/dev/dri/card1`).
    Char(String),
    /// A VFIO device node (`/dev/vfio/devices/vfio0`), by path.
    Vfio(String),
    /// A VFIO group (`/dev/vfio/40`).
    VfioGroup(u32),
}

impl Node {
    fn what(&self) -> String {
        match self {
            Node::Block(name) => format!("block device {name}"),
            Node::Char(path) | Node::Vfio(path) => path.clone(),
            Node::VfioGroup(g) => format!("IOMMU group {g}"),
        }
    }

    fn is_vfio(&self) -> bool {
        matches!(self, Node::Vfio(_) | Node::VfioGroup(_))
    }
}

/// A node of `functions` open in `process`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenNode {
    pub node: Node,
    pub functions: Vec<PciAddress>,
    pub process: Process,
}

/// A use the edge named itself: a mount, swap, an interface that is up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named {
    pub function: PciAddress,
    /// The block device it names (mounted, swap), by kernel name.
    pub block: Option<String>,
    pub why: String,
}

/// Everything the edge read about who uses which function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    pub named: Vec<Named>,
    pub blocks: Vec<BlockDevice>,
    pub open: Vec<OpenNode>,
}

/// Who uses a function.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Use {
    /// The host: never to be taken from it. The reason, `block device nvme1n1 is held by dm-0
    /// (vg0-data)`.
    Host(String),
    /// A VM holds it through VFIO: `vm` is its name (from its command line, when it names
    /// one), `why` what it holds open.
    Vm {
        vm: Option<String>,
        pid: u32,
        why: String,
    },
}

impl Use {
    /// What a refusal says of function `f`: `0000:d8:00.0 is used by the host: block device
    /// nvme1n1 is held by dm-0 (vg0-data)`, `0000:3b:02.0 is used by VM vm1: IOMMU group 40 is
    /// open by pid 900 (qemu-system-x86)`.
    pub fn line(&self, f: PciAddress) -> String {
        match self {
            Use::Host(why) => format!("{f} is used by the host: {why}"),
            Use::Vm {
                vm: Some(vm), why, ..
            } => format!("{f} is used by VM {vm}: {why}"),
            Use::Vm { vm: None, why, .. } => format!("{f} is used by a VM: {why}"),
        }
    }
}

/// Every use of every function the facts name, in the table's order, each reason once.
pub fn uses(facts: &Facts) -> BTreeMap<PciAddress, Vec<Use>> {
    let mut out: BTreeMap<PciAddress, Vec<Use>> = BTreeMap::new();
    let mut add = |f: PciAddress, u: Use| {
        let list = out.entry(f).or_default();
        if !list.contains(&u) {
            list.push(u);
        }
    };
    for n in &facts.named {
        add(n.function, Use::Host(n.why.clone()));
    }
    for b in &facts.blocks {
        for h in &b.holders {
            let holder = match &h.dm_name {
                Some(dm) => format!("{} ({dm})", h.name),
                None => h.name.clone(),
            };
            for f in &b.functions {
                add(
                    *f,
                    Use::Host(format!("block device {} is held by {holder}", b.name)),
                );
            }
        }
    }
    for o in &facts.open {
        let why = format!("{} is open by {}", o.node.what(), o.process.who());
        for f in &o.functions {
            let u = if o.node.is_vfio() && o.process.is_vm() {
                Use::Vm {
                    vm: o.process.guest.clone(),
                    pid: o.process.pid,
                    why: why.clone(),
                }
            } else {
                Use::Host(why.clone())
            };
            add(*f, u);
        }
    }
    // EBUSY says "someone holds it exclusively" without saying who: a reason only where no
    // other fact about that device (or its partition) says why (a mount, swap, a holder; a
    // process that has it open may or may not be the one holding it exclusively), and for the
    // most precise device (a partition, not its disk).
    let said = |name: &str| {
        facts.named.iter().any(|n| n.block.as_deref() == Some(name))
            || facts
                .blocks
                .iter()
                .any(|b| b.name == name && !b.holders.is_empty())
    };
    for b in facts.blocks.iter().filter(|b| b.busy) {
        let parts: Vec<&BlockDevice> = facts
            .blocks
            .iter()
            .filter(|p| p.disk.as_deref() == Some(b.name.as_str()))
            .collect();
        let explained = said(&b.name)
            || parts.iter().any(|p| p.busy || said(&p.name))
            || b.disk.as_deref().is_some_and(said);
        if explained {
            continue;
        }
        for f in &b.functions {
            add(
                *f,
                Use::Host(format!("block device {} is held exclusively", b.name)),
            );
        }
    }
    out
}

/// The host's uses only, by function: what protects a function (the inventory) and refuses a
/// domain (the hook's guard).
pub fn host_uses(facts: &Facts) -> BTreeMap<PciAddress, Vec<String>> {
    let mut out: BTreeMap<PciAddress, Vec<String>> = BTreeMap::new();
    for (f, us) in uses(facts) {
        let whys: Vec<String> = us
            .into_iter()
            .filter_map(|u| match u {
                Use::Host(why) => Some(why),
                Use::Vm { .. } => None,
            })
            .collect();
        if !whys.is_empty() {
            out.insert(f, whys);
        }
    }
    out
}

/// What the last scan of every process's descriptors found (`host::sysfs::hostuse::index`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HolderIndex {
    /// Every node of a PCI function a process held.
    pub open: Vec<OpenNode>,
    /// The pids `/proc` listed, ascending: a pid not among them started since.
    pub seen: Vec<u32>,
    /// Counts the scans since vfiod started (0: none yet, every process is new).
    pub generation: u64,
}

/// The most processes started since the last index that a guard reads at once (the newest
/// pids): each costs its descriptors' reads, and a host that forks hard (a build) would
/// otherwise make the guard as slow as a whole scan. The rest wait for the next refresh.
pub const NEW_PIDS_MAX: usize = 64;

/// The processes a bounded read reads again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recheck {
    /// Ascending.
    pub pids: Vec<u32>,
    /// New processes beyond [`NEW_PIDS_MAX`], left to the next refresh.
    pub left_to_refresh: usize,
}

/// Which processes to read again, of those `/proc` lists now (`listed`, ascending): every one
/// the index found holding a node of a function in `scope` (`None`: any function; it may have
/// closed it or exited since), and those the index has not seen (started since it was built),
/// the newest [`NEW_PIDS_MAX`] of them. Pure.
pub fn pids_to_check(index: &HolderIndex, listed: &[u32], scope: Option<&[PciAddress]>) -> Recheck {
    let holders: BTreeSet<u32> = index
        .open
        .iter()
        .filter(|o| scope.is_none_or(|s| o.functions.iter().any(|f| s.contains(f))))
        .map(|o| o.process.pid)
        .collect();
    let new: Vec<u32> = listed
        .iter()
        .copied()
        .filter(|p| index.seen.binary_search(p).is_err())
        .collect();
    let left_to_refresh = new.len().saturating_sub(NEW_PIDS_MAX);
    let mut pids: Vec<u32> = listed
        .iter()
        .copied()
        .filter(|p| holders.contains(p))
        .chain(new.into_iter().skip(left_to_refresh))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    Recheck {
        pids,
        left_to_refresh,
    }
}

/// The uses that keep a function from vfiod's claims (the inventory's protection): every host
/// use, and a VM's use of a function no claim of vfiod's holds (`claimed`): a QEMU started by
/// hand, a libvirt domain given it without vfiod. A VM holding a function vfiod claimed for it
/// is that claim at work. Pure.
pub fn outside_vfiod(
    uses: BTreeMap<PciAddress, Vec<Use>>,
    claimed: &BTreeSet<PciAddress>,
) -> BTreeMap<PciAddress, Vec<Use>> {
    uses.into_iter()
        .filter_map(|(f, us)| {
            let kept: Vec<Use> = us
                .into_iter()
                .filter(|u| matches!(u, Use::Host(_)) || !claimed.contains(&f))
                .collect();
            (!kept.is_empty()).then_some((f, kept))
        })
        .collect()
}

/// The reason a function the inventory protects for its uses records: `used by the host:
/// WHY; WHY` when the host uses it, else `used by VM vm1: WHY` (`used by a VM: ...` when its
/// command line names none). Pure.
pub fn protection_reason(uses: &[Use]) -> Option<String> {
    let host: Vec<&str> = uses
        .iter()
        .filter_map(|u| match u {
            Use::Host(why) => Some(why.as_str()),
            Use::Vm { .. } => None,
        })
        .collect();
    if !host.is_empty() {
        return Some(format!("{HOST_USE_PREFIX}{}", host.join("; ")));
    }
    let vms: Vec<String> = uses
        .iter()
        .filter_map(|u| match u {
            Use::Vm {
                vm: Some(vm), why, ..
            } => Some(format!("used by VM {vm}: {why}")),
            Use::Vm { vm: None, why, .. } => Some(format!("used by a VM: {why}")),
            Use::Host(_) => None,
        })
        .collect();
    (!vms.is_empty()).then(|| vms.join("; "))
}

/// How the reason of a function the host uses starts.
pub const HOST_USE_PREFIX: &str = "used by the host: ";

/// Whether a recorded reason is one [`protection_reason`] wrote (not `[[protect]]`'s, not a
/// group-mate's).
pub fn is_use_reason(reason: &str) -> bool {
    reason.starts_with(HOST_USE_PREFIX)
        || reason.starts_with("used by VM ")
        || reason.starts_with("used by a VM: ")
}

/// The guest name in a QEMU command line (its arguments, in order): `-name guest=vm1,...`
/// (libvirt's form) or `-name vm1`.
pub fn guest_name(args: &[&str]) -> Option<String> {
    let i = args.iter().position(|a| *a == "-name")?;
    let value = args.get(i + 1)?;
    let name = value
        .split(',')
        .find_map(|p| p.strip_prefix("guest="))
        .or_else(|| value.split(',').next().filter(|p| !p.contains('=')))?;
    (!name.is_empty()).then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    const F: &str = "0000:d8:00.0";

    fn disk(name: &str) -> BlockDevice {
        BlockDevice {
            name: name.into(),
            functions: vec![a(F)],
            ..BlockDevice::default()
        }
    }

    fn named(block: &str, why: &str) -> Named {
        Named {
            function: a(F),
            block: Some(block.into()),
            why: why.into(),
        }
    }

    fn process(pid: u32, comm: &str, guest: Option<&str>) -> Process {
        Process {
            pid,
            comm: comm.into(),
            guest: guest.map(str::to_string),
        }
    }

    fn open(node: Node, p: Process) -> OpenNode {
        OpenNode {
            node,
            functions: vec![a(F)],
            process: p,
        }
    }

    fn host(s: &str) -> Use {
        Use::Host(s.into())
    }

    #[test]
    fn each_kind_of_holder_is_a_use_with_its_reason() {
        let lvm = BlockDevice {
            holders: vec![BlockHolder {
                name: "dm-0".into(),
                dm_name: Some("vg0-data".into()),
            }],
            ..disk("nvme1n1")
        };
        let md = BlockDevice {
            holders: vec![BlockHolder {
                name: "md127".into(),
                dm_name: None,
            }],
            ..disk("nvme1n1")
        };
        let busy = BlockDevice {
            busy: true,
            ..disk("nvme1n1")
        };
        let part = BlockDevice {
            busy: true,
            disk: Some("nvme1n1".into()),
            ..disk("nvme1n1p1")
        };
        let qemu = process(900, "qemu-system-x86", Some("vm1"));
        let fio = process(812, "fio", None);
        let cases: Vec<(&str, Facts, Vec<Use>)> = vec![
            ("nothing", Facts::default(), vec![]),
            (
                "a mount named by the edge",
                Facts {
                    named: vec![named("nvme1n1p2", "block device nvme1n1p2 is mounted at /")],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1p2 is mounted at /")],
            ),
            (
                "a device-mapper holder (LVM) with its name",
                Facts {
                    blocks: vec![lvm.clone()],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1 is held by dm-0 (vg0-data)")],
            ),
            (
                "an md holder, which has no dm name",
                Facts {
                    blocks: vec![md],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1 is held by md127")],
            ),
            (
                "EBUSY and nothing else",
                Facts {
                    blocks: vec![busy.clone()],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1 is held exclusively")],
            ),
            (
                "EBUSY on a partition and its disk: the partition is named",
                Facts {
                    blocks: vec![busy.clone(), part],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1p1 is held exclusively")],
            ),
            (
                "EBUSY explained by the holder",
                Facts {
                    blocks: vec![BlockDevice {
                        busy: true,
                        ..lvm.clone()
                    }],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1 is held by dm-0 (vg0-data)")],
            ),
            (
                "EBUSY explained by a mount",
                Facts {
                    named: vec![named("nvme1n1", "block device nvme1n1 is mounted at /")],
                    blocks: vec![busy.clone()],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1 is mounted at /")],
            ),
            (
                "EBUSY of another device than the mounted one: both",
                Facts {
                    named: vec![named("nvme1n1p2", "block device nvme1n1p2 is mounted at /")],
                    blocks: vec![BlockDevice {
                        busy: true,
                        ..disk("nvme2n1")
                    }],
                    ..Facts::default()
                },
                vec![
                    host("block device nvme1n1p2 is mounted at /"),
                    host("block device nvme2n1 is held exclusively"),
                ],
            ),
            (
                "EBUSY of a disk whose partition is mounted: the mount says it",
                Facts {
                    named: vec![named("nvme1n1p2", "block device nvme1n1p2 is mounted at /")],
                    blocks: vec![
                        busy.clone(),
                        BlockDevice {
                            disk: Some("nvme1n1".into()),
                            ..disk("nvme1n1p2")
                        },
                    ],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1p2 is mounted at /")],
            ),
            (
                "EBUSY and an open in a process (its O_EXCL, or another holder's): both",
                Facts {
                    blocks: vec![busy],
                    open: vec![open(Node::Block("nvme1n1".into()), fio.clone())],
                    ..Facts::default()
                },
                vec![
                    host("block device nvme1n1 is open by pid 812 (fio)"),
                    host("block device nvme1n1 is held exclusively"),
                ],
            ),
            (
                "a block device open in a process",
                Facts {
                    open: vec![open(Node::Block("nvme1n1".into()), fio.clone())],
                    ..Facts::default()
                },
                vec![host("block device nvme1n1 is open by pid 812 (fio)")],
            ),
            (
                "a raw disk of a VM: the host's driver serves it",
                Facts {
                    open: vec![open(Node::Block("nvme1n1".into()), qemu.clone())],
                    ..Facts::default()
                },
                vec![host(
                    "block device nvme1n1 is open by pid 900 (qemu-system-x86)",
                )],
            ),
            (
                "a host driver's character node",
                Facts {
                    open: vec![open(Node::Char("/dev/nvme1".into()), fio.clone())],
                    ..Facts::default()
                },
                vec![host("/dev/nvme1 is open by pid 812 (fio)")],
            ),
            (
                "the VFIO device node in a QEMU: that VM",
                Facts {
                    open: vec![open(Node::Vfio("/dev/vfio/devices/vfio0".into()), qemu)],
                    ..Facts::default()
                },
                vec![Use::Vm {
                    vm: Some("vm1".into()),
                    pid: 900,
                    why: "/dev/vfio/devices/vfio0 is open by pid 900 (qemu-system-x86)".into(),
                }],
            ),
            (
                "a VFIO group in a QEMU without a name",
                Facts {
                    open: vec![open(
                        Node::VfioGroup(40),
                        process(901, "qemu-system-x86", None),
                    )],
                    ..Facts::default()
                },
                vec![Use::Vm {
                    vm: None,
                    pid: 901,
                    why: "IOMMU group 40 is open by pid 901 (qemu-system-x86)".into(),
                }],
            ),
            (
                "a VFIO group in another process: the host",
                Facts {
                    open: vec![open(Node::VfioGroup(40), process(77, "dpdk-testpmd", None))],
                    ..Facts::default()
                },
                vec![host("IOMMU group 40 is open by pid 77 (dpdk-testpmd)")],
            ),
            (
                "one reason once, two holders each",
                Facts {
                    blocks: vec![lvm.clone(), lvm],
                    open: vec![
                        open(Node::Block("nvme1n1".into()), fio.clone()),
                        open(Node::Block("nvme1n1".into()), fio),
                    ],
                    ..Facts::default()
                },
                vec![
                    host("block device nvme1n1 is held by dm-0 (vg0-data)"),
                    host("block device nvme1n1 is open by pid 812 (fio)"),
                ],
            ),
        ];
        for (what, facts, want) in cases {
            let got = uses(&facts).remove(&a(F)).unwrap_or_default();
            assert_eq!(got, want, "{what}");
            let hosts: Vec<String> = want
                .iter()
                .filter_map(|u| match u {
                    Use::Host(w) => Some(w.clone()),
                    Use::Vm { .. } => None,
                })
                .collect();
            assert_eq!(
                host_uses(&facts).remove(&a(F)).unwrap_or_default(),
                hosts,
                "{what}"
            );
        }
    }

    #[test]
    fn refusal_lines() {
        let f = a(F);
        for (u, want) in [
            (
                host("block device nvme1n1 is held exclusively"),
                "0000:d8:00.0 is used by the host: block device nvme1n1 is held exclusively",
            ),
            (
                Use::Vm {
                    vm: Some("vm1".into()),
                    pid: 9,
                    why: "IOMMU group 4 is open by pid 9 (qemu-system-x86)".into(),
                },
                "0000:d8:00.0 is used by VM vm1: IOMMU group 4 is open by pid 9 (qemu-system-x86)",
            ),
            (
                Use::Vm {
                    vm: None,
                    pid: 9,
                    why: "IOMMU group 4 is open by pid 9 (qemu-system-x86)".into(),
                },
                "0000:d8:00.0 is used by a VM: IOMMU group 4 is open by pid 9 (qemu-system-x86)",
            ),
        ] {
            assert_eq!(u.line(f), want);
        }
    }

    #[test]
    fn a_multipath_head_is_every_controllers_use() {
        let head = BlockDevice {
            functions: vec![a("0000:01:00.0"), a("0000:02:00.0")],
            busy: true,
            ..disk("nvme0n1")
        };
        let got = host_uses(&Facts {
            blocks: vec![head],
            ..Facts::default()
        });
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[&a("0000:02:00.0")],
            vec!["block device nvme0n1 is held exclusively".to_string()]
        );
    }

    /// Which processes a bounded read reads again: the index's holders of the functions asked
    /// about that `/proc` still lists, and the processes the index has not seen, the newest
    /// [`NEW_PIDS_MAX`] of them.
    #[test]
    fn pids_to_check_table() {
        let g = a("0000:3b:02.0");
        let held = |pid: u32, f: PciAddress| OpenNode {
            node: Node::VfioGroup(40),
            functions: vec![f],
            process: process(pid, "qemu-system-x86", None),
        };
        let index = HolderIndex {
            open: vec![held(10, a(F)), held(20, g), held(30, a(F))],
            seen: vec![1, 10, 20, 30, 40],
            generation: 3,
        };
        let many: Vec<u32> = [1, 10, 20, 30, 40]
            .into_iter()
            .chain(100..100 + NEW_PIDS_MAX as u32 + 5)
            .collect();
        let newest: Vec<u32> = (105..100 + NEW_PIDS_MAX as u32 + 5).collect();
        let only_f = [a(F)];
        let other = [a("0000:af:00.0")];
        type Row<'a> = (
            &'a str,
            &'a [u32],
            Option<&'a [PciAddress]>,
            Vec<u32>,
            usize,
        );
        let rows: Vec<Row> = vec![
            (
                "nothing new, scope F",
                &[1, 10, 20, 30, 40],
                Some(&only_f),
                vec![10, 30],
                0,
            ),
            (
                "every function",
                &[1, 10, 20, 30, 40],
                None,
                vec![10, 20, 30],
                0,
            ),
            (
                "a holder gone from /proc",
                &[1, 20, 30, 40],
                Some(&only_f),
                vec![30],
                0,
            ),
            (
                "a process started since",
                &[1, 10, 20, 30, 40, 41],
                Some(&only_f),
                vec![10, 30, 41],
                0,
            ),
            (
                "a function no one held",
                &[1, 10, 20, 30, 40, 41],
                Some(&other),
                vec![41],
                0,
            ),
            (
                "more new processes than the cap: the newest",
                &many,
                Some(&other),
                newest,
                5,
            ),
        ];
        for (what, listed, scope, pids, left) in rows {
            let got = pids_to_check(&index, listed, scope);
            assert_eq!(got.pids, pids, "{what}");
            assert_eq!(got.left_to_refresh, left, "{what}");
        }
        // Before the first scan every process is new.
        let got = pids_to_check(&HolderIndex::default(), &[5, 6], None);
        assert_eq!((got.pids, got.left_to_refresh), (vec![5, 6], 0));
    }

    /// What protects a function in the inventory, and the reason it records: the host's uses
    /// always; a VM's only outside vfiod's claims (a QEMU started by hand).
    #[test]
    fn uses_outside_vfiod_and_their_reasons() {
        let vm = |name: Option<&str>| Use::Vm {
            vm: name.map(str::to_string),
            pid: 900,
            why: "/dev/vfio/devices/vfio0 is open by pid 900 (qemu-system-x86)".into(),
        };
        let f = a(F);
        let claimed = BTreeSet::from([f]);
        type Row = (&'static str, Vec<Use>, bool, Option<&'static str>);
        let rows: Vec<Row> = vec![
            ("nothing", vec![], false, None),
            (
                "the host",
                vec![host("network interface enp2s0 is up")],
                true,
                Some("used by the host: network interface enp2s0 is up"),
            ),
            (
                "a QEMU by hand",
                vec![vm(Some("scratch"))],
                false,
                Some("used by VM scratch: /dev/vfio/devices/vfio0 is open by pid 900 (qemu-system-x86)"),
            ),
            (
                "a QEMU without a name",
                vec![vm(None)],
                false,
                Some("used by a VM: /dev/vfio/devices/vfio0 is open by pid 900 (qemu-system-x86)"),
            ),
            ("the VM of vfiod's claim", vec![vm(Some("vm1"))], true, None),
            (
                "the host and a VM: the host says it",
                vec![vm(Some("scratch")), host("block device nvme1n1 is held exclusively")],
                false,
                Some("used by the host: block device nvme1n1 is held exclusively"),
            ),
            (
                "the host beside vfiod's claim",
                vec![vm(Some("vm1")), host("/dev/nvme1 is open by pid 8 (nvme)")],
                true,
                Some("used by the host: /dev/nvme1 is open by pid 8 (nvme)"),
            ),
        ];
        for (what, uses, is_claimed, want) in rows {
            let claimed = if is_claimed {
                claimed.clone()
            } else {
                BTreeSet::new()
            };
            let kept = outside_vfiod(BTreeMap::from([(f, uses)]), &claimed);
            let got = kept.get(&f).and_then(|us| protection_reason(us));
            assert_eq!(got.as_deref(), want, "{what}");
            assert_eq!(kept.contains_key(&f), want.is_some(), "{what}");
            if let Some(w) = want {
                assert!(is_use_reason(w), "{what}");
            }
        }
        assert!(!is_use_reason("protected by config (address=0000:17:00.0)"));
        assert!(!is_use_reason(
            "shares its IOMMU group with protected device 0000:17:00.0"
        ));
    }

    #[test]
    fn guest_names_from_qemu_command_lines() {
        for (args, want) in [
            (
                &["qemu-system-x86_64", "-name", "guest=vm1,debug-threads=on"][..],
                Some("vm1"),
            ),
            (&["qemu-system-x86_64", "-name", "vm2"][..], Some("vm2")),
            (
                &["qemu-system-x86_64", "-name", "vm3,process=x"][..],
                Some("vm3"),
            ),
            (&["qemu-system-x86_64", "-m", "1024"][..], None),
            (&["qemu-system-x86_64", "-name"][..], None),
            (&["qemu-system-x86_64", "-name", "guest="][..], None),
        ] {
            assert_eq!(guest_name(args).as_deref(), want, "{args:?}");
        }
    }
}
