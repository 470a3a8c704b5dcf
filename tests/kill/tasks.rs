//! vfiod killed with SIGKILL at each step of a split (the `VFIOD_TEST_KILL_AT_STEP` hook), then
//! restarted on the same (persistent) simulated host: the task shows `error: interrupted`, the
//! device's state is consistent and re-read, and a reset brings it to its configured mode.
//! Also: a kill during an image download leaves a partial file that the next start removes.

use crate::common;

use crate::common::vfioctl;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use vfiod::model::pci::PciAddress;
use vfiod::sim::bus::PrivateBus;

const FPGA: &str = "0000:af:00.0";
const CONFIG: &str = "scenario = \"public\"\npoll_interval = 3600\n[[select]]\nclass = \"0x12\"\n";

/// The daemon under test, stopped whatever happens to the test (a failed assertion must not
/// leave a vfiod running on the machine).
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn vfiod(dir: &Path, bus: &str, kill_at: Option<usize>) -> Daemon {
    vfiod_with(dir, bus, kill_at, None)
}

/// `kill_point`: the named kill point of a job (`VFIOD_TEST_KILL_AT`).
fn vfiod_with(dir: &Path, bus: &str, kill_at: Option<usize>, kill_point: Option<&str>) -> Daemon {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vfiod"));
    c.args(["--simulate", "--sim-root"])
        .arg(dir.join("sim"))
        .arg("--config")
        .arg(dir.join("vfiod.toml"))
        .args(["--bus", bus])
        .env("VFIOD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match kill_at {
        Some(k) => c.env("VFIOD_TEST_KILL_AT_STEP", k.to_string()),
        None => c.env_remove("VFIOD_TEST_KILL_AT_STEP"),
    };
    match kill_point {
        Some(p) => c.env("VFIOD_TEST_KILL_AT", p),
        None => c.env_remove("VFIOD_TEST_KILL_AT"),
    };
    Daemon(c.spawn().expect("start vfiod"))
}

fn wait_ready(bus: &str) {
    common::eventually_blocking(Duration::from_secs(60), "vfiod comes up", || {
        vfioctl(bus, &["status"]).0.then_some(())
    });
}

/// What the simulated kernel's files say about the FPGA: (numvfs, VF links, VFs on vfio-pci).
fn kernel_view(root: &Path) -> (u32, usize, usize) {
    let dev = root.join("sys/bus/pci/devices").join(FPGA);
    let numvfs: u32 = std::fs::read_to_string(dev.join("sriov_numvfs"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut links = 0;
    let mut on_vfio = 0;
    for i in 0..4 {
        if let Ok(t) = std::fs::read_link(dev.join(format!("virtfn{i}"))) {
            links += 1;
            let vf: PciAddress = t.file_name().unwrap().to_str().unwrap().parse().unwrap();
            let drv = std::fs::read_link(
                root.join("sys/bus/pci/devices")
                    .join(vf.to_string())
                    .join("driver"),
            );
            if drv.is_ok_and(|d| d.ends_with("vfio-pci")) {
                on_vfio += 1;
            }
        }
    }
    (numvfs, links, on_vfio)
}

#[test]
fn killed_at_every_step_of_a_split_then_restarted() {
    // The FPGA split plan: autoprobe, numvfs, wait, then override + probe + check per VF (15).
    for k in [0usize, 1, 2, 3, 5, 8, 14] {
        let dir = common::fast_tempdir();
        std::fs::write(dir.path().join("vfiod.toml"), CONFIG).unwrap();
        let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        let addr = bus.address().to_string();

        // First run: the start-up reconciliation splits the FPGA and dies at step k.
        let mut first = vfiod(dir.path(), &addr, Some(k));
        let status = common::eventually_blocking(
            Duration::from_secs(60),
            &format!("k={k}: vfiod is killed"),
            || first.0.try_wait().unwrap(),
        );
        assert_eq!(
            status.signal(),
            Some(9),
            "k={k}: expected death by SIGKILL, got {status:?}"
        );
        let root = dir.path().join("sim/root");
        let (numvfs, links, _) = kernel_view(&root);
        assert_eq!(
            numvfs as usize, links,
            "k={k}: the kernel itself is never half-split"
        );

        // Restart: the interrupted task is reported, nothing is retried behind the operator's back.
        let second = vfiod(dir.path(), &addr, None);
        wait_ready(&addr);
        let (ok, tasks) = vfioctl(&addr, &["task", "list", "--json"]);
        assert!(ok, "{tasks}");
        let tasks: Vec<serde_json::Value> = serde_json::from_str(&tasks).unwrap();
        assert_eq!(tasks.len(), 1, "k={k}: {tasks:?}");
        assert_eq!(tasks[0]["state"], "error", "k={k}");
        assert!(
            tasks[0]["result"].as_str().unwrap().contains("interrupted"),
            "k={k}: {tasks:?}"
        );
        assert_eq!(
            kernel_view(&root).0,
            numvfs,
            "k={k}: the restart changed the device"
        );
        let (_, show) = vfioctl(&addr, &["show", FPGA, "--json"]);
        let shown: serde_json::Value = serde_json::from_str(&show).unwrap();
        assert_eq!(
            shown["num_vfs"], numvfs,
            "k={k}: the store re-read the device"
        );

        // Busy until reset; the reset brings it to its configured mode (issue 33) from
        // whatever state was left, and a split asked for then finds it done.
        let (ok, out) = vfioctl(&addr, &["mode", FPGA, "vf", "--wait"]);
        assert!(!ok && out.contains("Busy"), "k={k}: {out}");
        let (ok, out) = vfioctl(&addr, &["task", "reset", FPGA]);
        assert!(ok, "k={k}: {out}");
        common::eventually_blocking(
            Duration::from_secs(60),
            &format!("k={k}: the split after the reset is done"),
            || {
                let (_, out) = vfioctl(&addr, &["show", FPGA, "--json"]);
                let shown: serde_json::Value = serde_json::from_str(&out).ok()?;
                (shown["task_state"] == "idle").then_some(())
            },
        );
        let (ok, out) = vfioctl(&addr, &["mode", FPGA, "vf", "--wait"]);
        assert!(ok, "k={k}: {out}");
        assert_eq!(kernel_view(&root), (4, 4, 4), "k={k}");

        drop(second);
    }
}

/// SIGKILL while the FPGA is being programmed (the `program:writing` kill point, before the
/// partial reconfiguration): after the restart the task is `error: interrupted`, the card is
/// re-read (still its old AFU), a new program is Busy until the reset, then succeeds.
#[test]
fn killed_while_programming_then_restarted() {
    use sha2::Digest;
    const PF_CONFIG: &str =
        "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nclass = \"0x12\"\n";
    let nlb = "d8424dc4a4a3c413f89e433683f9040b";
    let dir = common::fast_tempdir();
    std::fs::write(dir.path().join("vfiod.toml"), PF_CONFIG).unwrap();
    let image = vfiod::fpga::image::build::gbs(
        vfiod::sim::kernel::REFERENCE_FPGA_INTERFACE,
        &[nlb],
        b"green bitstream",
    );
    let file = dir.path().join("nlb.gbs");
    std::fs::write(&file, &image).unwrap();
    let digest: String = sha2::Sha256::digest(&image)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let addr = bus.address().to_string();

    let mut first = vfiod_with(dir.path(), &addr, None, Some("program:writing"));
    wait_ready(&addr);
    let (ok, out) = vfioctl(
        &addr,
        &[
            "image",
            "add",
            "nlb",
            file.to_str().unwrap(),
            "--sha256",
            &digest,
        ],
    );
    assert!(ok, "{out}");
    let (_, out) = vfioctl(&addr, &["fpga", "program", FPGA, "nlb", "--wait"]);
    let status = common::eventually_blocking(Duration::from_secs(60), "vfiod is killed", || {
        first.0.try_wait().unwrap()
    });
    assert_eq!(status.signal(), Some(9), "{status:?}: {out}");
    let afu = |root: &Path| {
        std::fs::read_to_string(
            root.join("sys/bus/pci/devices")
                .join(FPGA)
                .join("fpga_region/region0/dfl-port.0/afu_id"),
        )
        .unwrap()
        .trim()
        .to_string()
    };
    let root = dir.path().join("sim/root");
    assert_eq!(afu(&root), vfiod::sim::kernel::REFERENCE_FPGA_AFU);

    let second = vfiod(dir.path(), &addr, None);
    wait_ready(&addr);
    let (ok, tasks) = vfioctl(&addr, &["task", "list", "--json"]);
    assert!(ok, "{tasks}");
    let tasks: Vec<serde_json::Value> = serde_json::from_str(&tasks).unwrap();
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    assert_eq!(
        (tasks[0]["kind"].as_str(), tasks[0]["state"].as_str()),
        (Some("program"), Some("error"))
    );
    assert!(
        tasks[0]["result"].as_str().unwrap().contains("interrupted"),
        "{tasks:?}"
    );
    let (_, show) = vfioctl(&addr, &["show", FPGA, "--json"]);
    let shown: serde_json::Value = serde_json::from_str(&show).unwrap();
    assert_eq!(shown["task_state"], "error", "{shown}");
    // The image survived the kill, the card was not touched.
    assert!(vfioctl(&addr, &["image", "show", "nlb"]).0);
    assert_eq!(afu(&root), vfiod::sim::kernel::REFERENCE_FPGA_AFU);

    let (ok, out) = vfioctl(&addr, &["fpga", "program", FPGA, "nlb", "--wait"]);
    assert!(!ok && out.contains("Busy"), "{out}");
    assert!(vfioctl(&addr, &["task", "reset", FPGA]).0);
    let (ok, out) = vfioctl(&addr, &["fpga", "program", FPGA, "nlb", "--wait"]);
    assert!(ok, "{out}");
    assert_eq!(afu(&root), nlb);
    drop(second);
}

/// SIGKILL while an image is being downloaded (`Images.AddFromUrl` from a plain-http server on
/// loopback, which the loopback rule allows): the partial download stays behind as a
/// temporary file, and the next start removes it, with no catalog entry for it.
#[test]
fn killed_while_downloading_an_image_then_restarted() {
    use std::io::{BufRead, BufReader, Write};
    let dir = common::fast_tempdir();
    std::fs::write(dir.path().join("vfiod.toml"), CONFIG).unwrap();
    // A server that sends a 64 MiB header's worth of promise and then a trickle.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            std::thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n");
                while s.write_all(&[0u8; 4096]).is_ok() {
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
        }
    });
    let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let addr = bus.address().to_string();
    let mut first = vfiod(dir.path(), &addr, None);
    wait_ready(&addr);
    let url = format!("http://127.0.0.1:{port}/big.gbs");
    let mut add = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args(["image", "add", "big", "--url", &url, "--sha256"])
        .arg("0".repeat(64))
        .env("VFIOD_BUS", &addr)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let images = dir.path().join("sim/state/images");
    let partial = || {
        std::fs::read_dir(&images)
            .map(|d| {
                d.filter_map(|e| {
                    let n = e.ok()?.file_name().to_string_lossy().into_owned();
                    n.starts_with(".downloading-").then_some(n)
                })
                .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let left = common::eventually_blocking(Duration::from_secs(30), "a partial download", || {
        let p = partial();
        (!p.is_empty()).then_some(p)
    });
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let _ = add.wait();
    assert_eq!(partial(), left, "the kill left the partial download");

    let second = vfiod(dir.path(), &addr, None);
    wait_ready(&addr);
    assert!(partial().is_empty(), "{:?}", partial());
    let (ok, out) = vfioctl(&addr, &["image", "list", "--json"]);
    assert!(ok && out.trim() == "[]", "{out}");
    drop(second);
}

/// SIGKILL while a device is being cleaned (the `clean:resetting` kill point, before its reset):
/// after the restart the clean is `error: interrupted`, the device is still held out of the
/// pool (`cleaning`, not claimable), and after `vfioctl task reset` it is cleaned and claimable.
#[test]
fn killed_while_cleaning_then_restarted() {
    const NVME: &str = "0000:d8:00.0";
    const NVME_CONFIG: &str =
        "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nid = \"144d:a824\"\n";
    let dir = common::fast_tempdir();
    std::fs::write(dir.path().join("vfiod.toml"), NVME_CONFIG).unwrap();
    let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let addr = bus.address().to_string();

    let mut first = vfiod_with(dir.path(), &addr, None, Some("clean:resetting"));
    wait_ready(&addr);
    let (ok, out) = vfioctl(
        &addr,
        &["claim", "--address", NVME, "--vm", "tenant1", "--json"],
    );
    assert!(ok, "{out}");
    let claim: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (ok, out) = vfioctl(&addr, &["release", &claim["id"].to_string()]);
    assert!(ok, "{out}");
    let status = common::eventually_blocking(Duration::from_secs(60), "vfiod is killed", || {
        first.0.try_wait().unwrap()
    });
    assert_eq!(status.signal(), Some(9), "{status:?}");

    let second = vfiod(dir.path(), &addr, None);
    wait_ready(&addr);
    let show = || {
        let (_, out) = vfioctl(&addr, &["show", NVME, "--json"]);
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let shown = show();
    assert_eq!(
        (shown["state"].as_str(), shown["task_state"].as_str()),
        (Some("cleaning"), Some("error")),
        "{shown}"
    );
    assert!(
        shown["last_result"].as_str().unwrap_or("").is_empty()
            || !shown["last_result"].as_str().unwrap().contains("success"),
        "{shown}"
    );
    let (ok, tasks) = vfioctl(&addr, &["task", "list", "--json"]);
    assert!(ok, "{tasks}");
    let tasks: Vec<serde_json::Value> = serde_json::from_str(&tasks).unwrap();
    let clean = tasks.iter().find(|t| t["kind"] == "clean").unwrap();
    assert_eq!(clean["state"], "error", "{clean}");
    assert!(
        clean["result"].as_str().unwrap().contains("interrupted"),
        "{clean}"
    );
    // Not claimable while held.
    let (ok, out) = vfioctl(&addr, &["claim", "--address", NVME, "--vm", "tenant2"]);
    assert!(!ok, "{out}");

    assert!(vfioctl(&addr, &["task", "reset", NVME]).0);
    common::eventually_blocking(Duration::from_secs(30), "cleaned, then claimable", || {
        let s = show();
        (s["state"] == "usable" && s["task_state"] == "idle").then_some(())
    });
    let shown = show();
    assert_eq!(shown["reset_health"]["cleans"], 1, "{shown}");
    let (ok, out) = vfioctl(&addr, &["claim", "--address", NVME, "--vm", "tenant2"]);
    assert!(ok, "{out}");
    drop(second);
}

/// The FPGA's VFs as the kernel has them: (address, driver).
fn vf_drivers(root: &Path) -> Vec<(String, Option<String>)> {
    let dev = root.join("sys/bus/pci/devices").join(FPGA);
    (0..4)
        .filter_map(|i| std::fs::read_link(dev.join(format!("virtfn{i}"))).ok())
        .map(|t| {
            let vf = t.file_name().unwrap().to_str().unwrap().to_string();
            let driver =
                std::fs::read_link(root.join("sys/bus/pci/devices").join(&vf).join("driver"))
                    .ok()
                    .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()));
            (vf, driver)
        })
        .collect()
}

/// Issue 33: SIGKILL part-way through a restore (two of the FPGA's four VFs already unbound),
/// restart, `vfioctl task reset`: the records say the drivers sysfs shows, and the reset brings
/// the device back to its configured mode at once, so that no claim ever hands out a VF
/// without its driver (before the fix the two stayed driverless and "usable" until a reload).
#[test]
fn killed_during_a_restore_then_reset_hands_out_no_driverless_vf() {
    let dir = common::fast_tempdir();
    std::fs::write(dir.path().join("vfiod.toml"), CONFIG).unwrap();
    let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let addr = bus.address().to_string();
    let root = dir.path().join("sim/root");
    let idle = |what: &str| {
        common::eventually_blocking(Duration::from_secs(60), what, || {
            let (ok, out) = vfioctl(&addr, &["show", FPGA, "--json"]);
            let shown: serde_json::Value = serde_json::from_str(&out).ok()?;
            (ok && shown["task_state"] == "idle").then_some(())
        })
    };

    // First run: the start-up reconciliation splits the FPGA onto vfio-pci.
    let first = vfiod(dir.path(), &addr, None);
    wait_ready(&addr);
    idle("the split is done");
    assert_eq!(kernel_view(&root), (4, 4, 4));
    drop(first);

    // Second run: a restore, killed before its third step (two VFs unbound).
    let mut second = vfiod(dir.path(), &addr, Some(2));
    wait_ready(&addr);
    let _ = vfioctl(&addr, &["mode", FPGA, "pf"]);
    let status = common::eventually_blocking(Duration::from_secs(60), "vfiod is killed", || {
        second.0.try_wait().unwrap()
    });
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert_eq!(kernel_view(&root), (4, 4, 2), "two VFs were unbound");

    // Third run: the records say what sysfs says.
    let third = vfiod(dir.path(), &addr, None);
    wait_ready(&addr);
    for (vf, driver) in vf_drivers(&root) {
        let (_, out) = vfioctl(&addr, &["show", &vf, "--json"]);
        let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            shown["driver"].as_str(),
            driver.as_deref(),
            "{vf}: the record is what sysfs shows: {shown}"
        );
    }
    let (ok, out) = vfioctl(&addr, &["task", "reset", FPGA]);
    assert!(ok, "{out}");
    // At once: a claim gets no VF without its driver (none at all while the repair runs).
    let claimed = |vm: &str| -> Option<String> {
        let (ok, out) = vfioctl(&addr, &["claim", "--parent", FPGA, "--vm", vm, "--json"]);
        if !ok {
            return None;
        }
        let c: serde_json::Value = serde_json::from_str(&out).unwrap();
        Some(c["address"].as_str().unwrap().to_string())
    };
    if let Some(vf) = claimed("right-after-the-reset") {
        let driver = vf_drivers(&root)
            .into_iter()
            .find(|(a, _)| *a == vf)
            .unwrap()
            .1;
        assert_eq!(
            driver.as_deref(),
            Some("vfio-pci"),
            "{vf} was handed out without its driver"
        );
    }
    idle("the repair is done");
    assert_eq!(kernel_view(&root), (4, 4, 4), "back in its configured mode");
    let vf = claimed("later").expect("a VF is claimable once repaired");
    let driver = vf_drivers(&root)
        .into_iter()
        .find(|(a, _)| *a == vf)
        .unwrap()
        .1;
    assert_eq!(driver.as_deref(), Some("vfio-pci"));
    drop(third);
}
