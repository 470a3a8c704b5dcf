//! A claim's life after it is made, as pure decisions: which state a step leads to (attach,
//! detach, release, libvirt's device events), what an attach asks of libvirt (live, config),
//! the names vfiod gives its hostdevs, and what the reconcile with a domain's definitions does
//! to a claim. No I/O: the attach and detach jobs and the engine act on these answers.
//!
//! ```text
//!   claimed ──attach──▶ attaching ──ok──▶ attached ──detach──▶ detaching ──removed──▶ released
//!      │                    └──failed──▶ released      ▲           │ refused
//!      └──release, lease──▶ released                   └───────────┘ (timeout: stays detaching
//!                                                                     until the late event)
//! ```

use crate::model::claim::ClaimState;
use crate::model::pci::PciAddress;

/// What happens to a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// An attach job starts.
    Attach,
    /// libvirt has the hostdevs.
    Attached,
    /// The attach failed: the claim is released (the rule: a failed attach gives the device
    /// back).
    AttachFailed,
    /// A detach job starts.
    Detach,
    /// The domain no longer has the hostdevs: the claim ends and the device returns to the pool.
    Detached,
    /// libvirt or the guest refused the detach: the device is still in the domain.
    DetachRefused,
    /// The guest did not let go in time: the request stands, the records stay, and a late
    /// device-removed event completes it.
    DetachTimedOut,
    /// An operator's release, or a lapsed lease.
    Release,
    /// Out of the domain for a live migration, the reservation kept: the migration takes the VM
    /// away (the claim is then released) or fails (the device is attached again).
    Park,
}

/// Why a step is not possible in a claim's state; each maps to a named D-Bus error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Another step is under way (attaching, detaching).
    #[error("claim {id} is {state}: wait until that ends")]
    Busy { id: i64, state: ClaimState },
    /// The claim's state does not allow it (a release of an attached claim, a detach of a claim
    /// that is not attached).
    #[error("claim {id} is {state}: {hint}")]
    Wrong {
        id: i64,
        state: ClaimState,
        hint: &'static str,
    },
}

/// The state `step` leads to from `state`, or why it cannot be taken. Pure.
pub fn next(id: i64, state: ClaimState, step: Step) -> Result<ClaimState, Refusal> {
    use ClaimState::*;
    let wrong = |hint| Err(Refusal::Wrong { id, state, hint });
    match (state, step) {
        (Released, _) => wrong("it is over"),
        (Claimed, Step::Attach) => Ok(Attaching),
        (Claimed, Step::Release) => Ok(Released),
        (Claimed, _) => wrong("it is not attached"),
        (Attaching, Step::Attached) => Ok(Attached),
        (Attaching, Step::AttachFailed) => Ok(Released),
        (Attaching, _) => Err(Refusal::Busy { id, state }),
        (Attached, Step::Detach) => Ok(Detaching),
        // libvirt removed the device without vfiod asking (a detach by hand): the domain no
        // longer has it, and the VM's reservation stays.
        (Attached, Step::Detached) => Ok(Claimed),
        (Attached, Step::Release) => wrong("its domain has the device: detach it first"),
        (Attached, _) => wrong("it is already attached"),
        (Detaching, Step::Detached) => Ok(Released),
        (Detaching, Step::DetachRefused) => Ok(Attached),
        (Detaching, Step::DetachTimedOut) => Ok(Detaching),
        // A detach that timed out may be asked again.
        (Detaching, Step::Detach) => Ok(Detaching),
        (Detaching, Step::Park) => Ok(Claimed),
        (Detaching, Step::Release) => {
            wrong("its domain may still have the device: the detach must complete first")
        }
        (Detaching, _) => Err(Refusal::Busy { id, state }),
    }
}

/// The alias of the `index`th hostdev of claim `id` in its domain: `ua-` is libvirt's prefix for
/// aliases a client chooses. It names the device in libvirt's device-removed events and marks it
/// as vfiod's in the domain XML, across restarts.
pub fn alias(id: i64, index: usize) -> String {
    format!("ua-vfiod-{id}-{index}")
}

/// The claim and hostdev index an alias of [`alias`] names; `None` for anyone else's alias.
pub fn parse_alias(alias: &str) -> Option<(i64, usize)> {
    let rest = alias.strip_prefix("ua-vfiod-")?;
    let (id, index) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(id) || !digits(index) {
        return None;
    }
    Some((id.parse().ok()?, index.parse().ok()?))
}

/// Which definitions of a domain an attach changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Affect {
    pub live: bool,
    pub config: bool,
}

/// The definitions an attach changes, from its flags (`live`, `config`) and the domain's state.
/// No flag: both when the domain runs, its configuration when it does not. Pure.
pub fn affect(flags: &[String], running: bool, persistent: bool) -> Result<Affect, String> {
    let mut a = Affect {
        live: false,
        config: false,
    };
    for f in flags {
        match f.as_str() {
            "live" => a.live = true,
            "config" => a.config = true,
            other => {
                return Err(format!(
                    "unknown attach flag {other:?} (known: \"live\", \"config\")"
                ))
            }
        }
    }
    if !a.live && !a.config {
        a = Affect {
            live: running,
            config: persistent || !running,
        };
    }
    if a.live && !running {
        return Err(
            "the domain is not running: a live attach needs a running domain (use the \
                    flag \"config\" for its next start)"
                .into(),
        );
    }
    if a.config && !persistent {
        return Err(
            "the domain is transient: it has no configuration to attach to (use the \
                    flag \"live\")"
                .into(),
        );
    }
    Ok(a)
}

/// A hostdev in a domain definition, as the reconcile sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assigned {
    pub source: PciAddress,
    pub alias: Option<String>,
    pub guest_address: Option<String>,
}

/// A domain as the reconcile sees it: `None` definitions are ones it does not have (a stopped
/// domain has no live one, a transient domain no configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainDefinitions {
    pub name: String,
    pub uuid: String,
    pub live: Option<Vec<Assigned>>,
    pub config: Option<Vec<Assigned>>,
}

impl DomainDefinitions {
    /// Whether `definition` (live or config) assigns every one of `functions`.
    fn has_all(definition: &Option<Vec<Assigned>>, functions: &[PciAddress]) -> bool {
        definition
            .as_ref()
            .is_some_and(|d| functions.iter().all(|f| d.iter().any(|a| a.source == *f)))
    }

    fn has_any(definition: &Option<Vec<Assigned>>, functions: &[PciAddress]) -> bool {
        definition
            .as_ref()
            .is_some_and(|d| functions.iter().any(|f| d.iter().any(|a| a.source == *f)))
    }

    /// Where the guest sees `function`, by the live definition.
    pub fn guest_address(&self, function: PciAddress) -> Option<String> {
        self.live
            .as_ref()?
            .iter()
            .find(|a| a.source == function)?
            .guest_address
            .clone()
    }
}

/// What the reconcile does to a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Repair {
    /// Records and libvirt agree.
    Keep,
    /// Only worth reporting; nothing safe to change.
    Report(String),
    /// The domain has the claim's devices: the claim is attached (an attach that completed while
    /// vfiod was down, or devices assigned by hand).
    MarkAttached { why: String },
    /// The domain no longer has the devices, and the VM keeps its reservation.
    BackToClaimed { why: String },
    /// The claim is over (its domain is gone, its detach completed, its attach never happened).
    Release { why: String },
}

/// What to do with a claim in `state` holding `functions` for a VM whose domain is `domain`
/// (`None`: libvirt has no such domain). `for_run`: a libvirt hook made the claim for one run of
/// the domain ([`crate::hook::for_a_run`]), which its `stopped`/`release` hooks end; when vfiod
/// did not hear them (it was not running), the reconcile ends it once the domain is found not
/// running, although the domain's own XML still names the functions. Only for claims no task
/// is working on. Pure.
pub fn reconcile(
    state: ClaimState,
    functions: &[PciAddress],
    persistent: bool,
    for_run: bool,
    domain: Option<&DomainDefinitions>,
) -> Repair {
    use ClaimState::*;
    if let Some(d) = domain.filter(|d| d.live.is_none()) {
        if for_run && !persistent && matches!(state, Claimed | Attached) {
            return Repair::Release {
                why: format!(
                    "{} no longer runs: the libvirt hook claimed it for that run (the domain \
                     stopped while vfiod was not running)",
                    d.name
                ),
            };
        }
    }
    let Some(d) = domain else {
        return match state {
            Claimed | Released => Repair::Keep,
            Attaching => Repair::Release {
                why: "its attach did not complete and its domain does not exist".into(),
            },
            Detaching => Repair::Release {
                why: "its detach completed: the domain no longer exists".into(),
            },
            Attached if persistent => Repair::BackToClaimed {
                why: "its domain no longer exists; the claim is persistent and stays".into(),
            },
            Attached => Repair::Release {
                why: "its domain no longer exists".into(),
            },
        };
    };
    let live = DomainDefinitions::has_all(&d.live, functions);
    let config = DomainDefinitions::has_all(&d.config, functions);
    let anywhere = DomainDefinitions::has_any(&d.live, functions)
        || DomainDefinitions::has_any(&d.config, functions);
    match state {
        Released => Repair::Keep,
        Claimed if live || config => Repair::MarkAttached {
            why: format!("domain {} has its devices", d.name),
        },
        Claimed => Repair::Keep,
        Attaching if live || config => Repair::MarkAttached {
            why: format!("its attach to {} completed", d.name),
        },
        Attaching if anywhere => Repair::Report(format!(
            "its attach to {} completed for some of its functions only",
            d.name
        )),
        Attaching => Repair::Release {
            why: format!("its attach to {} did not complete", d.name),
        },
        Attached if live || config => Repair::Keep,
        Attached if anywhere => {
            Repair::Report(format!("domain {} has only some of its functions", d.name))
        }
        Attached => Repair::BackToClaimed {
            why: format!("domain {} no longer has its devices", d.name),
        },
        Detaching if anywhere => Repair::Keep,
        Detaching => Repair::Release {
            why: format!("its detach from {} completed", d.name),
        },
    }
}

/// Functions a domain has assigned that no active claim holds, among the ones vfiod manages:
/// the reverse mismatch of [`reconcile`]. Pure.
pub fn unclaimed_assignments(
    domain: &DomainDefinitions,
    held: &[PciAddress],
    managed: &dyn Fn(PciAddress) -> bool,
) -> Vec<PciAddress> {
    let mut out: Vec<PciAddress> = domain
        .live
        .iter()
        .chain(domain.config.iter())
        .flatten()
        .map(|a| a.source)
        .filter(|f| managed(*f) && !held.contains(f))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Whether `function`, which `domain` has and no claim holds, is left for the libvirt hook to
/// claim when the domain starts (`auto_claim`): the domain does not run with it, only its
/// configuration names it. So it is after every stop of a domain whose own XML names a managed
/// function (its `stopped` hook released the claim made for the run); not a mismatch to warn
/// about. Pure.
pub fn claimed_at_start(
    domain: &DomainDefinitions,
    function: PciAddress,
    auto_claim: bool,
) -> bool {
    auto_claim && !DomainDefinitions::has_any(&domain.live, &[function])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ClaimState::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn the_state_table() {
        let all = [
            Step::Attach,
            Step::Attached,
            Step::AttachFailed,
            Step::Detach,
            Step::Detached,
            Step::DetachRefused,
            Step::DetachTimedOut,
            Step::Release,
            Step::Park,
        ];
        let expect = |state, step| -> Option<ClaimState> {
            Some(match (state, step) {
                (Claimed, Step::Attach) => Attaching,
                (Claimed, Step::Release) => Released,
                (Attaching, Step::Attached) => Attached,
                (Attaching, Step::AttachFailed) => Released,
                (Attached, Step::Detach) => Detaching,
                (Attached, Step::Detached) => Claimed,
                (Detaching, Step::Detached) => Released,
                (Detaching, Step::DetachRefused) => Attached,
                (Detaching, Step::DetachTimedOut) => Detaching,
                (Detaching, Step::Detach) => Detaching,
                (Detaching, Step::Park) => Claimed,
                _ => return None,
            })
        };
        for state in [Claimed, Attaching, Attached, Detaching, Released] {
            for step in all {
                assert_eq!(
                    next(1, state, step).ok(),
                    expect(state, step),
                    "{state} {step:?}"
                );
            }
        }
        // Refusals say why, and an attach or detach under way is Busy.
        assert_eq!(
            next(3, Attaching, Step::Release),
            Err(Refusal::Busy {
                id: 3,
                state: Attaching
            })
        );
        let e = next(3, Attached, Step::Release).unwrap_err().to_string();
        assert!(e.contains("detach it first"), "{e}");
        let e = next(3, Claimed, Step::Detach).unwrap_err().to_string();
        assert!(e.contains("claim 3 is claimed: it is not attached"), "{e}");
    }

    #[test]
    fn aliases_round_trip_and_ignore_others() {
        assert_eq!(alias(12, 1), "ua-vfiod-12-1");
        assert_eq!(parse_alias("ua-vfiod-12-1"), Some((12, 1)));
        for other in [
            "hostdev0",
            "ua-vfiod-12",
            "ua-vfiod--1",
            "ua-vfiod-x-1",
            "ua-vfiod-1-2-3",
            "ua-other-1-2",
        ] {
            assert_eq!(parse_alias(other), None, "{other}");
        }
    }

    #[test]
    fn attach_flags() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let both = Affect {
            live: true,
            config: true,
        };
        assert_eq!(affect(&[], true, true), Ok(both));
        assert_eq!(
            affect(&[], false, true),
            Ok(Affect {
                live: false,
                config: true
            })
        );
        assert_eq!(
            affect(&[], true, false),
            Ok(Affect {
                live: true,
                config: false
            })
        );
        assert_eq!(
            affect(&f(&["live"]), true, true),
            Ok(Affect {
                live: true,
                config: false
            })
        );
        assert_eq!(affect(&f(&["live", "config"]), true, true), Ok(both));
        assert!(affect(&f(&["live"]), false, true)
            .unwrap_err()
            .contains("not running"));
        assert!(affect(&f(&["config"]), true, false)
            .unwrap_err()
            .contains("transient"));
        assert!(affect(&f(&["hot"]), true, true)
            .unwrap_err()
            .contains("unknown attach flag \"hot\""));
    }

    fn dom(live: Option<&[&str]>, config: Option<&[&str]>) -> DomainDefinitions {
        let defs = |v: &[&str]| {
            v.iter()
                .map(|s| Assigned {
                    source: a(s),
                    alias: None,
                    guest_address: Some("0000:07:00.0".into()),
                })
                .collect()
        };
        DomainDefinitions {
            name: "vm1".into(),
            uuid: "u".into(),
            live: live.map(defs),
            config: config.map(defs),
        }
    }

    #[test]
    fn the_reconcile_table() {
        let f = [a("0000:01:00.1")];
        let with = dom(Some(&["0000:01:00.1"]), Some(&[]));
        let without = dom(Some(&[]), Some(&[]));
        let stopped_with = dom(None, Some(&["0000:01:00.1"]));
        let kind = |r: Repair| match r {
            Repair::Keep => "keep",
            Repair::Report(_) => "report",
            Repair::MarkAttached { .. } => "attached",
            Repair::BackToClaimed { .. } => "claimed",
            Repair::Release { .. } => "release",
        };
        let cases: &[(ClaimState, bool, Option<&DomainDefinitions>, &str)] = &[
            (Claimed, false, None, "keep"),
            (Claimed, false, Some(&without), "keep"),
            (Claimed, false, Some(&with), "attached"),
            (Attaching, false, Some(&with), "attached"),
            (Attaching, false, Some(&stopped_with), "attached"),
            (Attaching, false, Some(&without), "release"),
            (Attaching, false, None, "release"),
            (Attached, false, Some(&with), "keep"),
            (Attached, false, Some(&stopped_with), "keep"),
            (Attached, false, Some(&without), "claimed"),
            (Attached, false, None, "release"),
            (Attached, true, None, "claimed"),
            (Detaching, false, Some(&with), "keep"),
            (Detaching, false, Some(&without), "release"),
            (Detaching, false, None, "release"),
            (Released, false, Some(&with), "keep"),
        ];
        for (state, persistent, d, want) in cases {
            assert_eq!(
                kind(reconcile(*state, &f, *persistent, false, *d)),
                *want,
                "{state} persistent={persistent} {d:?}"
            );
        }
        // A claim the prepare hook made for a run (the domain's XML names the function): the
        // domain stopped while vfiod did not run, so its stopped hook was not heard. Its
        // configuration still names the function; the run is over all the same.
        let for_run: &[(ClaimState, Option<&DomainDefinitions>, &str)] = &[
            (Attached, Some(&stopped_with), "release"),
            (Claimed, Some(&stopped_with), "release"),
            (Attached, Some(&dom(None, Some(&[]))), "release"),
            // Still running, or gone: as for any claim.
            (Attached, Some(&with), "keep"),
            (Claimed, Some(&with), "attached"),
            (Attached, None, "release"),
            (Detaching, Some(&stopped_with), "keep"),
        ];
        for (state, d, want) in for_run {
            assert_eq!(
                kind(reconcile(*state, &f, false, true, *d)),
                *want,
                "{state} for its run {d:?}"
            );
        }
        // A persistent claim outlives the run even if a hook made it.
        assert_eq!(
            kind(reconcile(Attached, &f, true, true, Some(&stopped_with))),
            "keep"
        );
        // A claim of two functions (a GPU and its audio) with one in the domain: reported only.
        let two = [a("0000:01:00.1"), a("0000:01:00.2")];
        assert!(matches!(
            reconcile(Attached, &two, false, false, Some(&with)),
            Repair::Report(_)
        ));
        assert_eq!(with.guest_address(f[0]).as_deref(), Some("0000:07:00.0"));
    }

    #[test]
    fn assignments_no_claim_holds() {
        let d = dom(
            Some(&["0000:01:00.1", "0000:01:00.2"]),
            Some(&["0000:01:00.2", "0000:02:00.0"]),
        );
        let managed = |f: PciAddress| f != a("0000:02:00.0");
        assert_eq!(
            unclaimed_assignments(&d, &[a("0000:01:00.1")], &managed),
            vec![a("0000:01:00.2")]
        );
        // In the running domain: a mismatch. In its configuration only (a stopped domain whose
        // XML names it): the hook claims it at the next start, unless auto_claim is off.
        assert!(!claimed_at_start(&d, a("0000:01:00.2"), true));
        let stopped = dom(None, Some(&["0000:01:00.2"]));
        assert!(claimed_at_start(&stopped, a("0000:01:00.2"), true));
        assert!(!claimed_at_start(&stopped, a("0000:01:00.2"), false));
        let config_only = dom(Some(&[]), Some(&["0000:01:00.2"]));
        assert!(claimed_at_start(&config_only, a("0000:01:00.2"), true));
    }
}
