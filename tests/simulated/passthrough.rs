//! What makes passthrough impossible on a host, on the simulated kernel: the boot GPU driving
//! the host's console (a host use, unless `[host] allow_console_gpu` says it may go), and a
//! host without an IOMMU (nothing is claimed, bound to vfio-pci or attached).

use crate::common;

use crate::common::{addr, dict, eventually_async, vfioctl, Harness};
use crate::hooks::{domain_xml, harness_with, hook};
use std::time::Duration;
use vfiod::client::claim;
use vfiod::dbus::wire::Dict;
use vfiod::sim::kernel::HostModel;
use zbus::Variant;

const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";
const FPGA: &str = "0000:af:00.0";
const NIC: &str = "0000:3b:00.0";

/// The GPU's group, the FPGA and the NIC selected; private scenario, so that each stays on its
/// own driver until asked.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\n\
     [[select]]\nclass = \"0x03\"\n\
     [[select]]\nid = \"10de:1aef\"\n\
     [[select]]\nclass = \"0x12\"\n\
     [[select]]\nid = \"8086:1572\"\n";

const NO_IOMMU: &str = "no IOMMU: passthrough is unsafe; enable VT-d/AMD-Vi in firmware and boot \
                        with intel_iommu=on (or amd_iommu=on) iommu=pt";

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

/// A host without an IOMMU: status says so, a claim, a bind to vfio-pci (a split onto
/// vfio-pci VFs) and the hook's prepare are refused with the line that says how to turn it on,
/// and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_without_an_iommu_refuses_passthrough() {
    let (h, hook_config, bus) = harness_with(CONFIG, HostModel::no_iommu()).await;
    let m = vfiod::client::manager(&h.client).await.unwrap();
    assert_eq!(m.iommu().await.unwrap(), "absent");
    let (ok, out) = vfioctl(&bus, &["status"]);
    assert!(ok, "{out}");
    assert_eq!(out.matches(NO_IOMMU).count(), 1, "{out}");
    let (ok, out) = vfioctl(&bus, &["status", "--json"]);
    assert!(ok, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["no_iommu"], NO_IOMMU, "{out}");

    let claims = claim::claims_proxy(&h.client).await.unwrap();
    for req in [at(FPGA), dict(&[("kind", Variant::from("gpu"))])] {
        let (name, message) = refusal(claims.claim(req, vm("x")).await);
        assert_eq!(name, "org.vfiod.Vfiod1.Error.NoIommu", "{message}");
        assert_eq!(message, NO_IOMMU);
    }
    assert!(claim::list_claims(&h.client).await.unwrap().is_empty());

    let nic = vfiod::client::device(&h.client, NIC).await.unwrap();
    let (name, message) = refusal(
        nic.set_mode("vf", vfiod::client::mode_options(Some(4)))
            .await,
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.NoIommu", "{message}");
    assert_eq!(
        message,
        format!("{NIC} cannot be passed through: {NO_IOMMU}")
    );
    let sriov = h
        .kernel
        .root()
        .join(format!("sys/bus/pci/devices/{NIC}/sriov_numvfs"));
    assert_eq!(std::fs::read_to_string(&sriov).unwrap().trim(), "0");

    let xml = domain_xml("vm1", &[FPGA]);
    let r = hook(&bus, &hook_config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{} {}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains(&format!("vfiod: domain vm1 cannot start: {NO_IOMMU}")),
        "{}",
        r.stderr
    );
    assert_eq!(h.kernel.driver_of(addr(FPGA)).as_deref(), Some("dfl-pci"));
    assert!(claim::list_claims(&h.client).await.unwrap().is_empty());
}

/// A claim made while the host had an IOMMU, attached after it booted without one: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_without_an_iommu_is_refused() {
    let (h, _, _) = harness_with(CONFIG, HostModel::reference()).await;
    let claims = claim::claims_proxy(&h.client).await.unwrap();
    let path = claims.claim(at(FPGA), vm("vm1")).await.unwrap();
    // What the kernel shows after a boot without intel_iommu=on: no group, no link.
    let root = h.kernel.root();
    let groups = root.join("sys/kernel/iommu_groups");
    std::fs::remove_dir_all(&groups).unwrap();
    std::fs::create_dir(&groups).unwrap();
    for d in std::fs::read_dir(root.join("sys/bus/pci/devices")).unwrap() {
        let link = d.unwrap().path().join("iommu_group");
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(link).unwrap();
        }
    }
    let c = claim::ClaimProxy::builder(&h.client)
        .path(path)
        .build()
        .await
        .unwrap();
    let (name, message) = refusal(c.attach("vm1", Dict::new()).await);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.NoIommu", "{message}");
    assert_eq!(
        message,
        format!("{FPGA} cannot be passed through: {NO_IOMMU}")
    );
}
