//! Claims following libvirt's own domain events, with a real libvirtd (Debian's, a child of the
//! test serving libvirt's test driver; `tests/common/libvirtd.rs`): undefining a domain releases
//! its claims, but a persistent claim stays and is reported.

use crate::common;

use crate::common::libvirtd::Libvirtd;
use crate::common::{addr, dict, eventually_async, Harness};
use std::time::Duration;
use vfiod::client::claim;
use zbus::Variant;

fn define(d: &Libvirtd, name: &str) -> String {
    let file = d.dir.path().join(format!("{name}.xml"));
    // A hostdev nobody claims here: the test driver only keeps it in the XML.
    std::fs::write(
        &file,
        common::libvirtd::test_domain_xml(name, "0000:3b:03.7"),
    )
    .unwrap();
    d.virsh(&["define", file.to_str().unwrap()]);
    d.virsh(&["domuuid", name]).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undefining_a_domain_releases_its_claims_but_persistent_ones() {
    let d = Libvirtd::start();
    let config = format!(
        "scenario = \"public\"\nlibvirt_uri = \"{}\"\n[[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 8\n",
        d.uri()
    );
    let h = Harness::start(&config).await;
    let vm1_uuid = define(&d, "vm1");
    define(&d, "vm2");
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let vf = || dict(&[("role", Variant::from("vf"))]);
    // vm1 by UUID only (as a client that knows the domain by UUID), vm2 by name and persistent,
    // and a VM libvirt does not know.
    let by_uuid = m
        .claim(vf(), dict(&[("vm_uuid", Variant::from(vm1_uuid.clone()))]))
        .await
        .unwrap();
    let persistent = m
        .claim(
            vf(),
            dict(&[
                ("vm_name", Variant::from("vm2")),
                ("persistent", Variant::from(true)),
            ]),
        )
        .await
        .unwrap();
    let other = m
        .claim(vf(), dict(&[("vm_name", Variant::from("vm3"))]))
        .await
        .unwrap();
    let first = claim::claim_view(&h.client, by_uuid.as_str())
        .await
        .unwrap();

    d.virsh(&["undefine", "vm1"]);
    let client = &h.client;
    let path = by_uuid.to_string();
    eventually_async(
        Duration::from_secs(15),
        "vm1's claim is released once libvirt says vm1 was undefined",
        || {
            let path = path.clone();
            async move {
                let list = claim::list_claims(client).await.unwrap();
                (!list.iter().any(|c| c.path == path)).then_some(list)
            }
        },
    )
    .await;
    let events = h
        .store()
        .events(Some(addr(&first.address)), 0, 100)
        .unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.message.contains("released: its domain vm1 was undefined")),
        "{events:?}"
    );

    d.virsh(&["undefine", "vm2"]);
    let kept = claim::claim_view(&h.client, persistent.as_str())
        .await
        .unwrap();
    let store = h.store();
    let address = addr(&kept.address);
    common::eventually(
        Duration::from_secs(15),
        "the persistent claim's event",
        || {
            let events = store.events(Some(address), 0, 100).unwrap();
            events
                .iter()
                .any(|e| e.message.contains("the claim is persistent and stays"))
                .then_some(())
        },
    )
    .await;
    let left: Vec<String> = claim::list_claims(&h.client)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.path)
        .collect();
    assert_eq!(left, [persistent.to_string(), other.to_string()]);
}
