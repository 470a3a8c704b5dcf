//! libvirt's qemu hook through `vfioctl hook qemu` (the binary libvirt's shim execs), against
//! vfiod on the simulated host and a private bus: each operation on real domain XML, what it
//! does to the claims and bindings, idempotence, and the hard deadlines when vfiod is down or
//! does not answer.

use crate::common;

use crate::common::{addr, dict, Harness};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;
use vfiod::client::claim;
use zbus::Variant;

/// The FPGA (selected, private scenario: PF mode, left on its own driver) and the NIC split into
/// VFs on vfio-pci.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\n\
     [[select]]\nclass = \"0x12\"\n\
     [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n";
const FPGA: &str = "0000:af:00.0";
const VF0: &str = "0000:3b:02.0";
const VF1: &str = "0000:3b:02.1";
/// A function vfiod does not manage and the host does not use (the data NVMe drive).
const UNMANAGED: &str = "0000:d8:00.0";
/// The host's NIC (its interface enp2s0 is up) and boot NVMe (mounted at /): protected.
const HOST_NIC: &str = "0000:02:00.0";
const BOOT_NVME: &str = "0000:3d:00.0";
const UUID: &str = "6ba7b810-9dad-11d1-80b4-00c04fd430c8";

fn hostdev(a: &str, guest_bus: u8) -> String {
    let p = addr(a);
    format!(
        "<hostdev mode='subsystem' type='pci' managed='no'>\
         <source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source>\
         <address type='pci' domain='0x0000' bus='0x{guest_bus:02x}' slot='0x00' function='0x0'/>\
         </hostdev>",
        p.domain, p.bus, p.slot, p.function
    )
}

pub(crate) fn domain_xml(name: &str, devices: &[&str]) -> String {
    let hostdevs: String = devices
        .iter()
        .enumerate()
        .map(|(i, a)| hostdev(a, 7 + i as u8))
        .collect();
    format!(
        "<domain type='kvm'><name>{name}</name><uuid>{UUID}</uuid><memory>65536</memory>\
         <devices><disk type='file' device='disk'><source file='/x.qcow2'/><target dev='vda'/></disk>\
         <hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/><product id='0x5678'/></source>\
         <address type='usb' bus='0' port='1'/></hostdev>{hostdevs}</devices></domain>"
    )
}

pub(crate) struct Ran {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the hook as libvirt runs it (`qemu.d/vfiod`, the `vfiod-qemu-hook` binary) with
/// `args` and `xml` on stdin.
pub(crate) fn hook(bus: &str, config: &std::path::Path, args: &[&str], xml: &str) -> Ran {
    run_hook(
        Command::new(env!("CARGO_BIN_EXE_vfiod-qemu-hook")),
        bus,
        config,
        args,
        xml,
    )
}

/// `vfioctl hook qemu ARGS`: the same run, by hand.
fn hook_by_hand(bus: &str, config: &std::path::Path, args: &[&str], xml: &str) -> Ran {
    let mut vfioctl = Command::new(env!("CARGO_BIN_EXE_vfioctl"));
    vfioctl.args(["hook", "qemu"]);
    run_hook(vfioctl, bus, config, args, xml)
}

fn run_hook(
    mut command: Command,
    bus: &str,
    config: &std::path::Path,
    args: &[&str],
    xml: &str,
) -> Ran {
    let mut child = command
        .args(args)
        .env("VFIOD_BUS", bus)
        .env("VFIOD_CONFIG", config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(xml.as_bytes())
        .unwrap();
    // A hook that never ends fails the test at common::HUNG instead of hanging it; how long a
    // run took is not asserted by tests (the hook's deadlines show in what it says).
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(common::HUNG) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) on the pid of our own child, which has not been reaped.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("the hook {args:?} did not end within {:?}", common::HUNG);
        }
    };
    Ran {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

/// The unix sockets bound to `path` now (the listener and the connections it accepted), from
/// the kernel's table: a test sees a client reach a socket server without timing it.
fn unix_sockets_at(path: &std::path::Path) -> usize {
    let path = path.to_string_lossy();
    std::fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .filter(|l| l.split_whitespace().nth(7) == Some(&*path))
        .count()
}

async fn harness() -> (Harness, std::path::PathBuf, String) {
    harness_with(CONFIG, vfiod::sim::kernel::HostModel::reference()).await
}

pub(crate) async fn harness_with(
    config: &str,
    model: vfiod::sim::kernel::HostModel,
) -> (Harness, std::path::PathBuf, String) {
    let h = Harness::start_with(config, model).await;
    // What the hook reads: the deadlines, and the state directory the daemon uses.
    let path = h.dir.path().join("hook.toml");
    std::fs::write(
        &path,
        format!(
            "state_dir = \"{}\"\n{config}[hooks]\ndeadline_ms = 3000\nnotify_deadline_ms = 1000\n",
            h.dir.path().join("state").display()
        ),
    )
    .unwrap();
    let bus = h.bus.address().to_string();
    (h, path, bus)
}

async fn claims_now(h: &Harness) -> Vec<claim::ClaimView> {
    claim::list_claims(&h.client).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lifecycle_of_a_domain_claims_binds_attaches_and_releases() {
    let (h, config, bus) = harness().await;
    let xml = domain_xml("vm1", &[FPGA, VF0, UNMANAGED]);
    assert_eq!(h.kernel.driver_of(addr(FPGA)).as_deref(), Some("dfl-pci"));
    let unmanaged_driver = h.kernel.driver_of(addr(UNMANAGED));

    // prepare: the managed functions are claimed for vm1 and bound to vfio-pci; the USB and
    // the unmanaged hostdevs are left alone.
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.is_empty(), "prepare is no filter: {}", r.stdout);
    let list = claims_now(&h).await;
    let mut held: Vec<_> = list
        .iter()
        .map(|c| (c.address.clone(), c.state.clone()))
        .collect();
    held.sort();
    assert_eq!(
        held,
        [
            (VF0.to_string(), "claimed".to_string()),
            (FPGA.to_string(), "claimed".to_string())
        ]
    );
    assert!(
        list.iter().all(|c| c.vm_name == "vm1" && c.vm_uuid == UUID),
        "{list:?}"
    );
    assert_eq!(h.kernel.driver_of(addr(FPGA)).as_deref(), Some("vfio-pci"));
    assert_eq!(h.kernel.driver_of(addr(UNMANAGED)), unmanaged_driver);
    // The same operation again changes nothing.
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(claims_now(&h).await.len(), 2);

    // started: attached, with the guest addresses of the XML.
    for _ in 0..2 {
        let r = hook(&bus, &config, &["vm1", "started", "begin", "-"], &xml);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    let list = claims_now(&h).await;
    let fpga = list.iter().find(|c| c.address == FPGA).unwrap();
    assert_eq!(
        (fpga.state.as_str(), fpga.guest_address.as_str()),
        ("attached", "0000:07:00.0")
    );
    let vf = list.iter().find(|c| c.address == VF0).unwrap();
    assert_eq!(
        (vf.state.as_str(), vf.guest_address.as_str()),
        ("attached", "0000:08:00.0")
    );

    // Another domain naming a function vm1 holds cannot start, and is told why in one line.
    let other = domain_xml("vm2", &[VF0]).replace(UUID, "00000000-0000-0000-0000-000000000002");
    let r = hook(&bus, &config, &["vm2", "prepare", "begin", "-"], &other);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!("{VF0} is claimed by VM vm1")),
        "{}",
        r.stderr
    );

    // stopped, release: out of the domain and released (claims for the VM's run); twice is
    // the same as once.
    for op in ["stopped", "release", "release"] {
        let r = hook(&bus, &config, &["vm1", op, "end", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    assert!(claims_now(&h).await.is_empty());
    let events = h.store().events(Some(addr(VF0)), 0, 100).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.message.contains("released: domain vm1 stopped")),
        "{events:?}"
    );
}

/// A domain stopped and started again at once (`virsh destroy; virsh start`) finds its VF
/// still being cleaned after the claim its stop ended: `prepare` waits for the clean (within
/// its deadline) instead of failing, and the VF was reset in between. A clean that outlasts the
/// deadline refuses the start in one line that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_started_again_at_once_waits_for_its_devices_clean() {
    use vfiod::sim::kernel::{FaultAction, FaultTarget};
    // The daemon and the hook read one file on a host: one deadline for both (the default
    // 10 s, so that a loaded machine still finishes the short clean within it).
    let daemon = format!("{CONFIG}[hooks]\ndeadline_ms = 10000\nnotify_deadline_ms = 1000\n");
    let h = Harness::start_with(&daemon, vfiod::sim::kernel::HostModel::reference()).await;
    let config = h.dir.path().join("hook.toml");
    let state = h.dir.path().join("state");
    std::fs::write(
        &config,
        format!("state_dir = \"{}\"\n{daemon}", state.display()),
    )
    .unwrap();
    let bus = h.bus.address().to_string();
    let xml = domain_xml("vm1", &[VF0]);
    for op in ["prepare", "started"] {
        let r = hook(&bus, &config, &["vm1", op, "begin", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    // The reset is held in the kernel until the test releases it: the clean is still running
    // when the domain starts again (a state the test sees, where a 600 ms reset and "it took
    // at least 300 ms" raced the machine's load).
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(VF0), "reset".into()),
        FaultAction::Hold,
        Some(1),
    );
    for op in ["stopped", "release"] {
        let r = hook(&bus, &config, &["vm1", op, "end", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    common::eventually(common::HUNG, "the clean reaches its reset", || {
        (h.kernel.hanging() == 1).then_some(())
    })
    .await;
    // The prepare reaches vfiod (its connection to vfiod's hook socket shows in the kernel's
    // table of sockets) while the reset is held: it can only succeed by waiting for the clean.
    let socket = state.join(vfiod::dbus::hook_socket::SOCKET_NAME);
    let peers = || unix_sockets_at(&socket);
    let idle = peers();
    let prepare = {
        let (bus, config, xml) = (bus.clone(), config.clone(), xml.clone());
        std::thread::spawn(move || hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml))
    };
    common::eventually(common::HUNG, "the prepare connects to vfiod", || {
        (peers() > idle).then_some(())
    })
    .await;
    let answered_during_the_clean = prepare.is_finished();
    h.kernel.release_hangs();
    let r = prepare.join().unwrap();
    assert!(!answered_during_the_clean, "{}", r.stderr);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(h.kernel.resets(addr(VF0)), ["flr"], "cleaned in between");
    assert_eq!(claims_now(&h).await.len(), 1);
    for op in ["stopped", "release"] {
        let r = hook(&bus, &config, &["vm1", op, "end", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    common::cleaned(&h, VF0).await;

    // A reset slower than the hook's deadline: refused, and said why.
    for op in ["prepare", "started"] {
        let r = hook(&bus, &config, &["vm1", op, "begin", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(VF0), "reset".into()),
        FaultAction::Delay(Duration::from_secs(11)),
        Some(1),
    );
    for op in ["stopped", "release"] {
        let r = hook(&bus, &config, &["vm1", op, "end", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!("{VF0} is still being cleaned")),
        "{}",
        r.stderr
    );
    assert!(claims_now(&h).await.is_empty(), "nothing claimed");
    common::cleaned(&h, VF0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_claims_outlive_the_run_and_auto_claim_can_be_off() {
    let (h, config, bus) = harness().await;
    let m = claim::claims_proxy(&h.client).await.unwrap();
    m.claim(
        dict(&[("address", Variant::from(VF1))]),
        dict(&[
            ("vm_name", Variant::from("vm1")),
            ("persistent", Variant::from(true)),
        ]),
    )
    .await
    .unwrap();
    let xml = domain_xml("vm1", &[VF1]);
    for (op, sub) in [
        ("prepare", "begin"),
        ("started", "begin"),
        ("stopped", "end"),
    ] {
        let r = hook(&bus, &config, &["vm1", op, sub, "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    let list = claims_now(&h).await;
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].state.as_str(), list[0].guest_address.as_str()),
        ("claimed", "")
    );

    // Without auto_claim, a managed function no claim holds stops the start.
    let strict = h.dir.path().join("strict.toml");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("[hooks]\n", "[hooks]\nauto_claim = false\n");
    std::fs::write(&strict, &text).unwrap();
    h.replace_config(&text);
    h.manager().await.reload().await.unwrap();
    let r = hook(
        &bus,
        &strict,
        &["vm3", "prepare", "begin", "-"],
        &domain_xml("vm3", &[VF0]),
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("is not claimed for vm3"), "{}", r.stderr);
    assert_eq!(claims_now(&h).await.len(), 1, "nothing was claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_notifications_and_bad_xml() {
    let (h, config, bus) = harness().await;
    let xml = domain_xml("vm1", &[VF0]);
    for (op, sub) in [
        ("migrate", "begin"),
        ("restore", "begin"),
        ("reconnect", "begin"),
        ("attach", "begin"),
        ("some-future-op", "x"),
    ] {
        let r = hook(&bus, &config, &["vm1", op, sub, "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
        assert!(
            r.stdout.is_empty(),
            "{op}: a filter with empty output leaves the XML: {}",
            r.stdout
        );
    }
    assert!(claims_now(&h).await.is_empty(), "none of these claims");
    // Malformed XML: prepare fails with a clear message, a notification passes.
    let r = hook(
        &bus,
        &config,
        &["vm1", "prepare", "begin", "-"],
        "<domain><name>vm1",
    );
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("cannot read the XML of domain vm1"),
        "{}",
        r.stderr
    );
    let r = hook(&bus, &config, &["vm1", "stopped", "end", "-"], "not xml");
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// `vfioctl hook qemu` by hand answers as the installed hook does, whatever the case: a start
/// refused, a notification, a filter, bad XML, and with vfiod gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_hook_qemu_answers_as_the_installed_hook() {
    let (mut h, config, bus) = harness().await;
    let vm1 = domain_xml("vm1", &[VF0]);
    let vm2 = domain_xml("vm2", &[VF0]).replace(UUID, "00000000-0000-0000-0000-000000000002");
    // Cases that change nothing, so that both runs meet the same records.
    let cases: [(&[&str], &str); 4] = [
        (&["vm2", "prepare", "begin", "-"], &vm2),
        (&["vm1", "started", "begin", "-"], &vm1),
        (&["vm1", "attach", "begin", "-"], &vm1),
        (&["vm1", "prepare", "begin", "-"], "<domain><name>vm1"),
    ];
    let answers = |h: &str| -> Vec<(i32, String, String)> {
        cases
            .iter()
            .map(|(args, xml)| {
                let r = if h == "installed" {
                    hook(&bus, &config, args, xml)
                } else {
                    hook_by_hand(&bus, &config, args, xml)
                };
                (r.code, r.stdout, r.stderr)
            })
            .collect()
    };
    // vm1 started with VF0 (claimed and attached), so that vm2's start is refused.
    for op in ["prepare", "started"] {
        let r = hook(&bus, &config, &["vm1", op, "begin", "-"], &vm1);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    let installed = answers("installed");
    assert_eq!(
        installed[0].0, 1,
        "vm2 may not start with vm1's VF: {installed:?}"
    );
    assert_eq!(installed, answers("by hand"));
    // vfiod gone: the fallback of each.
    h.stop_server().await;
    let installed = answers("installed");
    assert_eq!(installed[1].0, 0, "a notification passes: {installed:?}");
    assert_eq!(installed, answers("by hand"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_vfiod_notifications_pass_and_prepare_fails_closed_only_for_managed_devices() {
    let (mut h, config, bus) = harness().await;
    // The daemon has recorded its inventory (managed functions) in its state directory.
    h.stop_server().await;
    let managed = domain_xml("vm1", &[VF0]);
    let unmanaged = domain_xml("vm2", &[UNMANAGED]);
    let none = domain_xml("vm3", &[]);
    for (op, sub) in [
        ("stopped", "end"),
        ("release", "end"),
        ("reconnect", "begin"),
        ("started", "begin"),
    ] {
        let r = hook(&bus, &config, &["vm1", op, sub, "-"], &managed);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
        // Passed on the bus's answer that vfiod is not there, not after waiting for a deadline
        // (a fact of the run, where "under 5 s" raced the load).
        assert!(
            !r.stderr.contains("did not answer within"),
            "{op}: {}",
            r.stderr
        );
    }
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &managed);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(VF0)
            && r.stderr.contains("vfiod cannot check them")
            && r.stderr.contains("systemctl start vfiod"),
        "{}",
        r.stderr
    );
    for xml in [&unmanaged, &none] {
        let r = hook(&bus, &config, &["vm2", "prepare", "begin", "-"], xml);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    let r = hook(&bus, &config, &["vm1", "migrate", "begin", "-"], &managed);
    assert_eq!(r.code, 1, "migrate fails closed too: {}", r.stderr);
}

#[test]
fn a_daemon_that_does_not_answer_is_given_up_on_at_the_deadline() {
    // A bus socket that accepts connections and never says a word.
    let dir = common::fast_tempdir();
    let socket = dir.path().join("silent");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let _keep = std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let config = dir.path().join("hook.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[hooks]\ndeadline_ms = 1500\nnotify_deadline_ms = 500\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let bus = format!("unix:path={}", socket.display());
    let xml = domain_xml("vm1", &[VF0]);
    let r = hook(&bus, &config, &["vm1", "stopped", "end", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // Given up on at its own deadline: the hook says which (the silent socket never answers,
    // so no bound on the run's time is needed to prove it).
    assert!(
        r.stderr.contains("did not answer within 500 ms"),
        "{}",
        r.stderr
    );
    // prepare: no records either (no state directory): any PCI hostdev may be vfiod's.
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("did not answer within 1500 ms"),
        "{}",
        r.stderr
    );
    let r = hook(
        &bus,
        &config,
        &["vm3", "prepare", "begin", "-"],
        &domain_xml("vm3", &[]),
    );
    assert_eq!(
        r.code, 0,
        "a domain without PCI hostdevs always passes: {}",
        r.stderr
    );
}

/// The destination's side of a migration: the incoming XML carries vfiod's metadata (what the
/// VM had on the source) and no hostdev (the source detached it). The `migrate` hook claims an
/// equivalent free device here, leaves the XML unchanged, and refuses when there is none,
/// claiming nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migrate_hook_claims_equivalents_or_refuses() {
    use vfiod::host::libvirt::xml::{metadata_element, MetadataDevice};
    let (h, config, bus) = harness().await;
    let incoming = |name: &str, n: usize| {
        let devices: Vec<MetadataDevice> = (0..n)
            .map(|i| MetadataDevice {
                source: addr(&format!("0000:81:00.{i}")),
                kind: "nic".into(),
                id: "8086:154c".into(),
                role: "vf".into(),
                claim: Some(40 + i as i64),
            })
            .collect();
        domain_xml(name, &[]).replace(
            "<memory>",
            &format!(
                "<metadata>{}</metadata><memory>",
                metadata_element(&devices)
            ),
        )
    };
    let xml = incoming("mover", 2);
    for _ in 0..2 {
        let r = hook(&bus, &config, &["mover", "migrate", "begin", "-"], &xml);
        assert_eq!(r.code, 0, "{}", r.stderr);
        assert!(
            r.stdout.is_empty(),
            "the XML stays as it came: {}",
            r.stdout
        );
    }
    let list = claims_now(&h).await;
    assert_eq!(list.len(), 2, "twice the same hook claims once: {list:?}");
    assert!(list
        .iter()
        .all(|c| c.vm_name == "mover" && c.kind == "nic" && c.state == "claimed"));

    // 4 VFs, 2 held: a VM that needs 3 more cannot come, and nothing is left claimed for it.
    let r = hook(
        &bus,
        &config,
        &["big", "migrate", "begin", "-"],
        &incoming("big", 3).replace(UUID, "00000000-0000-0000-0000-0000000000bb"),
    );
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains("cannot come here: no free nic vf 8086:154c"),
        "{}",
        r.stderr
    );
    assert_eq!(
        claims_now(&h).await.len(),
        2,
        "the refused migration holds nothing"
    );

    // The incoming domain never ran here: its stopped/release hooks give the claims back.
    let r = hook(&bus, &config, &["mover", "release", "end", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(claims_now(&h).await.is_empty());
}

/// What a live migration would do to each device, before anyone tries: a managed VF on
/// vfio-pci is detached and re-claimed on the destination, an unmanaged function cannot be
/// carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_say_whether_they_can_be_migrated() {
    let (h, _, _) = harness().await;
    let devices = vfiod::client::list_devices(&h.client).await.unwrap();
    let of = |a: &str| {
        devices
            .iter()
            .find(|d| d.address == a)
            .map(|d| d.migratable.clone())
            .unwrap_or_else(|| panic!("{a} not listed"))
    };
    assert_eq!(of(VF0), "detach");
    assert_eq!(of(FPGA), "detach");
    assert_eq!(of(UNMANAGED), "no");
}

/// A device whose driver migrates its state moves with the VM: the incoming XML still has its
/// hostdev, naming the source host's function. The destination's hook claims an equivalent
/// function here and outputs the XML with the hostdev pointed at it (libvirt takes a filter's
/// output as the domain's XML); once the domain runs, `started` marks the claim attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_moves_with_the_vm_lands_on_a_function_here() {
    use vfiod::host::libvirt::xml::{hostdevs, metadata_element, MetadataDevice};
    let (h, config, bus) = harness().await;
    let source = "0000:81:00.1";
    let meta = metadata_element(&[MetadataDevice {
        source: addr(source),
        kind: "nic".into(),
        id: "8086:154c".into(),
        role: "vf".into(),
        claim: Some(9),
    }]);
    let xml = domain_xml("mover", &[source])
        .replace("<memory>", &format!("<metadata>{meta}</metadata><memory>"));
    let r = hook(&bus, &config, &["mover", "migrate", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let list = claims_now(&h).await;
    assert_eq!(list.len(), 1, "{list:?}");
    let local = list[0].address.clone();
    let now = hostdevs(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.stdout));
    assert_eq!(now.len(), 1);
    assert_eq!(
        now[0].source,
        addr(&local),
        "the hostdev lands on our function"
    );
    assert_eq!(
        now[0].guest_address.as_deref(),
        Some("0000:07:00.0"),
        "the guest sees the same slot"
    );
    let r = hook(
        &bus,
        &config,
        &["mover", "started", "begin", "-"],
        &r.stdout,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let list = claims_now(&h).await;
    assert_eq!(
        (list[0].state.as_str(), list[0].guest_address.as_str()),
        ("attached", "0000:07:00.0")
    );
}

/// A `<hostdev managed='yes'>` for `a`: what makes libvirt take the function from its host
/// driver when the domain starts.
fn managed_hostdev_xml(name: &str, functions: &[&str]) -> String {
    domain_xml(name, functions).replace("managed='no'", "managed='yes'")
}

/// Issue 19: the host guard. Every PCI function the XML assigns that the host uses refuses the
/// start (at `prepare`, `restore`, and a destination's `migrate`), selected or not, directly or
/// through its IOMMU group, with one line naming the function and the use; nothing is claimed
/// or bound. An unselected unused function and one vfiod does not know are left to libvirt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_guard_refuses_every_function_the_host_uses() {
    // The host NIC's selected (its ids) but protected; the GPU is listed in [[protect]], so its
    // HDMI audio function is protected as its IOMMU group-mate.
    let config = format!(
        "{CONFIG}[[select]]\nid = \"8086:15f3\"\n[[protect]]\naddress = \"0000:17:00.0\"\n"
    );
    let (h, hook_config, bus) =
        harness_with(&config, vfiod::sim::kernel::HostModel::reference()).await;
    let nic_driver = h.kernel.driver_of(addr(HOST_NIC));
    assert_eq!(nic_driver.as_deref(), Some("igc"));
    for (functions, says) in [
        (
            vec![HOST_NIC],
            "vfiod: domain vm1 cannot start: 0000:02:00.0 is used by the host: network interface enp2s0 is up",
        ),
        (
            vec![BOOT_NVME],
            "vfiod: domain vm1 cannot start: 0000:3d:00.0 is used by the host: block device nvme",
        ),
        (
            vec!["0000:17:00.1"],
            "0000:17:00.1 is used by the host: shares its IOMMU group with protected device 0000:17:00.0",
        ),
        // A managed function beside it: refused all the same, and not claimed.
        (vec![VF0, HOST_NIC], "0000:02:00.0 is used by the host"),
    ] {
        let xml = managed_hostdev_xml("vm1", &functions);
        let r = hook(&bus, &hook_config, &["vm1", "prepare", "begin", "-"], &xml);
        assert_eq!(r.code, 1, "{functions:?}: {}", r.stderr);
        assert_eq!(r.stderr.trim().lines().count(), 1, "one line: {}", r.stderr);
        assert!(r.stderr.contains(says), "{functions:?}: {}", r.stderr);
        let r = hook(&bus, &hook_config, &["vm1", "restore", "begin", "-"], &xml);
        assert_eq!(r.code, 1, "restore {functions:?}: {}", r.stderr);
        assert!(r.stderr.contains(" is used by the host: "), "{}", r.stderr);
    }
    assert!(claims_now(&h).await.is_empty(), "nothing was claimed");
    assert_eq!(h.kernel.driver_of(addr(HOST_NIC)), nic_driver);
    assert_eq!(h.kernel.driver_of(addr(VF0)).as_deref(), Some("vfio-pci"));

    // Unselected and unused, or unknown: libvirt's.
    let free = managed_hostdev_xml("vm2", &[UNMANAGED, "0000:09:00.0"]);
    let r = hook(&bus, &hook_config, &["vm2", "prepare", "begin", "-"], &free);
    assert_eq!(r.code, 0, "{}", r.stderr);

    // A destination: a hostdev the incoming XML keeps as it is names a function of this host.
    let incoming = managed_hostdev_xml("mover", &[HOST_NIC]);
    let r = hook(
        &bus,
        &hook_config,
        &["mover", "migrate", "begin", "-"],
        &incoming,
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("vfiod: domain mover cannot come here: 0000:02:00.0 is used by the host"),
        "{}",
        r.stderr
    );

    // Nor can it be claimed (and so attached) through D-Bus.
    let m = claim::claims_proxy(&h.client).await.unwrap();
    let (name, message) = common::refusal(
        m.claim(
            dict(&[("address", Variant::from(HOST_NIC))]),
            dict(&[("vm_name", Variant::from("vm1"))]),
        )
        .await,
        "a claim on the host's NIC",
    );
    assert!(
        name.contains("Protected") && message.contains("used by the host"),
        "{name}: {message}"
    );

    // The guard off (dangerous): the host's function is left to libvirt; vfiod still does not
    // touch it itself.
    let off = format!("{config}[hooks]\nguard_host_devices = false\n");
    h.replace_config(&off);
    h.manager().await.reload().await.unwrap();
    let xml = managed_hostdev_xml("vm1", &[HOST_NIC]);
    let r = hook(&bus, &hook_config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(h.kernel.driver_of(addr(HOST_NIC)), nic_driver);
    assert!(claims_now(&h).await.is_empty());
}

/// A process of the simulated host holding `nodes` open.
fn process(pid: u32, comm: &str, nodes: &[&str]) -> vfiod::sim::kernel::ProcessSpec {
    vfiod::sim::kernel::ProcessSpec {
        pid,
        comm: comm.into(),
        cmdline: vec![comm.into()],
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    }
}

/// Issue 32: the host guard asks the kernel. The data NVMe drive (unselected, nothing
/// mounted) is left to libvirt until something holds its namespace: a dm (LVM) or md holder,
/// an exclusive open (ZFS, btrfs, O_EXCL), a process with the disk or the controller's node
/// open (a raw-disk VM's QEMU too); each refuses `prepare` and `restore` with one line naming
/// the holder, and the start is allowed again once the holder is gone. A multipath head
/// (no PCI parent) counts for its controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_holder_the_kernel_knows_refuses_the_start() {
    let (h, hook_config, bus) = harness().await;
    h.kernel.add_disk(addr(UNMANAGED), 1, false).unwrap();
    h.kernel.add_disk(addr(UNMANAGED), 2, true).unwrap();
    let xml = managed_hostdev_xml("vm1", &[UNMANAGED]);
    let start = || hook(&bus, &hook_config, &["vm1", "prepare", "begin", "-"], &xml);
    let r = start();
    assert_eq!(r.code, 0, "an idle drive is libvirt's: {}", r.stderr);
    type Step = Box<dyn Fn(&vfiod::sim::kernel::SimKernel)>;
    let cases: Vec<(Step, Step, &str)> = vec![
        (
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.add_holder("nvme1n1", "dm-0", Some("vg0-data")).unwrap()
            }),
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.remove_holder("nvme1n1", "dm-0").unwrap()
            }),
            "block device nvme1n1 is held by dm-0 (vg0-data)",
        ),
        (
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.add_holder("nvme2n1", "md127", None).unwrap()
            }),
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.remove_holder("nvme2n1", "md127").unwrap()
            }),
            "block device nvme2n1 is held by md127",
        ),
        (
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.hold_exclusively("nvme1n1", true).unwrap()
            }),
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.hold_exclusively("nvme1n1", false).unwrap()
            }),
            "block device nvme1n1 is held exclusively",
        ),
        (
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.spawn(process(812, "fio", &["/dev/nvme2n1"])).unwrap()
            }),
            Box::new(|k: &vfiod::sim::kernel::SimKernel| k.end(812).unwrap()),
            "block device nvme2n1 is open by pid 812 (fio)",
        ),
        (
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.spawn(process(813, "nvme", &["/dev/nvme1"])).unwrap()
            }),
            Box::new(|k: &vfiod::sim::kernel::SimKernel| k.end(813).unwrap()),
            "/dev/nvme1 is open by pid 813 (nvme)",
        ),
        (
            Box::new(|k: &vfiod::sim::kernel::SimKernel| {
                k.spawn(process(900, "qemu-system-x86", &["/dev/nvme1n1"]))
                    .unwrap()
            }),
            Box::new(|k: &vfiod::sim::kernel::SimKernel| k.end(900).unwrap()),
            "block device nvme1n1 is open by pid 900 (qemu-system-x86)",
        ),
    ];
    for (hold, release, says) in cases {
        hold(&h.kernel);
        let r = start();
        assert_eq!(r.code, 1, "{says}: {}", r.stderr);
        assert_eq!(r.stderr.trim().lines().count(), 1, "one line: {}", r.stderr);
        let line =
            format!("vfiod: domain vm1 cannot start: {UNMANAGED} is used by the host: {says}");
        assert!(r.stderr.contains(&line), "{says}: {}", r.stderr);
        let r = hook(&bus, &hook_config, &["vm1", "restore", "begin", "-"], &xml);
        assert_eq!(r.code, 1, "restore, {says}: {}", r.stderr);
        assert!(r.stderr.contains(says), "{}", r.stderr);
        release(&h.kernel);
        let r = start();
        assert_eq!(r.code, 0, "{says} gone: {}", r.stderr);
    }
    assert!(claims_now(&h).await.is_empty(), "nothing was claimed");
}

/// Issue 19: the guard holds when vfiod does not answer: the hook's fallback reads the store
/// and refuses a domain naming a function it records as used by the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_vfiod_the_records_still_refuse_the_hosts_functions() {
    let (mut h, config, bus) = harness().await;
    h.stop_server().await;
    for (f, says) in [
        (
            HOST_NIC,
            "0000:02:00.0 is used by the host: network interface enp2s0 is up",
        ),
        (
            BOOT_NVME,
            "0000:3d:00.0 is used by the host: block device nvme",
        ),
    ] {
        let xml = managed_hostdev_xml("vm1", &[f]);
        let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
        assert_eq!(r.code, 1, "{}", r.stderr);
        assert!(
            r.stderr.starts_with("vfiod: domain vm1 cannot start: ") && r.stderr.contains(says),
            "{}",
            r.stderr
        );
        assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
        assert!(
            r.stderr.matches("ServiceUnknown").count() == 1,
            "why vfiod did not answer, once: {}",
            r.stderr
        );
        let r = hook(&bus, &config, &["vm1", "migrate", "begin", "-"], &xml);
        assert_eq!(r.code, 1, "{}", r.stderr);
        assert!(
            r.stderr.contains("cannot come here") && r.stderr.contains(says),
            "{}",
            r.stderr
        );
    }
    let r = hook(
        &bus,
        &config,
        &["vm2", "prepare", "begin", "-"],
        &managed_hostdev_xml("vm2", &[UNMANAGED]),
    );
    assert_eq!(r.code, 0, "an unused function is libvirt's: {}", r.stderr);
    // Off: the fallback leaves the host's function to libvirt too.
    let off = h.dir.path().join("off.toml");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("[hooks]\n", "[hooks]\nguard_host_devices = false\n");
    std::fs::write(&off, text).unwrap();
    let r = hook(
        &bus,
        &off,
        &["vm1", "prepare", "begin", "-"],
        &managed_hostdev_xml("vm1", &[HOST_NIC]),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// Issue 24 item 8: the claims the hook makes name their domain through the checks of a D-Bus
/// `Claim`: no name, a name with control characters or longer than a domain name may be is
/// refused, in one line that does not echo it raw, and nothing is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hook_checks_the_owner_as_a_claim_does() {
    let (h, config, bus) = harness().await;
    let long = "v".repeat(100_000);
    for name in ["", "evil\nname", "esc\u{1b}[31mred", long.as_str()] {
        let xml = domain_xml("placeholder", &[VF0]);
        let r = hook(&bus, &config, &[name, "prepare", "begin", "-"], &xml);
        assert_eq!(r.code, 1, "{name:?}: {}", r.stderr);
        assert_eq!(r.stderr.trim_end().lines().count(), 1, "{}", r.stderr);
        assert!(!r.stderr.contains('\u{1b}'), "{:?}", r.stderr);
        assert!(r.stderr.len() < 400, "{} bytes", r.stderr.len());
    }
    assert!(claims_now(&h).await.is_empty());
}

/// Issue 24 item 9: a `prepare` refused half way gives back the claims it made in that run
/// (a VF, then its own PF, which cannot be claimed while its VF is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_prepare_releases_what_it_claimed() {
    let (h, config, bus) = harness().await;
    let xml = domain_xml("vm1", &[VF0, "0000:3b:00.0"]);
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("0000:3b:00.0 cannot be claimed"),
        "{}",
        r.stderr
    );
    assert!(
        claims_now(&h).await.is_empty(),
        "{:?}",
        claims_now(&h).await
    );
    // A claim the domain held before the run is its own: kept.
    let m = claim::claims_proxy(&h.client).await.unwrap();
    m.claim(
        dict(&[("address", Variant::from(VF1))]),
        dict(&[("vm_name", Variant::from("vm1"))]),
    )
    .await
    .unwrap();
    let xml = domain_xml("vm1", &[VF1, VF0, "0000:3b:00.0"]);
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let list = claims_now(&h).await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].address, VF1);
}

/// Issue 24 item 10: over the size cap, an operation that may fail is refused, a notification
/// still exits 0 (a failing `reconnect` makes libvirt kill the VM).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_pass_over_the_size_cap() {
    let (h, config, bus) = harness().await;
    let mut xml = domain_xml("vm1", &[VF0]);
    xml.push_str(&" ".repeat(vfiod::client::hook::MAX_XML));
    for (op, sub) in [
        ("reconnect", "begin"),
        ("stopped", "end"),
        ("release", "end"),
        ("started", "begin"),
    ] {
        let r = hook(&bus, &config, &["vm1", op, sub, "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    for op in ["prepare", "migrate"] {
        let r = hook(&bus, &config, &["vm1", op, "begin", "-"], &xml);
        assert_eq!(r.code, 1, "{op}: {}", r.stderr);
        assert!(r.stderr.contains("larger than"), "{}", r.stderr);
    }
    assert!(claims_now(&h).await.is_empty());
}

/// Issue 24 item 3, the hook's side: when vfiod does not answer, the hook's own reading of the
/// XML is bounded by the same deadline and never runs after it, however slow the document is
/// to read; the answer is the fail-closed refusal.
#[test]
fn the_hook_never_reads_the_xml_past_its_deadline() {
    let dir = common::fast_tempdir();
    let socket = dir.path().join("silent");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let _keep = std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let config = dir.path().join("hook.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[hooks]\ndeadline_ms = 800\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let bus = format!("unix:path={}", socket.display());
    // Many attributes on one hostdev, and many hostdevs: the slowest documents under the cap.
    let attrs: String = (0..100_000).map(|i| format!(" a{i}='x'")).collect();
    let xml = domain_xml("vm1", &[VF0]).replace(
        "<hostdev mode='subsystem' type='pci' managed='no'>",
        &format!("<hostdev mode='subsystem' type='pci' managed='no'{attrs}>"),
    );
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 1, "{}", r.stderr);
    // It decided at its deadline, from what it had read by then. How long the run takes
    // against a trivial document's (about the same: both end at the deadline) is claimed by
    // benches/hook_deadline.rs; "under 2.5 s" here raced the machine's load.
    assert!(
        r.stderr.contains("did not answer within 800 ms"),
        "{}",
        r.stderr
    );
}

/// Issue 24 item 3, the daemon's side: vfiod reads the hook's XML off the async threads, so a
/// document slow to read is answered at the hook's deadline (fail closed) and vfiod keeps
/// answering other calls meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_document_does_not_hold_vfiod_past_the_deadline() {
    let (h, _config, _bus) = harness().await;
    // The costliest document the parser's limits still let through (issue 24 item 3's other
    // half, xml/limits.rs): elements of 1,000 attributes each, as many as its budget of
    // quadratic steps allows. A document past those limits is refused before it is parsed.
    let attrs: String = (0..1000).map(|i| format!(" a{i}='x'")).collect();
    let elements: String = (0..60).map(|i| format!("<e{i}{attrs}/>")).collect();
    let xml = domain_xml("vm1", &[VF0]).replace(
        "</domain>",
        &format!("<metadata><vfiod:x xmlns:vfiod='urn:x'>{elements}</vfiod:x></metadata></domain>"),
    );
    h.replace_config(&format!("{CONFIG}[hooks]\ndeadline_ms = 1000\n"));
    let m = h.manager().await;
    m.reload().await.unwrap();
    // The hook and another call at once, each bounded only against a hung test: the answer
    // says the deadline ended it (or the parse was quick), and the other call is answered.
    // (Bounds on how long each took, "2.5 s" and "2 s", raced the machine's load.)
    let asked = tokio::time::timeout(common::HUNG, m.hook("vm1", "prepare", "begin", "-", &xml));
    let other = tokio::time::timeout(common::HUNG, vfiod::client::list_devices(&h.client));
    let (answer, listed) = tokio::join!(asked, other);
    let (code, _, message) = answer.expect("the hook is answered").unwrap();
    assert!(
        code == 0 || message.contains("no answer for prepare begin - of vm1 within 1000 ms"),
        "{code}: {message}"
    );
    listed.expect("vfiod answers a list meanwhile").unwrap();
}

/// vfiod answers the hook on its own socket (`STATE_DIR/hook.sock`, peer to peer) as on the
/// bus: with the bus unreachable the hook still gets vfiod's answers; with the socket gone it
/// asks on the bus and gets the same; with neither it decides alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hook_asks_on_vfiods_socket_first_and_on_the_bus_without_it() {
    let (h, config, bus) = harness().await;
    let socket = h
        .dir
        .path()
        .join("state")
        .join(vfiod::dbus::hook_socket::SOCKET_NAME);
    let no_bus = format!("unix:path={}", h.dir.path().join("no-bus").display());
    let vm1 = domain_xml("vm1", &[VF0]);
    let vm2 = domain_xml("vm2", &[VF0]).replace(UUID, "00000000-0000-0000-0000-000000000002");
    for op in ["prepare", "started"] {
        let r = hook(&no_bus, &config, &["vm1", op, "begin", "-"], &vm1);
        assert_eq!(r.code, 0, "{op} on the socket alone: {}", r.stderr);
    }
    let list = claims_now(&h).await;
    assert_eq!(
        list.len(),
        1,
        "vfiod claimed VF0 for vm1 on the socket: {list:?}"
    );
    assert_eq!(
        (list[0].vm_name.as_str(), list[0].state.as_str()),
        ("vm1", "attached")
    );
    let on_socket = hook(&no_bus, &config, &["vm2", "prepare", "begin", "-"], &vm2);
    assert_eq!(on_socket.code, 1);
    assert!(
        on_socket
            .stderr
            .contains(&format!("{VF0} is claimed by VM vm1")),
        "{}",
        on_socket.stderr
    );
    // The socket gone (as under an older vfiod): the same answer, on the bus.
    let aside = socket.with_extension("aside");
    std::fs::rename(&socket, &aside).unwrap();
    let on_bus = hook(&bus, &config, &["vm2", "prepare", "begin", "-"], &vm2);
    assert_eq!(
        (on_bus.code, &on_bus.stdout, &on_bus.stderr),
        (on_socket.code, &on_socket.stdout, &on_socket.stderr)
    );
    // Neither: the hook's own answer from the records.
    let alone = hook(&no_bus, &config, &["vm2", "prepare", "begin", "-"], &vm2);
    assert_eq!(alone.code, 1);
    assert!(
        alone.stderr.contains("vfiod cannot check them"),
        "{}",
        alone.stderr
    );
    std::fs::rename(&aside, &socket).unwrap();
    assert_eq!(claims_now(&h).await.len(), 1, "nothing else was claimed");
}

/// Peers that connect to the hook socket and never speak hold a slot each for the handshake's
/// time at most; while every slot is taken the hook asks on the bus and still gets vfiod's
/// answer in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_peers_on_the_hook_socket_do_not_keep_the_hook_from_vfiod() {
    use std::io::Read;
    use vfiod::dbus::hook_socket::{MAX_PEERS, SOCKET_NAME};
    let (h, config, bus) = harness().await;
    let socket = h.dir.path().join("state").join(SOCKET_NAME);
    let mut stuck: Vec<_> = (0..MAX_PEERS + 4)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap())
        .collect();
    let vm1 = domain_xml("vm1", &[VF0]);
    let r = hook(&bus, &config, &["vm1", "prepare", "begin", "-"], &vm1);
    // Answered by vfiod (after its deadline the hook would have decided alone, and a prepare
    // of a managed device fails closed then): no bound on the run's time needed.
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(claims_now(&h).await.len(), 1, "vfiod answered, on the bus");
    // Each stuck peer is hung up on once the handshake time is over: the read ends with the
    // peer's end of file (a peer kept would fail the read at common::HUNG; "within 3
    // handshakes" raced the machine's load).
    for (i, s) in stuck.iter_mut().enumerate() {
        s.set_read_timeout(Some(common::HUNG)).unwrap();
        let mut buf = [0u8; 64];
        let read = s.read(&mut buf);
        assert!(
            matches!(read, Ok(0)),
            "stuck peer {i}: {read:?}, not hung up on"
        );
    }
    // The slots are free again: the socket answers with the bus out of reach.
    let no_bus = format!("unix:path={}", h.dir.path().join("no-bus").display());
    let r = hook(&no_bus, &config, &["vm1", "started", "begin", "-"], &vm1);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("attached") && !r.stderr.contains("not recorded"),
        "answered by vfiod: {}",
        r.stderr
    );
    assert_eq!(claims_now(&h).await[0].state, "attached");
}

/// Only root (or the uid vfiod runs as) is answered on the hook socket, whatever the file's
/// mode: a user's connection is closed before a byte is read, and that user's hook decides
/// alone (here: fails closed for vfiod's VF), with nothing claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_hook_socket_answers_root_only() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    assert!(nix::unistd::geteuid().is_root(), "run as root (--ignored)");
    let (h, _config, _bus) = harness().await;
    let state = h.dir.path().join("state");
    let socket = state.join(vfiod::dbus::hook_socket::SOCKET_NAME);
    // Everything open to the user, so that only the peer check stands in the way.
    let open = |p: &std::path::Path, mode| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    open(h.dir.path(), 0o755);
    open(&state, 0o755);
    open(&socket, 0o666);
    let config = h.dir.path().join("nobody.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[hooks]\ndeadline_ms = 1500\n",
            state.display()
        ),
    )
    .unwrap();
    open(&config, 0o644);
    let no_bus = format!("unix:path={}", h.dir.path().join("no-bus").display());
    let vm1 = domain_xml("vm1", &[VF0]);
    let mut as_nobody = Command::new(env!("CARGO_BIN_EXE_vfiod-qemu-hook"));
    // SAFETY: setuid only, between fork and exec.
    unsafe {
        as_nobody.pre_exec(|| {
            nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)).map_err(std::io::Error::from)
        });
    }
    let r = run_hook(
        as_nobody,
        &no_bus,
        &config,
        &["vm1", "prepare", "begin", "-"],
        &vm1,
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("vfiod cannot check them"),
        "decided alone: {}",
        r.stderr
    );
    assert!(
        claims_now(&h).await.is_empty(),
        "nobody's hook claimed nothing"
    );
    // Root's, the same way: vfiod's answer.
    let r = hook(&no_bus, &config, &["vm1", "prepare", "begin", "-"], &vm1);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(claims_now(&h).await.len(), 1);
}

/// The real `vfiod --simulate --sim-root DIR/sim` on its own bus (for what the in-process
/// harness cannot do: stop it with SIGSTOP, or give it a test hook's variable), stopped with
/// SIGKILL whatever happens to the test.
struct Vfiod {
    child: std::process::Child,
    dir: tempfile::TempDir,
    bus: vfiod::sim::bus::PrivateBus,
    log: std::path::PathBuf,
}

impl Vfiod {
    /// Starts it with `CONFIG` and `env`, and waits until the NIC's VFs are split and idle.
    fn start(env: &[(&str, &str)]) -> Vfiod {
        let dir = common::fast_tempdir();
        std::fs::write(dir.path().join("vfiod.toml"), CONFIG).unwrap();
        let bus = vfiod::sim::bus::PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        let log = dir.path().join("vfiod.log");
        let mut command = Command::new(env!("CARGO_BIN_EXE_vfiod"));
        command
            .args(["--simulate", "--sim-root"])
            .arg(dir.path().join("sim"))
            .arg("--config")
            .arg(dir.path().join("vfiod.toml"))
            .args(["--bus", bus.address()])
            .env("VFIOD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().expect("start vfiod");
        let v = Vfiod {
            child,
            dir,
            bus,
            log,
        };
        common::eventually_blocking(Duration::from_secs(120), "vfiod splits the NIC", || {
            [VF0, VF1]
                .iter()
                .all(|vf| {
                    let (ok, out) = common::vfioctl(v.bus(), &["show", vf, "--json"]);
                    ok && serde_json::from_str::<serde_json::Value>(&out)
                        .is_ok_and(|d| d["state"] == "usable" && d["task_state"] == "idle")
                })
                .then_some(())
        });
        v
    }

    fn bus(&self) -> &str {
        self.bus.address()
    }

    fn signal(&self, s: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), s).unwrap();
    }

    /// A hook configuration with these deadlines, whose state directory is `state` (vfiod's
    /// own, `DIR/sim/state`, when `None`).
    fn hook_config(&self, state: Option<&std::path::Path>, extra: &str) -> std::path::PathBuf {
        let own = self.dir.path().join("sim/state");
        let path = self.dir.path().join("hook.toml");
        std::fs::write(
            &path,
            format!(
                "state_dir = \"{}\"\n{CONFIG}[hooks]\n{extra}",
                state.unwrap_or(&own).display()
            ),
        )
        .unwrap();
        path
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn claims(&self) -> Vec<serde_json::Value> {
        let (ok, out) = common::vfioctl(self.bus(), &["claims", "--json"]);
        assert!(ok, "{out}");
        serde_json::from_str(&out).unwrap()
    }
}

impl Drop for Vfiod {
    fn drop(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 33: a run of the hook that vfiod gets only after the hook gave up is not carried out.
/// vfiod is stopped (SIGSTOP) while the hook asks on the bus (no hook socket where it looks;
/// dbus-daemon keeps the calls for vfiod): `prepare` of ghost-a and ghost-b are refused at the
/// deadline and libvirt starts neither, and ghost-b's `release` passes "not recorded". Once vfiod
/// runs again it answers the three queued calls without carrying any out: no claim for a
/// domain that never started.
#[test]
fn runs_the_hook_gave_up_on_are_never_carried_out() {
    use nix::sys::signal::Signal;
    let v = Vfiod::start(&[]);
    let elsewhere = v.dir.path().join("no-socket-here");
    let config = v.hook_config(
        Some(&elsewhere),
        "deadline_ms = 1000\nnotify_deadline_ms = 500\n",
    );
    v.signal(Signal::SIGSTOP);
    for (domain, vf) in [("ghost-a", VF0), ("ghost-b", VF1)] {
        let r = hook(
            v.bus(),
            &config,
            &[domain, "prepare", "begin", "-"],
            &domain_xml(domain, &[vf]),
        );
        assert_eq!(r.code, 1, "{domain}: refused at the deadline: {}", r.stderr);
        assert!(r.stderr.contains("did not answer"), "{}", r.stderr);
    }
    let r = hook(
        v.bus(),
        &config,
        &["ghost-b", "release", "end", "-"],
        &domain_xml("ghost-b", &[VF1]),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    v.signal(Signal::SIGCONT);
    // vfiod logs its answer to each prepare, carried out or not.
    common::eventually_blocking(
        Duration::from_secs(60),
        "vfiod answers the queued prepares",
        || {
            let log = v.log_text();
            (log.contains("prepare begin - of ghost-a:")
                && log.contains("prepare begin - of ghost-b:"))
            .then_some(())
        },
    );
    // A call after them on the same bus is answered after them: the claims are final.
    assert!(
        v.claims().is_empty(),
        "claims for domains that never started: {:?}",
        v.claims()
    );
    // Why, for each: the deadline had passed, or (on the bus, where vfiod asks the bus who
    // called) the hook that asked had left before vfiod could identify it.
    let log = v.log_text();
    for domain in ["ghost-a", "ghost-b"] {
        assert!(
            log.lines()
                .any(|l| l.contains(&format!("prepare begin - of {domain}:"))
                    && l.contains("not carried out")),
            "vfiod says why {domain} was not carried out: {log}"
        );
    }
}

/// Issue 33: the same order kept when both runs reach vfiod in time but out of order: a
/// `prepare` sent before a `release` of its domain that vfiod has already answered is not
/// carried out (it was given up on), and claims nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_overtaken_by_a_later_one_of_its_domain_is_not_carried_out() {
    let (h, _config, _bus) = harness().await;
    let m = h.manager().await;
    let now = vfiod::host::clock::monotonic_ms();
    let options = |sent: u64| {
        dict(&[
            ("sent_ms", Variant::from(sent)),
            ("deadline_ms", Variant::from(now + 60_000)),
        ])
    };
    let xml = domain_xml("vm1", &[VF0]);
    let (code, _, message) = m
        .hook_with_options("vm1", "release", "end", "-", &xml, options(now))
        .await
        .unwrap();
    assert_eq!(code, 0, "{message}");
    let (code, _, message) = m
        .hook_with_options("vm1", "prepare", "begin", "-", &xml, options(now - 100))
        .await
        .unwrap();
    assert_eq!(code, 1, "{message}");
    assert!(
        message.contains("not carried out: a later run of the hook for this domain"),
        "{message}"
    );
    assert!(claims_now(&h).await.is_empty());
    // Past its deadline: not carried out either; a run in time is.
    let late = dict(&[
        ("sent_ms", Variant::from(now - 20_000)),
        ("deadline_ms", Variant::from(now - 10_000)),
    ]);
    let (code, _, message) = m
        .hook_with_options(
            "vm2",
            "prepare",
            "begin",
            "-",
            &domain_xml("vm2", &[VF1]),
            late,
        )
        .await
        .unwrap();
    assert_eq!(code, 1, "{message}");
    assert!(message.contains("its hook gave up waiting"), "{message}");
    assert!(claims_now(&h).await.is_empty());
    let (code, _, message) = m
        .hook_with_options(
            "vm2",
            "prepare",
            "begin",
            "-",
            &domain_xml("vm2", &[VF1]),
            options(vfiod::host::clock::monotonic_ms()),
        )
        .await
        .unwrap();
    assert_eq!(code, 0, "{message}");
    assert_eq!(claims_now(&h).await.len(), 1);
    // Half the timing, or a deadline before the send: a bad request.
    for bad in [
        dict(&[("sent_ms", Variant::from(now))]),
        dict(&[
            ("sent_ms", Variant::from(now)),
            ("deadline_ms", Variant::from(now - 1)),
        ]),
    ] {
        let (name, message) = common::refusal(
            m.hook_with_options("vm3", "prepare", "begin", "-", &xml, bad)
                .await,
            "bad timing",
        );
        assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{message}");
    }
}

/// Issue 33: a domain restarted at once (`prepare`, `release`, `prepare`) with two VFs is not
/// refused because the clean its release started has given the VFs back but not yet ended
/// (held open here by the `clean:given-back` test hook, a window real runs hit once in a
/// hundred): `prepare` waits for the clean's task as for its hold.
#[test]
fn a_domain_restarted_at_once_waits_for_the_end_of_its_clean() {
    let v = Vfiod::start(&[("VFIOD_TEST_PAUSE_AT", "clean:given-back")]);
    let config = v.hook_config(None, "deadline_ms = 10000\nnotify_deadline_ms = 2000\n");
    let xml = domain_xml("vm1", &[VF0, VF1]);
    for op in ["prepare", "started"] {
        let r = hook(v.bus(), &config, &["vm1", op, "begin", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    for op in ["stopped", "release"] {
        let r = hook(v.bus(), &config, &["vm1", op, "end", "-"], &xml);
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
    }
    let r = hook(v.bus(), &config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "the restart is refused: {}", r.stderr);
    assert_eq!(v.claims().len(), 2);
}

/// Issue 33: with vfiod not answering, a start of a domain that assigns no PCI function is
/// answered at once by the hook alone (there is nothing for vfiod to check), not at the end of
/// the deadline (here a minute: the wait below fails first); and when vfiod's records cannot be
/// read, the refusal of a domain with PCI functions does not call them vfiod's.
#[test]
fn without_an_answer_a_domain_without_pci_functions_starts_at_once() {
    let dir = common::fast_tempdir();
    let socket = dir.path().join("silent");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let _keep = std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let config = dir.path().join("hook.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[hooks]\ndeadline_ms = 60000\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let bus = format!("unix:path={}", socket.display());
    for op in ["prepare", "start", "restore"] {
        let (tx, rx) = std::sync::mpsc::channel();
        let (b, c) = (bus.clone(), config.clone());
        std::thread::spawn(move || {
            let _ = tx.send(hook(
                &b,
                &c,
                &["vm3", op, "begin", "-"],
                &domain_xml("vm3", &[]),
            ));
        });
        let r = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{op}: the hook waited for vfiod"));
        assert_eq!(r.code, 0, "{op}: {}", r.stderr);
        assert_eq!(r.stderr, "", "{op}");
    }
    let short = dir.path().join("short.toml");
    std::fs::write(
        &short,
        format!(
            "state_dir = \"{}\"\n[hooks]\ndeadline_ms = 500\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let r = hook(
        &bus,
        &short,
        &["vm1", "prepare", "begin", "-"],
        &domain_xml("vm1", &[HOST_NIC]),
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        !r.stderr.contains("that vfiod manages") && r.stderr.contains("may manage"),
        "a function vfiod's records do not name is not called vfiod's: {}",
        r.stderr
    );
}

/// Issue 33's soak (`tests/soak_faults.rs`, seeds 1796663269829954671 and an earlier run): a
/// `prepare` naming a VF that the kernel has but vfiod's records do not yet (a split was
/// creating it) was answered OK with no claim and no bind, as for a function vfiod does not
/// manage; once split, the VF could be claimed by another VM. Here the NIC is re-split behind
/// vfiod's back and one new VF cannot be read by the inventory pass: the records lack it, and a
/// start with it is refused, naming the PF, until vfiod has recorded it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_not_yet_recorded_is_not_left_to_libvirt() {
    let (h, config, bus) = harness().await;
    let sysfs = h.kernel.sysfs();
    let numvfs = sysfs.device_attr(addr("0000:3b:00.0"), "sriov_numvfs");
    sysfs.write(&numvfs, "0").unwrap();
    sysfs.write(&numvfs, "8").unwrap();
    let vf = "0000:3b:02.5";
    // The window held open: the pass the split's uevents start (20 ms later) cannot read the
    // new VF, so the records lack it while the kernel has it (and its PF link).
    h.kernel.make_unreadable(addr(vf), "vendor", libc::EIO);
    assert!(sysfs
        .read_optional_link_name(&sysfs.device_attr(addr(vf), "physfn"))
        .unwrap()
        .is_some());
    let r = hook(
        &bus,
        &config,
        &["vm1", "prepare", "begin", "-"],
        &domain_xml("vm1", &[vf]),
    );
    assert_eq!(r.code, 1, "a start with an unrecorded VF: {}", r.stderr);
    assert!(
        r.stderr
            .contains("0000:3b:02.5 is busy: vfiod has not recorded this VF of 0000:3b:00.0 yet"),
        "{}",
        r.stderr
    );
    assert!(claims_now(&h).await.is_empty());
    // Once recorded (a rescan), the start claims and binds it as any managed VF.
    h.kernel.make_readable(addr(vf), "vendor");
    h.manager().await.rescan().await.unwrap();
    let r = hook(
        &bus,
        &config,
        &["vm1", "prepare", "begin", "-"],
        &domain_xml("vm1", &[vf]),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(claims_now(&h).await.len(), 1);
    assert_eq!(h.kernel.driver_of(addr(vf)).as_deref(), Some("vfio-pci"));
}
