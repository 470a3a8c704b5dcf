//! What makes passthrough impossible on a host, on the simulated kernel: the boot GPU driving
//! the host's console (a host use, unless `[host] allow_console_gpu` says it may go).

use crate::common;

use crate::common::{addr, dict, eventually_async, Harness};
use crate::hooks::{domain_xml, harness_with, hook};
use std::time::Duration;
use vfiod::client::claim;
use vfiod::dbus::wire::Dict;
use vfiod::sim::kernel::HostModel;
use zbus::Variant;

const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";

/// The GPU's group, the FPGA and the NIC selected; private scenario, so that each stays on its
/// own driver until asked.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\n\
     [[select]]\nclass = \"0x03\"\n\
     [[select]]\nid = \"10de:1aef\"\n\
     [[select]]\nclass = \"0x12\"\n\
     [[select]]\nid = \"8086:1572\"\n";

fn vm(name: &str) -> Dict {
    dict(&[("vm_name", Variant::from(name.to_string()))])
}

fn at(address: &str) -> Dict {
    dict(&[("address", Variant::from(address.to_string()))])
}

fn refusal<T>(r: zbus::Result<T>) -> (String, String) {
    common::refusal(r, "a call that must be refused")
}

/// (state, reason) of `address` as the daemon shows it.
async fn state_of(h: &Harness, address: &str) -> (String, String) {
    let d = vfiod::client::list_devices(&h.client)
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.address == address)
        .unwrap_or_else(|| panic!("{address} is listed"));
    (d.state, d.state_reason)
}

/// The boot VGA GPU with the console on its framebuffer is the host's: protected with the
/// reason, refused by a claim and by the hook. Allowed in `[host]`, it is usable, claimed and
/// given to a domain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_gpu_is_the_hosts_unless_the_config_allows_it() {
    let (h, hook_config, bus) = harness_with(CONFIG, HostModel::console_gpu()).await;
    let why = "boot VGA device driving the host console (fb0)";
    let (state, reason) = state_of(&h, GPU).await;
    assert_eq!(state, "protected", "{reason}");
    assert_eq!(reason, format!("used by the host: {why}"));
    let (state, reason) = state_of(&h, AUDIO).await;
    assert_eq!(state, "protected", "{reason}");
    assert!(reason.contains(GPU), "{reason}");

    let claims = claim::claims_proxy(&h.client).await.unwrap();
    let (name, message) = refusal(claims.claim(at(GPU), vm("desk")).await);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Protected", "{message}");
    assert!(message.contains(why), "{message}");
    assert!(claim::list_claims(&h.client).await.unwrap().is_empty());

    let xml = domain_xml("desk", &[GPU, AUDIO]);
    let r = hook(&bus, &hook_config, &["desk", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{} {}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains(&format!("{GPU} is used by the host: {why}")),
        "{}",
        r.stderr
    );
    assert_eq!(h.kernel.driver_of(addr(GPU)).as_deref(), Some("nouveau"));

    // The operator passes the only GPU on purpose.
    std::fs::write(
        &h.config_path,
        format!("{CONFIG}[host]\nallow_console_gpu = [\"{GPU}\"]\n"),
    )
    .unwrap();
    vfiod::client::manager(&h.client)
        .await
        .unwrap()
        .reload()
        .await
        .unwrap();
    let client = &h.client;
    eventually_async(
        Duration::from_secs(30),
        "the console GPU is usable once allowed",
        || async move {
            let listed = vfiod::client::list_devices(client).await.ok()?;
            listed
                .iter()
                .filter(|d| d.address == GPU || d.address == AUDIO)
                .all(|d| d.state == "usable")
                .then_some(())
        },
    )
    .await;
    let r = hook(&bus, &hook_config, &["desk", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "{} {}", r.stdout, r.stderr);
    assert_eq!(h.kernel.driver_of(addr(GPU)).as_deref(), Some("vfio-pci"));
    let held: Vec<String> = claim::list_claims(&h.client)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.address)
        .collect();
    assert!(held.contains(&GPU.to_string()), "{held:?}");
}

/// On the reference host the GPU is the boot VGA device's sibling of no console: usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_without_the_console_stays_usable() {
    let mut model = HostModel::reference();
    // The boot VGA device of a headless host: no console bound to it.
    for f in model
        .functions
        .iter_mut()
        .filter(|f| f.address == addr(GPU))
    {
        f.boot_vga = true;
    }
    let (h, _, _) = harness_with(CONFIG, model).await;
    assert_eq!(state_of(&h, GPU).await.0, "usable");
    let claims = claim::claims_proxy(&h.client).await.unwrap();
    claims.claim(at(GPU), vm("headless")).await.unwrap();
}
