//! Claims over a real bus (a private dbus-daemon) on the simulated reference host, with the real
//! SQLite store: atomic claims under concurrency, the PF/VF and IOMMU-group rules, what survives
//! a restart, the named errors, and vfioctl's claim commands.

use crate::common;

use crate::common::{addr, connect, dict, eventually_async, vfioctl, Harness};
use std::collections::BTreeSet;
use std::time::Duration;
use vfiod::client::claim::{self, ClaimView};
use vfiod::dbus::wire::Dict;
use zbus::Variant;

/// The NIC split into 40 VFs (its VFs match the class selector, so they are selected), and the
/// GPU's IOMMU group; the other devices are not selected.
const CLAIMS_CONFIG: &str = r#"
scenario = "public"
poll_interval = 10
[[select]]
class = "0x0200"
mode = "vf"
num_vfs = 40
vf_driver = "vfio-pci"
[[select]]
class = "0x03"
[[select]]
id = "10de:1aef"
"#;

const NIC: &str = "0000:3b:00.0";
const POOL: usize = 40;

fn vm(name: &str) -> Dict {
    dict(&[("vm_name", Variant::from(name.to_string()))])
}

/// (error name, message) of a refused call.
fn refusal<T>(r: zbus::Result<T>) -> (String, String) {
    common::refusal(r, "a call that must be refused")
}

/// Starts vfiod and waits until the NIC's 40 VFs are selected, usable and idle.
async fn start() -> Harness {
    let h = Harness::start(CLAIMS_CONFIG).await;
    let client = &h.client;
    eventually_async(
        Duration::from_secs(120),
        "the NIC is split into 40 idle, selected VFs",
        || async move {
            let listed = vfiod::client::list_devices(client).await.ok()?;
            let ready = listed
                .iter()
                .filter(|d| {
                    d.parent_pf.as_deref() == Some(NIC)
                        && d.managed
                        && d.state == "usable"
                        && d.task_state == "idle"
                })
                .count();
            let pf_idle = listed
                .iter()
                .any(|d| d.address == NIC && d.task_state == "idle");
            (ready == POOL && pf_idle).then_some(())
        },
    )
    .await;
    h
}

async fn claims_of(h: &Harness) -> Vec<ClaimView> {
    claim::list_claims(&h.client).await.unwrap()
}

/// Every function held by the active claims, each once, or the test fails naming the double.
fn held_once(list: &[ClaimView]) -> BTreeSet<String> {
    let mut held = BTreeSet::new();
    for c in list {
        for f in &c.functions {
            assert!(held.insert(f.clone()), "{f} is in two claims: {list:#?}");
        }
    }
    held
}

/// 64 clients, each on its own connection, claim a VF at once from a pool of 40: exactly 40 get
/// one, 24 get NoDeviceAvailable, no function is in two claims; after a restart the store and
/// the bus still say the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_share_forty_vfs_without_a_double_booking() {
    let mut h = start().await;
    let address = h.bus.address().to_string();
    let mut calls = Vec::new();
    for i in 0..64 {
        let address = address.clone();
        calls.push(tokio::spawn(async move {
            let conn = connect(&address).await;
            let m = claim::claims_proxy(&conn).await.unwrap();
            let r = m
                .claim(
                    dict(&[("role", Variant::from("vf"))]),
                    vm(&format!("vm-{i}")),
                )
                .await;
            (i, r.map(|p| p.to_string()))
        }));
    }
    let mut won = Vec::new();
    let mut refused = Vec::new();
    for c in calls {
        let (i, r) = c.await.unwrap();
        match r {
            Ok(path) => won.push((i, path)),
            Err(e) => refused.push(refusal::<()>(Err(e))),
        }
    }
    assert_eq!(won.len(), POOL, "refusals: {refused:?}");
    assert_eq!(refused.len(), 64 - POOL);
    for (name, message) in &refused {
        assert_eq!(
            name, "org.vfiod.Vfiod1.Error.NoDeviceAvailable",
            "{message}"
        );
        assert!(
            message.contains("40 claimed"),
            "the reason says the pool is taken: {message}"
        );
    }
    let list = claims_of(&h).await;
    assert_eq!(list.len(), POOL);
    let held = held_once(&list);
    assert_eq!(held.len(), POOL);
    for c in &list {
        assert_eq!(c.state, "claimed");
        let d = vfiod::client::show_device(&h.client, &c.address)
            .await
            .unwrap();
        assert_eq!(d.parent_pf.as_deref(), Some(NIC));
        assert_eq!(d.claim.as_deref(), Some(c.path.as_str()));
        assert_eq!(d.vm.as_deref(), Some(c.vm.as_str()));
    }
    let paths: BTreeSet<_> = won.iter().map(|(_, p)| p.clone()).collect();
    assert_eq!(
        paths,
        list.iter().map(|c| c.path.clone()).collect::<BTreeSet<_>>()
    );
    let records = h.store().active_claim_records().unwrap();
    assert_eq!(records.len(), POOL);

    // A restart: the same claims, from the store, on the bus.
    h.stop_server().await;
    h.start_server().await;
    let after = claims_of(&h).await;
    assert_eq!(after, list, "the claims survive a restart unchanged");
    let store = h.store();
    assert_eq!(store.active_claim_records().unwrap(), records);
    let listed = vfiod::client::list_devices(&h.client).await.unwrap();
    let shown: BTreeSet<String> = listed
        .iter()
        .filter(|d| d.claim.is_some())
        .map(|d| d.address.clone())
        .collect();
    assert_eq!(shown, held, "each claimed device shows its claim");
    assert!(listed
        .iter()
        .filter(|d| d.claim.is_some())
        .all(|d| d.vm.as_deref().is_some_and(|v| v.starts_with("vm-"))));
    let free = claim::claims_proxy(&h.client)
        .await
        .unwrap()
        .find_devices(dict(&[("role", Variant::from("vf"))]))
        .await
        .unwrap();
    assert!(free.is_empty(), "{free:?}");
}

/// A claim of the PF racing claims of its VFs: the PF is split, so its claim is refused
/// whichever order they arrive in (as the mode change it would be, issue 33, or for a VF
/// already held), and every VF's claim wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pf_claim_racing_its_vfs_claims_never_both_win() {
    let h = start().await;
    let address = h.bus.address().to_string();
    for round in 0..3 {
        let mut calls = Vec::new();
        for i in 0..9 {
            let address = address.clone();
            calls.push(tokio::spawn(async move {
                let conn = connect(&address).await;
                let m = claim::claims_proxy(&conn).await.unwrap();
                // The PF's claim goes out in the middle of its VFs'.
                let want = if i == 4 {
                    dict(&[("address", Variant::from(NIC))])
                } else {
                    dict(&[("parent", Variant::from(NIC))])
                };
                (i == 4, m.claim(want, vm(&format!("r{round}-{i}"))).await)
            }));
        }
        let mut vfs_won = 0;
        for c in calls {
            match c.await.unwrap() {
                // Refused as a mode change, or (after a VF's claim) because a VF is held.
                (true, r) => {
                    let (name, message) = refusal(r);
                    assert!(
                        (name == "org.vfiod.Vfiod1.Error.InvalidArgument"
                            && message.contains("a mode change, not a claim"))
                            || (name == "org.vfiod.Vfiod1.Error.NoDeviceAvailable"
                                && message.contains("has its VF")),
                        "{name}: {message}"
                    );
                }
                (false, r) => {
                    r.unwrap();
                    vfs_won += 1;
                }
            }
        }
        assert_eq!(vfs_won, 8, "round {round}");
        let list = claims_of(&h).await;
        held_once(&list);
        for c in list {
            claim::release(&h.client, zbus::OwnedObjectPath::try_from(c.path).unwrap())
                .await
                .unwrap();
        }
        assert!(claims_of(&h).await.is_empty());
    }
}

/// Issue 33: a claim by kind gets a VF of the NIC that policy splits, never the PF itself
/// (which would take every VF with it), until the VFs are all claimed; then none is
/// available, and the PF is still split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_by_kind_never_takes_a_split_pf() {
    let h = start().await;
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let mut got = BTreeSet::new();
    for i in 0..POOL {
        let path = m
            .claim(
                dict(&[("kind", Variant::from("nic"))]),
                vm(&format!("tenant-{i}")),
            )
            .await
            .unwrap();
        let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
        assert_ne!(c.address, NIC, "claim {i} took the split PF");
        got.insert(c.address);
    }
    assert_eq!(got.len(), POOL);
    let (name, message) = refusal(
        m.claim(dict(&[("kind", Variant::from("nic"))]), vm("tenant-x"))
            .await,
    );
    assert_eq!(
        name, "org.vfiod.Vfiod1.Error.NoDeviceAvailable",
        "{message}"
    );
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(POOL as u32));
}

/// Concurrent claim changes share one transaction and one fsync (the engine's group commit):
/// inside a batch each change is decided on what the ones before it left, a failing change is
/// undone alone, and the history records them in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_claim_changes_is_decided_in_order_and_fails_change_by_change() {
    use vfiod::claim::{Owner, Requirements};
    use vfiod::store::{ClaimChange, StoreError};
    let h = start().await;
    let store = h.store();
    let vf = store
        .claim_snapshot()
        .unwrap()
        .devices
        .iter()
        .find(|d| d.parent_pf == Some(addr(NIC)))
        .unwrap()
        .address;
    let claim = |req: Requirements, vm: &str| ClaimChange::Claim {
        requirements: req,
        owner: Owner::new(Some(vm), None, 0, false).unwrap(),
        requested_by: "test".into(),
    };
    let this_vf = Requirements {
        address: Some(vf),
        ..Requirements::default()
    };
    let any_vf = Requirements {
        parent: Some(addr(NIC)),
        ..Requirements::default()
    };
    let mut r = store
        .change_claims(vec![
            claim(this_vf.clone(), "a"),
            claim(this_vf.clone(), "b"),
            ClaimChange::Release {
                id: 999_999,
                by: "test".into(),
                why: "no such claim".into(),
            },
            claim(any_vf, "c"),
        ])
        .into_iter();
    let a = r.next().unwrap().expect("the first claim of the VF wins");
    assert_eq!(a.address, vf);
    let b = r.next().unwrap();
    assert!(matches!(b, Err(StoreError::Unclaimable(_))), "{b:?}");
    let none = r.next().unwrap();
    assert!(
        matches!(none, Err(StoreError::NoSuchClaim(999_999))),
        "{none:?}"
    );
    let c = r.next().unwrap().expect("another VF for c");
    assert_ne!(c.address, vf);
    let active: Vec<i64> = store
        .active_claim_records()
        .unwrap()
        .iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(active, vec![a.id, c.id], "the failed changes left nothing");

    // A release and a claim of the same VF in one batch: the claim sees the release, and the
    // hold its end put on the VF for its clean (issue 23): nothing slips in between.
    let mut r = store
        .change_claims(vec![
            ClaimChange::Release {
                id: a.id,
                by: "test".into(),
                why: "batch".into(),
            },
            claim(this_vf.clone(), "b"),
        ])
        .into_iter();
    r.next().unwrap().expect("release");
    let refused = r
        .next()
        .unwrap()
        .expect_err("the released VF waits for its clean");
    assert!(refused.to_string().contains("being cleaned"), "{refused}");
    common::cleaned(&h, &vf.to_string()).await;
    let b = store
        .change_claims(vec![claim(this_vf, "b")])
        .pop()
        .unwrap()
        .expect("b gets the VF a released, once clean");
    assert_eq!(b.address, vf);
    let history: Vec<String> = store
        .events(Some(vf), 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.message)
        .filter(|m| m.starts_with("claim "))
        .collect();
    assert_eq!(history.len(), 3, "{history:#?}");
    assert!(history[0].contains(&format!("claim {} ", a.id)) && history[0].contains("claimed"));
    assert!(history[1].contains(&format!("claim {} ", a.id)) && history[1].contains("released"));
    assert!(history[2].contains(&format!("claim {} ", b.id)) && history[2].contains("claimed"));
}

/// A GPU's claim takes its audio function; neither is claimable alone afterwards; a claimed
/// device cannot be converted; release frees both, and the released claim is gone from the bus
/// but kept in the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_holds_the_whole_iommu_group_until_released() {
    let h = start().await;
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let path = m
        .claim(
            dict(&[("kind", Variant::from("gpu"))]),
            dict(&[
                ("vm_name", Variant::from("desktop")),
                (
                    "vm_uuid",
                    Variant::from("6BA7B810-9DAD-11D1-80B4-00C04FD430C8"),
                ),
                ("persistent", Variant::from(true)),
            ]),
        )
        .await
        .unwrap();
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.address, "0000:17:00.0");
    assert_eq!(c.functions, ["0000:17:00.0", "0000:17:00.1"]);
    assert_eq!(c.vm, "desktop");
    assert_eq!(c.vm_uuid, "6ba7b810-9dad-11d1-80b4-00c04fd430c8");
    assert_eq!(c.kind, "gpu");
    assert!(c.persistent);
    assert_eq!(c.lease_expires_ms, 0);
    assert!(!c.requested_by.is_empty());

    let audio = dict(&[("address", Variant::from("0000:17:00.1"))]);
    let (name, message) = refusal(m.claim(audio.clone(), vm("other")).await);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.NoDeviceAvailable");
    assert!(
        message.contains(&format!("held by claim {}", c.id)),
        "{message}"
    );
    assert!(m.find_devices(audio).await.unwrap().is_empty());

    // The mode guard refuses to convert a PF whose VF is claimed, naming the VM.
    let vf_claim = m
        .claim(dict(&[("parent", Variant::from(NIC))]), vm("db"))
        .await
        .unwrap();
    let nic = vfiod::client::device(&h.client, NIC).await.unwrap();
    let (name, message) = refusal(nic.set_mode("pf", vfiod::client::mode_options(None)).await);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse", "{message}");
    assert!(message.contains("db"), "{message}");
    claim::release(&h.client, vf_claim).await.unwrap();

    let audio_dev = vfiod::client::show_device(&h.client, "0000:17:00.1")
        .await
        .unwrap();
    assert_eq!(audio_dev.claim.as_deref(), Some(path.as_str()));

    claim::release(&h.client, path.clone()).await.unwrap();
    let (name, _) = refusal(claim::claim_view(&h.client, path.as_str()).await.map_err(
        |e| match e {
            vfiod::client::ClientError::Call(z) => z,
            other => panic!("{other}"),
        },
    ));
    assert_eq!(name, "org.freedesktop.DBus.Error.UnknownObject");
    let d = vfiod::client::show_device(&h.client, "0000:17:00.1")
        .await
        .unwrap();
    assert_eq!(d.claim, None);
    let record = h.store().claim_record(c.id as i64).unwrap().unwrap();
    assert_eq!(record.state.as_str(), "released");
    assert!(record.released_ms.is_some());
    let events = h
        .store()
        .events(Some(addr("0000:17:00.0")), 0, 1000)
        .unwrap();
    let claim_events: Vec<_> = events
        .iter()
        .filter(|e| e.kind.as_str() == "claim")
        .map(|e| e.message.clone())
        .collect();
    assert_eq!(claim_events.len(), 2, "{claim_events:?}");
    assert!(claim_events[0].contains("with 0000:17:00.1"));
    assert!(claim_events[1].contains("released"));
    // Cleaned as one group (its functions list no reset of their own: the bus below their
    // root port is reset through reset_subordinate), then free again: the next claim gets it.
    let result = common::cleaned(&h, "0000:17:00.0").await;
    assert!(result.contains("reset_subordinate"), "{result}");
    assert_eq!(
        vfiod::client::show_device(&h.client, "0000:17:00.1")
            .await
            .unwrap()
            .state,
        "usable"
    );
    assert_eq!(
        m.find_devices(dict(&[("kind", Variant::from("gpu"))]))
            .await
            .unwrap()
            .len(),
        1
    );
}

/// Bad requirements and owners are refused by name and change nothing; unselected, protected
/// and busy devices are never claimed, each with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_and_unclaimable_devices_get_named_errors() {
    let h = start().await;
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let events_before = h.store().events(None, 0, 100_000).unwrap().len();
    let huge = "x".repeat(1 << 20);
    let cases: Vec<(Dict, Dict, &str, &str)> = vec![
        (
            dict(&[("colour", Variant::from("red"))]),
            vm("a"),
            "InvalidArgument",
            "unknown query key \"colour\"",
        ),
        (
            dict(&[("kind", Variant::from("gpgpu"))]),
            vm("a"),
            "InvalidArgument",
            "key kind",
        ),
        (
            dict(&[("numa_node", Variant::from("one"))]),
            vm("a"),
            "InvalidArgument",
            "numa_node must be a 32-bit integer",
        ),
        (
            dict(&[("id", Variant::from("8086"))]),
            vm("a"),
            "InvalidArgument",
            "invalid id",
        ),
        (
            dict(&[("address", Variant::from(huge.clone()))]),
            vm("a"),
            "InvalidArgument",
            "1048576 characters",
        ),
        (
            dict(&[]),
            dict(&[]),
            "InvalidArgument",
            "needs vm_name or vm_uuid",
        ),
        (
            dict(&[]),
            dict(&[
                ("vm_name", Variant::from("a")),
                ("lease", Variant::from(1u32)),
            ]),
            "InvalidArgument",
            "unknown query key \"lease\"",
        ),
        (
            dict(&[]),
            dict(&[("vm_uuid", Variant::from("not-a-uuid"))]),
            "InvalidArgument",
            "not a UUID",
        ),
        (
            dict(&[]),
            dict(&[("vm_name", Variant::from(huge.clone()))]),
            "InvalidArgument",
            "more than the 255",
        ),
        // Issue 33: a blank name, or one with a character that does not show.
        (dict(&[]), vm(" "), "InvalidArgument", "is blank"),
        (
            dict(&[]),
            vm("\u{202E}1-tnanet"),
            "InvalidArgument",
            "invisible character U+202E",
        ),
        (
            dict(&[]),
            vm("tenant\u{200B}"),
            "InvalidArgument",
            "invisible character U+200B",
        ),
        // A split PF named: a mode change, not a claim.
        (
            dict(&[("address", Variant::from(NIC))]),
            vm("a"),
            "InvalidArgument",
            "is split into 40 VFs by the configuration: taking it whole would remove every VF",
        ),
        (
            dict(&[("kind", Variant::from("fpga"))]),
            vm("a"),
            "NotManaged",
            "not selected by the configuration",
        ),
        (
            dict(&[
                ("kind", Variant::from("other")),
                ("address", Variant::from("0000:17:00.1")),
            ]),
            vm("a"),
            "NoDeviceAvailable",
            "a gpu, which its claim would take too (ask for kind gpu)",
        ),
        (
            dict(&[("address", Variant::from("0000:3d:00.0"))]),
            vm("a"),
            "Protected",
            "used by the host",
        ),
        (
            dict(&[("address", Variant::from("0000:99:00.0"))]),
            vm("a"),
            "NoDeviceAvailable",
            "no PCI function on this host matches address=0000:99:00.0",
        ),
    ];
    for (req, owner, error, wanted) in cases {
        let (name, message) = refusal(m.claim(req.clone(), owner).await);
        assert_eq!(name, format!("org.vfiod.Vfiod1.Error.{error}"), "{message}");
        assert!(message.contains(wanted), "{message} / {wanted}");
        assert!(
            message.len() < 400,
            "a short error: {} bytes",
            message.len()
        );
    }
    assert!(claims_of(&h).await.is_empty());
    assert_eq!(
        h.store().events(None, 0, 100_000).unwrap().len(),
        events_before,
        "a refused claim records nothing"
    );

    // A device under a task: Busy naming the task.
    h.kernel.inject(
        vfiod::sim::kernel::FaultTarget::DeviceAttr(addr(NIC), "sriov_numvfs".into()),
        vfiod::sim::kernel::FaultAction::Delay(Duration::from_secs(3)),
        Some(1),
    );
    let nic = vfiod::client::device(&h.client, NIC).await.unwrap();
    let task = nic
        .set_mode("vf", vfiod::client::mode_options(Some(8)))
        .await
        .unwrap();
    let id: String = task.as_str().rsplit('/').next().unwrap().to_string();
    let (name, message) = refusal(
        m.claim(dict(&[("address", Variant::from("0000:3b:02.0"))]), vm("a"))
            .await,
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy", "{message}");
    assert!(message.contains(&format!("task {id}")), "{message}");
}

/// `vfioctl claim`, `find`, `claims`, `release`, and `list` showing the VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_claims_lists_and_releases() {
    let h = start().await;
    let bus = h.bus.address().to_string();
    let (ok, out) = vfioctl(&bus, &["find", "--kind", "gpu"]);
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "0000:17:00.0");
    let (ok, out) = vfioctl(
        &bus,
        &[
            "claim", "--vf", "--numa", "0", "--vm", "web1", "--lease", "600",
        ],
    );
    assert!(ok, "{out}");
    assert!(out.starts_with("claim 1: 0000:3b:"), "{out}");
    let (ok, out) = vfioctl(&bus, &["claims"]);
    assert!(ok, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("CLAIM"), "{out}");
    assert!(
        lines[1].contains("web1") && lines[1].contains("claimed") && lines[1].contains("until"),
        "{out}"
    );
    let (ok, out) = vfioctl(&bus, &["claims", "--json"]);
    assert!(ok, "{out}");
    let parsed: Vec<ClaimView> = serde_json::from_str(&out).unwrap();
    assert_eq!(parsed.len(), 1);
    assert!(parsed[0].lease_expires_ms > parsed[0].created_ms);
    let claimed = parsed[0].address.clone();
    let (ok, out) = vfioctl(&bus, &["list"]);
    assert!(ok, "{out}");
    let row = out.lines().find(|l| l.starts_with(&claimed)).unwrap();
    assert!(row.ends_with("claimed by web1"), "{row}");
    let (ok, out) = vfioctl(&bus, &["show", &claimed]);
    assert!(ok, "{out}");
    assert!(out.contains("/org/vfiod/Vfiod1/claim/1 for web1"), "{out}");

    let (ok, out) = vfioctl(&bus, &["claim", "--kind", "fpga", "--vm", "x"]);
    assert!(!ok);
    assert!(out.contains("NotManaged"), "{out}");
    let (ok, out) = vfioctl(&bus, &["claim", "--kind", "gpu"]);
    assert!(!ok, "a claim needs a VM: {out}");
    let (ok, out) = vfioctl(&bus, &["release", "one"]);
    assert!(!ok);
    assert!(out.contains("is not a claim"), "{out}");

    let (ok, out) = vfioctl(&bus, &["release", "1"]);
    assert!(ok, "{out}");
    let (ok, out) = vfioctl(&bus, &["claims"]);
    // No claims: nothing printed (stderr is not a terminal).
    assert!(ok && out.trim().is_empty(), "{out}");
    let (ok, out) = vfioctl(&bus, &["release", "1"]);
    assert!(!ok, "{out}");
    assert!(out.contains("no active claim 1"), "{out}");
}

/// A claim whose lease runs out before an attach is released by vfiod (an event says so, its
/// object goes, the device is free); the configuration's default lease applies to a claim that
/// names none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_releases_the_claim() {
    let h = start().await;
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let path = m
        .claim(
            dict(&[("address", Variant::from("0000:3b:02.0"))]),
            dict(&[
                ("vm_name", Variant::from("brief")),
                ("lease_seconds", Variant::from(1u32)),
            ]),
        )
        .await
        .unwrap();
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert!(c.lease_expires_ms >= c.created_ms + 1000, "{c:?}");
    let client = &h.client;
    eventually_async(
        Duration::from_secs(15),
        "the lapsed claim is released",
        || async move {
            let list = claim::list_claims(client).await.unwrap();
            list.is_empty().then_some(())
        },
    )
    .await;
    let events = h
        .store()
        .events(Some(addr("0000:3b:02.0")), 0, 100)
        .unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind.as_str() == "claim" && e.message.contains("lease of 1 s ran out")),
        "{events:?}"
    );
    let d = vfiod::client::show_device(&h.client, "0000:3b:02.0")
        .await
        .unwrap();
    assert_eq!(d.claim, None);

    // The configuration's default lease, after a reload.
    std::fs::write(
        &h.source().main,
        format!("{CLAIMS_CONFIG}\n[claims]\ndefault_lease_seconds = 3600\n"),
    )
    .unwrap();
    h.manager().await.reload().await.unwrap();
    let path = m.claim(dict(&[]), vm("default")).await.unwrap();
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert!(
        (3_599_000..=3_601_000).contains(&(c.lease_expires_ms - c.created_ms)),
        "{c:?}"
    );
    let path = m
        .claim(
            dict(&[]),
            dict(&[
                ("vm_name", Variant::from("none")),
                ("lease_seconds", Variant::from(0u32)),
            ]),
        )
        .await
        .unwrap();
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.lease_expires_ms, 0, "0 asks for no lease: {c:?}");
}

/// A claimed device that breaks stays claimed (its VM still has it) and is reported with the
/// VM; released, it does not return to the pool until it is healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_device_that_breaks_stays_claimed_and_is_reported() {
    let h = start().await;
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let vf = "0000:3b:02.3";
    let one = || dict(&[("address", Variant::from(vf))]);
    let path = m.claim(one(), vm("db1")).await.unwrap();
    h.kernel.set_config_all_ones(addr(vf), true).unwrap();
    h.manager().await.rescan().await.unwrap();
    let d = vfiod::client::show_device(&h.client, vf).await.unwrap();
    assert_eq!(d.state, "broken");
    assert_eq!(d.claim.as_deref(), Some(path.as_str()), "still claimed");
    let events = h.store().events(Some(addr(vf)), 0, 100).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind.as_str() == "claim" && e.message.contains("broke while claimed by db1")),
        "{events:?}"
    );
    claim::release(&h.client, path).await.unwrap();
    let (name, message) = refusal(m.claim(one(), vm("db2")).await);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.NoDeviceAvailable");
    assert!(message.contains("broken"), "{message}");
    assert!(m.find_devices(one()).await.unwrap().is_empty());
    // Healthy again: cleaned (its claim ended while it was unreadable), then back in the pool.
    h.kernel.set_config_all_ones(addr(vf), false).unwrap();
    h.manager().await.rescan().await.unwrap();
    common::cleaned(&h, vf).await;
    assert_eq!(m.find_devices(one()).await.unwrap().len(), 1);
    m.claim(one(), vm("db2")).await.unwrap();
}
