//! Resetting PCI functions through sysfs, and what the health check reads afterwards.
//!
//! [`reset_function`] tries a function's reset methods one at a time: it writes one method to
//! `reset_method`, checks the kernel took it, writes `1` to `reset`, and stops at the first
//! that works; then it puts back the list it read first, whatever happened. It uses only the
//! methods that list holds: what an operator took out of it (or an empty list) stays unused. [`reset_group`]
//! resets the whole bus below the claim's bridge through `reset_subordinate`, only when every
//! function on that bus is the claim's. Each reset write is bounded by the caller's timeout
//! (the writer's bounded writes, `Sysfs::write`): a reset that hangs is abandoned, its thread
//! left stuck in the kernel, and reported `hung`; nothing more is written to that function.
//!
//! These block for up to the timeout per write: call them off the async threads. What to reset
//! and in which order is decided in `clean::reset`; whether the function came back healthy in
//! `clean::health`, from what [`observe`] reads.

use super::{Sysfs, SysfsError};
use crate::clean::health::Observed;
use crate::clean::reset::{group_allowed, Bus, ResetMethods};
use crate::model::pci::PciAddress;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The method name of the one plain `reset` of a kernel without `reset_method` (before 5.15).
pub const DEFAULT_METHOD: &str = "default";
/// The method name of a reset of the whole bus through the bridge.
pub const GROUP_METHOD: &str = "reset_subordinate";

/// One reset method tried: how long the reset took, or why it did not work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    pub method: String,
    pub outcome: Result<Duration, String>,
}

/// What a reset did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResetReport {
    /// Every method tried, in order.
    pub attempts: Vec<Attempt>,
    /// The method that worked and how long its reset took.
    pub worked: Option<(String, Duration)>,
    /// A reset write did not finish within the timeout: it was abandoned (its thread is still
    /// in the kernel) and nothing else was tried or written.
    pub hung: bool,
    /// There was nothing to try: no reset attribute, or no method to try.
    pub none_available: bool,
    /// Why nothing was tried at all (a group reset refused, the function unreadable); nothing
    /// was written.
    pub refused: Option<String>,
    /// `reset_method` could not be put back as it was read first, and why (after a hang it is
    /// not even tried). `None`: put back, or never changed.
    pub not_restored: Option<String>,
    /// A read or write failed for vfiod's own lack of descriptors or memory (EMFILE, ENFILE,
    /// ENOMEM), which says nothing about the device: the reset is to be tried again, and the
    /// device not blamed.
    pub shortage: bool,
}

fn names_in(sysfs: &Sysfs, dir: &Path) -> Result<BTreeSet<String>, SysfsError> {
    let names = sysfs
        .backend()
        .read_dir(dir)
        .map_err(|source| SysfsError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(names
        .into_iter()
        .filter_map(|n| n.into_string().ok())
        .collect())
}

fn listed(sysfs: &Sysfs, address: PciAddress) -> Result<Vec<String>, SysfsError> {
    Ok(sysfs
        .read_text(&sysfs.device_attr(address, "reset_method"))?
        .split_whitespace()
        .map(str::to_string)
        .collect())
}

/// What the kernel shows about a function's resets: `reset_method`'s list (when there is one)
/// and whether `reset` exists. Read-only.
pub fn read_methods(sysfs: &Sysfs, address: PciAddress) -> Result<ResetMethods, SysfsError> {
    let names = names_in(sysfs, &sysfs.device_dir(address))?;
    let listed = if names.contains("reset_method") {
        Some(listed(sysfs, address)?)
    } else {
        None
    };
    Ok(ResetMethods {
        address,
        listed,
        reset: names.contains("reset"),
    })
}

/// The function's directory under its parent: the parent's address when that is a bridge
/// (`None` on a root bus, whose parent is `pciDDDD:BB`).
fn parent_bridge(sysfs: &Sysfs, address: PciAddress) -> Result<Option<PathBuf>, SysfsError> {
    let dir = sysfs.device_dir(address);
    let real = sysfs
        .backend()
        .canonicalize(&dir)
        .map_err(|source| SysfsError::Read { path: dir, source })?;
    Ok(real
        .parent()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.parse::<PciAddress>().is_ok())
        })
        .map(Path::to_path_buf))
}

/// Every function below a bridge's directory, at any depth.
fn functions_below(sysfs: &Sysfs, dir: &Path, out: &mut Vec<PciAddress>) -> Result<(), SysfsError> {
    for name in names_in(sysfs, dir)? {
        if let Ok(a) = name.parse::<PciAddress>() {
            out.push(a);
            functions_below(sysfs, &dir.join(&name), out)?;
        }
    }
    Ok(())
}

/// The bridge all `functions` are directly below, whether it shows `reset_subordinate`, and
/// every function a reset of its bus would reset. `None` when they are not all below one
/// bridge. Read-only.
pub fn read_bus(sysfs: &Sysfs, functions: &[PciAddress]) -> Result<Option<Bus>, SysfsError> {
    let mut bridge_dir = None;
    for &f in functions {
        let Some(dir) = parent_bridge(sysfs, f)? else {
            return Ok(None);
        };
        match &bridge_dir {
            Some(d) if *d != dir => return Ok(None),
            _ => bridge_dir = Some(dir),
        }
    }
    let Some(dir) = bridge_dir else {
        return Ok(None);
    };
    let bridge: PciAddress = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .expect("parent_bridge keeps only directories named by an address");
    let mut below = Vec::new();
    functions_below(sysfs, &dir, &mut below)?;
    below.sort();
    Ok(Some(Bus {
        bridge,
        reset_subordinate: names_in(sysfs, &dir)?.contains(GROUP_METHOD),
        functions: below,
    }))
}

/// One bounded reset write: how long it took, or why it failed; `Err(None)` when it hung.
fn reset_write(sysfs: &Sysfs, path: &Path) -> Result<Duration, Option<SysfsError>> {
    let start = Instant::now();
    match sysfs.write(path, "1") {
        Ok(()) => Ok(start.elapsed()),
        Err(SysfsError::WriteTimeout { .. }) => Err(None),
        Err(e) => Err(Some(e)),
    }
}

fn hung(timeout: Duration) -> String {
    format!("did not finish within {timeout:?}: abandoned")
}

/// Resets one function, trying each method of `order` alone, in order, until one works (see
/// the module's header). Only methods `reset_method` lists are tried: one it does not list is
/// a failed attempt with nothing written, and an empty list (resets disabled) or no listed
/// method in `order` is `none_available`. On a kernel without `reset_method` but with `reset`,
/// `order` is not used: one plain reset, method [`DEFAULT_METHOD`]. Each write is bounded by
/// `timeout`.
pub fn reset_function(
    sysfs: &Sysfs,
    address: PciAddress,
    order: &[String],
    timeout: Duration,
) -> ResetReport {
    let bounded = sysfs.clone().with_write_timeout(timeout);
    let mut report = ResetReport::default();
    let methods = match read_methods(sysfs, address) {
        Ok(m) => m,
        Err(e) => {
            report.refused = Some(report.why(&e));
            return report;
        }
    };
    let reset = sysfs.device_attr(address, "reset");
    let original = match methods.listed {
        None if !methods.reset => {
            report.none_available = true;
            return report;
        }
        None => {
            let outcome = reset_write(&bounded, &reset).map_err(|e| e.map(|e| report.why(&e)));
            report.record(DEFAULT_METHOD, outcome, timeout);
            return report;
        }
        // An empty list is an operator's "never reset this function".
        Some(l) if l.is_empty() || order.is_empty() => {
            report.none_available = true;
            return report;
        }
        Some(l) => l,
    };
    let reset_method = sysfs.device_attr(address, "reset_method");
    let mut wrote = false;
    for method in order {
        // A method not in the list is one the kernel does not offer or an operator took out
        // (one that hangs this device, say): never used, nothing written for it.
        if !original.contains(method) {
            report.attempts.push(Attempt {
                method: method.clone(),
                outcome: Err(format!(
                    "not enabled: reset_method reads {:?}",
                    original.join(" ")
                )),
            });
            continue;
        }
        wrote = true;
        // One method alone, so that the kernel tries only it and the report can say which
        // worked. The kernel refuses a name it does not support (EINVAL, list unchanged); the
        // list is read back anyway, so that the reset never runs a method other than this
        // one (another writer, a kernel that behaves otherwise).
        let taken = match bounded.write(&reset_method, method) {
            Err(SysfsError::WriteTimeout { .. }) => {
                report.record(method, Err(None), timeout);
                break;
            }
            Err(e) => Err(report.why(&e)),
            Ok(()) => match listed(sysfs, address) {
                Ok(now) if now == [method.as_str()] => Ok(()),
                Ok(now) => Err(format!(
                    "the kernel did not take {method}: reset_method reads {:?}",
                    now.join(" ")
                )),
                Err(e) => Err(report.why(&e)),
            },
        };
        if let Err(why) = taken {
            report.attempts.push(Attempt {
                method: method.clone(),
                outcome: Err(why),
            });
            continue;
        }
        let outcome = reset_write(&bounded, &reset).map_err(|e| e.map(|e| report.why(&e)));
        // After a hang nothing more is written to the function: its reset still holds it.
        if report.record(method, outcome, timeout) || report.hung {
            break;
        }
    }
    if !wrote {
        report.none_available = true;
        return report;
    }
    if report.hung {
        report.not_restored = Some(format!(
            "reset_method not put back to {:?}: a write hung and is still in the kernel",
            original.join(" ")
        ));
        return report;
    }
    // An empty line is how an empty list is written (a write of nothing stores nothing).
    let value = if original.is_empty() {
        "\n".to_string()
    } else {
        original.join(" ")
    };
    report.not_restored = match bounded.write(&reset_method, &value) {
        Err(e) => Some(report.why(&e)),
        Ok(()) => match listed(sysfs, address) {
            Ok(now) if now == original => None,
            Ok(now) => Some(format!(
                "reset_method reads {:?} instead of {:?}",
                now.join(" "),
                original.join(" ")
            )),
            Err(e) => Some(report.why(&e)),
        },
    };
    report
}

/// Resets the whole bus below the bridge that `functions` are below, through its
/// `reset_subordinate`, bounded by `timeout`. Refused, with nothing written, unless every
/// function on that bus is in `functions`; `none_available` when the bridge does not show
/// `reset_subordinate`.
pub fn reset_group(sysfs: &Sysfs, functions: &[PciAddress], timeout: Duration) -> ResetReport {
    let mut report = ResetReport::default();
    let bus = match read_bus(sysfs, functions) {
        Ok(Some(bus)) => bus,
        Ok(None) => {
            report.refused = Some(crate::clean::reset::NoGroup::NoBridge.to_string());
            return report;
        }
        Err(e) => {
            report.refused = Some(report.why(&e));
            return report;
        }
    };
    match group_allowed(&bus, functions) {
        Ok(()) => {}
        Err(crate::clean::reset::NoGroup::NoAttribute(_)) => {
            report.none_available = true;
            return report;
        }
        Err(e) => {
            report.refused = Some(e.to_string());
            return report;
        }
    }
    let bounded = sysfs.clone().with_write_timeout(timeout);
    let outcome = reset_write(&bounded, &sysfs.device_attr(bus.bridge, GROUP_METHOD))
        .map_err(|e| e.map(|e| report.why(&e)));
    report.record(GROUP_METHOD, outcome, timeout);
    report
}

impl ResetReport {
    /// Why `e` failed, on one line; notes a failure that is vfiod's own shortage.
    fn why(&mut self, e: &SysfsError) -> String {
        self.shortage |= e.is_own_shortage();
        crate::error_chain(e)
    }

    /// Adds an attempt at a reset write; true when it worked.
    fn record(
        &mut self,
        method: &str,
        outcome: Result<Duration, Option<String>>,
        timeout: Duration,
    ) -> bool {
        let outcome = match outcome {
            Ok(took) => {
                self.worked = Some((method.to_string(), took));
                Ok(took)
            }
            Err(None) => {
                self.hung = true;
                Err(hung(timeout))
            }
            Err(Some(why)) => Err(why),
        };
        let worked = outcome.is_ok();
        self.attempts.push(Attempt {
            method: method.to_string(),
            outcome,
        });
        worked
    }
}

/// The two reads of [`observe`], as they came.
type Raw = (
    Result<Vec<u8>, SysfsError>,
    Result<Option<String>, SysfsError>,
);

fn read_raw(sysfs: &Sysfs, address: PciAddress) -> Raw {
    (
        sysfs.read_bytes(&sysfs.device_attr(address, "config")),
        sysfs.read_optional_link_name(&sysfs.device_attr(address, "driver")),
    )
}

fn observed((config, driver): Raw) -> Observed {
    Observed {
        config: config
            .map(|mut c| {
                c.truncate(64);
                c
            })
            .map_err(|e| crate::error_chain(&e)),
        driver: driver.map_err(|e| crate::error_chain(&e)),
    }
}

/// What the health check needs of a function, read-only: its config-space header (the first
/// 64 bytes) and the driver bound to it.
pub fn observe(sysfs: &Sysfs, address: PciAddress) -> Observed {
    observed(read_raw(sysfs, address))
}

/// [`observe`], unless a read failed for vfiod's own lack of descriptors or memory: then why,
/// since such a reading says nothing about the device's health.
pub fn observe_unless_short(sysfs: &Sysfs, address: PciAddress) -> Result<Observed, String> {
    let raw = read_raw(sysfs, address);
    let errors = [raw.0.as_ref().err(), raw.1.as_ref().err()];
    if let Some(e) = errors.into_iter().flatten().find(|e| e.is_own_shortage()) {
        return Err(crate::error_chain(e));
    }
    Ok(observed(raw))
}
