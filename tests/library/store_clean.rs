//! Cleaning between tenants in the real SQLite store (issue 23): the hold a claim's end writes in
//! its own transaction (under the configured policy), what a clean's outcome does to the hold and
//! the reset history, the quarantine an operator clears by resetting the clean's task, and that
//! all of it survives a reopen.

use vfiod::claim::{Owner, Requirements};
use vfiod::config::Settings;
use vfiod::model::clean::HoldState;
use vfiod::model::device::{Device, Kind, Mode, Role, State};
use vfiod::model::pci::{ClassCode, PciAddress};
use vfiod::model::task::TaskKind;
use vfiod::store::{CleanOutcome, CleanPolicy, DeviceChange, FunctionClean, Store, StoreError};

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn device(address: &str, managed: bool) -> Device {
    let group = if address == A { 11 } else { 12 };
    Device {
        address: addr(address),
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
        iommu_group: Some(group),
        role: Role::Function,
        separable: false,
        mode: Mode::Pf,
        total_vfs: 0,
        num_vfs: 0,
        parent_pf: None,
        managed,
        state: State::Usable,
        state_reason: String::new(),
    }
}

const A: &str = "0000:01:00.1";
const B: &str = "0000:01:00.2";

fn host(dir: &std::path::Path, policy: &str) -> Store {
    let store = Store::open(dir).unwrap();
    store
        .apply_changes(
            &[
                DeviceChange::Added(device(A, true)),
                DeviceChange::Added(device(B, true)),
            ],
            &[],
        )
        .unwrap();
    let settings =
        Settings::from_toml_str(policy, std::path::Path::new("policy.toml")).expect("policy");
    store.set_clean_policy(CleanPolicy::of(&settings));
    store
}

fn take(store: &Store, address: &str, vm: &str) -> Result<i64, StoreError> {
    store
        .claim(
            &Requirements {
                address: Some(addr(address)),
                ..Default::default()
            },
            &Owner::new(Some(vm), None, 0, false).unwrap(),
            "test",
        )
        .map(|c| c.id)
}

/// Under the default policy a release holds the function in the same transaction: it cannot be
/// claimed until a clean records it clean, and the hold survives a reopen of the file.
#[test]
fn a_release_holds_its_function_until_a_clean_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path(), "");
    let id = take(&store, A, "vm1").unwrap();
    store.release_claim(id, "test", "done").unwrap();
    let holds = store.clean_holds().unwrap();
    assert_eq!(holds.len(), 1, "{holds:?}");
    assert_eq!(
        (holds[0].address, holds[0].state, holds[0].claim_id),
        (addr(A), HoldState::Pending, Some(id))
    );
    let refused = take(&store, A, "vm2").unwrap_err().to_string();
    assert!(refused.contains("being cleaned"), "{refused}");
    assert!(store.claim_snapshot().unwrap().cleaning.len() == 1);
    drop(store);

    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.clean_holds().unwrap().len(), 1, "durable");
    store
        .clean_finished(&CleanOutcome {
            functions: vec![FunctionClean {
                address: addr(A),
                reset: Some(("flr".into(), 12)),
                failure: None,
                quarantine: false,
            }],
        })
        .unwrap();
    assert!(store.clean_holds().unwrap().is_empty());
    let h = store.reset_health(addr(A)).unwrap().unwrap();
    assert_eq!(
        (
            h.method.as_deref(),
            h.duration_ms,
            h.cleans,
            h.failures_in_row
        ),
        (Some("flr"), Some(12), 1, 0)
    );
    assert!(h.ok_ms.is_some());
    take(&store, A, "vm2").expect("clean: claimable");
}

/// `[claims] clean = "none"` holds nothing; a `[[clean]]` entry still holds what it names.
#[test]
fn the_policy_decides_which_releases_hold() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(
        dir.path(),
        &format!(
            "[claims]\nclean = \"none\"\n[[clean]]\naddress = \"{B}\"\ncommand = \"/bin/true\"\n"
        ),
    );
    let a = take(&store, A, "vm1").unwrap();
    let b = take(&store, B, "vm1").unwrap();
    store.release_claim(a, "test", "done").unwrap();
    store.release_claim(b, "test", "done").unwrap();
    let held: Vec<PciAddress> = store
        .clean_holds()
        .unwrap()
        .iter()
        .map(|h| h.address)
        .collect();
    assert_eq!(held, [addr(B)]);
    take(&store, A, "vm2").expect("not held: claimable at once");

    // Unmanaged functions are never held (claims never hold them anyway: the rule is the
    // policy's own).
    let settings = Settings::default();
    assert!(!CleanPolicy::of(&settings).applies(&device(A, false)));
    assert!(CleanPolicy::of(&settings).applies(&device(A, true)));
    assert!(!CleanPolicy::none().applies(&device(A, true)));
}

/// A failure that does not quarantine keeps the hold and counts; one that does makes it
/// quarantined. Resetting the clean's task clears a quarantine (held again, its failures
/// forgotten), and leaves a mere failure's count.
#[test]
fn failures_count_quarantines_hold_and_a_task_reset_clears_a_quarantine() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path(), "");
    for address in [A, B] {
        let id = take(&store, address, "vm1").unwrap();
        store.release_claim(id, "test", "done").unwrap();
    }
    let failed = |address: &str, quarantine: bool| FunctionClean {
        address: addr(address),
        reset: None,
        failure: Some(format!("failure of {address}")),
        quarantine,
    };
    store
        .clean_finished(&CleanOutcome {
            functions: vec![failed(A, false), failed(B, true)],
        })
        .unwrap();
    let hold = |a: &str| store.clean_hold(addr(a)).unwrap().unwrap();
    assert_eq!(hold(A).state, HoldState::Pending);
    assert_eq!(hold(B).state, HoldState::Quarantined);
    assert_eq!(hold(B).reason, format!("failure of {B}"));
    for a in [A, B] {
        let h = store.reset_health(addr(a)).unwrap().unwrap();
        assert_eq!((h.failures_in_row, h.cleans), (1, 0), "{a}");
        assert_eq!(h.failure.as_deref(), Some(&*format!("failure of {a}")));
    }
    let quarantine = store
        .events(Some(addr(B)), 0, 100)
        .unwrap()
        .into_iter()
        .any(|e| e.kind.as_str() == "clean" && e.message.contains("is quarantined"));
    assert!(quarantine);

    // A failed clean task on each; the operator resets them.
    for a in [A, B] {
        let t = store
            .create_task_covering(addr(a), &[], TaskKind::Clean, "{}", "test")
            .unwrap();
        store.task_progress(t.id, "reset", 0).unwrap();
        store.task_failed(t.id, "failed").unwrap();
        store.reset_task(addr(a), "operator").unwrap();
    }
    assert_eq!(
        hold(B).state,
        HoldState::Pending,
        "the quarantine is cleared"
    );
    assert!(hold(B).reason.contains("quarantine cleared by operator"));
    assert_eq!(
        store
            .reset_health(addr(B))
            .unwrap()
            .unwrap()
            .failures_in_row,
        0
    );
    assert_eq!(
        store
            .reset_health(addr(A))
            .unwrap()
            .unwrap()
            .failures_in_row,
        1,
        "not quarantined: the count goes on"
    );
    // Still held: a quarantine's end is a new clean, not a return to the pool.
    assert!(take(&store, B, "vm2").is_err());
}

/// A hold on a function that is gone is let go with an event; an operator's hold has no claim.
#[test]
fn holds_on_demand_and_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path(), "");
    store.hold_on_demand(&[addr(A)], "uid 0").unwrap();
    store.hold_on_demand(&[addr(A)], "uid 1").unwrap();
    let h = store.clean_hold(addr(A)).unwrap().unwrap();
    assert_eq!((h.claim_id, h.state), (None, HoldState::Pending));
    assert!(h.reason.contains("uid 0"), "the first hold stands: {h:?}");
    store
        .drop_clean_hold(addr(A), "the function is gone")
        .unwrap();
    assert!(store.clean_hold(addr(A)).unwrap().is_none());
    assert!(store
        .events(Some(addr(A)), 0, 100)
        .unwrap()
        .iter()
        .any(|e| e
            .message
            .contains("cleaning hold dropped: the function is gone")));
}
