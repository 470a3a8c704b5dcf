//! Claims in the real SQLite store: chosen and recorded atomically also across two store handles
//! on one file (two processes), kept across a reopen, released into history, and lapsed leases
//! released only while a claim is merely claimed.

use std::collections::BTreeSet;
use std::sync::Arc;
use vfiod::claim::{Owner, Requirements};
use vfiod::model::device::{Device, Kind, Mode, Role, State};
use vfiod::model::pci::{ClassCode, PciAddress};
use vfiod::store::{DeviceChange, Store, StoreError};

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn device(address: &str, role: Role, parent: Option<&str>, group: u32) -> Device {
    Device {
        address: addr(address),
        vendor_id: 0x8086,
        device_id: if role == Role::Vf { 0x154c } else { 0x1572 },
        subsystem_vendor_id: 0,
        subsystem_device_id: 0,
        revision: 2,
        class: ClassCode(0x020000),
        vendor_name: "Intel Corporation".into(),
        device_name: String::new(),
        kind: Kind::Nic,
        driver: Some("vfio-pci".into()),
        driver_override: None,
        numa_node: Some(0),
        iommu_group: Some(group),
        role,
        separable: role == Role::Pf,
        mode: if role == Role::Vf {
            Mode::None
        } else {
            Mode::Vf
        },
        total_vfs: if role == Role::Pf { 64 } else { 0 },
        num_vfs: if role == Role::Pf { 32 } else { 0 },
        parent_pf: parent.map(addr),
        managed: true,
        state: State::Usable,
        state_reason: String::new(),
    }
}

/// A store with one PF and 32 VFs.
fn host(dir: &std::path::Path) -> Store {
    let store = Store::open(dir).unwrap();
    let mut changes = vec![DeviceChange::Added(device(
        "0000:3b:00.0",
        Role::Pf,
        None,
        1,
    ))];
    for i in 0..32u32 {
        changes.push(DeviceChange::Added(device(
            &format!("0000:3b:{:02x}.{}", 2 + i / 8, i % 8),
            Role::Vf,
            Some("0000:3b:00.0"),
            100 + i,
        )));
    }
    store.apply_changes(&changes, &[]).unwrap();
    store
}

fn owner(vm: &str, lease: u32) -> Owner {
    Owner::new(Some(vm), None, lease, false).unwrap()
}

fn vf() -> Requirements {
    Requirements {
        role: Some(Role::Vf),
        ..Default::default()
    }
}

/// Two store handles on one file (as two processes would have), four threads each, claim VFs
/// until none is left: every VF is claimed exactly once, and the rest are told why not.
#[test]
fn two_handles_on_one_file_never_claim_a_vf_twice() {
    let dir = tempfile::tempdir().unwrap();
    drop(host(dir.path()));
    let handles = [
        Arc::new(Store::open(dir.path()).unwrap()),
        Arc::new(Store::open(dir.path()).unwrap()),
    ];
    let mut threads = Vec::new();
    for t in 0..8 {
        let store = Arc::clone(&handles[t % 2]);
        threads.push(std::thread::spawn(move || {
            let mut got = Vec::new();
            loop {
                match store.claim(&vf(), &owner(&format!("vm-{t}"), 0), "test") {
                    Ok(c) => got.push(c.address),
                    Err(StoreError::Unclaimable(u)) => {
                        assert!(u.to_string().contains("32 claimed"), "{u}");
                        return got;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    let mut all = Vec::new();
    for t in threads {
        all.extend(t.join().unwrap());
    }
    let unique: BTreeSet<_> = all.iter().copied().collect();
    assert_eq!(all.len(), 32, "{all:?}");
    assert_eq!(unique.len(), 32);
    // The PF is now excluded by its claimed VFs.
    let pf = Requirements {
        address: Some(addr("0000:3b:00.0")),
        ..Default::default()
    };
    let e = handles[0].claim(&pf, &owner("x", 0), "test").unwrap_err();
    assert!(e.to_string().contains("its VF"), "{e}");
    // A reopen sees the same claims.
    drop(handles);
    let store = Store::open(dir.path()).unwrap();
    let claims = store.active_claim_records().unwrap();
    assert_eq!(claims.len(), 32);
    assert_eq!(
        claims.iter().map(|c| c.address).collect::<BTreeSet<_>>(),
        unique
    );
}

#[test]
fn release_keeps_history_and_frees_the_functions() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    let c = store.claim(&vf(), &owner("vm1", 0), ":1.7").unwrap();
    assert_eq!(c.functions, [c.address]);
    assert_eq!(c.requested_by, ":1.7");
    assert_eq!(c.kind, Some(Kind::Nic));
    assert_eq!(c.state.as_str(), "claimed");
    let r = store.release_claim(c.id, "root", "test").unwrap();
    assert_eq!(r.state.as_str(), "released");
    assert!(matches!(
        store.release_claim(c.id, "root", "again"),
        Err(StoreError::ClaimReleased(_))
    ));
    assert!(matches!(
        store.release_claim(999, "root", "none"),
        Err(StoreError::NoSuchClaim(999))
    ));
    assert!(store.active_claim_records().unwrap().is_empty());
    assert_eq!(
        store.claim_record(c.id).unwrap().unwrap().state.as_str(),
        "released"
    );
    // The same VF is the best choice again.
    let again = store.claim(&vf(), &owner("vm2", 0), ":1.8").unwrap();
    assert_eq!(again.address, c.address);
    assert_ne!(again.id, c.id);
}

#[test]
fn a_lapsed_lease_releases_only_a_claim_that_is_merely_claimed() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    let leased = store.claim(&vf(), &owner("short", 60), "t").unwrap();
    let attached = store.claim(&vf(), &owner("running", 60), "t").unwrap();
    let unleased = store.claim(&vf(), &owner("forever", 0), "t").unwrap();
    let expires = leased.lease_expires_ms.unwrap();
    assert!(expires >= leased.created_ms + 60_000);
    assert_eq!(unleased.lease_expires_ms, None);
    // An attach took place (the attach job writes this state; set here by hand).
    let conn = rusqlite::Connection::open(store.path()).unwrap();
    conn.execute(
        "UPDATE claims SET state = 'attached' WHERE id = ?1",
        [attached.id],
    )
    .unwrap();

    assert!(store.release_lapsed_claims(expires - 1).unwrap().is_empty());
    let released = store.release_lapsed_claims(expires + 1).unwrap();
    assert_eq!(
        released.iter().map(|c| c.id).collect::<Vec<_>>(),
        [leased.id]
    );
    let active: Vec<i64> = store
        .active_claim_records()
        .unwrap()
        .iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(active, [attached.id, unleased.id]);
    let events = store.events(Some(leased.address), 0, 100).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.message.contains("lease of 60 s ran out")),
        "{events:?}"
    );
    assert!(store.release_lapsed_claims(i64::MAX).unwrap().is_empty());
}
