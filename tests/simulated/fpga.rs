//! FPGA program and verify tasks over D-Bus against the simulated DFL card (`0000:af:00.0`,
//! and `0000:b1:00.0` on the two-card host): the task's life (idle, prepare, running with
//! step `programming`, success, idle with the last result), illegal images refused in prepare
//! leaving the device idle, a failing backend leaving `error` until ResetTask (Busy meanwhile),
//! one task per card, a card in VF mode (refused when a VF is claimed; else restored,
//! programmed and split again), and the exec backend with a real script.

use crate::common;

use crate::common::{dict, eventually_async, refusal, vfioctl, Harness};
use sha2::{Digest, Sha256};
use std::time::Duration;
use vfiod::client::image::images;
use vfiod::client::{self, DeviceProxy, TaskProxy};
use vfiod::fpga::image::build;
use vfiod::sim::kernel::{
    FaultAction, FaultTarget, HostModel, REFERENCE_FPGA_AFU, REFERENCE_FPGA_INTERFACE,
};
use zbus::OwnedObjectPath;

const AF: &str = "0000:af:00.0";
const B1: &str = "0000:b1:00.0";
const NLB: &str = "d8424dc4a4a3c413f89e433683f9040b";
/// The FPGAs selected, in PF mode (private scenario): start-up changes nothing.
const CONFIG: &str =
    "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nclass = \"0x12\"\nkind = \"fpga\"\n";

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Adds `bytes` to the catalog as `name` (through a descriptor).
async fn add(h: &Harness, name: &str, bytes: &[u8], options: vfiod::dbus::wire::Dict) {
    let path = h.dir.path().join(format!("{name}.img"));
    std::fs::write(&path, bytes).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    images(&h.client)
        .await
        .unwrap()
        .add(name, zbus::Fd::from(&f), &sha(bytes), options)
        .await
        .unwrap();
}

/// The NLB image for the reference card's static region.
fn nlb() -> Vec<u8> {
    build::gbs(REFERENCE_FPGA_INTERFACE, &[NLB], &vec![0x5a; 4096])
}

async fn dev(h: &Harness, a: &str) -> DeviceProxy<'static> {
    client::device(&h.client, a).await.unwrap()
}

async fn task(h: &Harness, p: &OwnedObjectPath) -> TaskProxy<'static> {
    client::task(&h.client, p.clone()).await.unwrap()
}

/// Waits for the task to end; (state, result).
async fn finish(h: &Harness, p: &OwnedObjectPath) -> (String, String) {
    let t = task(h, p).await;
    let t = &t;
    eventually_async(Duration::from_secs(60), "the task ends", || async move {
        let s = t.state().await.unwrap();
        (s == "success" || s == "error").then_some(())
    })
    .await;
    (t.state().await.unwrap(), t.result().await.unwrap())
}

/// The device's TaskState once the view has caught up with the end of its task.
async fn settled_state(h: &Harness, a: &str) -> String {
    let d = common::proxies::device(h, a).await;
    let d = &d;
    eventually_async(
        Duration::from_secs(30),
        "the device's task state settles",
        || async move {
            let s = d.task_state().await.unwrap();
            (s != "prepare" && s != "running").then_some(s)
        },
    )
    .await
}

async fn task_state(h: &Harness, a: &str) -> String {
    common::proxies::device(h, a)
        .await
        .task_state()
        .await
        .unwrap()
}

fn pr_writes(h: &Harness) -> usize {
    h.kernel
        .take_write_log()
        .iter()
        .filter(|(p, _)| p.to_string_lossy().contains("dfl-fme"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn program_then_verify_end_to_end() {
    let h = Harness::start(CONFIG).await;
    add(&h, "nlb", &nlb(), dict(&[])).await;
    let af = common::addr(AF);
    assert_eq!(h.kernel.afu_id_of(af).as_deref(), Some(REFERENCE_FPGA_AFU));
    let d = dev(&h, AF).await;
    assert_eq!(task_state(&h, AF).await, "idle");
    // A slow write, to see the task running in its programming step.
    h.kernel.inject(
        FaultTarget::DeviceAttr(af, "dfl-fme-pr".into()),
        FaultAction::Delay(Duration::from_millis(800)),
        Some(1),
    );
    let path = d.program("nlb", Default::default()).await.unwrap();
    let t = task(&h, &path).await;
    assert_eq!(t.kind().await.unwrap(), "program");
    let t = &t;
    let step = eventually_async(
        Duration::from_secs(30),
        "the programming step",
        || async move {
            let (s, step) = (t.state().await.unwrap(), t.step().await.unwrap());
            (s == "running" && step.starts_with("programming")).then_some(step)
        },
    )
    .await;
    assert_eq!(step, "programming nlb");
    assert_eq!(task_state(&h, AF).await, "running");
    let (state, result) = finish(&h, &path).await;
    assert_eq!(state, "success", "{result}");
    assert!(
        result.contains("programmed image nlb into 0000:af:00.0"),
        "{result}"
    );
    assert!(
        result.contains(&format!("the device runs image nlb: AFU {NLB}")),
        "{result}"
    );
    assert_eq!(t.percent().await.unwrap(), 100);
    assert_eq!(settled_state(&h, AF).await, "idle");
    let last = common::proxies::device(&h, AF)
        .await
        .last_result()
        .await
        .unwrap();
    assert!(last.contains("programmed image nlb"), "{last}");
    assert_eq!(h.kernel.afu_id_of(af).as_deref(), Some(NLB));
    // The simulated FME got the bitstream without its GBS header.
    assert_eq!(
        std::fs::read(h.kernel.root().join("dev/dfl-fme.0")).unwrap(),
        vec![0x5a; 4096]
    );

    // Verify: what the port reports against the image.
    let (state, result) = finish(&h, &d.verify("nlb", Default::default()).await.unwrap()).await;
    assert_eq!(
        (state.as_str(), result.contains("runs image nlb")),
        ("success", true),
        "{result}"
    );
    // Against an image the card does not run: a verify that fails (and, as any failed task,
    // holds the device until reset).
    let other = build::gbs(REFERENCE_FPGA_INTERFACE, &["11".repeat(16).as_str()], b"x");
    add(&h, "other", &other, dict(&[])).await;
    let (state, result) = finish(&h, &d.verify("other", Default::default()).await.unwrap()).await;
    assert_eq!(state, "error");
    assert!(result.contains(&format!("reports AFU {NLB}")), "{result}");
    d.reset_task().await.unwrap();
    assert_eq!(settled_state(&h, AF).await, "idle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn illegal_images_are_refused_in_prepare_and_leave_the_device_idle() {
    let h = Harness::start(CONFIG).await;
    let p = images(&h.client).await.unwrap();
    add(
        &h,
        "wrong-if",
        &build::gbs(&"ab".repeat(16), &[NLB], b"bits"),
        dict(&[]),
    )
    .await;
    add(&h, "tampered", &nlb(), dict(&[])).await;
    add(&h, "off", &nlb(), dict(&[])).await;
    p.deactivate("off").await.unwrap();
    add(&h, "raw", b"no header", dict(&[])).await;
    let x = build::xclbin([0; 16], [1; 16], b"payload");
    add(&h, "shell", &x, dict(&[])).await;
    // The stored file changes behind vfiod's back.
    let stored = h.dir.path().join("state/images/tampered");
    let mut bytes = std::fs::read(&stored).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&stored, bytes).unwrap();

    let d = dev(&h, AF).await;
    h.kernel.take_write_log();
    let before = h.store().tasks(None, 1000).unwrap().len();
    for (image, reason) in [
        ("wrong-if", "is built for interface abababab"),
        ("tampered", "no longer has its recorded SHA-256"),
        ("off", "is deactivated"),
        ("raw", "no declared format"),
        ("shell", "configure an exec backend"),
        ("missing", "no image \"missing\""),
    ] {
        let (name, message) = refusal(d.program(image, Default::default()).await, image);
        assert!(
            name.ends_with("InvalidArgument"),
            "{image}: {name}: {message}"
        );
        assert!(message.contains(reason), "{image}: {message}");
        assert_eq!(settled_state(&h, AF).await, "idle", "{image}");
    }
    let (name, _) = refusal(
        d.verify("off", Default::default()).await,
        "verify of a deactivated image",
    );
    assert!(name.ends_with("InvalidArgument"));
    assert_eq!(pr_writes(&h), 0, "a refused program reached the card");
    // Refusals inside the task are recorded (as refused and reset), the one before admission
    // (no such image) is not.
    assert_eq!(h.store().tasks(None, 1000).unwrap().len(), before + 6);
    assert_eq!(
        h.kernel.afu_id_of(common::addr(AF)).as_deref(),
        Some(REFERENCE_FPGA_AFU)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_backend_leaves_error_until_reset() {
    let h = Harness::start(CONFIG).await;
    add(&h, "nlb", &nlb(), dict(&[])).await;
    let af = common::addr(AF);
    let d = dev(&h, AF).await;
    h.kernel.inject(
        FaultTarget::DeviceAttr(af, "dfl-fme-pr".into()),
        FaultAction::Errno(libc::EIO),
        Some(1),
    );
    let (state, result) = finish(&h, &d.program("nlb", Default::default()).await.unwrap()).await;
    assert_eq!(state, "error");
    assert!(
        result.contains("partial reconfiguration through") && result.contains("Input/output error"),
        "{result}"
    );
    assert_eq!(settled_state(&h, AF).await, "error");
    let (name, message) = refusal(
        d.program("nlb", Default::default()).await,
        "a program while in error",
    );
    assert!(name.ends_with("Busy"), "{name}: {message}");
    let (name, _) = refusal(
        d.verify("nlb", Default::default()).await,
        "a verify while in error",
    );
    assert!(name.ends_with("Busy"));
    d.reset_task().await.unwrap();
    assert_eq!(settled_state(&h, AF).await, "idle");
    let reset = h.store().tasks(Some(af), 10).unwrap();
    assert!(
        reset.iter().any(|t| t.reset_by.is_some()),
        "the reset is recorded with who did it"
    );
    let (state, result) = finish(&h, &d.program("nlb", Default::default()).await.unwrap()).await;
    assert_eq!(state, "success", "{result}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_program_at_a_time_per_card_and_two_cards_at_once() {
    let h = Harness::start_with(CONFIG, HostModel::two_fpgas()).await;
    add(&h, "nlb", &nlb(), dict(&[])).await;
    let (af, b1) = (common::addr(AF), common::addr(B1));
    for a in [af, b1] {
        h.kernel.inject(
            FaultTarget::DeviceAttr(a, "dfl-fme-pr".into()),
            FaultAction::Delay(Duration::from_millis(1200)),
            None,
        );
    }
    let (d1, d2) = (dev(&h, AF).await, dev(&h, AF).await);
    let (r1, r2) = tokio::join!(
        d1.program("nlb", Default::default()),
        d2.program("nlb", Default::default())
    );
    let (ok, refused) = match (r1, r2) {
        (Ok(p), Err(e)) | (Err(e), Ok(p)) => (p, e),
        (a, b) => panic!("two programs on one card: {a:?} and {b:?}"),
    };
    let (name, message) = refusal::<()>(Err(refused), "the second program");
    assert!(
        name.ends_with("Busy") && message.contains("program"),
        "{name}: {message}"
    );
    assert_eq!(finish(&h, &ok).await.0, "success");
    assert_eq!(settled_state(&h, AF).await, "idle");

    // Two cards: both run, at the same time. Each card's partial reconfiguration is held in
    // the kernel until released: both are held at once, or they ran one after the other (a
    // state, where this used to be "both within 2.3 s").
    h.kernel.clear_faults();
    for a in [af, b1] {
        h.kernel.inject(
            FaultTarget::DeviceAttr(a, "dfl-fme-pr".into()),
            FaultAction::Hold,
            Some(1),
        );
    }
    let (da, db) = (dev(&h, AF).await, dev(&h, B1).await);
    let (ra, rb) = tokio::join!(
        da.program("nlb", Default::default()),
        db.program("nlb", Default::default())
    );
    let (pa, pb) = (ra.unwrap(), rb.unwrap());
    common::eventually(
        common::HUNG,
        "both cards in their partial reconfiguration at once",
        || (h.kernel.hanging() == 2).then_some(()),
    )
    .await;
    h.kernel.release_hangs();
    let (sa, sb) = tokio::join!(finish(&h, &pa), finish(&h, &pb));
    assert_eq!(
        (sa.0.as_str(), sb.0.as_str()),
        ("success", "success"),
        "{sa:?} {sb:?}"
    );
    assert_eq!(h.kernel.afu_id_of(b1).as_deref(), Some(NLB));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_in_vf_mode_is_refused_when_a_vf_is_claimed_else_restored_programmed_and_split_again(
) {
    let h = Harness::start(CONFIG).await;
    add(&h, "nlb", &nlb(), dict(&[])).await;
    let af = common::addr(AF);
    let d = dev(&h, AF).await;
    assert_eq!(
        finish(
            &h,
            &d.set_mode("vf", vfiod::client::mode_options(Some(2)))
                .await
                .unwrap()
        )
        .await
        .0,
        "success"
    );
    assert_eq!(settled_state(&h, AF).await, "idle");
    // The inventory pass after the split records the VFs.
    let h_ = &h;
    eventually_async(
        Duration::from_secs(30),
        "the VFs are recorded",
        || async move {
            h_.store()
                .device(common::addr("0000:af:00.1"))
                .unwrap()
                .map(|_| ())
        },
    )
    .await;
    let m = client::claim::claims_proxy(&h.client).await.unwrap();
    let claim = m
        .claim(
            dict(&[("address", zbus::Variant::from("0000:af:00.1"))]),
            dict(&[("vm_name", zbus::Variant::from("db1"))]),
        )
        .await
        .unwrap();
    h.kernel.take_write_log();
    let (name, message) = refusal(
        d.program("nlb", Default::default()).await,
        "program with a claimed VF",
    );
    assert!(name.ends_with("InUse"), "{name}: {message}");
    assert!(message.contains("claimed by VM db1"), "{message}");
    assert!(
        h.kernel.take_write_log().is_empty(),
        "the refusal changed something"
    );
    assert_eq!(h.kernel.num_vfs(af), Some(2));
    assert_eq!(settled_state(&h, AF).await, "idle");

    client::claim::release(&h.client, claim).await.unwrap();
    // The released VF is cleaned first (a task on the card): waited for, or the program is
    // refused Busy when it asks before the clean ended (seen on a loaded machine).
    common::cleaned(&h, "0000:af:00.1").await;
    let (state, result) = finish(&h, &d.program("nlb", Default::default()).await.unwrap()).await;
    assert_eq!(state, "success", "{result}");
    assert!(
        result.contains("restored to PF mode (from 2 VFs)")
            && result.contains("split again into 2 VFs"),
        "{result}"
    );
    assert_eq!(h.kernel.num_vfs(af), Some(2));
    assert_eq!(h.kernel.afu_id_of(af).as_deref(), Some(NLB));
    assert_eq!(
        h.kernel.driver_of(common::addr("0000:af:00.1")).as_deref(),
        Some("vfio-pci")
    );

    // A failed write after the restore: the card is split again, the task stays in error.
    h.kernel.inject(
        FaultTarget::DeviceAttr(af, "dfl-fme-pr".into()),
        FaultAction::Errno(libc::EIO),
        Some(1),
    );
    let (state, result) = finish(&h, &d.program("nlb", Default::default()).await.unwrap()).await;
    assert_eq!(state, "error");
    assert!(
        result.contains("rollback split again into 2 VFs"),
        "{result}"
    );
    assert_eq!(h.kernel.num_vfs(af), Some(2));
    assert_eq!(settled_state(&h, AF).await, "error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exec_backend_runs_the_operators_command() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("program.sh");
    let log = dir.path().join("args");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$@\" > {}\necho \"writing $2 into $1\"\necho warning >&2\n\
             case \"$2\" in *fail*) echo broken; exit 3;; *slow*) sleep 30;; esac\n",
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = format!(
        "{CONFIG}[[fpga]]\naddress = \"{AF}\"\nbackend = \"exec\"\n\
         command = \"{} {{address}} {{image}}\"\ntimeout_seconds = 2\n",
        script.display()
    );
    let h = Harness::start(&config).await;
    let x = build::xclbin([0; 16], [1; 16], b"payload");
    add(&h, "shell", &x, dict(&[])).await;
    add(&h, "fail", &x, dict(&[])).await;
    add(&h, "slow", &x, dict(&[])).await;
    // An opaque image declaring the AFU the card runs: the command's success, then a verify
    // of the port, pass.
    add(
        &h,
        "good",
        b"vendor bits",
        dict(&[
            ("format", "opaque".into()),
            ("afu_id", REFERENCE_FPGA_AFU.into()),
        ]),
    )
    .await;
    let d = dev(&h, AF).await;
    let (state, result) = finish(&h, &d.program("good", Default::default()).await.unwrap()).await;
    assert_eq!(state, "success", "{result}");
    assert!(
        result.contains("succeeded; output: writing") && result.contains("warning"),
        "{result}"
    );
    let (state, result) = finish(&h, &d.program("shell", Default::default()).await.unwrap()).await;
    assert_eq!(
        state, "error",
        "the card's port reports another AFU than the xclbin's: {result}"
    );
    let stored = h.dir.path().join("state/images/shell");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap().trim(),
        format!("{AF} {}", stored.display())
    );
    assert!(result.contains("reports AFU"), "{result}");
    d.reset_task().await.unwrap();
    let (state, result) = finish(&h, &d.program("fail", Default::default()).await.unwrap()).await;
    assert_eq!(state, "error");
    assert!(
        result.contains("failed (exit status: 3)")
            && result.contains("broken")
            && result.contains("warning"),
        "{result}"
    );
    d.reset_task().await.unwrap();
    let (state, result) = finish(&h, &d.program("slow", Default::default()).await.unwrap()).await;
    assert_eq!(state, "error");
    assert!(result.contains("did not finish within 2s"), "{result}");
    assert_eq!(pr_writes(&h), 0, "the exec backend never used the FME");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_fpga_program_and_verify() {
    let h = Harness::start(CONFIG).await;
    add(&h, "nlb", &nlb(), dict(&[])).await;
    let bus = h.bus.address().to_string();
    let (ok, out) = vfioctl(&bus, &["fpga", "program", AF, "nlb", "--wait"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("program: success: programmed image nlb"),
        "{out}"
    );
    settled_state(&h, AF).await;
    let (ok, out) = vfioctl(&bus, &["fpga", "verify", AF, "nlb", "--wait"]);
    assert!(ok && out.contains("runs image nlb"), "{out}");
    settled_state(&h, AF).await;
    let (ok, out) = vfioctl(&bus, &["task", "show", AF]);
    assert!(
        ok && out.contains("0000:af:00.0: idle") && out.contains("verify: success"),
        "{out}"
    );
    let (ok, out) = vfioctl(&bus, &["fpga", "program", AF, "missing"]);
    assert!(!ok && out.contains("InvalidArgument"), "{out}");
}
