//! How a claim's functions are reset when the claim ends: each function alone by its own
//! methods, the whole group at once through the upstream bridge, or not at all.
//!
//! Linux offers a function-level reset through `DEVICE/reset`, which tries the methods
//! `DEVICE/reset_method` lists (`device_specific acpi flr af_flr pm bus cxl_bus`, in the
//! kernel's order) until one works. A function alone on its bus may list `bus`; a
//! multi-function device (a GPU and its HDMI audio) never does, since resetting the bus would
//! reset the sibling too. Such a group is reset through its bridge's `reset_subordinate`
//! (recent kernels, Debian 12's 6.1.192 among them; older ones have no group reset), which is
//! legal only when every function on that bus is being cleaned.
//!
//! The rules of [`plan`], in order:
//!
//! | the claim's functions | and the bus below their bridge | plan |
//! |---|---|---|
//! | every one has a method of its own | (not looked at) | [`ResetPlan::Each`], nothing without |
//! | some have none, none has resets disabled | `reset_subordinate` shown, every function on it is in the claim | [`ResetPlan::Group`] |
//! | some have none | no group reset ([`NoGroup`] says why) | [`ResetPlan::Each`] for those that have one, the rest `without` |
//! | none has one | no group reset | [`ResetPlan::Nothing`] |
//!
//! A function "has a method of its own" when `reset_method` lists one, or, on a kernel older
//! than 5.15 without `reset_method`, when it shows `reset`. An empty `reset_method` next to a
//! `reset` means an operator disabled its resets: it is not reset alone, and not through the
//! bus either. Each function's order is [`reset_order`]: the kernel's list with the method that
//! worked last time first, so that a function whose first listed method never works does not
//! spend that method's timeout at every clean.

use crate::model::pci::PciAddress;
use std::collections::{BTreeMap, BTreeSet};

/// What the kernel shows about one function's resets (read by
/// `host::sysfs::reset::read_methods`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResetMethods {
    pub address: PciAddress,
    /// What `reset_method` lists, in order; `None`: no such attribute (no reset method at all,
    /// or a kernel older than 5.15).
    pub listed: Option<Vec<String>>,
    /// The function shows `reset`.
    pub reset: bool,
}

impl ResetMethods {
    /// It can be reset alone: a listed method, or `reset` on a kernel without `reset_method`.
    fn own(&self) -> bool {
        match &self.listed {
            Some(l) => !l.is_empty(),
            None => self.reset,
        }
    }

    /// An operator disabled its resets (an empty `reset_method`).
    fn disabled(&self) -> bool {
        self.listed.as_ref().is_some_and(Vec::is_empty)
    }
}

/// The bridge above a claim's functions and its secondary bus (read by
/// `host::sysfs::reset::read_bus`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bus {
    pub bridge: PciAddress,
    /// The bridge shows `reset_subordinate`.
    pub reset_subordinate: bool,
    /// Every function a reset of the bus resets: all below the bridge, at any depth.
    pub functions: Vec<PciAddress>,
}

/// One function reset alone: `reset_function` with these methods, in this order. Empty on a
/// kernel without `reset_method`, where the one plain `reset` is all there is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionReset {
    pub address: PciAddress,
    pub order: Vec<String>,
}

/// Why a claim's functions cannot be reset together through their bridge.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoGroup {
    #[error("the functions are not all below one bridge")]
    NoBridge,
    #[error("bridge {0} shows no reset_subordinate (the kernel has no group reset)")]
    NoAttribute(PciAddress),
    #[error("the bus below bridge {bridge} also holds {}, not being cleaned", list(.others))]
    OthersOnBus {
        bridge: PciAddress,
        others: Vec<PciAddress>,
    },
    #[error("resets of {} are disabled (reset_method is empty)", list(.0))]
    Disabled(Vec<PciAddress>),
}

fn list(addresses: &[PciAddress]) -> String {
    addresses
        .iter()
        .map(PciAddress::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// How a claim's functions are reset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResetPlan {
    /// Each function in `resets` alone; those in `without` have no reset, and `no_group` says
    /// why the bus reset cannot cover them (`None` when `without` is empty).
    Each {
        resets: Vec<FunctionReset>,
        without: Vec<PciAddress>,
        no_group: Option<NoGroup>,
    },
    /// The whole bus below `bridge` at once (`reset_group`): every function on it is the
    /// claim's.
    Group { bridge: PciAddress },
    /// Nothing can reset any of the functions.
    Nothing { no_group: NoGroup },
}

/// The order in which to try a function's reset methods: the kernel's listed order, but the
/// method that worked last time first (when it is still listed). Names vfiod does not know keep
/// their place; nothing listed gives nothing.
pub fn reset_order(listed: &[String], last_worked: Option<&str>) -> Vec<String> {
    let first = last_worked.filter(|w| listed.iter().any(|m| m == w));
    first
        .map(str::to_string)
        .into_iter()
        .chain(listed.iter().filter(|m| Some(m.as_str()) != first).cloned())
        .collect()
}

/// Whether the bus below `bus.bridge` may be reset to clean `functions`: only when the bridge
/// shows `reset_subordinate` and every function on the bus is one of them.
pub fn group_allowed(bus: &Bus, functions: &[PciAddress]) -> Result<(), NoGroup> {
    if !bus.reset_subordinate {
        return Err(NoGroup::NoAttribute(bus.bridge));
    }
    let ours: BTreeSet<&PciAddress> = functions.iter().collect();
    let others: Vec<PciAddress> = bus
        .functions
        .iter()
        .filter(|a| !ours.contains(a))
        .copied()
        .collect();
    if !others.is_empty() {
        return Err(NoGroup::OthersOnBus {
            bridge: bus.bridge,
            others,
        });
    }
    Ok(())
}

/// How to reset a claim's `functions` (see the table in the module's header). `last_worked`
/// is each function's method that worked at its last reset; `bus` the bridge above them all
/// (`None`: they are not below one bridge).
pub fn plan(
    functions: &[ResetMethods],
    last_worked: &BTreeMap<PciAddress, String>,
    bus: Option<&Bus>,
) -> ResetPlan {
    let (own, without): (Vec<&ResetMethods>, Vec<&ResetMethods>) =
        functions.iter().partition(|f| f.own());
    let resets: Vec<FunctionReset> = own
        .iter()
        .map(|f| FunctionReset {
            address: f.address,
            order: reset_order(
                f.listed.as_deref().unwrap_or_default(),
                last_worked.get(&f.address).map(String::as_str),
            ),
        })
        .collect();
    if without.is_empty() {
        return ResetPlan::Each {
            resets,
            without: Vec::new(),
            no_group: None,
        };
    }
    let disabled: Vec<PciAddress> = functions
        .iter()
        .filter(|f| f.disabled())
        .map(|f| f.address)
        .collect();
    let addresses: Vec<PciAddress> = functions.iter().map(|f| f.address).collect();
    let group = if !disabled.is_empty() {
        Err(NoGroup::Disabled(disabled))
    } else {
        match bus {
            None => Err(NoGroup::NoBridge),
            Some(b) => group_allowed(b, &addresses).map(|()| b.bridge),
        }
    };
    match group {
        Ok(bridge) => ResetPlan::Group { bridge },
        Err(no_group) if resets.is_empty() => ResetPlan::Nothing { no_group },
        Err(no_group) => ResetPlan::Each {
            resets,
            without: without.iter().map(|f| f.address).collect(),
            no_group: Some(no_group),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|m| m.to_string()).collect()
    }

    #[test]
    fn reset_order_puts_the_last_method_that_worked_first() {
        let table: &[(&[&str], Option<&str>, &[&str])] = &[
            // listed, last worked, order
            (&["flr", "bus"], None, &["flr", "bus"]),
            (&["flr", "bus"], Some("bus"), &["bus", "flr"]),
            (&["flr", "bus"], Some("flr"), &["flr", "bus"]),
            (
                &["acpi", "flr", "pm", "bus"],
                Some("pm"),
                &["pm", "acpi", "flr", "bus"],
            ),
            // No longer listed (an operator took it out): the kernel's order.
            (&["flr", "bus"], Some("pm"), &["flr", "bus"]),
            (&["flr"], Some("reset_subordinate"), &["flr"]),
            (&["flr"], Some("default"), &["flr"]),
            // Names vfiod does not know keep their place.
            (
                &["vendor_x", "flr", "bus"],
                Some("bus"),
                &["bus", "vendor_x", "flr"],
            ),
            (&["flr", "vendor_x"], Some("vendor_x"), &["vendor_x", "flr"]),
            (&[], None, &[]),
            (&[], Some("flr"), &[]),
        ];
        for (listed, last, want) in table {
            assert_eq!(
                reset_order(&names(listed), *last),
                names(want),
                "listed {listed:?}, last worked {last:?}"
            );
        }
    }

    fn methods(address: &str, listed: Option<&[&str]>, reset: bool) -> ResetMethods {
        ResetMethods {
            address: a(address),
            listed: listed.map(names),
            reset,
        }
    }

    const GPU: &str = "0000:17:00.0";
    const AUDIO: &str = "0000:17:00.1";
    const PORT: &str = "0000:00:01.0";

    fn bus(reset_subordinate: bool, functions: &[&str]) -> Bus {
        Bus {
            bridge: a(PORT),
            reset_subordinate,
            functions: functions.iter().map(|f| a(f)).collect(),
        }
    }

    fn each(resets: &[(&str, &[&str])], without: &[&str], no_group: Option<NoGroup>) -> ResetPlan {
        ResetPlan::Each {
            resets: resets
                .iter()
                .map(|(f, order)| FunctionReset {
                    address: a(f),
                    order: names(order),
                })
                .collect(),
            without: without.iter().map(|f| a(f)).collect(),
            no_group,
        }
    }

    #[test]
    fn plan_table() {
        let flr: Option<&[&str]> = Some(&["flr", "bus"]);
        let none: Option<&[&str]> = None;
        let empty: Option<&[&str]> = Some(&[]);
        let pair = [GPU, AUDIO];
        let table: Vec<(&str, Vec<ResetMethods>, Option<Bus>, ResetPlan)> = vec![
            (
                "each function has its own: each alone, the bus is not looked at",
                vec![methods(GPU, flr, true), methods(AUDIO, Some(&["pm"]), true)],
                Some(bus(true, &pair)),
                each(&[(GPU, &["bus", "flr"]), (AUDIO, &["pm"])], &[], None),
            ),
            (
                "an old kernel's plain reset counts as a method of its own",
                vec![methods(GPU, none, true)],
                None,
                each(&[(GPU, &[])], &[], None),
            ),
            (
                "the GPU and its audio have none: the group through the bridge",
                vec![methods(GPU, none, false), methods(AUDIO, none, false)],
                Some(bus(true, &pair)),
                ResetPlan::Group { bridge: a(PORT) },
            ),
            (
                "one without a method is enough to prefer the group, which covers both",
                vec![methods(GPU, flr, true), methods(AUDIO, none, false)],
                Some(bus(true, &pair)),
                ResetPlan::Group { bridge: a(PORT) },
            ),
            (
                "no reset_subordinate: nothing",
                vec![methods(GPU, none, false), methods(AUDIO, none, false)],
                Some(bus(false, &pair)),
                ResetPlan::Nothing {
                    no_group: NoGroup::NoAttribute(a(PORT)),
                },
            ),
            (
                "another function on the bus: the group reset would hit it",
                vec![methods(GPU, none, false)],
                Some(bus(true, &pair)),
                ResetPlan::Nothing {
                    no_group: NoGroup::OthersOnBus {
                        bridge: a(PORT),
                        others: vec![a(AUDIO)],
                    },
                },
            ),
            (
                "not below one bridge",
                vec![methods(GPU, none, false), methods(AUDIO, none, false)],
                None,
                ResetPlan::Nothing {
                    no_group: NoGroup::NoBridge,
                },
            ),
            (
                "no group possible: those with a method alone, the rest without",
                vec![methods(GPU, flr, true), methods(AUDIO, none, false)],
                Some(bus(false, &pair)),
                each(
                    &[(GPU, &["bus", "flr"])],
                    &[AUDIO],
                    Some(NoGroup::NoAttribute(a(PORT))),
                ),
            ),
            (
                "resets disabled by an operator: not reset, not even through the bus",
                vec![methods(GPU, empty, true), methods(AUDIO, none, false)],
                Some(bus(true, &pair)),
                ResetPlan::Nothing {
                    no_group: NoGroup::Disabled(vec![a(GPU)]),
                },
            ),
        ];
        let last_worked: BTreeMap<PciAddress, String> = [(a(GPU), "bus".to_string())].into();
        for (what, functions, bus, want) in table {
            assert_eq!(plan(&functions, &last_worked, bus.as_ref()), want, "{what}");
        }
    }

    #[test]
    fn no_group_reads_as_a_reason() {
        let table = [
            (
                NoGroup::NoBridge,
                "the functions are not all below one bridge",
            ),
            (
                NoGroup::NoAttribute(a(PORT)),
                "bridge 0000:00:01.0 shows no reset_subordinate (the kernel has no group reset)",
            ),
            (
                NoGroup::OthersOnBus {
                    bridge: a(PORT),
                    others: vec![a(GPU), a(AUDIO)],
                },
                "the bus below bridge 0000:00:01.0 also holds 0000:17:00.0, 0000:17:00.1, \
                 not being cleaned",
            ),
            (
                NoGroup::Disabled(vec![a(GPU)]),
                "resets of 0000:17:00.0 are disabled (reset_method is empty)",
            ),
        ];
        for (reason, text) in table {
            assert_eq!(reason.to_string(), text);
        }
    }
}
