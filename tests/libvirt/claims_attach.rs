//! Claim.Attach and Claim.Detach against a real libvirtd serving QEMU's session driver
//! (tests/common/libvirtd.rs), with a TCG domain and vfiod on the simulated host. What this
//! machine can do for real: libvirt refusing an attach (a domain that does not exist; a live
//! hostdev the session driver cannot assign, the host having no such device and no IOMMU), an
//! attach to a domain's configuration and its detach, a detach that fails because libvirt is
//! gone (records kept, the device out of the pool), and the reconcile of claims with the
//! domains' definitions after a reconnect. A live hostdev attach and the guest's acknowledgement
//! of its unplug need an IOMMU and a guest OS: tests/vm/scenarios/claims.py.
//!
//! Needs `qemu-system-x86` besides the packages of README's test command.

use crate::common;

use crate::common::libvirtd::{require_qemu, tcg_domain_xml, Libvirtd};
use crate::common::{addr, dict, eventually_async, refusal, Harness};
use std::time::Duration;
use vfiod::client::claim::{self, ClaimProxy};
use vfiod::model::event::EventKind;
use zbus::Variant;

/// The first QEMU domain under a new daemon probes QEMU's capabilities: slow under load.
const SLOW: Duration = Duration::from_secs(90);

fn config(uri: &str) -> String {
    format!(
        "scenario = \"public\"\nlibvirt_uri = \"{uri}\"\n\
         [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n\
         [claims]\ndetach_timeout = 3\n"
    )
}

fn define(d: &Libvirtd, name: &str, start: bool) -> String {
    let file = d.dir.path().join(format!("{name}.xml"));
    std::fs::write(&file, tcg_domain_xml(name)).unwrap();
    let uri = d.qemu_uri();
    d.virsh_at(&uri, &["define", file.to_str().unwrap()]);
    if start {
        d.virsh_at(&uri, &["start", name]);
    }
    d.virsh_at(&uri, &["domuuid", name]).trim().to_string()
}

async fn setup() -> (Libvirtd, Harness) {
    require_qemu();
    let d = Libvirtd::start();
    let h = Harness::start(&config(&d.qemu_uri())).await;
    d.announce(h.kernel.root());
    // The helper starts once vfiod sees the daemon (it looks every 2 s): domain events are
    // heard only from then on.
    common::wait_for_libvirt(h.engine()).await;
    (d, h)
}

async fn claim_vf(h: &Harness, vm: &str) -> zbus::OwnedObjectPath {
    let m = claim::claims_proxy(&h.client).await.unwrap();
    m.claim(
        dict(&[("role", Variant::from("vf"))]),
        dict(&[("vm_name", Variant::from(vm.to_string()))]),
    )
    .await
    .unwrap()
}

async fn proxy<'a>(h: &'a Harness, path: &zbus::OwnedObjectPath) -> ClaimProxy<'a> {
    ClaimProxy::builder(&h.client)
        .path(path.clone())
        .build()
        .await
        .unwrap()
}

async fn active_paths(h: &Harness) -> Vec<String> {
    claim::list_claims(&h.client)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.path)
        .collect()
}

async fn findable(h: &Harness, address: &str) -> bool {
    let m = claim::claims_proxy(&h.client).await.unwrap();
    m.find_devices(dict(&[("address", Variant::from(address.to_string()))]))
        .await
        .unwrap()
        .len()
        == 1
}

/// Waits until `address` is findable again: its claim ended, and its clean (issue 23) brought
/// it back to the pool.
async fn back_in_pool(h: &Harness, address: &str, what: &str) {
    eventually_async(Duration::from_secs(30), what, || async {
        findable(h, address).await.then_some(())
    })
    .await;
}

fn claim_events(h: &Harness, address: &str) -> Vec<String> {
    h.store()
        .events(Some(addr(address)), 0, 200)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == EventKind::Claim)
        .map(|e| e.message)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_libvirt_refuses_releases_the_claim() {
    let (d, h) = setup().await;
    define(&d, "vm1", true);

    // A domain libvirt does not have.
    let path = claim_vf(&h, "ghost").await;
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    let (name, message) = refusal(
        proxy(&h, &path)
            .await
            .attach("ghost", claim::attach_options(&[]))
            .await,
        "attach to a domain that does not exist",
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.AttachFailed", "{message}");
    assert!(message.contains("no domain ghost"), "{message}");
    assert!(!active_paths(&h).await.contains(&path.to_string()));
    back_in_pool(&h, &c.address, "the VF is back in the pool").await;
    let events = claim_events(&h, &c.address);
    assert!(
        events
            .iter()
            .any(|e| e.contains("released: the attach to ghost failed")),
        "{events:?}"
    );
    // The failed task does not hold the device: it can be claimed and attached again.
    let again = claim_vf(&h, "vm1").await;
    let again_view = claim::claim_view(&h.client, again.as_str()).await.unwrap();
    assert_eq!(again_view.address, c.address, "the same VF, the best again");

    // A live hostdev the session driver cannot assign (no such host device, no VFIO here).
    // Bounded only against a hung test (SLOW); the refusal's name and text are the claim.
    let (name, message) = refusal(
        tokio::time::timeout(
            SLOW,
            proxy(&h, &again)
                .await
                .attach("vm1", claim::attach_options(&["live"])),
        )
        .await
        .expect("the attach is answered"),
        "live attach libvirt cannot do",
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.AttachFailed", "{message}");
    assert!(
        message.contains("could not attach a device to domain vm1"),
        "{message}"
    );
    assert!(!active_paths(&h).await.contains(&again.to_string()));
    back_in_pool(&h, &c.address, "the VF is back in the pool").await;
    let live = d.virsh_at(&d.qemu_uri(), &["dumpxml", "vm1"]);
    assert!(
        !live.contains("ua-vfiod-"),
        "nothing of vfiod's is left: {live}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_before_the_attach_change_nothing() {
    let (d, h) = setup().await;
    define(&d, "vm1", false);
    let path = claim_vf(&h, "vm1").await;
    let p = proxy(&h, &path).await;
    for (domain, flags, error, says) in [
        (
            "vm2",
            claim::attach_options(&["config"]),
            "InvalidArgument",
            "is for VM vm1, not vm2",
        ),
        (
            "vm1",
            dict(&[("hot", Variant::from(true))]),
            "InvalidArgument",
            "unknown query key \"hot\"",
        ),
        (
            "vm1",
            dict(&[("live", false.into()), ("config", false.into())]),
            "InvalidArgument",
            "nothing to attach to",
        ),
        (
            "",
            Default::default(),
            "InvalidArgument",
            "the domain must be named",
        ),
    ] {
        let (name, message) = refusal(p.attach(domain, flags).await, domain);
        assert_eq!(name, format!("org.vfiod.Vfiod1.Error.{error}"), "{message}");
        assert!(message.contains(says), "{message}");
    }
    let (name, message) = refusal(p.detach().await, "detach of a claim never attached");
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{message}");
    assert!(message.contains("it is not attached"), "{message}");
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.state, "claimed");

    // vm1 is defined but stopped: a live attach is refused by the domain's state, which only
    // the attach itself learns; the claim is released by the rule.
    let (name, message) = refusal(
        p.attach("vm1", claim::attach_options(&["live"])).await,
        "live to a stopped domain",
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.AttachFailed", "{message}");
    assert!(message.contains("not running"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_attach_and_detach_and_a_detach_that_fails() {
    let (mut d, h) = setup().await;
    let uuid = define(&d, "vm1", false);
    let path = claim_vf(&h, "vm1").await;
    let p = proxy(&h, &path).await;
    // A stopped domain: into its configuration (the default then).
    p.attach("vm1", claim::attach_options(&[]))
        .await
        .expect("config attach");
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.state, "attached");
    assert_eq!(c.vm_uuid, uuid, "the UUID libvirt has is recorded");
    assert!(!c.guest_address.is_empty(), "{c:?}");
    let config = d.virsh_at(&d.qemu_uri(), &["dumpxml", "--inactive", "vm1"]);
    let alias = format!("ua-vfiod-{}-0", c.id);
    assert!(config.contains(&alias), "{config}");
    assert!(!findable(&h, &c.address).await);
    // An attached claim cannot be released: its domain has the device.
    let (name, message) = refusal(p.release().await, "release of an attached claim");
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse", "{message}");
    assert!(message.contains("detach it first"), "{message}");

    // libvirt goes away: the detach fails, and nothing changes.
    d.kill();
    let (name, message) = refusal(p.detach().await, "detach without libvirt");
    assert_eq!(name, "org.vfiod.Vfiod1.Error.DetachFailed", "{message}");
    assert!(message.contains("the claim stays attached"), "{message}");
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.state, "attached");
    assert!(!findable(&h, &c.address).await, "still out of the pool");

    // libvirt is back: the detach goes through, the claim ends, the VF is in the pool again.
    d.restart();
    d.announce(h.kernel.root());
    let client = &h.client;
    let detached = eventually_async(SLOW, "the detach succeeds once libvirt is back", || {
        let path = path.clone();
        async move {
            let p = ClaimProxy::builder(client).path(path).build().await.ok()?;
            p.detach().await.ok()
        }
    })
    .await;
    let _: () = detached;
    assert!(!active_paths(&h).await.contains(&path.to_string()));
    back_in_pool(&h, &c.address, "the VF is back in the pool").await;
    let config = d.virsh_at(&d.qemu_uri(), &["dumpxml", "--inactive", "vm1"]);
    assert!(!config.contains(&alias), "{config}");
    let events = claim_events(&h, &c.address);
    assert!(
        events.iter().any(|e| e.contains("detach failed")),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| e.contains("detached from vm1")),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconcile_repairs_claims_libvirt_disagrees_with() {
    let (mut d, h) = setup().await;
    define(&d, "vm1", false);
    // Attached to vm1's configuration, then removed from it behind vfiod's back.
    let path = claim_vf(&h, "vm1").await;
    proxy(&h, &path)
        .await
        .attach("vm1", claim::attach_options(&["config"]))
        .await
        .unwrap();
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    let hostdev =
        vfiod::host::libvirt::hostdev_xml(addr(&c.address), &format!("ua-vfiod-{}-0", c.id));
    let file = d.dir.path().join("hostdev.xml");
    std::fs::write(&file, &hostdev).unwrap();
    // And the reverse: a managed VF assigned to vm1 by hand, that no claim holds.
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let free = m
        .find_devices(dict(&[("role", Variant::from("vf"))]))
        .await
        .unwrap();
    let by_hand = free[0].as_str().rsplit('/').next().unwrap().to_string();
    let by_hand = by_hand
        .strip_prefix("pci_")
        .unwrap()
        .replacen('_', ":", 2)
        .replacen('_', ".", 1);
    let hand_file = d.dir.path().join("by-hand.xml");
    std::fs::write(
        &hand_file,
        vfiod::host::libvirt::hostdev_xml(addr(&by_hand), "ua-byhand"),
    )
    .unwrap();
    let uri = d.qemu_uri();
    d.virsh_at(
        &uri,
        &["detach-device", "vm1", file.to_str().unwrap(), "--config"],
    );
    d.virsh_at(
        &uri,
        &[
            "attach-device",
            "vm1",
            hand_file.to_str().unwrap(),
            "--config",
        ],
    );

    // vfiod learns of it when libvirt reconnects (as after a restart of either).
    d.restart();
    d.announce(h.kernel.root());
    let client = &h.client;
    let first = path.to_string();
    let (first, by_hand_ref) = (&first, &by_hand);
    let list = eventually_async(SLOW, "the reconcile puts the claim back", || async move {
        let list = claim::list_claims(client).await.unwrap();
        let back = list
            .iter()
            .any(|c| &c.path == first && c.state == "claimed");
        back.then_some(list)
    })
    .await;
    // The function assigned by hand is reported, not claimed behind the operator's back.
    assert_eq!(list.len(), 1, "{list:?}");
    assert!(list.iter().all(|c| &c.address != by_hand_ref), "{list:?}");
    let events = claim_events(&h, &c.address);
    assert!(
        events
            .iter()
            .any(|e| e.contains("reconcile: domain vm1 no longer has its devices")),
        "{events:?}"
    );
    // Reported in the same reconcile, after the repair the wait above saw.
    let h_ref = &h;
    eventually_async(
        SLOW,
        "the hostdev no claim holds is reported",
        || async move {
            claim_events(h_ref, by_hand_ref)
                .iter()
                .any(|e| {
                    e.contains("domain vm1 has") && e.contains("assigned but no claim holds it")
                })
                .then_some(())
        },
    )
    .await;
}

/// Runs libvirt's qemu hook (`vfioctl hook qemu ARGS`, the XML on stdin) against the harness's
/// vfiod; returns its exit code and stderr.
fn run_hook(h: &Harness, uri: &str, args: &[&str], xml: &str) -> (i32, String) {
    use std::io::Write;
    let file = h.dir.path().join("hook.toml");
    std::fs::write(
        &file,
        format!(
            "state_dir = \"{}\"\n{}",
            h.dir.path().join("state").display(),
            config(uri)
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args(["hook", "qemu"])
        .args(args)
        .env("VFIOD_BUS", h.bus.address())
        .env("VFIOD_CONFIG", &file)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(xml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A domain whose own XML names a managed VF runs through the hook (prepare claims it for the
/// run, started marks it attached), then stops while vfiod does not hear it (no stopped/release
/// hook reaches it; here: the domain never really ran in libvirt). The reconcile when vfiod
/// reconnects ends the claim although the domain's configuration still names the VF, and the VF
/// in that configuration is no warning: the hook claims it at the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconcile_ends_a_run_claim_of_a_domain_that_stopped_unheard() {
    let (mut d, h) = setup().await;
    let uri = d.qemu_uri();
    define(&d, "vm1", false);
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let free = m
        .find_devices(dict(&[("role", Variant::from("vf"))]))
        .await
        .unwrap();
    let vf = free[0].as_str().rsplit('/').next().unwrap().to_string();
    let vf = vf
        .strip_prefix("pci_")
        .unwrap()
        .replacen('_', ":", 2)
        .replacen('_', ".", 1);
    let p = addr(&vf);
    let hostdev = format!(
        "<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x{:04x}' \
         bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source></hostdev>",
        p.domain, p.bus, p.slot, p.function
    );
    let file = d.dir.path().join("named.xml");
    std::fs::write(&file, &hostdev).unwrap();
    d.virsh_at(
        &uri,
        &["attach-device", "vm1", file.to_str().unwrap(), "--config"],
    );
    let xml = d.virsh_at(&uri, &["dumpxml", "vm1", "--inactive"]);

    for op in ["prepare", "started"] {
        let (code, stderr) = run_hook(&h, &uri, &["vm1", op, "begin", "-"], &xml);
        assert_eq!(code, 0, "{op}: {stderr}");
    }
    let list = claim::list_claims(&h.client).await.unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(
        (
            list[0].address.as_str(),
            list[0].vm_name.as_str(),
            list[0].state.as_str()
        ),
        (vf.as_str(), "vm1", "attached"),
        "{list:?}"
    );
    assert!(!findable(&h, &vf).await);

    // vfiod hears of the domain again when libvirt reconnects (as after a restart of either).
    d.restart();
    d.announce(h.kernel.root());
    let client = &h.client;
    eventually_async(SLOW, "the reconcile ends the claim", || async move {
        claim::list_claims(client)
            .await
            .unwrap()
            .is_empty()
            .then_some(())
    })
    .await;
    back_in_pool(&h, &vf, "the VF is back in the pool").await;
    let events = claim_events(&h, &vf);
    assert!(
        events
            .iter()
            .any(|e| e.contains("released by the reconcile: vm1 no longer runs")),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| e.contains("domain vm1 has")
            && e.contains("in its configuration only, and the libvirt hook claims it")),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_libvirt_attach_says_so_and_claims_still_work() {
    let h = Harness::start(
        "scenario = \"public\"\nlibvirt_uri = \"\"\n[[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n",
    )
    .await;
    let path = claim_vf(&h, "vm1").await;
    let (name, message) = refusal(
        proxy(&h, &path)
            .await
            .attach("vm1", claim::attach_options(&[]))
            .await,
        "attach without libvirt",
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Failed", "{message}");
    assert!(
        message.contains("libvirt is off in this configuration"),
        "{message}"
    );
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.state, "claimed", "a refusal changes nothing");
    proxy(&h, &path).await.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_attaches_and_detaches() {
    let (d, h) = setup().await;
    define(&d, "vm1", false);
    let bus = h.bus.address().to_string();
    let run = move |args: Vec<String>| {
        let bus = bus.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                common::vfioctl(&bus, &args)
            })
            .await
            .unwrap()
        }
    };
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (ok, out) = run(args(&["claim", "--vf", "--vm", "vm1"])).await;
    assert!(ok, "{out}");
    let id = out
        .strip_prefix("claim ")
        .and_then(|r| r.split(':').next())
        .expect("claim N: ...")
        .to_string();

    let (ok, out) = run(args(&["attach", &id, "vm1", "--live", "--wait"])).await;
    assert!(!ok, "a live attach to a stopped domain fails: {out}");
    assert!(
        out.contains("AttachFailed") && out.contains("not running"),
        "{out}"
    );
    let (ok, out) = run(args(&["claims"])).await;
    assert!(
        ok && out.trim().is_empty(),
        "the failed attach released it: {out}"
    );

    let (ok, out) = run(args(&["claim", "--vf", "--vm", "vm1"])).await;
    assert!(ok, "{out}");
    let id = out[6..].split(':').next().unwrap().to_string();
    let (ok, out) = run(args(&["attach", &id, "vm1", "--config", "--wait"])).await;
    assert!(ok, "{out}");
    assert!(out.contains("attached to vm1 at guest address"), "{out}");
    let (ok, out) = run(args(&["claims", "--json"])).await;
    assert!(ok, "{out}");
    let list: Vec<claim::ClaimView> = serde_json::from_str(&out).unwrap();
    assert_eq!(list[0].state, "attached");

    let (ok, out) = run(args(&["release", &id])).await;
    assert!(!ok && out.contains("detach it first"), "{out}");
    let (ok, out) = run(args(&["detach", &id])).await;
    assert!(ok, "{out}");
    assert!(out.contains(&format!("claim {id} ")), "{out}");
    let client = &h.client;
    eventually_async(SLOW, "the claim is gone after the detach", || async move {
        claim::list_claims(client)
            .await
            .unwrap()
            .is_empty()
            .then_some(())
    })
    .await;
    let (ok, out) = run(args(&["detach", &id, "--wait"])).await;
    assert!(
        !ok && out.contains(&format!("no active claim {id}")),
        "{out}"
    );

    // The same with --json: the claim as an object, then the ended claim.
    let (ok, out) = run(args(&["claim", "--vf", "--vm", "vm1", "--json"])).await;
    assert!(ok, "{out}");
    let c: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = c["id"]
        .as_u64()
        .expect("a claim's id is a number")
        .to_string();
    let (ok, out) = run(args(&[
        "attach", &id, "vm1", "--config", "--wait", "--json",
    ]))
    .await;
    assert!(ok, "{out}");
    let c: claim::ClaimView = serde_json::from_str(&out).unwrap();
    assert_eq!(c.state, "attached", "{out}");
    assert!(!c.guest_address.is_empty(), "{out}");
    let (ok, out) = run(args(&["detach", &id, "--wait", "--json"])).await;
    assert!(ok, "{out}");
    let ended: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ended["id"].to_string(), id, "{out}");
    assert_eq!(ended["state"], "released", "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undefining_a_stopped_domain_ends_its_attached_claims() {
    let (d, h) = setup().await;
    define(&d, "vm1", false);
    define(&d, "vm2", false);
    let one = claim_vf(&h, "vm1").await;
    proxy(&h, &one)
        .await
        .attach("vm1", claim::attach_options(&[]))
        .await
        .unwrap();
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let two = m
        .claim(
            dict(&[("role", Variant::from("vf"))]),
            dict(&[
                ("vm_name", Variant::from("vm2")),
                ("persistent", Variant::from(true)),
            ]),
        )
        .await
        .unwrap();
    proxy(&h, &two)
        .await
        .attach("vm2", claim::attach_options(&[]))
        .await
        .unwrap();
    let uri = d.qemu_uri();
    d.virsh_at(&uri, &["undefine", "vm1"]);
    d.virsh_at(&uri, &["undefine", "vm2"]);
    let client = &h.client;
    let (one_s, two_s) = (one.to_string(), two.to_string());
    let (one_s, two_s) = (&one_s, &two_s);
    let list = eventually_async(
        SLOW,
        "vm1's claim ends, vm2's persistent one stays",
        || async move {
            let list = claim::list_claims(client).await.unwrap();
            let gone = !list.iter().any(|c| &c.path == one_s);
            let kept = list
                .iter()
                .any(|c| &c.path == two_s && c.state == "claimed");
            (gone && kept).then_some(list)
        },
    )
    .await;
    assert_eq!(list.len(), 1, "{list:?}");
}
