//! Resets on the simulated kernel, through `vfiod::host::sysfs::reset` as the clean job calls
//! it, each outcome checked on the resulting state: the kernel's reset count and log, what
//! `reset_method` reads afterwards, the driver, config space, and the health check's verdict.
//! The kernel facts behind them: `reset` runs the methods `reset_method` lists, in order,
//! falling through on ENOTTY; `reset_method` takes supported names (EINVAL otherwise),
//! `default` or nothing; a bridge's `reset_subordinate` resets its whole bus.

use crate::common;
use crate::common::fast_tempdir as scratch_dir;
use std::collections::BTreeMap;
use std::fs;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vfiod::clean::health::{check, Expected, Unhealthy};
use vfiod::clean::reset::{plan, reset_order, Bus, ResetMethods, ResetPlan};
use vfiod::host::sysfs::reset::{
    observe, read_bus, read_methods, reset_function, reset_group, Attempt, ResetReport,
};
use vfiod::host::sysfs::{Sysfs, SysfsError};
use vfiod::model::pci::PciAddress;
use vfiod::sim::kernel::{FunctionSpec, HostModel, ResetBehaviour, SimKernel};

const NIC: &str = "0000:3b:00.0"; // X710, VFs from 0000:3b:02.0, iavf when autoprobed
const VF0: &str = "0000:3b:02.0";
const DATA_NVME: &str = "0000:d8:00.0"; // flr bus, nvme
const GPU: &str = "0000:17:00.0"; // no method of its own
const AUDIO: &str = "0000:17:00.1";
const GPU_PORT: &str = "0000:00:01.0"; // shows reset_subordinate

const TIMEOUT: Duration = Duration::from_secs(5);

fn addr(s: &str) -> PciAddress {
    s.parse().expect("address")
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|m| m.to_string()).collect()
}

struct Host {
    _dir: tempfile::TempDir,
    kernel: Arc<SimKernel>,
    sysfs: Sysfs,
}

impl Host {
    fn reference() -> Host {
        Host::with(HostModel::reference())
    }

    fn with(model: HostModel) -> Host {
        let dir = scratch_dir();
        let kernel = SimKernel::build(&dir.path().join("root"), &model).expect("simulated host");
        let sysfs = kernel.sysfs();
        Host {
            _dir: dir,
            kernel,
            sysfs,
        }
    }

    /// The NIC's first VF, bound to iavf (autoprobe on).
    fn with_vf() -> Host {
        let h = Host::reference();
        h.set(NIC, "sriov_numvfs", "2");
        assert_eq!(h.kernel.driver_of(addr(VF0)).as_deref(), Some("iavf"));
        h.kernel.take_write_log();
        h
    }

    fn attr(&self, a: &str, name: &str) -> String {
        let p = self.sysfs.device_attr(addr(a), name);
        fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
            .trim()
            .to_string()
    }

    fn try_set(&self, a: &str, attr: &str, value: &str) -> Result<(), SysfsError> {
        self.sysfs.write_device_attr(addr(a), attr, value)
    }

    fn set(&self, a: &str, attr: &str, value: &str) {
        self.try_set(a, attr, value)
            .unwrap_or_else(|e| panic!("{a}/{attr} <- {value:?}: {}", vfiod::error_chain(&e)));
    }

    fn behave(&self, a: &str, method: &str, b: ResetBehaviour) {
        self.kernel
            .set_reset_behaviour(addr(a), method, b)
            .expect("set_reset_behaviour");
    }

    /// `a` reset by the order the clean job would use (the kernel's list, nothing worked yet).
    fn reset(&self, a: &str, timeout: Duration) -> ResetReport {
        let m = read_methods(&self.sysfs, addr(a)).expect("read_methods");
        let order = reset_order(m.listed.as_deref().unwrap_or_default(), None);
        reset_function(&self.sysfs, addr(a), &order, timeout)
    }

    /// What the health check compares with: the function before its reset.
    fn expected(&self, a: &str) -> Expected {
        Expected::before(&observe(&self.sysfs, addr(a))).expect("healthy before the reset")
    }

    fn health(&self, a: &str, expected: &Expected) -> Result<(), String> {
        check(expected, &observe(&self.sysfs, addr(a))).map_err(|e| e.to_string())
    }
}

fn errno(r: Result<(), SysfsError>) -> i32 {
    match r {
        Ok(()) => panic!("the write was expected to fail but succeeded"),
        Err(e) => e
            .errno()
            .unwrap_or_else(|| panic!("error without errno: {}", vfiod::error_chain(&e))),
    }
}

fn worked(report: &ResetReport) -> &str {
    report
        .worked
        .as_ref()
        .map(|(m, _)| m.as_str())
        .unwrap_or_else(|| panic!("no method worked: {report:#?}"))
}

// ----- the kernel's attributes --------------------------------------------------------------

/// `reset_method` takes an ordered list of supported names, `default`, or nothing; a name the
/// function does not support fails the whole write with EINVAL and changes nothing.
#[test]
fn reset_method_takes_supported_names_default_or_nothing() {
    let h = Host::reference();
    assert_eq!(h.attr(DATA_NVME, "reset_method"), "flr bus");

    for bad in ["pm", "flr pm", "bus nonsense"] {
        assert_eq!(
            errno(h.try_set(DATA_NVME, "reset_method", bad)),
            libc::EINVAL,
            "{bad:?}"
        );
        assert_eq!(
            h.attr(DATA_NVME, "reset_method"),
            "flr bus",
            "after {bad:?}"
        );
    }
    h.set(DATA_NVME, "reset_method", "bus flr");
    assert_eq!(h.attr(DATA_NVME, "reset_method"), "bus flr");
    h.set(DATA_NVME, "reset_method", "bus");
    assert_eq!(
        h.kernel.reset_methods_of(addr(DATA_NVME)),
        Some(names(&["bus"]))
    );
    h.set(DATA_NVME, "reset_method", "default");
    assert_eq!(h.attr(DATA_NVME, "reset_method"), "flr bus");

    // Nothing disables resets: `reset` stays, and answers ENOTTY.
    h.set(DATA_NVME, "reset_method", "\n");
    assert_eq!(
        fs::read(h.sysfs.device_attr(addr(DATA_NVME), "reset_method")).unwrap(),
        b""
    );
    assert_eq!(errno(h.try_set(DATA_NVME, "reset", "1")), libc::ENOTTY);
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(0));
    h.set(DATA_NVME, "reset_method", "default");

    // `reset` takes 1 only.
    assert_eq!(errno(h.try_set(DATA_NVME, "reset", "2")), libc::EINVAL);
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(0));
    h.set(DATA_NVME, "reset", "1");
    assert_eq!(h.kernel.resets(addr(DATA_NVME)), names(&["flr"]));
}

/// The reference host: VFs have FLR; the GPU and its audio function show no reset at all,
/// their root port shows `reset_subordinate`.
#[test]
fn reference_host_reset_attributes() {
    let h = Host::with_vf();
    assert_eq!(h.attr(VF0, "reset_method"), "flr");
    for f in [GPU, AUDIO] {
        let m = read_methods(&h.sysfs, addr(f)).unwrap();
        assert_eq!((m.listed, m.reset), (None, false), "{f}");
    }
    assert!(h
        .sysfs
        .device_attr(addr(GPU_PORT), "reset_subordinate")
        .exists());
    assert!(!h.sysfs.device_attr(addr(GPU), "reset_subordinate").exists());
    assert_eq!(
        read_bus(&h.sysfs, &[addr(GPU), addr(AUDIO)]).unwrap(),
        Some(Bus {
            bridge: addr(GPU_PORT),
            reset_subordinate: true,
            functions: vec![addr(GPU), addr(AUDIO)],
        })
    );
    // A VF shares its bus with its PF and the other VFs: all of them.
    let bus = read_bus(&h.sysfs, &[addr(VF0)]).unwrap().unwrap();
    assert_eq!(bus.bridge, addr("0000:00:02.0"));
    assert_eq!(
        bus.functions,
        vec![addr(NIC), addr(VF0), addr("0000:3b:02.1")]
    );
    // Not below one bridge.
    assert_eq!(
        read_bus(&h.sysfs, &[addr(GPU), addr(DATA_NVME)]).unwrap(),
        None
    );
}

/// The kernel itself falls through on ENOTTY only: another errno ends the reset.
#[test]
fn the_kernel_falls_through_on_enotty_only() {
    let h = Host::reference();
    h.behave(
        DATA_NVME,
        "flr",
        ResetBehaviour::Fails {
            errno: libc::ENOTTY,
            delay_ms: 0,
        },
    );
    h.set(DATA_NVME, "reset", "1");
    assert_eq!(h.kernel.resets(addr(DATA_NVME)), names(&["bus"]));

    h.behave(
        DATA_NVME,
        "flr",
        ResetBehaviour::Fails {
            errno: libc::EIO,
            delay_ms: 0,
        },
    );
    assert_eq!(errno(h.try_set(DATA_NVME, "reset", "1")), libc::EIO);
    assert_eq!(
        h.kernel.resets(addr(DATA_NVME)),
        names(&["bus"]),
        "bus not tried"
    );
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(1));
}

// ----- one function -------------------------------------------------------------------------

/// FLR works: one reset, counted, `reset_method` as it was, the driver still bound, healthy.
#[test]
fn flr_works_and_everything_is_as_before() {
    let h = Host::with_vf();
    let expected = h.expected(VF0);
    assert_eq!(
        (expected.vendor_id, expected.device_id),
        (0xffff, 0xffff),
        "a VF's registers"
    );

    let r = h.reset(VF0, TIMEOUT);
    assert_eq!(worked(&r), "flr");
    assert_eq!(r.attempts.len(), 1);
    assert!(
        !r.hung && !r.none_available && r.refused.is_none(),
        "{r:#?}"
    );
    assert_eq!(r.not_restored, None);
    assert_eq!(h.kernel.reset_count(addr(VF0)), Some(1));
    assert_eq!(h.kernel.resets(addr(VF0)), names(&["flr"]));
    assert_eq!(h.attr(VF0, "reset_method"), "flr");
    assert_eq!(h.kernel.driver_of(addr(VF0)).as_deref(), Some("iavf"));
    assert_eq!(h.health(VF0, &expected), Ok(()));
    // Nothing else was reset.
    assert_eq!(h.kernel.reset_count(addr(NIC)), Some(0));
    assert_eq!(h.kernel.resets(addr("0000:3b:02.1")), Vec::<String>::new());
}

/// A listed method that does not work (a FLR that never completes: ENOTTY after the kernel's
/// wait) falls through to the next; the report says which worked, the list is put back.
#[test]
fn a_listed_method_that_fails_falls_through_to_the_next() {
    let h = Host::reference();
    h.behave(
        DATA_NVME,
        "flr",
        ResetBehaviour::Fails {
            errno: libc::ENOTTY,
            delay_ms: 50,
        },
    );
    let expected = h.expected(DATA_NVME);

    let r = h.reset(DATA_NVME, TIMEOUT);
    assert_eq!(worked(&r), "bus");
    assert_eq!(r.attempts.len(), 2, "{r:#?}");
    assert_eq!(r.attempts[0].method, "flr");
    let why = r.attempts[0].outcome.as_ref().unwrap_err();
    assert!(why.contains("os error 25"), "ENOTTY: {why}");
    assert_eq!(r.attempts[1].method, "bus");
    assert!(r.attempts[1].outcome.is_ok());
    assert_eq!(r.not_restored, None);
    assert_eq!(h.attr(DATA_NVME, "reset_method"), "flr bus");
    assert_eq!(h.kernel.resets(addr(DATA_NVME)), names(&["bus"]));
    assert_eq!(h.health(DATA_NVME, &expected), Ok(()));

    // Next time the method that worked goes first: no time spent on the FLR.
    let order = reset_order(&names(&["flr", "bus"]), Some("bus"));
    let r = reset_function(&h.sysfs, addr(DATA_NVME), &order, TIMEOUT);
    assert_eq!(r.attempts.len(), 1);
    assert_eq!(worked(&r), "bus");
    assert_eq!(h.attr(DATA_NVME, "reset_method"), "flr bus");
}

/// Every method fails: nothing worked, each says why, the list is put back.
#[test]
fn every_method_failing_is_reported_and_the_list_put_back() {
    let h = Host::reference();
    for m in ["flr", "bus"] {
        h.behave(
            DATA_NVME,
            m,
            ResetBehaviour::Fails {
                errno: libc::ENOTTY,
                delay_ms: 0,
            },
        );
    }
    let r = h.reset(DATA_NVME, TIMEOUT);
    assert_eq!(r.worked, None);
    assert!(!r.hung && !r.none_available);
    assert_eq!(
        r.attempts
            .iter()
            .map(|a| a.method.as_str())
            .collect::<Vec<_>>(),
        ["flr", "bus"]
    );
    assert!(r.attempts.iter().all(|a| a.outcome.is_err()));
    assert_eq!(r.not_restored, None);
    assert_eq!(h.attr(DATA_NVME, "reset_method"), "flr bus");
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(0));
}

/// Only the methods `reset_method` lists are used: one an operator took out (or the function
/// does not support) is a failed attempt with nothing written for it, and the operator's
/// order is put back. None of the order listed: none available, nothing written.
#[test]
fn a_method_not_listed_is_never_used() {
    let h = Host::reference();
    h.set(DATA_NVME, "reset_method", "bus");
    h.kernel.take_write_log();
    let r = reset_function(
        &h.sysfs,
        addr(DATA_NVME),
        &names(&["flr", "pm", "bus"]),
        TIMEOUT,
    );
    assert_eq!(
        r.attempts
            .iter()
            .map(|a| (a.method.as_str(), a.outcome.is_ok()))
            .collect::<Vec<_>>(),
        [("flr", false), ("pm", false), ("bus", true)]
    );
    assert_eq!(
        r.attempts[0].outcome,
        Err("not enabled: reset_method reads \"bus\"".into())
    );
    assert_eq!(worked(&r), "bus");
    assert_eq!(
        h.attr(DATA_NVME, "reset_method"),
        "bus",
        "the operator's list"
    );
    assert_eq!(h.kernel.resets(addr(DATA_NVME)), names(&["bus"]));
    let log = h.kernel.take_write_log();
    assert!(
        log.iter().all(|(_, v)| v != "flr" && v != "pm"),
        "a method not listed was written: {log:?}"
    );

    let r = reset_function(&h.sysfs, addr(DATA_NVME), &names(&["flr"]), TIMEOUT);
    assert!(r.none_available && r.worked.is_none(), "{r:#?}");
    assert_eq!(r.not_restored, None);
    assert!(h.kernel.take_write_log().is_empty());
}

/// A reset that hangs is abandoned at the timeout and reported hung; nothing more is tried or
/// written, so `reset_method` is not put back, and the report says so.
#[test]
fn a_hung_reset_is_abandoned_at_the_timeout() {
    let h = Host::reference();
    h.behave(DATA_NVME, "flr", ResetBehaviour::Hangs);
    let timeout = Duration::from_millis(300);

    let start = Instant::now();
    let r = h.reset(DATA_NVME, timeout);
    let took = start.elapsed();
    assert!(took >= timeout, "returned before the timeout: {took:?}");
    // Abandoned at the timeout, not at the hang's end: the reset still hangs in the kernel
    // (its hang lasts until released). That is the claim, not a bound on how long it took.
    assert_eq!(
        h.kernel.hanging(),
        1,
        "the hung reset is still in the kernel"
    );
    assert!(r.hung, "{r:#?}");
    assert_eq!(r.worked, None);
    assert_eq!(
        r.attempts,
        vec![Attempt {
            method: "flr".into(),
            outcome: Err("did not finish within 300ms: abandoned".into()),
        }],
        "bus is not tried after a hang"
    );
    let why = r.not_restored.expect("not restored after a hang");
    assert!(why.contains("\"flr bus\""), "{why}");
    assert_eq!(
        h.attr(DATA_NVME, "reset_method"),
        "flr",
        "left as the hung reset found it"
    );
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(0));

    // The stuck write still holds its thread; release_hangs ends it, with EINTR and no
    // effect: no reset, and no accepted write to `reset`.
    h.kernel.release_hangs();
    common::eventually_blocking(common::HUNG, "the released reset leaves its hang", || {
        (h.kernel.hanging() == 0).then_some(())
    });
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(0));
    let log = h.kernel.take_write_log();
    assert!(log.iter().all(|(p, _)| !p.ends_with("reset")), "{log:?}");
}

/// A reset after which config space reads all-ones "works", and the health check fails it.
#[test]
fn all_ones_after_the_reset_fails_the_health_check() {
    let h = Host::with_vf();
    h.behave(VF0, "flr", ResetBehaviour::AllOnes);
    let expected = h.expected(VF0);
    let r = h.reset(VF0, TIMEOUT);
    assert_eq!(worked(&r), "flr");
    assert_eq!(
        h.health(VF0, &expected),
        Err("config space reads all-ones after the reset".into())
    );
    assert!(matches!(
        h.sysfs.read_function(addr(VF0)),
        Err(SysfsError::ConfigAllOnes { .. })
    ));
    assert_eq!(
        fs::read(h.sysfs.device_attr(addr(VF0), "config")).unwrap(),
        vec![0xff; 256]
    );
}

/// A reset that unbinds the driver fails the health check with the driver's name.
#[test]
fn a_driver_lost_in_the_reset_fails_the_health_check() {
    let h = Host::reference();
    h.behave(DATA_NVME, "flr", ResetBehaviour::Unbinds);
    let expected = h.expected(DATA_NVME);
    assert_eq!(expected.driver.as_deref(), Some("nvme"));
    let r = h.reset(DATA_NVME, TIMEOUT);
    assert_eq!(worked(&r), "flr");
    assert_eq!(h.kernel.driver_of(addr(DATA_NVME)), None);
    assert!(!h.sysfs.device_attr(addr(DATA_NVME), "driver").exists());
    assert_eq!(
        h.health(DATA_NVME, &expected),
        Err("driver nvme is no longer bound".into())
    );
    assert_eq!(
        check(&expected, &observe(&h.sysfs, addr(DATA_NVME))),
        Err(Unhealthy::DriverLost {
            expected: "nvme".into(),
            now: None
        })
    );
}

/// No reset attribute at all (the GPU), or resets disabled: nothing available, nothing written.
#[test]
fn no_reset_method_is_none_available_and_writes_nothing() {
    let h = Host::reference();
    let r = h.reset(GPU, TIMEOUT);
    assert!(r.none_available, "{r:#?}");
    assert!(r.attempts.is_empty() && r.worked.is_none() && !r.hung);
    assert!(h.kernel.take_write_log().is_empty());

    // Resets disabled by an operator: not even an explicit order overrides that.
    h.set(DATA_NVME, "reset_method", "\n");
    h.kernel.take_write_log();
    let r = h.reset(DATA_NVME, TIMEOUT);
    assert!(r.none_available, "{r:#?}");
    let r = reset_function(&h.sysfs, addr(DATA_NVME), &names(&["flr"]), TIMEOUT);
    assert!(r.none_available && r.attempts.is_empty(), "{r:#?}");
    assert!(h.kernel.take_write_log().is_empty());
    assert_eq!(h.kernel.reset_count(addr(DATA_NVME)), Some(0));
}

/// A kernel before 5.15 has `reset` but no `reset_method`: one plain reset, method "default".
#[test]
fn an_old_kernel_gets_one_plain_reset() {
    let h = Host::reference();
    fs::remove_file(h.sysfs.device_attr(addr(DATA_NVME), "reset_method")).unwrap();
    let m = read_methods(&h.sysfs, addr(DATA_NVME)).unwrap();
    assert_eq!((m.listed.clone(), m.reset), (None, true));
    let r = reset_function(&h.sysfs, addr(DATA_NVME), &[], TIMEOUT);
    assert_eq!(worked(&r), "default");
    assert_eq!(r.not_restored, None);
    assert_eq!(
        h.kernel.resets(addr(DATA_NVME)),
        names(&["flr"]),
        "the kernel's first method"
    );
    assert_eq!(
        plan(&[m], &BTreeMap::new(), None),
        ResetPlan::Each {
            resets: vec![vfiod::clean::reset::FunctionReset {
                address: addr(DATA_NVME),
                order: vec![],
            }],
            without: vec![],
            no_group: None,
        }
    );
}

// ----- the group ----------------------------------------------------------------------------

/// The GPU and its audio function: no reset of their own, so the plan is the group reset,
/// which resets both through the root port, their drivers still bound, both healthy.
#[test]
fn the_group_is_reset_through_the_bridge() {
    let h = Host::reference();
    let pair = [addr(GPU), addr(AUDIO)];
    let methods: Vec<ResetMethods> = pair
        .iter()
        .map(|&a| read_methods(&h.sysfs, a).unwrap())
        .collect();
    let bus = read_bus(&h.sysfs, &pair).unwrap();
    assert_eq!(
        plan(&methods, &BTreeMap::new(), bus.as_ref()),
        ResetPlan::Group {
            bridge: addr(GPU_PORT)
        }
    );
    let expected: Vec<Expected> = [GPU, AUDIO].iter().map(|f| h.expected(f)).collect();

    let r = reset_group(&h.sysfs, &pair, TIMEOUT);
    assert_eq!(worked(&r), "reset_subordinate");
    assert!(!r.hung && r.refused.is_none(), "{r:#?}");
    for (f, e) in [GPU, AUDIO].iter().zip(&expected) {
        assert_eq!(
            h.kernel.resets(addr(f)),
            names(&["reset_subordinate"]),
            "{f}"
        );
        assert_eq!(h.health(f, e), Ok(()), "{f}");
    }
    assert_eq!(h.kernel.driver_of(addr(GPU)).as_deref(), Some("nouveau"));
    assert_eq!(
        h.kernel.reset_count(addr(GPU_PORT)),
        Some(0),
        "the bridge itself is not reset"
    );
}

/// A group reset is refused, with nothing written, when the bus holds a function outside the
/// group; a bridge without `reset_subordinate` has none available.
#[test]
fn the_group_reset_is_refused_when_the_bus_holds_another_function() {
    let h = Host::reference();
    h.kernel.take_write_log();
    let r = reset_group(&h.sysfs, &[addr(GPU)], TIMEOUT);
    let why = r.refused.clone().expect("refused");
    assert!(why.contains(AUDIO), "{why}");
    assert!(r.attempts.is_empty() && r.worked.is_none());
    assert!(h.kernel.take_write_log().is_empty());
    assert_eq!(h.kernel.reset_count(addr(GPU)), Some(0));
    assert_eq!(h.kernel.reset_count(addr(AUDIO)), Some(0));

    // A VF alone: its PF and the other VFs share the bus.
    let h = Host::with_vf();
    let r = reset_group(&h.sysfs, &[addr(VF0)], TIMEOUT);
    assert!(r.refused.expect("refused").contains(NIC));
    assert!(h.kernel.take_write_log().is_empty());

    // Not below one bridge.
    let r = reset_group(&h.sysfs, &[addr(GPU), addr(DATA_NVME)], TIMEOUT);
    assert_eq!(
        r.refused.as_deref(),
        Some("the functions are not all below one bridge")
    );

    // A bridge without reset_subordinate.
    let mut model = HostModel::reference();
    for f in &mut model.functions {
        f.reset_subordinate = false;
    }
    let h = Host::with(model);
    let r = reset_group(&h.sysfs, &[addr(GPU), addr(AUDIO)], TIMEOUT);
    assert!(r.none_available && r.refused.is_none(), "{r:#?}");
    assert!(h.kernel.take_write_log().is_empty());
}

/// A bus reset that hangs (one function below never comes back) is abandoned at the timeout;
/// one where a function fails resets the others and reports the failure.
#[test]
fn a_hung_or_failed_group_reset_is_reported() {
    let h = Host::reference();
    h.behave(AUDIO, "bus", ResetBehaviour::Hangs);
    let timeout = Duration::from_millis(300);
    let r = reset_group(&h.sysfs, &[addr(GPU), addr(AUDIO)], timeout);
    // Abandoned at the timeout while the bus reset still hangs (not a bound on speed).
    assert_eq!(
        h.kernel.hanging(),
        1,
        "the hung bus reset is still in the kernel"
    );
    assert!(r.hung && r.worked.is_none(), "{r:#?}");
    assert_eq!(h.kernel.reset_count(addr(GPU)), Some(0));
    h.kernel.release_hangs();

    h.behave(
        AUDIO,
        "bus",
        ResetBehaviour::Fails {
            errno: libc::EIO,
            delay_ms: 0,
        },
    );
    let r = reset_group(&h.sysfs, &[addr(GPU), addr(AUDIO)], TIMEOUT);
    assert_eq!(r.worked, None);
    assert!(r.attempts[0]
        .outcome
        .as_ref()
        .unwrap_err()
        .contains("os error 5"));
    assert_eq!(h.kernel.resets(addr(GPU)), names(&["reset_subordinate"]));
    assert_eq!(h.kernel.reset_count(addr(AUDIO)), Some(0));
}

// ----- persistence --------------------------------------------------------------------------

/// A persistent kernel keeps `reset_method` and the reset count; one saved before resets were
/// simulated (no reset fields) still opens, with the model's lists.
#[test]
fn resets_survive_a_reopen_and_old_saved_models_load() {
    let dir = scratch_dir();
    let root = dir.path().join("root");
    let mut model = HostModel::reference();
    model.functions.push(
        FunctionSpec::new("0000:d8:00.1", 0x144d, 0xa824, 0x010802)
            .under("0000:00:05.0")
            .reset_methods(&["pm"])
            .reset_behaviour("pm", ResetBehaviour::Unbinds),
    );
    let k = SimKernel::build(&root, &model).unwrap();
    k.make_persistent().unwrap();
    let sysfs = k.sysfs();
    sysfs
        .write_device_attr(addr(DATA_NVME), "reset_method", "bus")
        .unwrap();
    sysfs
        .write_device_attr(addr(DATA_NVME), "reset", "1")
        .unwrap();
    drop((k, sysfs));

    let k = SimKernel::open(&root).unwrap();
    assert_eq!(k.reset_methods_of(addr(DATA_NVME)), Some(names(&["bus"])));
    assert_eq!(k.reset_count(addr(DATA_NVME)), Some(1));
    let text = fs::read_to_string(k.sysfs().device_attr(addr(DATA_NVME), "reset_method")).unwrap();
    assert_eq!(text, "bus\n");
    drop(k);

    // Strip every reset field, as a file saved before them.
    let state = root.join(".simkernel-state.json");
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&state).unwrap()).unwrap();
    let mut stripped = 0;
    for dev in v["devices"].as_object_mut().unwrap().values_mut() {
        let dev = dev.as_object_mut().unwrap();
        stripped += usize::from(dev.remove("reset_methods").is_some());
        dev.remove("resets");
        let spec = dev.get_mut("spec").unwrap().as_object_mut().unwrap();
        spec.remove("reset_behaviour");
        spec.remove("reset_subordinate");
    }
    assert!(stripped > 10);
    fs::write(&state, serde_json::to_vec(&v).unwrap()).unwrap();
    let k = SimKernel::open(&root).unwrap();
    assert_eq!(
        k.reset_methods_of(addr(DATA_NVME)),
        Some(names(&["flr", "bus"]))
    );
    assert_eq!(k.reset_count(addr(DATA_NVME)), Some(0));
    // Without the saved behaviour the pm reset now simply works.
    let sysfs = k.sysfs();
    sysfs
        .write_device_attr(addr("0000:d8:00.1"), "reset", "1")
        .unwrap();
    assert_eq!(k.driver_of(addr("0000:d8:00.1")).as_deref(), Some("nvme"));
    assert_eq!(k.resets(addr("0000:d8:00.1")), names(&["pm"]));
}
