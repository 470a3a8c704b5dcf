//! Mode policy: which mode a device should be in, and which conversion program gets it there.
//! Pure decisions, no I/O: tested as tables.
//!
//! - separable + `public` scenario => VF mode (split); separable + `private` => PF mode;
//!   a per-device `mode` in the config wins over the scenario.
//! - non-separable => PF only, never converted.
//! - anything not managed (not selected, protected, broken) or a VF => left alone.

use crate::config::{DeviceRule, Scenario};
use crate::model::device::{Device, Mode, Role, State};
use serde::Serialize;

/// The default driver for VFs handed to VMs.
pub const VFIO_PCI: &str = "vfio-pci";

/// Why a PF without a driver cannot be split, and what happens next (a [`Decision::Wait`]).
pub const NO_PF_DRIVER: &str = "(the kernel creates VFs through the PF's driver and none is \
     bound): the split runs when one binds; if none will, load the PF's driver module";

/// Where a device should be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum Target {
    /// Whole device. `driver`: bind the PF (and its IOMMU group) to this driver; `None` leaves
    /// the PF's driver alone.
    Pf { driver: Option<String> },
    /// Split into `num_vfs` VFs, each bound to `vf_driver`.
    Vf { num_vfs: u32, vf_driver: String },
}

/// The policy's answer for one device, with the reason shown by `vfioctl plan`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "decision", rename_all = "lowercase")]
pub enum Decision {
    /// vfiod does not touch this device.
    Leave { reason: String },
    /// The device should be in `target`.
    Target { target: Target, reason: String },
    /// The configuration asks for something this device cannot do.
    Refuse { reason: String },
    /// The device should be in `target` but cannot get there yet: a PF to split that has no
    /// driver, since the kernel creates VFs through the PF's driver (`sriov_numvfs` answers
    /// "no driver bound to device" without one). At boot the PF's driver may bind after vfiod
    /// has started; the pass that sees it bind plans the device again (`Engine::run`).
    Wait { target: Target, reason: String },
}

impl Decision {
    pub fn reason(&self) -> &str {
        match self {
            Decision::Leave { reason }
            | Decision::Target { reason, .. }
            | Decision::Refuse { reason }
            | Decision::Wait { reason, .. } => reason,
        }
    }
}

/// Which PFs this policy splits, for the claim rules (see [`crate::claim::SplitPolicy`]): a PF
/// whose target is VF mode, whatever its mode now, and one waiting for its driver to be split
/// (it is not offered whole meanwhile).
pub fn split_policy(
    settings: std::sync::Arc<crate::config::Settings>,
) -> crate::claim::SplitPolicy {
    crate::claim::SplitPolicy::new(move |d| {
        let rule = settings.rule_for(d.address, d.vendor_id, d.device_id, d.class);
        matches!(
            decide(d, rule, settings.scenario),
            Decision::Target {
                target: Target::Vf { .. },
                ..
            } | Decision::Wait {
                target: Target::Vf { .. },
                ..
            }
        )
    })
}

/// The policy table. `rule` is the first `[[select]]` entry matching the device, if any. A VF
/// is always left alone (its PF's mode decides), whatever `rule` is.
pub fn decide(device: &Device, rule: Option<&DeviceRule>, scenario: Scenario) -> Decision {
    let leave = |r: String| Decision::Leave { reason: r };
    match device.state {
        State::Broken => return leave(format!("broken: {}", device.state_reason)),
        State::Protected => return leave(format!("protected: {}", device.state_reason)),
        // Its mode waits for the clean: the reset and the check must see the device as the
        // last tenant left it, and the next pass applies the policy.
        State::Cleaning => return leave(format!("being cleaned: {}", device.state_reason)),
        State::Usable => {}
    }
    // Before the rule: a VF has no mode of its own, and whether it is selected is its PF's
    // rule, not `rule` (its own ids' match), so "not selected" would be wrong for the VFs of a
    // selected PF.
    if device.role == Role::Vf {
        return leave("a VF follows its PF's mode".into());
    }
    let Some(rule) = rule else {
        return leave("not selected by the configuration".into());
    };
    let vf_driver = rule
        .vf_driver
        .clone()
        .unwrap_or_else(|| VFIO_PCI.to_string());
    if !device.separable {
        return match rule.mode {
            Some(Mode::Vf) => Decision::Refuse {
                reason: "configured mode vf, but the device is non-separable (no SR-IOV): PF only"
                    .into(),
            },
            _ => Decision::Target {
                target: Target::Pf {
                    driver: rule.pf_driver.clone(),
                },
                reason: "non-separable: PF only, never converted".into(),
            },
        };
    }
    let (mode, why) = match (rule.mode, scenario) {
        (Some(Mode::Vf), _) => (Mode::Vf, "the configuration selects vf mode".to_string()),
        (Some(Mode::Pf), _) => (Mode::Pf, "the configuration selects pf mode".to_string()),
        (_, Scenario::Public) => (
            Mode::Vf,
            "scenario public: separable devices are split".to_string(),
        ),
        (_, Scenario::Private) => (
            Mode::Pf,
            "scenario private: separable devices stay whole".to_string(),
        ),
    };
    match mode {
        Mode::Vf => {
            let num_vfs = rule.num_vfs.unwrap_or(device.total_vfs);
            if num_vfs == 0 || num_vfs > device.total_vfs {
                return Decision::Refuse {
                    reason: format!(
                        "num_vfs {num_vfs} is outside 1..={} for this device",
                        device.total_vfs
                    ),
                };
            }
            let target = Target::Vf { num_vfs, vf_driver };
            if device.num_vfs == 0 && device.driver.is_none() {
                return Decision::Wait {
                    target,
                    reason: format!("{why}; waiting for a driver to bind to the PF {NO_PF_DRIVER}"),
                };
            }
            Decision::Target {
                target,
                reason: why,
            }
        }
        _ => Decision::Target {
            target: Target::Pf {
                driver: rule.pf_driver.clone(),
            },
            reason: why,
        },
    }
}

/// The conversion a device needs, from its current mode to its target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "program", rename_all = "lowercase")]
pub enum Program {
    /// Already there: "unchanged" is a result the caller can see.
    Nothing,
    /// PF -> VF.
    Split { num_vfs: u32 },
    /// VF -> PF.
    Restore,
    /// A change of VF count: the kernel refuses non-zero to non-zero, so restore, then split.
    Resplit { from: u32, to: u32 },
    /// VF count right, but some VFs are not on the target driver.
    RebindVfs,
    /// PF mode: move the function (and its IOMMU group) to `driver`.
    Bind { driver: String },
    /// PF mode without a driver: return the group's functions to the drivers they had before
    /// vfiod bound them.
    Unbind,
}

/// What the planner needs to know about a device's current state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Current<'a> {
    pub mode: Mode,
    pub num_vfs: u32,
    /// Drivers of the PF's VFs (VF mode), in VF order.
    pub vf_drivers: &'a [Option<String>],
    /// Drivers of the PF's IOMMU group's endpoints other than bridges (the PF included).
    pub group_drivers: &'a [Option<String>],
    /// Some group member is on a driver vfiod chose: its pre-vfiod driver is recorded and
    /// differs from the current one, or it has an override.
    pub returnable: bool,
}

pub fn program(current: &Current<'_>, target: &Target) -> Program {
    match target {
        Target::Vf { num_vfs, vf_driver } => match current.mode {
            Mode::Vf if current.num_vfs == *num_vfs => {
                if current
                    .vf_drivers
                    .iter()
                    .all(|d| d.as_deref() == Some(vf_driver.as_str()))
                {
                    Program::Nothing
                } else {
                    Program::RebindVfs
                }
            }
            Mode::Vf => Program::Resplit {
                from: current.num_vfs,
                to: *num_vfs,
            },
            _ => Program::Split { num_vfs: *num_vfs },
        },
        Target::Pf { driver } => match current.mode {
            Mode::Vf => Program::Restore,
            _ => match driver {
                Some(d)
                    if !current
                        .group_drivers
                        .iter()
                        .all(|g| g.as_deref() == Some(d.as_str())) =>
                {
                    Program::Bind { driver: d.clone() }
                }
                None if current.returnable => Program::Unbind,
                _ => Program::Nothing,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Selector;
    use crate::model::device::Kind;
    use crate::model::pci::ClassCode;

    fn dev(separable: bool, state: State, role: Role) -> Device {
        Device {
            address: "0000:3b:00.0".parse().unwrap(),
            vendor_id: 0x8086,
            device_id: 0x1572,
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 0,
            class: ClassCode(0x020000),
            vendor_name: String::new(),
            device_name: String::new(),
            kind: Kind::Nic,
            driver: Some("i40e".into()),
            driver_override: None,
            numa_node: None,
            iommu_group: Some(1),
            role,
            separable,
            mode: Mode::Pf,
            total_vfs: if separable { 64 } else { 0 },
            num_vfs: 0,
            parent_pf: None,
            managed: true,
            state,
            state_reason: "why".into(),
        }
    }

    fn rule(mode: Option<Mode>, num_vfs: Option<u32>) -> DeviceRule {
        DeviceRule {
            selector: Selector {
                address: None,
                id: Some((0x8086, None)),
                class: None,
            },
            kind: None,
            mode,
            num_vfs,
            vf_driver: None,
            pf_driver: None,
        }
    }

    fn target_of(d: Decision) -> Option<Target> {
        match d {
            Decision::Target { target, .. } => Some(target),
            _ => None,
        }
    }

    /// separable, scenario, configured mode, configured num_vfs, expected target
    type Row = (bool, Scenario, Option<Mode>, Option<u32>, Option<Target>);

    /// Every (separable, scenario, override) combination for a usable, selected PF.
    #[test]
    fn policy_table() {
        use Scenario::*;
        let vf = |n| {
            Some(Target::Vf {
                num_vfs: n,
                vf_driver: VFIO_PCI.into(),
            })
        };
        let pf = Some(Target::Pf { driver: None });
        #[rustfmt::skip]
        let table: &[Row] = &[
            (true,  Public,  None,           None,     vf(64)),
            (true,  Private, None,           None,     pf.clone()),
            (true,  Public,  Some(Mode::Pf), None,     pf.clone()),
            (true,  Private, Some(Mode::Vf), None,     vf(64)),
            (true,  Private, Some(Mode::Vf), Some(8),  vf(8)),
            (true,  Public,  None,           Some(16), vf(16)),
            (false, Public,  None,           None,     pf.clone()),
            (false, Private, None,           None,     pf.clone()),
            (false, Public,  Some(Mode::Pf), None,     pf.clone()),
            (false, Private, Some(Mode::Vf), None,     None), // refused: cannot split
            (true,  Public,  None,           Some(65), None), // refused: above total
        ];
        for (sep, scenario, mode, n, want) in table {
            let got = decide(
                &dev(*sep, State::Usable, Role::Pf),
                Some(&rule(*mode, *n)),
                *scenario,
            );
            assert_eq!(
                target_of(got.clone()),
                *want,
                "{sep} {scenario:?} {mode:?} {n:?}: {got:?}"
            );
            if want.is_none() {
                assert!(matches!(got, Decision::Refuse { .. }), "{got:?}");
            }
        }
    }

    /// A PF whose driver has not bound yet (at boot, vfiod may start first): a split waits for
    /// it, anything else goes ahead.
    #[test]
    fn a_pf_without_a_driver_waits_for_one_before_a_split() {
        use Scenario::*;
        let bare = |num_vfs| Device {
            driver: None,
            num_vfs,
            mode: if num_vfs > 0 { Mode::Vf } else { Mode::Pf },
            ..dev(true, State::Usable, Role::Pf)
        };
        let vf64 = Target::Vf {
            num_vfs: 64,
            vf_driver: VFIO_PCI.into(),
        };
        #[rustfmt::skip]
        let table: &[(Device, Scenario, Option<Mode>, &str)] = &[
            (bare(0), Public,  None,           "wait"),
            (bare(0), Private, Some(Mode::Vf), "wait"),
            (bare(0), Private, None,           "target"), // PF mode needs no driver
            (bare(0), Public,  Some(Mode::Pf), "target"),
            (bare(8), Public,  None,           "target"), // split already (a resplit)
            (dev(true, State::Usable, Role::Pf), Public, None, "target"),
        ];
        for (d, scenario, mode, want) in table {
            let got = decide(d, Some(&rule(*mode, None)), *scenario);
            let kind = match &got {
                Decision::Wait { target, reason } => {
                    assert_eq!(target, &vf64, "{got:?}");
                    assert!(reason.contains("waiting for a driver"), "{got:?}");
                    assert!(reason.contains("load the PF's driver module"), "{got:?}");
                    "wait"
                }
                Decision::Target { .. } => "target",
                _ => "other",
            };
            assert_eq!(kind, *want, "{:?} {scenario:?} {mode:?}: {got:?}", d.driver);
        }
    }

    #[test]
    fn devices_vfiod_must_leave_alone() {
        for (d, r, word) in [
            (
                dev(true, State::Protected, Role::Pf),
                Some(rule(None, None)),
                "protected",
            ),
            (
                dev(true, State::Broken, Role::Pf),
                Some(rule(None, None)),
                "broken",
            ),
            (dev(true, State::Usable, Role::Pf), None, "not selected"),
            (
                dev(false, State::Usable, Role::Vf),
                Some(rule(None, None)),
                "VF",
            ),
            // A VF whose own ids match no rule: managed through its PF or not, it has no mode.
            (dev(false, State::Usable, Role::Vf), None, "follows its PF"),
        ] {
            let got = decide(&d, r.as_ref(), Scenario::Public);
            assert!(matches!(got, Decision::Leave { .. }), "{got:?}");
            assert!(got.reason().contains(word), "{got:?}");
        }
    }

    /// Every (current mode, target) pair.
    #[test]
    fn program_table() {
        let vfio = Some(VFIO_PCI.to_string());
        let on_vfio = vec![vfio.clone(); 4];
        let mixed = vec![
            vfio.clone(),
            Some("iavf".into()),
            vfio.clone(),
            vfio.clone(),
        ];
        let group_host = vec![
            Some("nouveau".to_string()),
            Some("snd_hda_intel".to_string()),
        ];
        let group_vfio = vec![vfio.clone(), vfio.clone()];
        let cur = |mode, n, vfs: &'static [Option<String>], g: &'static [Option<String>]| Current {
            mode,
            num_vfs: n,
            vf_drivers: vfs,
            group_drivers: g,
            returnable: false,
        };
        let leak = |v: Vec<Option<String>>| -> &'static [Option<String>] {
            Box::leak(v.into_boxed_slice())
        };
        let (on_vfio, mixed, group_host, group_vfio) = (
            leak(on_vfio),
            leak(mixed),
            leak(group_host),
            leak(group_vfio),
        );
        let vf4 = Target::Vf {
            num_vfs: 4,
            vf_driver: VFIO_PCI.into(),
        };
        let vf8 = Target::Vf {
            num_vfs: 8,
            vf_driver: VFIO_PCI.into(),
        };
        let pf = Target::Pf { driver: None };
        let pf_vfio = Target::Pf {
            driver: vfio.clone(),
        };
        #[rustfmt::skip]
        let table: Vec<(Current, &Target, Program)> = vec![
            (cur(Mode::Pf, 0, &[], group_host), &vf4, Program::Split { num_vfs: 4 }),
            (cur(Mode::Vf, 4, on_vfio, group_host), &vf4, Program::Nothing),
            (cur(Mode::Vf, 4, mixed, group_host), &vf4, Program::RebindVfs),
            (cur(Mode::Vf, 4, on_vfio, group_host), &vf8, Program::Resplit { from: 4, to: 8 }),
            (cur(Mode::Vf, 4, on_vfio, group_host), &pf, Program::Restore),
            (cur(Mode::Vf, 4, on_vfio, group_host), &pf_vfio, Program::Restore),
            (cur(Mode::Pf, 0, &[], group_host), &pf, Program::Nothing),
            (cur(Mode::Pf, 0, &[], group_host), &pf_vfio, Program::Bind { driver: VFIO_PCI.into() }),
            (cur(Mode::Pf, 0, &[], group_vfio), &pf_vfio, Program::Nothing),
            (Current { returnable: true, ..cur(Mode::Pf, 0, &[], group_vfio) }, &pf, Program::Unbind),
            (Current { returnable: true, ..cur(Mode::Pf, 0, &[], group_vfio) }, &pf_vfio, Program::Nothing),
        ];
        for (c, t, want) in table {
            assert_eq!(program(&c, t), want, "{c:?} -> {t:?}");
        }
    }
}
