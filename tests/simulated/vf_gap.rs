//! Issue 33's soak (`tests/soak_faults.rs`, seed 1796665768741365169): a restore's task ended
//! before an inventory pass recorded its VFs removed, and a claim in that gap handed out a VF
//! the kernel no longer had ("claim 146 on 0000:af:00.2 ... handed out on driver None, its
//! record says Some(\"vfio-pci\")"). Here the `task:ended` test hook holds everything that runs
//! after a task's end is published for a second (and the loop's pass on the restore's uevents),
//! so the claim lands in that window every time:
//! it must get no function the kernel does not have.

use crate::common;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The NIC split into four VFs on vfio-pci.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\n\
     [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n";
const NIC: &str = "0000:3b:00.0";

struct Vfiod {
    child: std::process::Child,
    dir: tempfile::TempDir,
    bus: vfiod::sim::bus::PrivateBus,
}

impl Drop for Vfiod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Vfiod {
    fn start(env: &[(&str, &str)]) -> Vfiod {
        let dir = common::fast_tempdir();
        std::fs::write(dir.path().join("vfiod.toml"), CONFIG).unwrap();
        let bus = vfiod::sim::bus::PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_vfiod"));
        command
            .args(["--simulate", "--sim-root"])
            .arg(dir.path().join("sim"))
            .arg("--config")
            .arg(dir.path().join("vfiod.toml"))
            .args(["--bus", bus.address()])
            .env("VFIOD_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().expect("start vfiod");
        Vfiod { child, dir, bus }
    }

    fn ctl(&self, args: &[&str]) -> (bool, String) {
        common::vfioctl(self.bus.address(), args)
    }

    /// Whether the simulated kernel has the function now.
    fn kernel_has(&self, address: &str) -> bool {
        self.dir
            .path()
            .join("sim/root/sys/bus/pci/devices")
            .join(address)
            .exists()
    }
}

#[test]
fn a_claim_right_after_a_restore_gets_no_vf_the_kernel_no_longer_has() {
    // The loop's pass on the restore's uevents is held too: it would otherwise record the VFs
    // removed while the task still runs (a busy loop, as in the soak, gets to it later).
    let v = Vfiod::start(&[("VFIOD_TEST_PAUSE_AT", "task:ended,loop:uevent-pass")]);
    let vf_args = ["--vf", "--parent", NIC];
    common::eventually_blocking(Duration::from_secs(120), "vfiod splits the NIC", || {
        let mut find = vec!["find"];
        find.extend_from_slice(&vf_args);
        v.ctl(&find).0.then_some(())
    });
    let (ok, out) = v.ctl(&["task", "start", NIC, "restore", "--wait"]);
    assert!(ok, "the restore: {out}");
    assert!(
        !v.kernel_has("0000:3b:02.0"),
        "the restore left the NIC's first VF in the kernel"
    );
    // The task's end is published; whatever follows it is held for a second by the hook.
    let mut claim = vec!["claim", "--vm", "vm1", "--json"];
    claim.extend_from_slice(&vf_args);
    let (ok, out) = v.ctl(&claim);
    if ok {
        let c: serde_json::Value = serde_json::from_str(&out).expect("a claim as JSON");
        for f in c["functions"].as_array().expect("the claim's functions") {
            let f = f.as_str().unwrap();
            assert!(
                v.kernel_has(f),
                "claim {} handed out {f}, which the kernel no longer has (the restore removed it)",
                c["id"]
            );
        }
    }
}
