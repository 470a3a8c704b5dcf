//! libvirt's qemu hook, decided: what vfiod answers when libvirt runs
//! `/etc/libvirt/hooks/qemu.d/vfiod DOMAIN OPERATION SUB-OPERATION EXTRA` with the domain XML on
//! stdin (that is `vfiod-qemu-hook`, which forwards it in one D-Bus call, `Manager.Hook`). Pure: the engine
//! reads the records, calls these functions, and carries out their answer
//! (`engine::hook`). A hook must never call libvirt back (libvirt waits for it), so everything
//! is decided from the XML it was given and vfiod's own records.
//!
//! | operation           | refuses (exit 1, one line)                                | otherwise                          |
//! |---------------------|-----------------------------------------------------------|------------------------------------|
//! | `prepare begin`     | a function the XML assigns that the host uses (host guard); a managed function that is broken, another VM's claim, busy with a task, or unclaimed without `[hooks] auto_claim` | the managed functions are claimed (auto_claim) and bound to vfio-pci |
//! | `migrate begin`     | (destination) a function the incoming XML keeps that the host uses; no equivalent free here for a device the metadata lists; a pooled session its pool cannot move here (or a pool that does not answer) | claims the equivalents and prepares the pooled sessions' move (`engine::migration`, `engine::pool`); XML filter: the XML with the hostdevs of devices that move with their state retargeted onto the functions claimed here, or empty output (unchanged) when none does |
//! | `restore begin`     | a function the XML assigns that the host uses             | XML filter: empty output (unchanged) |
//! | `started begin`     | never                                                     | the domain's claims are attached, with the guest addresses of the XML |
//! | `stopped`, `release`| never                                                     | the domain's claims are detached; those for the VM's run are released; its pooled sessions take their `stopped` step in the background ([`crate::pool`]) |
//! | `reconnect begin`   | never (libvirt would kill the VM)                         | a reconcile is scheduled           |
//! | anything else       | never                                                     | exit 0                             |
//!
//! An operation that may refuse (prepare, migrate, restore) also refuses when its answer does not
//! come within `[hooks] deadline_ms`; a notification passes after `notify_deadline_ms`
//! (`engine::hook`).
//!
//! The host guard ([`host_uses`], [`refuse_host_devices`]) looks at every PCI function the XML
//! assigns, managed by vfiod or not, selected or not: one the host uses (what
//! [`crate::hostuse`] decides from the kernel's answers: a block device below it mounted, swap,
//! held by dm/md, busy for an exclusive open or open in a process; any of its nodes open in a
//! process; an interface that is up; listed in `[[protect]]`; or an IOMMU group-mate of such a
//! function) refuses the start, because `managed='yes'` would have libvirt
//! take it from its host driver. A function vfiod does not know is left to libvirt.
//! `[hooks] guard_host_devices = false` turns the guard off.

pub mod deadline;

use crate::model::claim::ClaimState;
use crate::model::device::{Device, State};
use crate::model::pci::PciAddress;
use crate::store::ClaimRecord;
use std::collections::BTreeMap;

/// Who the claims the `prepare` hook makes (`[hooks] auto_claim`) name as their requester.
pub const BY_PREPARE: &str = "libvirt hook";
/// Who the claims the destination's `migrate` hook makes name as their requester.
pub const BY_INCOMING: &str = "libvirt hook (incoming migration)";

/// Whether a claim requested by `requested_by` was made by a hook for one run of its domain on
/// this host (auto-claimed at `prepare`, or for an incoming migration): it ends with that run
/// (`stopped`/`release`), and the reconcile ends it when it finds the domain no longer running.
pub fn for_a_run(requested_by: &str) -> bool {
    requested_by == BY_PREPARE || requested_by == BY_INCOMING
}

/// libvirt's operation argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Prepare,
    Start,
    Started,
    Stopped,
    Release,
    Migrate,
    Restore,
    Reconnect,
    Attach,
    /// An operation newer than this code: passes.
    Other,
}

impl Operation {
    pub fn parse(op: &str) -> Operation {
        match op {
            "prepare" => Operation::Prepare,
            "start" => Operation::Start,
            "started" => Operation::Started,
            "stopped" => Operation::Stopped,
            "release" => Operation::Release,
            "migrate" => Operation::Migrate,
            "restore" => Operation::Restore,
            "reconnect" => Operation::Reconnect,
            "attach" => Operation::Attach,
            _ => Operation::Other,
        }
    }

    /// Whether a failure of the hook stops what libvirt is doing (the domain does not start,
    /// the migration is aborted): such an operation fails closed when vfiod cannot answer, for
    /// domains with devices vfiod manages. The others never fail: libvirt ignores their exit
    /// code, or, for `reconnect`, kills the running VM on a failure.
    pub fn may_fail(self) -> bool {
        matches!(
            self,
            Operation::Prepare | Operation::Start | Operation::Migrate | Operation::Restore
        )
    }

    /// Whether libvirt reads the hook's output as the domain's new XML (empty: unchanged).
    pub fn is_filter(self) -> bool {
        matches!(self, Operation::Migrate | Operation::Restore)
    }
}

/// What the hook returns: its exit code, its output (the new XML of a filter; empty means
/// unchanged), and a message for libvirt's error (one line) or the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub exit_code: i32,
    pub stdout: String,
    pub message: String,
}

impl Verdict {
    pub fn pass(message: impl Into<String>) -> Verdict {
        Verdict {
            exit_code: 0,
            stdout: String::new(),
            message: message.into(),
        }
    }

    pub fn fail(message: impl Into<String>) -> Verdict {
        Verdict {
            exit_code: 1,
            stdout: String::new(),
            message: message.into(),
        }
    }
}

/// The domain a hook is about, as its XML names it.
#[derive(Clone, Copy, Debug)]
pub struct DomainId<'a> {
    pub name: &'a str,
    pub uuid: Option<&'a str>,
}

impl DomainId<'_> {
    /// Whether `claim` is this domain's: by UUID when both know it, else by name.
    pub fn owns(&self, claim: &ClaimRecord) -> bool {
        match (self.uuid, claim.vm_uuid.as_deref()) {
            (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
            _ => claim.vm_name.as_deref() == Some(self.name),
        }
    }
}

/// What the host uses each function for, by address: "network interface enp2s0 is up". Only
/// functions the host uses are in it.
pub type HostUses = BTreeMap<PciAddress, String>;

/// The use of a protected function, from the reason the inventory recorded for it ("used by
/// the host: network interface enp2s0 is up" is "network interface enp2s0 is up").
pub fn recorded_use(state_reason: &str) -> &str {
    state_reason
        .strip_prefix("used by the host: ")
        .unwrap_or(state_reason)
}

/// What the host uses: what `[[protect]]` names (`configured`: function -> the reason the
/// inventory gives it, `protected by config (...)`) and what was just read (`detected`: the
/// kernel's answer now, [`crate::hostuse`]), each with its IOMMU group-mates among `devices`
/// (same group, not a bridge): the group moves as a whole. The records' states are not asked:
/// a holder gone since the last inventory pass no longer refuses, one that came since already
/// does. Pure.
pub fn host_uses(
    devices: &[Device],
    configured: &BTreeMap<PciAddress, String>,
    detected: &BTreeMap<PciAddress, Vec<String>>,
) -> HostUses {
    let mut out = HostUses::new();
    let group_of = |a: &PciAddress| {
        devices
            .iter()
            .find(|d| d.address == *a)
            .and_then(|d| d.iommu_group)
    };
    let mates = |a: PciAddress, group: u32| {
        devices
            .iter()
            .filter(move |d| d.iommu_group == Some(group) && d.address != a && !d.class.is_bridge())
            .map(|d| d.address)
    };
    for (a, why) in configured {
        out.insert(*a, why.clone());
    }
    for (a, whys) in detected.iter().filter(|(_, w)| !w.is_empty()) {
        out.insert(*a, whys.join("; "));
    }
    for (a, whys) in detected.iter().filter(|(_, w)| !w.is_empty()) {
        let Some(group) = group_of(a) else { continue };
        for mate in mates(*a, group) {
            out.entry(mate).or_insert_with(|| {
                format!(
                    "it shares IOMMU group {group} with {a} ({})",
                    whys.join("; ")
                )
            });
        }
    }
    for a in configured.keys() {
        let Some(group) = group_of(a) else { continue };
        for mate in mates(*a, group) {
            out.entry(mate)
                .or_insert_with(|| format!("shares its IOMMU group with protected device {a}"));
        }
    }
    out
}

/// The functions the host guard reads for `functions`: they and their IOMMU group-mates (not
/// bridges), as the records know them. Pure.
pub fn guard_scope(devices: &[Device], functions: &[PciAddress]) -> Vec<PciAddress> {
    let mut out: Vec<PciAddress> = Vec::new();
    for f in functions {
        if !out.contains(f) {
            out.push(*f);
        }
        let group = devices
            .iter()
            .find(|d| d.address == *f)
            .and_then(|d| d.iommu_group);
        for mate in devices.iter().filter(|d| {
            group.is_some() && d.iommu_group == group && !d.class.is_bridge() && d.address != *f
        }) {
            if !out.contains(&mate.address) {
                out.push(mate.address);
            }
        }
    }
    out
}

/// The host guard: one problem ("0000:02:00.0 is used by the host: network interface enp2s0 is
/// up") for each of `functions` the host uses, in the XML's order. Pure.
pub fn host_problems(functions: &[PciAddress], uses: &HostUses) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = Vec::new();
    for f in functions {
        if seen.contains(f) {
            continue;
        }
        seen.push(*f);
        if let Some(why) = uses.get(f) {
            out.push(format!("{f} is used by the host: {why}"));
        }
    }
    out
}

/// The host guard for an operation that lets a domain start or arrive with `functions`
/// (`restore`, a destination's `migrate`): `Err` is the one line libvirt shows. `verb` is what
/// the domain cannot do ("start", "come here"). Pure.
pub fn refuse_host_devices(
    domain: &str,
    verb: &str,
    functions: &[PciAddress],
    uses: &HostUses,
) -> Result<(), String> {
    let problems = host_problems(functions, uses);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "vfiod: domain {domain} cannot {verb}: {}",
            problems.join("; ")
        ))
    }
}

/// A device libvirt reports hot-plugged into running domain `domain` under `alias`, with the
/// domain's live hostdevs: the function and the error line when it is one the host uses and
/// vfiod did not attach it (its aliases are its claims'; `vfiod_alias` tells them). No hook
/// runs for a live attach, so vfiod can only say so, loudly. Pure.
pub fn hot_plugged_host_device(
    domain: &str,
    alias: &str,
    hostdevs: &[crate::host::libvirt::xml::Hostdev],
    uses: &HostUses,
    vfiod_alias: impl Fn(&str) -> bool,
) -> Option<(PciAddress, String)> {
    if vfiod_alias(alias) {
        return None;
    }
    let h = hostdevs
        .iter()
        .find(|h| h.alias.as_deref() == Some(alias))?;
    let why = uses.get(&h.source)?;
    Some((
        h.source,
        format!(
            "error: {} was hot-plugged into running domain {domain} (device {alias}, not by \
             vfiod) although it is used by the host: {why}",
            h.source
        ),
    ))
}

/// What `prepare` needs done before the domain may start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Preparation {
    /// Managed functions of the XML that no claim holds: to be claimed for the domain, in order
    /// (a claim takes a function's whole IOMMU group, so a later one may be held by then).
    pub to_claim: Vec<PciAddress>,
    /// The managed functions of the XML: to be bound to vfio-pci.
    pub to_bind: Vec<PciAddress>,
}

/// `prepare begin`: whether the domain may start with the PCI functions its XML assigns, and
/// what to do first. `Err` is the one line libvirt shows the user. Every function the host uses
/// (`host`, see [`host_uses`]; empty when the guard is off) refuses the start; of the others,
/// functions vfiod does not manage (or does not know) are left to libvirt, except a VF the
/// records lack whose PF vfiod manages (`unrecorded`: such functions with the PF sysfs names,
/// e.g. VFs a split is creating): it is vfiod's, and cannot be handed out before it is recorded.
/// Pure.
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    domain: DomainId<'_>,
    functions: &[PciAddress],
    devices: &[Device],
    claims: &[ClaimRecord],
    busy: &[(PciAddress, i64)],
    auto_claim: bool,
    host: &HostUses,
    unrecorded: &[(PciAddress, PciAddress)],
) -> Result<Preparation, String> {
    let mut out = Preparation::default();
    let mut problems = host_problems(functions, host);
    for f in functions {
        if host.contains_key(f) || out.to_bind.contains(f) {
            continue;
        }
        let Some(d) = devices.iter().find(|d| d.address == *f) else {
            let pf = unrecorded
                .iter()
                .find(|(vf, _)| vf == f)
                .map(|(_, pf)| *pf)
                .filter(|pf| devices.iter().any(|d| d.address == *pf && d.managed));
            if let Some(pf) = pf {
                let why = match busy.iter().find(|(a, _)| *a == pf) {
                    Some((_, task)) => format!("task {task} is running on its PF {pf}"),
                    None => format!("vfiod has not recorded this VF of {pf} yet"),
                };
                problems.push(format!(
                    "{f} is busy: {why}; start the domain again once it is done"
                ));
            }
            continue;
        };
        // A protected function is never managed (see `inventory::is_managed`): the host guard
        // above is what refuses it.
        if !d.managed {
            continue;
        }
        if d.state == State::Broken {
            problems.push(format!("{f} is broken ({})", d.state_reason));
        }
        if d.state == State::Cleaning {
            problems.push(format!(
                "{f} is still being cleaned after its last claim ({}); start the domain again \
                 once it is done",
                d.state_reason
            ));
        }
        let holder = claims
            .iter()
            .find(|c| c.state.holds() && c.functions.contains(f));
        match holder {
            Some(c) if domain.owns(c) => {}
            Some(c) => problems.push(format!("{f} is claimed by VM {} (claim {})", c.vm(), c.id)),
            None => {
                if let Some((_, task)) = busy.iter().find(|(a, _)| a == f) {
                    problems.push(format!("{f} is busy: task {task} is running on it"));
                } else if auto_claim {
                    out.to_claim.push(*f);
                } else {
                    problems.push(format!(
                        "{f} is not claimed for {} (claim it first: vfioctl claim --address {f} \
                         --vm {}; or set [hooks] auto_claim = true)",
                        domain.name, domain.name
                    ));
                }
            }
        }
        out.to_bind.push(*f);
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(format!(
            "vfiod: domain {} cannot start: {}",
            domain.name,
            problems.join("; ")
        ))
    }
}

/// `started begin`: the domain's claims whose functions the running domain has, each with the
/// guest address of its device. Pure.
pub fn started<'a>(
    domain: DomainId<'_>,
    assigned: &[(PciAddress, Option<String>)],
    claims: &'a [ClaimRecord],
) -> Vec<(&'a ClaimRecord, Option<String>)> {
    claims
        .iter()
        .filter(|c| c.state.holds() && domain.owns(c))
        .filter(|c| {
            c.functions
                .iter()
                .all(|f| assigned.iter().any(|(a, _)| a == f))
        })
        .map(|c| {
            let guest = assigned
                .iter()
                .find(|(a, _)| *a == c.address)
                .and_then(|(_, g)| g.clone());
            (c, guest)
        })
        .collect()
}

/// What `stopped` and `release` do to one of the domain's claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterStop {
    /// Out of the domain (it no longer runs), the reservation kept: a persistent claim.
    Detach,
    /// Out of the domain and released: a claim for the VM's run.
    Release,
}

/// `stopped end` / `release end`: the domain's claims and what happens to each. Pure.
pub fn stopped<'a>(
    domain: DomainId<'_>,
    claims: &'a [ClaimRecord],
) -> Vec<(&'a ClaimRecord, AfterStop)> {
    claims
        .iter()
        .filter(|c| c.state.holds() && domain.owns(c))
        .filter_map(|c| {
            let after = if c.persistent {
                if c.state == ClaimState::Claimed {
                    return None;
                }
                AfterStop::Detach
            } else {
                AfterStop::Release
            };
            Some((c, after))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use crate::host::sysfs::hostuse;
    use crate::inventory;
    use crate::model::device::Kind;
    use crate::sim::kernel::{FunctionSpec, HostModel, SimKernel};

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    /// The host NIC's second port: in the NIC's IOMMU group, down, on no driver.
    const NIC_MATE: &str = "0000:02:00.1";

    /// The devices as the inventory makes them of the simulated reference host (plus a
    /// group-mate of its NIC): the FPGA and the X710 selected, the host's NIC and boot NVMe
    /// selected too but used by the host, the GPU listed in `[[protect]]`. When `broken`, the
    /// FPGA's config space could not be read on a second pass. The kernel comes back too, for
    /// the host's uses as read now.
    fn test_settings() -> Settings {
        Settings::from_toml_str(
            "[[select]]\nclass = \"0x12\"\n[[select]]\nid = \"8086:1572\"\n\
             [[select]]\nid = \"8086:15f3\"\n[[select]]\naddress = \"0000:3d:00.0\"\n\
             [[protect]]\naddress = \"0000:17:00.0\"\n",
            std::path::Path::new("test.toml"),
        )
        .unwrap()
    }

    /// What `[[protect]]` of [`test_settings`] names among `devices`.
    fn configured(devices: &[Device]) -> BTreeMap<PciAddress, String> {
        inventory::protected_by_config(&test_settings(), devices)
    }

    fn inventory_devices(
        broken: bool,
    ) -> (tempfile::TempDir, std::sync::Arc<SimKernel>, Vec<Device>) {
        let dir = tempfile::tempdir().unwrap();
        let mut model = HostModel::reference();
        model.functions.push(
            FunctionSpec::new(NIC_MATE, 0x8086, 0x15f3, 0x020000)
                .under("0000:00:1c.0")
                .group_with("0000:02:00.0"),
        );
        let kernel = SimKernel::build(dir.path(), &model).unwrap();
        let settings = test_settings();
        let sysfs = kernel.sysfs();
        let mut devices = inventory::scan(&sysfs, &settings, &BTreeMap::new()).unwrap();
        if broken {
            let previous = devices.iter().map(|d| (d.address, d.clone())).collect();
            kernel.make_unreadable(a("0000:af:00.0"), "config", libc::EIO);
            devices = inventory::scan(&sysfs, &settings, &previous).unwrap();
        }
        (dir, kernel, devices)
    }

    fn claim(id: i64, f: &str, vm: &str, state: ClaimState, persistent: bool) -> ClaimRecord {
        ClaimRecord {
            id,
            address: a(f),
            functions: vec![a(f)],
            vm_name: Some(vm.into()),
            vm_uuid: None,
            kind: Some(Kind::Nvme),
            state,
            guest_address: None,
            requested_by: "test".into(),
            created_ms: 0,
            updated_ms: 0,
            lease_expires_ms: None,
            persistent,
            released_ms: None,
        }
    }

    const VM1: DomainId<'static> = DomainId {
        name: "vm1",
        uuid: None,
    };

    #[test]
    fn the_inventory_never_makes_a_managed_protected_function() {
        let (_dir, _kernel, devices) = inventory_devices(false);
        let get = |s: &str| devices.iter().find(|d| d.address == a(s)).unwrap();
        for used in [
            "0000:02:00.0",
            NIC_MATE,
            "0000:3d:00.0",
            "0000:17:00.0",
            "0000:17:00.1",
        ] {
            let d = get(used);
            assert_eq!((d.state, d.managed), (State::Protected, false), "{used}");
        }
        assert!(get("0000:af:00.0").managed && get("0000:af:00.0").state == State::Usable);
        assert!(!get("0000:d8:00.0").managed && get("0000:d8:00.0").state == State::Usable);
        assert!(devices
            .iter()
            .all(|d| !(d.managed && d.state == State::Protected)));
    }

    /// The decision table of `prepare`, on the devices the inventory makes: what each function
    /// the XML may assign makes of the start.
    #[test]
    fn prepare_table() {
        let (_dir, kernel, devices) = inventory_devices(false);
        let host = host_uses(
            &devices,
            &configured(&devices),
            &hostuse::detect(&kernel.sysfs(), &[]),
        );
        let none = HostUses::new();
        let claims = [
            claim(1, "0000:af:00.0", "vm1", ClaimState::Claimed, false),
            claim(2, "0000:af:00.0", "vm2", ClaimState::Released, false),
        ];
        let f = |v: &[&str]| v.iter().map(|s| a(s)).collect::<Vec<_>>();
        let run = |fs: &[&str], claims: &[ClaimRecord], busy: &[(PciAddress, i64)], auto, host| {
            prepare(VM1, &f(fs), &devices, claims, busy, auto, host, &[])
        };
        let bind_only = |fs: &[&str]| Preparation {
            to_claim: vec![],
            to_bind: f(fs),
        };
        let claim_and_bind = |fs: &[&str]| Preparation {
            to_claim: f(fs),
            to_bind: f(fs),
        };
        // (functions, claims, busy, auto_claim, guard on) -> Ok(preparation) or what the one
        // line says.
        type Row<'a> = (
            &'a [&'a str],
            &'a [ClaimRecord],
            &'a [(PciAddress, i64)],
            bool,
            bool,
            Result<Preparation, &'a str>,
        );
        let busy = [(a("0000:af:00.0"), 9)];
        let vm2s = [claim(3, "0000:af:00.0", "vm2", ClaimState::Attached, false)];
        let table: Vec<Row> = vec![
            // Its own claim; an unselected unused function and one vfiod does not know: left
            // to libvirt.
            (&["0000:af:00.0", "0000:d8:00.0", "0000:09:00.0"], &claims, &[], false, true, Ok(bind_only(&["0000:af:00.0"]))),
            // Unclaimed (a released claim does not count): claimed now, or refused.
            (&["0000:af:00.0"], &claims[1..], &[], true, true, Ok(claim_and_bind(&["0000:af:00.0"]))),
            (&["0000:af:00.0"], &claims[1..], &[], false, true, Err("0000:af:00.0 is not claimed for vm1 (claim it first")),
            (&["0000:af:00.0"], &vm2s, &[], true, true, Err("0000:af:00.0 is claimed by VM vm2 (claim 3)")),
            (&["0000:af:00.0"], &[], &busy, true, true, Err("0000:af:00.0 is busy: task 9 is running on it")),
            // The host guard: selected or not, directly or through the IOMMU group.
            (&["0000:02:00.0"], &[], &[], true, true, Err("0000:02:00.0 is used by the host: network interface enp2s0 is up")),
            (&[NIC_MATE], &[], &[], true, true, Err("0000:02:00.1 is used by the host: it shares IOMMU group 8 with 0000:02:00.0 (network interface enp2s0 is up)")),
            (&["0000:3d:00.0"], &[], &[], true, true, Err("0000:3d:00.0 is used by the host: block device nvme")),
            (&["0000:17:00.0"], &[], &[], true, true, Err("0000:17:00.0 is used by the host: protected by config")),
            (&["0000:17:00.1"], &[], &[], true, true, Err("0000:17:00.1 is used by the host: shares its IOMMU group with protected device 0000:17:00.0")),
            // A managed function next to a host one: nothing is claimed, the start is refused.
            (&["0000:af:00.0", "0000:02:00.0"], &[], &[], true, true, Err("0000:02:00.0 is used by the host")),
            // The guard off: the host's functions are not vfiod's, so libvirt is left to it.
            (&["0000:02:00.0", "0000:3d:00.0"], &[], &[], true, false, Ok(Preparation::default())),
        ];
        for (i, (fs, claims, busy, auto, guard, want)) in table.into_iter().enumerate() {
            let got = run(fs, claims, busy, auto, if guard { &host } else { &none });
            match (got, want) {
                (Ok(p), Ok(w)) => assert_eq!(p, w, "row {i}"),
                (Err(e), Err(says)) => {
                    assert!(
                        e.starts_with("vfiod: domain vm1 cannot start: "),
                        "row {i}: {e}"
                    );
                    assert!(e.contains(says), "row {i}: {e}");
                    assert!(!e.contains('\n'), "row {i}: one line: {e}");
                }
                (got, want) => panic!("row {i}: {got:?}, wanted {want:?}"),
            }
        }
        // Every problem in the one line.
        let e = run(
            &["0000:af:00.0", "0000:02:00.0", "0000:3d:00.0"],
            &vm2s,
            &[],
            true,
            &host,
        )
        .unwrap_err();
        assert!(
            e.contains("vm2") && e.contains("enp2s0") && e.contains("mounted"),
            "{e}"
        );
    }

    /// A live hot-plug libvirt reports: an error line for a function the host uses that vfiod
    /// did not attach; nothing for vfiod's own attachments, other functions, unknown aliases.
    #[test]
    fn a_hot_plugged_host_function_is_an_error_naming_the_domain() {
        use crate::host::libvirt::xml::hostdevs;
        let (_dir, kernel, devices) = inventory_devices(false);
        let uses = host_uses(
            &devices,
            &configured(&devices),
            &hostuse::detect(&kernel.sysfs(), &[]),
        );
        let dev = |alias: &str, a: &str| {
            let p: PciAddress = a.parse().unwrap();
            format!(
                "<hostdev mode='subsystem' type='pci' managed='yes'><source><address \
                 domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source>\
                 <alias name='{alias}'/></hostdev>",
                p.domain, p.bus, p.slot, p.function
            )
        };
        let xml = format!(
            "<domain><name>vm1</name><devices>{}{}{}</devices></domain>",
            dev("hostdev0", "0000:02:00.0"),
            dev("hostdev1", "0000:d8:00.0"),
            dev("ua-vfiod-7-0", "0000:3d:00.0"),
        );
        let live = hostdevs(&xml).unwrap();
        let ours = |a: &str| a.starts_with("ua-vfiod-");
        let (f, line) = hot_plugged_host_device("vm1", "hostdev0", &live, &uses, ours).unwrap();
        assert_eq!(f, a("0000:02:00.0"));
        assert!(
            line.starts_with("error: 0000:02:00.0 was hot-plugged into running domain vm1")
                && line.ends_with("used by the host: network interface enp2s0 is up"),
            "{line}"
        );
        for alias in ["hostdev1", "ua-vfiod-7-0", "hostdev9"] {
            assert_eq!(
                hot_plugged_host_device("vm1", alias, &live, &uses, ours),
                None,
                "{alias}"
            );
        }
    }

    #[test]
    fn a_broken_managed_function_refuses_the_start() {
        let (_dir, _kernel, devices) = inventory_devices(true);
        let d = devices
            .iter()
            .find(|d| d.address == a("0000:af:00.0"))
            .unwrap();
        assert_eq!((d.state, d.managed), (State::Broken, true));
        let e = prepare(
            VM1,
            &[d.address],
            &devices,
            &[],
            &[],
            true,
            &HostUses::new(),
            &[],
        )
        .unwrap_err();
        assert!(e.contains("0000:af:00.0 is broken ("), "{e}");
    }

    /// Issue 33's soak: a VF that exists in sysfs but not yet in the records (a split is
    /// creating it, or has just made it) was left to libvirt like a function vfiod does not
    /// manage: the start was answered OK with no claim and no bind, and the VF, once split, could
    /// be claimed by another VM. A VF of a managed PF is vfiod's: refused until recorded (naming
    /// the PF's task when one runs); one of an unmanaged PF, or a function with no PF, is still
    /// left to libvirt.
    #[test]
    fn a_vf_the_records_lack_refuses_the_start_when_its_pf_is_managed() {
        let (_dir, _kernel, devices) = inventory_devices(false);
        let managed_pf = devices
            .iter()
            .find(|d| d.managed && d.role == crate::model::device::Role::Pf && d.total_vfs > 0)
            .expect("a managed SR-IOV PF")
            .address;
        let unmanaged = devices.iter().find(|d| !d.managed).unwrap().address;
        let new_vf = a("0000:ee:02.1");
        assert!(devices.iter().all(|d| d.address != new_vf));
        let run = |unrecorded: &[(PciAddress, PciAddress)], busy: &[(PciAddress, i64)]| {
            prepare(
                VM1,
                &[new_vf],
                &devices,
                &[],
                busy,
                true,
                &HostUses::new(),
                unrecorded,
            )
        };
        let e = run(&[(new_vf, managed_pf)], &[(managed_pf, 7)]).unwrap_err();
        assert!(
            e.contains(&format!(
                "0000:ee:02.1 is busy: task 7 is running on its PF {managed_pf}"
            )),
            "{e}"
        );
        let e = run(&[(new_vf, managed_pf)], &[]).unwrap_err();
        assert!(
            e.contains(&format!(
                "vfiod has not recorded this VF of {managed_pf} yet"
            )),
            "{e}"
        );
        for left_to_libvirt in [vec![(new_vf, unmanaged)], vec![]] {
            assert_eq!(
                run(&left_to_libvirt, &[]),
                Ok(Preparation::default()),
                "{left_to_libvirt:?}"
            );
        }
    }

    /// What the host uses now counts as much as what the last inventory pass recorded: an
    /// interface brought up since, and its IOMMU group-mates.
    #[test]
    fn host_uses_found_now_and_their_group_mates() {
        let (_dir, _kernel, devices) = inventory_devices(false);
        // The records say the NIC is the host's (its interface was up at the last pass): the
        // kernel says it is not any more, and only the kernel is asked.
        assert_eq!(
            devices
                .iter()
                .find(|d| d.address == a("0000:02:00.0"))
                .unwrap()
                .state,
            State::Protected
        );
        let mut detected = BTreeMap::new();
        detected.insert(
            a("0000:d8:00.0"),
            vec!["block device nvme1n1 is held by dm-0 (vg0-data)".to_string()],
        );
        let uses = host_uses(&devices, &configured(&devices), &detected);
        assert_eq!(
            uses[&a("0000:d8:00.0")],
            "block device nvme1n1 is held by dm-0 (vg0-data)"
        );
        assert!(!uses.contains_key(&a("0000:02:00.0")), "{uses:?}");
        assert!(!uses.contains_key(&a(NIC_MATE)), "{uses:?}");
        assert!(!uses.contains_key(&a("0000:af:00.0")));
        // [[protect]] and its group-mate, as the inventory says them.
        assert_eq!(
            uses[&a("0000:17:00.0")],
            "protected by config (address=0000:17:00.0)"
        );
        assert_eq!(
            uses[&a("0000:17:00.1")],
            "shares its IOMMU group with protected device 0000:17:00.0"
        );
        // The NIC's group-mate, through the group, when the kernel says the NIC is used.
        let mut detected = BTreeMap::new();
        detected.insert(
            a("0000:02:00.0"),
            vec!["network interface enp2s0 is up".to_string()],
        );
        let uses = host_uses(&devices, &BTreeMap::new(), &detected);
        assert!(
            uses[&a(NIC_MATE)].starts_with("it shares IOMMU group ")
                && uses[&a(NIC_MATE)]
                    .ends_with("with 0000:02:00.0 (network interface enp2s0 is up)"),
            "{uses:?}"
        );
        let e = refuse_host_devices("vm1", "come here", &[a(NIC_MATE), a("0000:af:00.0")], &uses)
            .unwrap_err();
        assert!(
            e.starts_with("vfiod: domain vm1 cannot come here: 0000:02:00.1 is used by the host: "),
            "{e}"
        );
        assert!(refuse_host_devices("vm1", "start", &[a("0000:af:00.0")], &uses).is_ok());
    }

    #[test]
    fn a_domain_owns_claims_by_uuid_else_by_name() {
        let mut c = claim(1, "0000:01:00.1", "vm1", ClaimState::Claimed, false);
        let by_uuid = DomainId {
            name: "renamed",
            uuid: Some("AAAA"),
        };
        assert!(VM1.owns(&c));
        assert!(!by_uuid.owns(&c));
        c.vm_uuid = Some("aaaa".into());
        assert!(by_uuid.owns(&c));
        let other = DomainId {
            name: "vm1",
            uuid: Some("bbbb"),
        };
        assert!(!other.owns(&c), "the same name, another domain");
    }

    #[test]
    fn started_and_stopped() {
        let claims = [
            claim(1, "0000:01:00.1", "vm1", ClaimState::Claimed, false),
            claim(2, "0000:01:00.2", "vm1", ClaimState::Attached, true),
            claim(3, "0000:01:00.3", "vm2", ClaimState::Claimed, false),
            claim(4, "0000:01:00.4", "vm1", ClaimState::Claimed, true),
        ];
        let assigned = [
            (a("0000:01:00.1"), Some("0000:07:00.0".to_string())),
            (a("0000:01:00.3"), None),
        ];
        let s = started(VM1, &assigned, &claims);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].0.id, s[0].1.as_deref()), (1, Some("0000:07:00.0")));
        let s: Vec<_> = stopped(VM1, &claims)
            .into_iter()
            .map(|(c, a)| (c.id, a))
            .collect();
        assert_eq!(s, [(1, AfterStop::Release), (2, AfterStop::Detach)]);
    }

    #[test]
    fn claims_made_for_a_run() {
        assert!(for_a_run(BY_PREPARE) && for_a_run(BY_INCOMING));
        assert!(!for_a_run("vfioctl (uid 0)") && !for_a_run(""));
    }

    #[test]
    fn operations() {
        assert_eq!(Operation::parse("prepare"), Operation::Prepare);
        assert_eq!(Operation::parse("new-thing"), Operation::Other);
        assert!(Operation::Prepare.may_fail() && Operation::Migrate.may_fail());
        assert!(!Operation::Stopped.may_fail() && !Operation::Reconnect.may_fail());
        assert!(Operation::Migrate.is_filter() && !Operation::Prepare.is_filter());
    }
}
