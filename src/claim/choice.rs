//! What is claimable, and which candidate a claim gets.
//!
//! A function is claimable when it is usable (not broken, not protected), selected by the
//! configuration (`managed`), held by no claim, not a PF whose VFs are claimed nor a VF whose PF
//! is, not a PF that is split into VFs or that the configuration splits (taking it whole would
//! remove every VF: that is a mode change, not a claim), and under no task (its own, its IOMMU
//! group's or its PF's). A claim takes the function's whole IOMMU group (libvirt refuses to give
//! a VM part of a group: a GPU goes with its audio function), so every group-mate must be
//! claimable too.
//!
//! Among the claimable candidates the winner is, in this order:
//! 1. on the NUMA node with the fewest claimed functions (claims spread over the nodes; a request
//!    that needs one node says `numa_node`),
//! 2. a VF of the PF with the fewest claimed VFs (a PF's failure or reset then hits fewer VMs),
//! 3. the lowest address (the same request on the same state gets the same device).

use super::requirements::Requirements;
use crate::model::clean::{CleanHold, HoldState};
use crate::model::device::{Device, Kind, Mode, Role, State};
use crate::model::pci::PciAddress;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

/// What the store holds when a claim is decided, read inside the claim's transaction.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Every function present.
    pub devices: Vec<Device>,
    /// Every function an active claim holds.
    pub held: Vec<Held>,
    /// Every function an active task holds (its device and its scope), with the task's id.
    pub busy: Vec<(PciAddress, i64)>,
    /// Every function held out of the pool for a clean (from its claim's end until the clean
    /// succeeds) or quarantined by one.
    pub cleaning: Vec<CleanHold>,
    /// The PFs the configuration's policy splits into VFs, whatever their mode now (a split not
    /// done yet, or one that failed): the engine fills it from the settings, the store has no
    /// configuration. A PF whose record shows VFs is split whether or not it is listed.
    pub splits: Vec<PciAddress>,
}

/// Which PFs the configuration splits into VFs: the mode policy's answer for one device
/// (`mode::policy::split_policy` makes it). The claim rules only read it, as plain addresses in
/// [`Snapshot::splits`]; the engine hands it to the store at start and at each reload, as it
/// does the clean policy, so that every claim (D-Bus, hooks) follows the configuration in force.
#[derive(Clone, Default)]
pub struct SplitPolicy(Option<Arc<SplitsFn>>);

/// Whether the configuration splits a PF.
type SplitsFn = dyn Fn(&Device) -> bool + Send + Sync;

impl SplitPolicy {
    /// Nothing is split by policy (a store opened without a daemon): only a PF whose record
    /// shows VFs counts as split.
    pub fn none() -> SplitPolicy {
        SplitPolicy(None)
    }

    /// `splits(d)`: whether the configuration splits PF `d`.
    pub fn new(splits: impl Fn(&Device) -> bool + Send + Sync + 'static) -> SplitPolicy {
        SplitPolicy(Some(Arc::new(splits)))
    }

    /// The PFs of `devices` the policy splits.
    pub fn splits(&self, devices: &[Device]) -> Vec<PciAddress> {
        match &self.0 {
            None => Vec::new(),
            Some(f) => devices
                .iter()
                .filter(|d| d.role == Role::Pf && f(d))
                .map(|d| d.address)
                .collect(),
        }
    }
}

impl fmt::Debug for SplitPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "SplitPolicy(configured)"
        } else {
            "SplitPolicy(none)"
        })
    }
}

/// One function of an active claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub address: PciAddress,
    pub claim_id: i64,
}

/// One function a new claim takes, with what the database needs to keep a PF and its VFs apart:
/// its SR-IOV family (the PF's address, for the PF and each of its VFs) and whether it is the PF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimFunction {
    pub address: PciAddress,
    pub family: Option<PciAddress>,
    pub is_pf: bool,
}

impl ClaimFunction {
    pub fn of(d: &Device) -> ClaimFunction {
        let family = match d.role {
            Role::Pf => Some(d.address),
            Role::Vf => d.parent_pf,
            Role::Function => None,
        };
        ClaimFunction {
            address: d.address,
            family,
            is_pf: d.role == Role::Pf,
        }
    }
}

/// The device a claim gets and every function it takes (the device first, then its IOMMU
/// group-mates).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub device: PciAddress,
    /// The device's kind, kept with the claim (its polkit checks name it even once the device
    /// is gone).
    pub kind: Kind,
    pub functions: Vec<ClaimFunction>,
}

/// Why a matching function is not claimable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    Broken(String),
    Protected(String),
    NotManaged,
    Claimed {
        claim_id: i64,
    },
    /// Its PF is claimed whole.
    PfClaimed {
        pf: PciAddress,
        claim_id: i64,
    },
    /// It is a PF and one of its VFs is claimed.
    VfClaimed {
        vf: PciAddress,
        claim_id: i64,
    },
    /// It is a PF that is split into VFs (`vfs` of them now), or that the configuration splits
    /// (`by_policy`): a claim would take it whole and the kernel would drop every VF.
    Split {
        vfs: u32,
        by_policy: bool,
    },
    /// A task holds it.
    Busy {
        task_id: i64,
    },
    /// Its claim ended and it is being cleaned before it returns to the pool.
    Cleaning(String),
    /// A clean found it unhealthy: out of the pool until an operator clears it.
    Quarantined(String),
    /// A function of its IOMMU group is not claimable.
    GroupMate {
        mate: PciAddress,
        reason: Box<Reason>,
    },
    /// Its IOMMU group holds a device of another kind than the one asked for.
    OtherKind {
        mate: PciAddress,
        kind: Kind,
    },
}

impl Reason {
    /// The word a summary counts it under.
    fn category(&self) -> &'static str {
        match self {
            Reason::Broken(_) => "broken",
            Reason::Protected(why)
                if why.starts_with("used by VM ") || why.starts_with("used by a VM") =>
            {
                "used by a VM"
            }
            Reason::Protected(_) => "used by the host",
            Reason::NotManaged => "not selected by the configuration",
            Reason::Claimed { .. } | Reason::PfClaimed { .. } | Reason::VfClaimed { .. } => {
                "claimed"
            }
            Reason::Split { .. } => "split into VFs",
            Reason::Busy { .. } => "busy with a task",
            Reason::Cleaning(_) => "being cleaned",
            Reason::Quarantined(_) => "quarantined",
            Reason::GroupMate { reason, .. } => reason.category(),
            Reason::OtherKind { .. } => "grouped with a device of another kind",
        }
    }

    /// The task that holds the function, directly or through a group-mate.
    pub fn task(&self) -> Option<i64> {
        match self {
            Reason::Busy { task_id } => Some(*task_id),
            Reason::GroupMate { reason, .. } => reason.task(),
            _ => None,
        }
    }
}

/// The predicate of a sentence whose subject is the function: "0000:3b:02.1 {reason}" reads
/// whole for every reason, and one nested in a group-mate's ("..., which {reason}") too.
impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Broken(why) => write!(f, "is broken ({why})"),
            // The inventory's own reasons say who uses it ("used by the host: boot disk",
            // "used by VM vm1: ..."): said once, not "used by the host (used by VM vm1: ...)".
            Reason::Protected(why) if crate::hostuse::is_use_reason(why) => write!(f, "is {why}"),
            Reason::Protected(why) => write!(f, "is used by the host ({why})"),
            Reason::NotManaged => f.write_str(
                "is not selected by the configuration (add a [[select]] rule for it to claim it)",
            ),
            Reason::Claimed { claim_id } => write!(f, "is held by claim {claim_id}"),
            Reason::PfClaimed { pf, claim_id } => {
                write!(f, "has its PF {pf} held whole by claim {claim_id}")
            }
            Reason::VfClaimed { vf, claim_id } => {
                write!(f, "has its VF {vf} held by claim {claim_id}")
            }
            Reason::Split { vfs, by_policy } => {
                let split = match (vfs, by_policy) {
                    (0, true) => "is to be split into VFs by the configuration".to_string(),
                    (0, false) => "is split into VFs".to_string(),
                    (n, true) => format!("is split into {n} VFs by the configuration"),
                    (n, false) => format!("is split into {n} VFs"),
                };
                write!(
                    f,
                    "{split}: taking it whole would remove every VF, which is a mode change, not \
                     a claim (claim one of its VFs, `vfioctl claim --parent` with its address; \
                     or have it kept whole first: mode = \"pf\" in its [[select]] entry, then \
                     `vfioctl reload`)"
                )
            }
            Reason::Busy { task_id } => write!(f, "is busy: task {task_id} is working on it"),
            Reason::Cleaning(why) => {
                write!(f, "is being cleaned before it returns to the pool ({why})")
            }
            Reason::Quarantined(why) => write!(
                f,
                "is quarantined ({why}); an operator clears it with `vfioctl task reset`"
            ),
            Reason::GroupMate { mate, reason } => {
                write!(f, "shares its IOMMU group with {mate}, which {reason}")
            }
            Reason::OtherKind { mate, kind } => write!(
                f,
                "shares its IOMMU group with {mate}, a {kind}, which its claim would take too \
                 (ask for kind {kind})"
            ),
        }
    }
}

/// Why a claim got nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// No function matches at all.
    NoMatch { requirements: String },
    /// Functions match, none is claimable: each with its reason.
    NoneClaimable {
        requirements: String,
        reasons: Vec<(PciAddress, Reason)>,
    },
}

/// A policy that refuses the one function a claim could have had: the caller named a device
/// that the host uses or that the configuration does not select, and the error says so by name
/// (`Protected`, `NotManaged`: exit 7 of vfioctl) rather than as "nothing available".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Protected,
    NotManaged,
    /// A PF that is split (or that the configuration splits): claiming it whole is a mode
    /// change the caller must ask for as one.
    Split,
}

impl Reason {
    /// The policy behind the reason, through group-mates too (a claim takes its whole group).
    fn policy(&self) -> Option<Policy> {
        match self {
            Reason::Protected(_) => Some(Policy::Protected),
            Reason::NotManaged => Some(Policy::NotManaged),
            Reason::Split { .. } => Some(Policy::Split),
            Reason::GroupMate { reason, .. } => reason.policy(),
            _ => None,
        }
    }
}

impl Unavailable {
    /// The policy that refuses the one matching function, when policy is the only obstacle.
    pub fn policy(&self) -> Option<Policy> {
        match self {
            Unavailable::NoneClaimable { reasons, .. } if reasons.len() == 1 => {
                reasons[0].1.policy()
            }
            _ => None,
        }
    }

    /// Whether a matching function is being cleaned after its last claim (directly or through a
    /// group-mate): it will be claimable once its clean succeeds, so a claim may wait for it.
    pub fn cleaning_soon(&self) -> bool {
        fn cleaning(r: &Reason) -> bool {
            match r {
                Reason::Cleaning(_) => true,
                Reason::GroupMate { reason, .. } => cleaning(reason),
                _ => false,
            }
        }
        match self {
            Unavailable::NoneClaimable { reasons, .. } => reasons.iter().any(|(_, r)| cleaning(r)),
            Unavailable::NoMatch { .. } => false,
        }
    }

    /// The tasks that hold matching functions (directly or through a group-mate): a claim may
    /// wait for those that are cleans.
    pub fn tasks(&self) -> Vec<i64> {
        match self {
            Unavailable::NoneClaimable { reasons, .. } => {
                reasons.iter().filter_map(|(_, r)| r.task()).collect()
            }
            Unavailable::NoMatch { .. } => Vec::new(),
        }
    }

    /// The task that holds the one matching function, when a task is the only obstacle: the
    /// caller named a device, and `Busy` naming the task says when to come back.
    pub fn busy_task(&self) -> Option<(PciAddress, i64)> {
        match self {
            Unavailable::NoneClaimable { reasons, .. } if reasons.len() == 1 => {
                let (a, r) = &reasons[0];
                r.task().map(|t| (*a, t))
            }
            _ => None,
        }
    }
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::NoMatch { requirements } => {
                write!(f, "no PCI function on this host matches {requirements}")
            }
            Unavailable::NoneClaimable {
                requirements,
                reasons,
            } => {
                if let [(a, r)] = reasons.as_slice() {
                    return write!(f, "{a} matches {requirements} but {r}");
                }
                let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
                for (_, r) in reasons {
                    *counts.entry(r.category()).or_default() += 1;
                }
                let summary: Vec<String> = counts.iter().map(|(c, n)| format!("{n} {c}")).collect();
                write!(
                    f,
                    "none of the {} functions matching {requirements} can be claimed: {}",
                    reasons.len(),
                    summary.join(", ")
                )
            }
        }
    }
}

/// The snapshot, indexed for the checks.
struct Index<'a> {
    by_address: HashMap<PciAddress, &'a Device>,
    held: HashMap<PciAddress, i64>,
    /// PF address -> the claimed VFs of that PF (address, claim).
    held_vfs: HashMap<PciAddress, Vec<(PciAddress, i64)>>,
    busy: HashMap<PciAddress, i64>,
    cleaning: HashMap<PciAddress, &'a CleanHold>,
    groups: HashMap<u32, Vec<&'a Device>>,
    splits: &'a [PciAddress],
}

impl<'a> Index<'a> {
    fn new(s: &'a Snapshot) -> Index<'a> {
        let by_address: HashMap<_, _> = s.devices.iter().map(|d| (d.address, d)).collect();
        let held: HashMap<_, _> = s.held.iter().map(|h| (h.address, h.claim_id)).collect();
        let mut held_vfs: HashMap<PciAddress, Vec<(PciAddress, i64)>> = HashMap::new();
        for h in &s.held {
            if let Some(pf) = by_address
                .get(&h.address)
                .filter(|d| d.role == Role::Vf)
                .and_then(|d| d.parent_pf)
            {
                held_vfs
                    .entry(pf)
                    .or_default()
                    .push((h.address, h.claim_id));
            }
        }
        let mut busy = HashMap::new();
        for &(a, task) in &s.busy {
            busy.entry(a).or_insert(task);
        }
        let mut groups: HashMap<u32, Vec<&Device>> = HashMap::new();
        for d in &s.devices {
            if let Some(g) = d.iommu_group {
                groups.entry(g).or_default().push(d);
            }
        }
        Index {
            by_address,
            held,
            held_vfs,
            busy,
            cleaning: s.cleaning.iter().map(|h| (h.address, h)).collect(),
            groups,
            splits: &s.splits,
        }
    }

    /// Why `d` alone (group aside) cannot be claimed.
    fn own_reason(&self, d: &Device) -> Option<Reason> {
        match d.state {
            State::Broken => return Some(Reason::Broken(d.state_reason.clone())),
            State::Protected => return Some(Reason::Protected(d.state_reason.clone())),
            // The hold below says, not the record: a pass records the state only after the
            // hold's transaction (the claim must not slip in between), and after the clean's
            // end (the device must not wait for it).
            State::Cleaning | State::Usable => {}
        }
        if let Some(h) = self.cleaning.get(&d.address) {
            return Some(match h.state {
                HoldState::Pending => Reason::Cleaning(h.reason.clone()),
                HoldState::Quarantined => Reason::Quarantined(h.reason.clone()),
            });
        }
        if !d.managed {
            return Some(Reason::NotManaged);
        }
        if let Some(&claim_id) = self.held.get(&d.address) {
            return Some(Reason::Claimed { claim_id });
        }
        if let Some(pf) = d.parent_pf.filter(|_| d.role == Role::Vf) {
            if let Some(&claim_id) = self.held.get(&pf) {
                return Some(Reason::PfClaimed { pf, claim_id });
            }
        }
        if d.role == Role::Pf {
            if let Some(&(vf, claim_id)) = self.held_vfs.get(&d.address).and_then(|v| v.first()) {
                return Some(Reason::VfClaimed { vf, claim_id });
            }
        }
        if d.role == Role::Pf {
            let by_policy = self.splits.contains(&d.address);
            if by_policy || d.mode == Mode::Vf || d.num_vfs > 0 {
                return Some(Reason::Split {
                    vfs: d.num_vfs,
                    by_policy,
                });
            }
        }
        if let Some(&task_id) = self.busy.get(&d.address) {
            return Some(Reason::Busy { task_id });
        }
        // A PF's task (split, restore) works on its VFs even when its scope does not list them
        // yet: they may not exist when the task starts.
        if let Some(&task_id) = d.parent_pf.and_then(|pf| self.busy.get(&pf)) {
            return Some(Reason::Busy { task_id });
        }
        None
    }

    /// The function's IOMMU group-mates (without itself), in address order.
    fn mates(&self, d: &Device) -> Vec<&'a Device> {
        let mut mates: Vec<&Device> = d
            .iommu_group
            .and_then(|g| self.groups.get(&g))
            .map(|m| {
                m.iter()
                    .copied()
                    .filter(|m| m.address != d.address)
                    .collect()
            })
            .unwrap_or_default();
        mates.sort_by_key(|m| m.address);
        mates
    }

    /// Why `d` cannot be claimed for a request of `kind` (`None`: any kind).
    fn reason(&self, d: &Device, kind: Option<Kind>) -> Option<Reason> {
        if let Some(r) = self.own_reason(d) {
            return Some(r);
        }
        let mates = self.mates(d);
        if let Some(r) = mates.iter().find_map(|m| {
            self.own_reason(m).map(|r| Reason::GroupMate {
                mate: m.address,
                reason: Box::new(r),
            })
        }) {
            return Some(r);
        }
        // A claim takes the whole group: a request for one kind must not hand out a device of
        // another (polkit allowed the kind asked for). Functions of kind `other` (a GPU's
        // audio function) go with any.
        let kind = kind?;
        mates
            .iter()
            .find(|m| m.kind != kind && m.kind != Kind::Other)
            .map(|m| Reason::OtherKind {
                mate: m.address,
                kind: m.kind,
            })
    }

    /// The ranking key of a claimable candidate (see the module's doc): lower wins.
    fn rank(&self, d: &Device) -> (usize, usize, PciAddress) {
        let node_load = d.numa_node.map_or(0, |node| {
            self.held
                .keys()
                .filter(|a| self.by_address.get(a).and_then(|h| h.numa_node) == Some(node))
                .count()
        });
        let pf_load = d
            .parent_pf
            .filter(|_| d.role == Role::Vf)
            .map_or(0, |pf| self.held_vfs.get(&pf).map_or(0, Vec::len));
        (node_load, pf_load, d.address)
    }
}

/// Why `address` cannot be claimed now, or `None` when it can (a function the snapshot lacks is
/// reported as not present by the caller, who knows it is missing).
pub fn unavailable(snapshot: &Snapshot, address: PciAddress) -> Option<Reason> {
    let index = Index::new(snapshot);
    index
        .by_address
        .get(&address)
        .and_then(|d| index.reason(d, None))
}

/// The claimable functions that match `req`, best first.
pub fn candidates(snapshot: &Snapshot, req: &Requirements) -> Vec<PciAddress> {
    let index = Index::new(snapshot);
    let mut found: Vec<_> = snapshot
        .devices
        .iter()
        .filter(|d| req.matches(d) && index.reason(d, req.kind).is_none())
        .map(|d| (index.rank(d), d.address))
        .collect();
    found.sort();
    found.into_iter().map(|(_, a)| a).collect()
}

/// The best claimable function for `req` and the functions its claim takes.
pub fn choose(snapshot: &Snapshot, req: &Requirements) -> Result<Choice, Unavailable> {
    let index = Index::new(snapshot);
    let mut best: Option<((usize, usize, PciAddress), &Device)> = None;
    let mut reasons = Vec::new();
    let mut matched = false;
    for d in snapshot.devices.iter().filter(|d| req.matches(d)) {
        matched = true;
        match index.reason(d, req.kind) {
            Some(r) => reasons.push((d.address, r)),
            None => {
                let rank = index.rank(d);
                if best.as_ref().is_none_or(|(b, _)| rank < *b) {
                    best = Some((rank, d));
                }
            }
        }
    }
    let requirements = req.to_string();
    match best {
        Some((_, d)) => Ok(Choice {
            device: d.address,
            kind: d.kind,
            functions: std::iter::once(d)
                .chain(index.mates(d))
                .map(ClaimFunction::of)
                .collect(),
        }),
        None if !matched => Err(Unavailable::NoMatch { requirements }),
        None => Err(Unavailable::NoneClaimable {
            requirements,
            reasons,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::device::Mode;
    use crate::model::pci::ClassCode;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn dev(address: &str, role: Role, parent: Option<&str>, numa: i32, group: u32) -> Device {
        Device {
            address: a(address),
            vendor_id: 0x8086,
            device_id: if role == Role::Vf { 0x154c } else { 0x1572 },
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 1,
            class: ClassCode(0x020000),
            vendor_name: String::new(),
            device_name: String::new(),
            kind: Kind::Nic,
            driver: Some("vfio-pci".into()),
            driver_override: None,
            numa_node: Some(numa),
            iommu_group: Some(group),
            role,
            separable: role == Role::Pf,
            mode: if role == Role::Vf {
                Mode::None
            } else {
                Mode::Vf
            },
            total_vfs: 0,
            num_vfs: 0,
            parent_pf: parent.map(a),
            managed: true,
            state: State::Usable,
            state_reason: String::new(),
        }
    }

    /// Two PFs on node 0 and 1, three VFs each (groups 10.., 20..), and a GPU with its audio
    /// function in group 30.
    fn host() -> Snapshot {
        let mut devices = vec![
            dev("0000:3b:00.0", Role::Pf, None, 0, 1),
            dev("0000:5e:00.0", Role::Pf, None, 1, 2),
        ];
        for i in 1..=3 {
            devices.push(dev(
                &format!("0000:3b:02.{i}"),
                Role::Vf,
                Some("0000:3b:00.0"),
                0,
                10 + i,
            ));
            devices.push(dev(
                &format!("0000:5e:02.{i}"),
                Role::Vf,
                Some("0000:5e:00.0"),
                1,
                20 + i,
            ));
        }
        let mut gpu = dev("0000:17:00.0", Role::Function, None, 0, 30);
        gpu.kind = Kind::Gpu;
        let mut audio = dev("0000:17:00.1", Role::Function, None, 0, 30);
        audio.kind = Kind::Other;
        devices.extend([gpu, audio]);
        devices.sort_by_key(|d| d.address);
        Snapshot {
            devices,
            ..Default::default()
        }
    }

    fn vf() -> Requirements {
        Requirements {
            role: Some(Role::Vf),
            ..Default::default()
        }
    }

    /// Claims `req` `n` times on `s`, recording each choice as held; returns the devices.
    fn claim_n(s: &mut Snapshot, req: &Requirements, n: usize) -> Vec<String> {
        let mut got = Vec::new();
        for _ in 0..n {
            let c = choose(s, req).unwrap();
            let id = s.held.len() as i64 + 1;
            for f in &c.functions {
                s.held.push(Held {
                    address: f.address,
                    claim_id: id,
                });
            }
            got.push(c.device.to_string());
        }
        got
    }

    /// Who uses a protected function is said once, by whichever words say it.
    #[test]
    fn a_protected_function_says_who_uses_it_once() {
        #[rustfmt::skip]
        let table = [
            ("used by the host: boot disk", "is used by the host: boot disk", "used by the host"),
            ("used by VM vm1: IOMMU group 7 is open by pid 9 (qemu-system-x86)",
             "is used by VM vm1: IOMMU group 7 is open by pid 9 (qemu-system-x86)", "used by a VM"),
            ("used by a VM: /dev/vfio/7 is open by pid 9", "is used by a VM: /dev/vfio/7 is open by pid 9",
             "used by a VM"),
            ("listed in [[protect]]", "is used by the host (listed in [[protect]])", "used by the host"),
        ];
        for (recorded, said, counted) in table {
            let r = Reason::Protected(recorded.to_string());
            assert_eq!(r.to_string(), said);
            assert_eq!(r.category(), counted, "{recorded}");
        }
    }

    #[test]
    fn claims_spread_over_numa_nodes_then_pfs_and_never_repeat() {
        let mut s = host();
        let got = claim_n(&mut s, &vf(), 6);
        assert_eq!(
            got,
            [
                "0000:3b:02.1",
                "0000:5e:02.1",
                "0000:3b:02.2",
                "0000:5e:02.2",
                "0000:3b:02.3",
                "0000:5e:02.3"
            ]
        );
        let e = choose(&s, &vf()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "none of the 6 functions matching role=vf can be claimed: 6 claimed"
        );
        assert_eq!(e.busy_task(), None);
        // Six claimed functions are not a policy's refusal.
        assert_eq!(e.policy(), None);
    }

    #[test]
    fn a_numa_requirement_keeps_to_its_node() {
        let mut s = host();
        let req = Requirements {
            numa_node: Some(1),
            role: Some(Role::Vf),
            ..Default::default()
        };
        assert_eq!(
            claim_n(&mut s, &req, 3),
            ["0000:5e:02.1", "0000:5e:02.2", "0000:5e:02.3"]
        );
        assert!(matches!(
            choose(&s, &req),
            Err(Unavailable::NoneClaimable { .. })
        ));
    }

    #[test]
    fn a_pf_and_its_vfs_exclude_each_other() {
        let mut s = host();
        // A PF held whole (claimed before it was split: a claim no longer takes a split PF).
        s.held.push(Held {
            address: a("0000:3b:00.0"),
            claim_id: 1,
        });
        let on_3b = Requirements {
            parent: Some(a("0000:3b:00.0")),
            ..Default::default()
        };
        let e = choose(&s, &on_3b).unwrap_err();
        assert!(e.to_string().contains("3 claimed"), "{e}");
        assert_eq!(
            unavailable(&s, a("0000:3b:02.1")),
            Some(Reason::PfClaimed {
                pf: a("0000:3b:00.0"),
                claim_id: 1
            })
        );

        let mut s = host();
        claim_n(
            &mut s,
            &Requirements {
                address: Some(a("0000:5e:02.2")),
                ..Default::default()
            },
            1,
        );
        let e = choose(
            &s,
            &Requirements {
                address: Some(a("0000:5e:00.0")),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "0000:5e:00.0 matches address=0000:5e:00.0 but has its VF 0000:5e:02.2 held by claim 1"
        );
    }

    /// Issue 33: a PF that is split (VFs enabled now) or that the configuration splits is
    /// never the answer to a request that does not name it (a kind, a role, an id), and a
    /// request that names it is refused as a mode change, with the way out.
    #[test]
    fn a_split_pf_is_never_claimed_whole() {
        let pf = a("0000:3b:00.0");
        // (the PF's mode, its VFs now, whether policy splits it, whether its VFs are recorded;
        // what a request for kind nic gets; what a request naming the PF is told)
        type Case<'a> = (Mode, u32, bool, bool, &'a str, Option<&'a str>);
        let cases: [Case; 5] = [
            (
                Mode::Vf,
                3,
                false,
                true,
                "0000:3b:02.1",
                Some("is split into 3 VFs:"),
            ),
            (
                Mode::Vf,
                64,
                true,
                true,
                "0000:3b:02.1",
                Some("is split into 64 VFs by the configuration:"),
            ),
            // Policy splits it, the split is not done yet (or failed): still not whole.
            (
                Mode::Pf,
                0,
                true,
                false,
                "0000:5e:00.0",
                Some("is to be split into VFs by the configuration:"),
            ),
            // Whole, and policy keeps it so: claimable by kind and by name.
            (Mode::Pf, 0, false, false, "0000:3b:00.0", None),
            // The mode the record shows is enough (a split by hand, policy silent).
            (
                Mode::Vf,
                0,
                false,
                false,
                "0000:5e:00.0",
                Some("is split into VFs"),
            ),
        ];
        for (mode, vfs, by_policy, with_vfs, by_kind, named) in cases {
            let case = format!("{mode:?} {vfs} VFs, policy splits: {by_policy}");
            let mut s = host();
            // Only the PFs and the GPU: the other PF (5e) is whole and kept whole, so that a
            // request by kind has a PF to fall back on.
            s.devices
                .retain(|d| d.role != Role::Vf || (with_vfs && d.parent_pf == Some(pf)));
            for d in s.devices.iter_mut().filter(|d| d.role == Role::Pf) {
                d.mode = Mode::Pf;
            }
            let d = s.devices.iter_mut().find(|d| d.address == pf).unwrap();
            d.mode = mode;
            d.num_vfs = vfs;
            if by_policy {
                s.splits.push(pf);
            }
            let kind = Requirements {
                kind: Some(Kind::Nic),
                ..Default::default()
            };
            // Node 0 and 1 are both empty: the lowest address wins among the claimable.
            assert_eq!(choose(&s, &kind).unwrap().device, a(by_kind), "{case}");
            let pfs = Requirements {
                role: Some(Role::Pf),
                kind: Some(Kind::Nic),
                ..Default::default()
            };
            assert_eq!(
                candidates(&s, &pfs).contains(&pf),
                named.is_none(),
                "{case}"
            );
            let name = Requirements {
                address: Some(pf),
                ..Default::default()
            };
            match named {
                None => assert_eq!(choose(&s, &name).unwrap().device, pf, "{case}"),
                Some(says) => {
                    let e = choose(&s, &name).unwrap_err();
                    let text = e.to_string();
                    assert!(text.contains(says), "{case}: {text}");
                    assert!(
                        text.contains("a mode change, not a claim")
                            && text.contains("vfioctl claim --parent")
                            && text.contains("mode = \"pf\""),
                        "{case}: the refusal says why and the way out: {text}"
                    );
                    assert_eq!(e.policy(), Some(Policy::Split), "{case}");
                    assert_eq!(e.busy_task(), None, "{case}");
                }
            }
        }
        // Among several matches, split PFs are counted as such.
        let e = choose(
            &host(),
            &Requirements {
                role: Some(Role::Pf),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "none of the 2 functions matching role=pf can be claimed: 2 split into VFs"
        );
        assert_eq!(e.policy(), None);
    }

    #[test]
    fn a_claim_takes_the_whole_iommu_group() {
        let mut s = host();
        let gpu = Requirements {
            kind: Some(Kind::Gpu),
            ..Default::default()
        };
        let c = choose(&s, &gpu).unwrap();
        assert_eq!(c.device, a("0000:17:00.0"));
        assert_eq!(
            c.functions.iter().map(|f| f.address).collect::<Vec<_>>(),
            [a("0000:17:00.0"), a("0000:17:00.1")]
        );
        assert!(c.functions.iter().all(|f| f.family.is_none() && !f.is_pf));
        // Asked for by its own kind, the audio function is refused: its claim would hand out the
        // GPU, which a rule for kind "other" never allowed.
        let other = Requirements {
            kind: Some(Kind::Other),
            ..Default::default()
        };
        let e = choose(&s, &other).unwrap_err();
        assert_eq!(
            e.to_string(),
            "0000:17:00.1 matches kind=other but shares its IOMMU group with 0000:17:00.0, a \
             gpu, which its claim would take too (ask for kind gpu)"
        );
        assert!(candidates(&s, &other).is_empty());
        // The audio function alone is not claimable while another claim holds it, nor is the
        // GPU with it.
        s.held.push(Held {
            address: a("0000:17:00.1"),
            claim_id: 9,
        });
        let e = choose(&s, &gpu).unwrap_err();
        assert_eq!(
            e.to_string(),
            "0000:17:00.0 matches kind=gpu but shares its IOMMU group with 0000:17:00.1, which is \
             held by claim 9"
        );
    }

    fn hold(address: PciAddress, state: HoldState, reason: &str) -> CleanHold {
        CleanHold {
            address,
            state,
            reason: reason.into(),
            claim_id: Some(7),
            since_ms: 0,
        }
    }

    #[test]
    fn broken_protected_unselected_and_busy_are_never_chosen() {
        let base = host();
        let target = a("0000:3b:02.1");
        let only = Requirements {
            address: Some(target),
            ..Default::default()
        };
        type Change<'a> = Box<dyn Fn(&mut Snapshot) + 'a>;
        let cases: Vec<(Change, &str)> =
            vec![
            (
                Box::new(|s| {
                    let d = s.devices.iter_mut().find(|d| d.address == target).unwrap();
                    d.state = State::Broken;
                    d.state_reason = "config space reads all-ones".into();
                }),
                "but is broken (config space reads all-ones)",
            ),
            (
                Box::new(|s| {
                    let d = s.devices.iter_mut().find(|d| d.address == target).unwrap();
                    d.state = State::Protected;
                    d.state_reason = "boot disk".into();
                }),
                "but is used by the host (boot disk)",
            ),
            (
                Box::new(|s| {
                    let d = s.devices.iter_mut().find(|d| d.address == target).unwrap();
                    d.managed = false;
                }),
                "but is not selected by the configuration",
            ),
            (
                Box::new(|s| s.busy.push((target, 42))),
                "0000:3b:02.1 matches address=0000:3b:02.1 but is busy: task 42 is working on it",
            ),
            // Held for a clean: refused by the hold even while its record still says usable
            // (a pass records the state after the hold's transaction).
            (
                Box::new(|s| s.cleaning.push(hold(target, HoldState::Pending, "claim 7 ended"))),
                "but is being cleaned before it returns to the pool (claim 7 ended)",
            ),
            (
                Box::new(|s| {
                    let d = s.devices.iter_mut().find(|d| d.address == target).unwrap();
                    d.state = State::Cleaning;
                    d.state_reason = "a record older than its hold".into();
                    s.cleaning.push(hold(target, HoldState::Pending, "claim 7 ended"))
                }),
                "but is being cleaned before it returns to the pool (claim 7 ended)",
            ),
            (
                Box::new(|s| {
                    s.cleaning
                        .push(hold(target, HoldState::Quarantined, "the reset hung"))
                }),
                "but is quarantined (the reset hung); an operator clears it with `vfioctl task \
                 reset`",
            ),
            (
                Box::new(|s| s.busy.push((a("0000:3b:00.0"), 43))),
                // The PF's task covers its VFs.
                "0000:3b:02.1 matches address=0000:3b:02.1 but is busy: task 43 is working on it",
            ),
        ];
        for (change, wanted) in cases {
            let mut s = base.clone();
            change(&mut s);
            let e = choose(&s, &only).unwrap_err();
            assert!(e.to_string().contains(wanted), "{e} / {wanted}");
            assert!(candidates(&s, &vf()).iter().all(|c| *c != target));
            assert_eq!(
                e.busy_task().is_some(),
                wanted.contains("busy: task"),
                "{wanted}"
            );
            let policy = if wanted.contains("used by the host") {
                Some(Policy::Protected)
            } else if wanted.contains("not selected") {
                Some(Policy::NotManaged)
            } else {
                None
            };
            assert_eq!(e.policy(), policy, "{wanted}");
        }
        assert_eq!(
            choose(
                &base,
                &Requirements {
                    kind: Some(Kind::Fpga),
                    ..Default::default()
                }
            )
            .unwrap_err(),
            Unavailable::NoMatch {
                requirements: "kind=fpga".into()
            }
        );
    }

    #[test]
    fn candidates_are_the_claimable_matches_best_first() {
        let mut s = host();
        s.held.push(Held {
            address: a("0000:3b:02.1"),
            claim_id: 1,
        });
        let found = candidates(&s, &vf());
        assert_eq!(found.len(), 5);
        // Node 1 has no claim yet: its VFs come first.
        assert_eq!(found[0], a("0000:5e:02.1"));
        assert!(!found.contains(&a("0000:3b:02.1")));
    }

    #[test]
    fn requirements_match_every_field() {
        let s = host();
        let d = s
            .devices
            .iter()
            .find(|d| d.address == a("0000:5e:02.3"))
            .unwrap();
        let yes = [
            Requirements::default(),
            Requirements {
                id: Some((0x8086, Some(0x154c))),
                ..Default::default()
            },
            Requirements {
                id: Some((0x8086, None)),
                parent: Some(a("0000:5e:00.0")),
                numa_node: Some(1),
                kind: Some(Kind::Nic),
                role: Some(Role::Vf),
                address: Some(a("0000:5e:02.3")),
            },
        ];
        for r in yes {
            assert!(r.matches(d), "{r}");
        }
        let no = [
            Requirements {
                id: Some((0x8086, Some(0x1572))),
                ..Default::default()
            },
            Requirements {
                id: Some((0x10de, None)),
                ..Default::default()
            },
            Requirements {
                parent: Some(a("0000:3b:00.0")),
                ..Default::default()
            },
            Requirements {
                numa_node: Some(0),
                ..Default::default()
            },
            Requirements {
                role: Some(Role::Pf),
                ..Default::default()
            },
        ];
        for r in no {
            assert!(!r.matches(d), "{r}");
        }
    }
}
