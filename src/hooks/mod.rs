//! libvirt's qemu hook, decided: what vfiod answers when libvirt runs
//! `/etc/libvirt/hooks/qemu.d/vfiod DOMAIN OPERATION SUB-OPERATION EXTRA` with the domain XML on
//! stdin (`vfioctl hook qemu` forwards it in one D-Bus call, `Manager.Hook`). Pure: the engine
//! reads the records, calls these functions, and carries out their answer
//! (`engine::hooks`). A hook must never call libvirt back (libvirt waits for it), so everything
//! is decided from the XML it was given and vfiod's own records.
//!
//! | operation           | answer                                                                   |
//! |---------------------|--------------------------------------------------------------------------|
//! | `prepare begin`     | every managed PCI function of the domain is its claim's, or is claimed now (`[hooks] auto_claim`), and bound to vfio-pci; otherwise exit 1 with one line for the user |
//! | `started begin`     | the domain's claims are attached, with the guest addresses of the XML     |
//! | `stopped`, `release`| the domain's claims are detached; those for the VM's run are released     |
//! | `reconnect begin`   | a reconcile is scheduled; never fails                                    |
//! | `migrate`, `restore`| XML filters: empty output (unchanged)                                    |
//! | anything else       | exit 0                                                                   |

use crate::model::claim::ClaimState;
use crate::model::device::{Device, State};
use crate::model::pci::PciAddress;
use crate::store::ClaimRecord;

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
/// what to do first. `Err` is the one line libvirt shows the user. Functions vfiod does not
/// manage (or does not know) are left alone. Pure.
pub fn prepare(
    domain: DomainId<'_>,
    functions: &[PciAddress],
    devices: &[Device],
    claims: &[ClaimRecord],
    busy: &[(PciAddress, i64)],
    auto_claim: bool,
) -> Result<Preparation, String> {
    let mut out = Preparation::default();
    let mut problems = Vec::new();
    for f in functions {
        let Some(d) = devices.iter().find(|d| d.address == *f) else {
            continue;
        };
        if !d.managed {
            continue;
        }
        match d.state {
            State::Usable => {}
            State::Broken => problems.push(format!("{f} is broken ({})", d.state_reason)),
            State::Protected => problems.push(format!("{f} is protected ({})", d.state_reason)),
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
    use crate::model::device::{Kind, Mode, Role};
    use crate::model::pci::ClassCode;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn dev(address: &str, managed: bool, state: State) -> Device {
        Device {
            address: a(address),
            vendor_id: 0x1b36,
            device_id: 0x0010,
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 2,
            class: ClassCode(0x010802),
            vendor_name: String::new(),
            device_name: String::new(),
            kind: Kind::Nvme,
            driver: Some("vfio-pci".into()),
            driver_override: None,
            numa_node: None,
            iommu_group: None,
            role: Role::Vf,
            separable: false,
            mode: Mode::None,
            total_vfs: 0,
            num_vfs: 0,
            parent_pf: None,
            managed,
            state,
            state_reason: match state {
                State::Usable => String::new(),
                State::Broken => "config space reads all-ones".into(),
                State::Protected => "mounted at /".into(),
            },
        }
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
    fn prepare_table() {
        let devices = [
            dev("0000:01:00.1", true, State::Usable),
            dev("0000:01:00.2", true, State::Usable),
            dev("0000:01:00.3", true, State::Broken),
            dev("0000:01:00.4", true, State::Protected),
            dev("0000:02:00.0", false, State::Usable),
        ];
        let claims = [
            claim(1, "0000:01:00.1", "vm1", ClaimState::Claimed, false),
            claim(2, "0000:01:00.2", "vm2", ClaimState::Attached, false),
            claim(3, "0000:01:00.5", "vm1", ClaimState::Released, false),
        ];
        let busy = [(a("0000:01:00.6"), 9)];
        let mut devices = devices.to_vec();
        devices.push(dev("0000:01:00.6", true, State::Usable));
        devices.push(dev("0000:01:00.5", true, State::Usable));
        let f = |v: &[&str]| v.iter().map(|s| a(s)).collect::<Vec<_>>();
        let run = |fs: &[&str], auto| prepare(VM1, &f(fs), &devices, &claims, &busy, auto);

        // Its own claim, an unmanaged function, a function vfiod does not know: fine.
        assert_eq!(
            run(&["0000:01:00.1", "0000:02:00.0", "0000:09:00.0"], false),
            Ok(Preparation {
                to_claim: vec![],
                to_bind: f(&["0000:01:00.1"]),
            })
        );
        // Unclaimed (a released claim does not count): claimed now, or refused without
        // auto_claim.
        assert_eq!(
            run(&["0000:01:00.5"], true),
            Ok(Preparation {
                to_claim: f(&["0000:01:00.5"]),
                to_bind: f(&["0000:01:00.5"]),
            })
        );
        let e = run(&["0000:01:00.5"], false).unwrap_err();
        assert!(
            e.contains("not claimed for vm1") && e.contains("auto_claim"),
            "{e}"
        );
        for (function, says) in [
            (
                "0000:01:00.2",
                "0000:01:00.2 is claimed by VM vm2 (claim 2)",
            ),
            (
                "0000:01:00.3",
                "0000:01:00.3 is broken (config space reads all-ones)",
            ),
            ("0000:01:00.4", "0000:01:00.4 is protected (mounted at /)"),
            (
                "0000:01:00.6",
                "0000:01:00.6 is busy: task 9 is running on it",
            ),
        ] {
            let e = run(&[function], true).unwrap_err();
            assert!(e.starts_with("vfiod: domain vm1 cannot start: "), "{e}");
            assert!(e.contains(says), "{e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
        // Every problem in the one line.
        let e = run(&["0000:01:00.2", "0000:01:00.3"], true).unwrap_err();
        assert!(e.contains("vm2") && e.contains("broken"), "{e}");
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
