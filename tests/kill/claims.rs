//! Claims across a crash of the daemon: vfiod killed with SIGKILL between a claim and its attach,
//! during an attach (before and after libvirt was asked) and during a detach (the `test-hooks`
//! feature's `VFIOD_TEST_KILL_AT` points of src/engine/job), then restarted on the same
//! (persistent) simulated host. After each restart no claim is lost or duplicated, and a claim
//! that disagrees with libvirt (the crash came between libvirt's change and the claim's) is
//! repaired by the reconcile that runs when the restarted daemon connects to libvirt, with an
//! event saying so; the reconcile also resets the task the kill interrupted, so that it does
//! not block the device.
//!
//! The daemon is the real binary, on a private bus, driven with `vfioctl`; libvirt is a real
//! libvirtd serving QEMU's session driver (tests/common/libvirtd.rs) with a TCG domain `vm1`
//! that is defined but never started: attaches and detaches go to its configuration, which
//! this machine can do (a live hostdev needs an IOMMU). The cases run one after the other on
//! one host, each starting with no claim.
//!
//! Needs `qemu-system-x86` besides the packages of README's test command.

use crate::common;

use crate::common::libvirtd::{require_qemu, tcg_domain_xml, Libvirtd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;
use vfiod::client::claim::ClaimView;
use vfiod::model::claim::ClaimState;
use vfiod::sim::bus::PrivateBus;

/// Long enough for a daemon start, a libvirt connection (polled every 2 s before the pid file
/// is announced) and the first QEMU probe under load.
const SLOW: Duration = Duration::from_secs(60);

/// The daemon under test, killed whatever happens to the test (a failed assertion must not
/// leave a vfiod running on the machine).
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The simulated host, its bus, the libvirtd and the domain `vm1`. The directory goes last.
struct Host {
    _bus: PrivateBus,
    bus: String,
    libvirtd: Libvirtd,
    uri: String,
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        require_qemu();
        let libvirtd = Libvirtd::start();
        let uri = libvirtd.qemu_uri();
        let dir = common::fast_tempdir();
        std::fs::write(
            dir.path().join("vfiod.toml"),
            format!(
                "scenario = \"public\"\nlibvirt_uri = \"{uri}\"\npoll_interval = 3600\n\
                 [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n"
            ),
        )
        .unwrap();
        let xml = libvirtd.dir.path().join("vm1.xml");
        std::fs::write(&xml, tcg_domain_xml("vm1")).unwrap();
        libvirtd.virsh_at(&uri, &["define", xml.to_str().unwrap()]);
        let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        Host {
            bus: bus.address().to_string(),
            _bus: bus,
            dir,
            libvirtd,
            uri,
        }
    }

    fn sim(&self) -> PathBuf {
        self.dir.path().join("sim")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("vfiod.log")
    }

    /// Starts vfiod (with `VFIOD_TEST_KILL_AT=kill_at` if given), waits until it serves, and
    /// announces the libvirtd to its simulated host.
    fn start(&self, kill_at: Option<&str>) -> Daemon {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .unwrap();
        let mut c = Command::new(env!("CARGO_BIN_EXE_vfiod"));
        c.args(["--simulate", "--sim-root"])
            .arg(self.sim())
            .arg("--config")
            .arg(self.dir.path().join("vfiod.toml"))
            .args(["--bus", &self.bus])
            .env("VFIOD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        match kill_at {
            Some(point) => c.env("VFIOD_TEST_KILL_AT", point),
            None => c.env_remove("VFIOD_TEST_KILL_AT"),
        };
        let mut daemon = Daemon(c.spawn().expect("start vfiod"));
        self.wait("vfiod serves", || {
            if let Some(status) = daemon.0.try_wait().unwrap() {
                panic!(
                    "vfiod exited during its start ({status:?}):\n{}",
                    std::fs::read_to_string(self.log()).unwrap_or_default()
                );
            }
            self.ctl(&["status"]).0.then_some(())
        });
        // After the start: opening the simulated host renders its /proc afresh.
        self.libvirtd.announce(&self.sim().join("root"));
        daemon
    }

    /// Polls `condition` until it holds; on timeout fails with vfiod's log.
    fn wait<T>(&self, what: &str, mut condition: impl FnMut() -> Option<T>) -> T {
        let deadline = std::time::Instant::now() + SLOW;
        loop {
            if let Some(v) = condition() {
                return v;
            }
            if std::time::Instant::now() > deadline {
                panic!(
                    "{what}: not within {SLOW:?}\nvfiod's log:\n{}",
                    std::fs::read_to_string(self.log()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the daemon has died, and checks that it was by SIGKILL.
    fn killed(&self, daemon: &mut Daemon, what: &str) {
        let status: ExitStatus = self.wait(&format!("{what}: vfiod dies"), || {
            daemon.0.try_wait().unwrap()
        });
        assert_eq!(
            status.signal(),
            Some(9),
            "{what}: expected death by SIGKILL, got {status:?}"
        );
    }

    fn ctl(&self, args: &[&str]) -> (bool, String) {
        common::vfioctl(&self.bus, args)
    }

    /// `vfioctl ARGS`, which must succeed.
    fn ok(&self, args: &[&str]) -> String {
        let (ok, out) = self.ctl(args);
        assert!(ok, "vfioctl {args:?}: {out}");
        out
    }

    fn claims(&self) -> Vec<ClaimView> {
        serde_json::from_str(&self.ok(&["claims", "--json"])).unwrap()
    }

    /// Claims a VF for vm1: (id, address).
    fn claim(&self) -> (String, String) {
        let out = self.ok(&["claim", "--vf", "--vm", "vm1"]);
        let id = out
            .strip_prefix("claim ")
            .and_then(|r| r.split(':').next())
            .unwrap_or_else(|| panic!("claim N: ...: {out}"))
            .to_string();
        let c = self.claims();
        let mine = c.iter().find(|c| c.id.to_string() == id).unwrap();
        (id, mine.address.clone())
    }

    /// The free VFs, as `vfioctl find --vf` lists them.
    fn free_vfs(&self) -> Vec<String> {
        self.ok(&["find", "--vf"])
            .lines()
            .filter(|l| !l.starts_with("no device"))
            .map(str::to_string)
            .collect()
    }

    /// vm1's configuration (the domain never runs).
    fn config(&self) -> String {
        self.libvirtd
            .virsh_at(&self.uri, &["dumpxml", "--inactive", "vm1"])
    }

    /// How many times vm1's configuration has claim `id`'s hostdev.
    fn aliases(&self, id: &str) -> usize {
        self.config().matches(&format!("'ua-vfiod-{id}-0'")).count()
    }

    /// The events of claim `id` on `address`, oldest first (`vfioctl events`).
    fn claim_events(&self, id: &str, address: &str) -> Vec<String> {
        let out = self.ok(&["events", address, "--json", "--limit", "1000"]);
        let events: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        let mine = format!("claim {id} on {address} ");
        events
            .into_iter()
            .filter(|e| e["kind"] == "claim")
            .map(|e| e["message"].as_str().unwrap().to_string())
            .filter(|m| m.starts_with(&mine))
            .collect()
    }

    /// The `kind` task of claim `id` on `address` (the only one: a claim has one attach and
    /// one detach at most here).
    fn task(&self, id: &str, address: &str, kind: &str) -> serde_json::Value {
        let out = self.ok(&["task", "list", address, "--json", "--limit", "100"]);
        let tasks: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        let claim_of = |t: &serde_json::Value| t["parameters"]["claim"].to_string();
        let mine: Vec<_> = tasks
            .into_iter()
            .filter(|t| t["kind"] == kind && claim_of(t) == id)
            .collect();
        assert_eq!(mine.len(), 1, "the {kind} task of claim {id}: {out}");
        mine.into_iter().next().unwrap()
    }

    /// Claim `id` as the store of the dead daemon has it.
    fn stored(&self, id: &str) -> ClaimState {
        let store = vfiod::store::Store::open(&self.sim().join("state")).unwrap();
        store
            .claim_record(id.parse().unwrap())
            .unwrap()
            .expect("the claim is in the store")
            .state
    }

    /// Claim `id`'s `kind` task, interrupted by the kill, was reset by the reconcile: it does
    /// not block the device.
    fn interrupted_and_reset(&self, id: &str, address: &str, kind: &str, case: &str) {
        let t = self.wait(&format!("{case}: the {kind} task is reset"), || {
            let t = self.task(id, address, kind);
            (t["reset_by"] != "").then_some(t)
        });
        assert_eq!(t["state"], "error", "{case}: {t}");
        assert!(
            t["result"].as_str().unwrap().contains("interrupted"),
            "{case}: {t}"
        );
        assert!(
            t["reset_by"].as_str().unwrap().contains("reconcile"),
            "{case}: {t}"
        );
    }
}

/// Kills a running daemon with SIGKILL (a crash: no cleanup) and reaps it.
fn sigkill(mut d: Daemon) {
    d.0.kill().unwrap();
    let status = d.0.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
}

#[test]
fn claims_survive_sigkill_and_the_reconcile_repairs_them() {
    let h = Host::new();
    let mut d = h.start(None);
    // The start-up split of the NIC gives the VFs.
    h.wait("the NIC is split", || {
        (h.free_vfs().len() == 4).then_some(())
    });

    // 1. Killed between the claim and its attach: the claim is kept as it was.
    let case = "killed after a claim";
    let (a, a_addr) = h.claim();
    sigkill(d);
    d = h.start(None);
    let claims = h.claims();
    assert_eq!(claims.len(), 1, "{case}: {claims:?}");
    assert_eq!(claims[0].id.to_string(), a, "{case}");
    assert_eq!(claims[0].address, a_addr, "{case}");
    assert_eq!(claims[0].state, "claimed", "{case}");
    assert!(
        !h.free_vfs().contains(&a_addr),
        "{case}: still out of the pool"
    );
    let out = h.ok(&["attach", &a, "vm1", "--config", "--wait"]);
    assert!(out.contains("attached to vm1"), "{case}: {out}");
    assert_eq!(h.claims()[0].state, "attached", "{case}");
    assert_eq!(h.aliases(&a), 1, "{case}: {}", h.config());
    h.ok(&["detach", &a, "--wait"]);
    assert!(h.claims().is_empty(), "{case}");
    assert!(!h.config().contains("ua-vfiod-"), "{case}");
    // The end of the claim started a clean of a_addr: the next kill must not cut it short (a
    // clean a stop interrupted keeps its device out of the pool until an operator resets it,
    // tests/kill/tasks.rs), so it is waited for as in the cases below.
    h.wait(
        &format!("{case}: a_addr cleaned and back in the pool"),
        || h.free_vfs().contains(&a_addr).then_some(()),
    );

    // 2. Killed during the attach, after libvirt has the hostdev and before the claim says so:
    // the reconcile finds the attach completed.
    let case = "killed in libvirt's attach";
    sigkill(d);
    let mut d = h.start(Some("attach:in-libvirt"));
    let (b, b_addr) = h.claim();
    let (ok, out) = h.ctl(&["attach", &b, "vm1", "--config", "--wait"]);
    assert!(!ok, "{case}: the daemon died: {out}");
    h.killed(&mut d, case);
    assert_eq!(h.stored(&b), ClaimState::Attaching, "{case}");
    assert_eq!(h.aliases(&b), 1, "{case}: libvirt has it");
    drop(d);
    let d = h.start(None);
    let claims = h.wait(&format!("{case}: the claim is repaired"), || {
        let c = h.claims();
        c.iter()
            .any(|c| c.id.to_string() == b && c.state == "attached")
            .then_some(c)
    });
    assert_eq!(claims.len(), 1, "{case}: {claims:?}");
    assert_eq!(claims[0].address, b_addr, "{case}");
    let events = h.claim_events(&b, &b_addr);
    assert!(
        events
            .iter()
            .any(|e| e.contains("reconcile") && e.contains("attach to vm1 completed")),
        "{case}: {events:?}"
    );
    assert_eq!(h.aliases(&b), 1, "{case}: the hostdev once: {}", h.config());
    h.interrupted_and_reset(&b, &b_addr, "attach", case);
    // The device is not blocked: the claim detaches.
    h.ok(&["detach", &b, "--wait"]);
    assert!(h.claims().is_empty(), "{case}");
    assert!(!h.config().contains("ua-vfiod-"), "{case}");
    h.wait(
        &format!("{case}: b_addr cleaned and back in the pool"),
        || h.free_vfs().contains(&b_addr).then_some(()),
    );

    // 3. Killed during the attach before libvirt was asked: the attach did not complete, and
    // the rule for that releases the claim.
    let case = "killed before libvirt's attach";
    sigkill(d);
    let mut d = h.start(Some("attach:attaching"));
    let (c, c_addr) = h.claim();
    let (ok, out) = h.ctl(&["attach", &c, "vm1", "--config", "--wait"]);
    assert!(!ok, "{case}: the daemon died: {out}");
    h.killed(&mut d, case);
    assert_eq!(h.stored(&c), ClaimState::Attaching, "{case}");
    assert!(
        !h.config().contains("ua-vfiod-"),
        "{case}: libvirt has nothing"
    );
    drop(d);
    // This run dies at the next detach: case 4.
    let mut d = h.start(Some("detach:asked"));
    h.wait(&format!("{case}: the claim is released"), || {
        h.claims().is_empty().then_some(())
    });
    let events = h.claim_events(&c, &c_addr);
    assert!(
        events
            .iter()
            .any(|e| e.contains("released by the reconcile")
                && e.contains("attach to vm1 did not complete")),
        "{case}: {events:?}"
    );
    assert!(!h.config().contains("ua-vfiod-"), "{case}");
    h.wait(
        &format!("{case}: c_addr cleaned and back in the pool"),
        || h.free_vfs().contains(&c_addr).then_some(()),
    );
    h.interrupted_and_reset(&c, &c_addr, "attach", case);

    // 4. Killed during the detach, once libvirt's configuration no longer has the hostdev and
    // before the claim ends: the reconcile finds the detach completed.
    let case = "killed in the detach";
    let (e, e_addr) = h.claim();
    h.ok(&["attach", &e, "vm1", "--config", "--wait"]);
    assert_eq!(h.aliases(&e), 1, "{case}");
    let (ok, out) = h.ctl(&["detach", &e, "--wait"]);
    assert!(!ok, "{case}: the daemon died: {out}");
    h.killed(&mut d, case);
    assert_eq!(h.stored(&e), ClaimState::Detaching, "{case}");
    assert!(!h.config().contains("ua-vfiod-"), "{case}: out of libvirt");
    drop(d);
    let _d = h.start(None);
    h.wait(&format!("{case}: the claim ends"), || {
        h.claims().is_empty().then_some(())
    });
    let events = h.claim_events(&e, &e_addr);
    assert!(
        events
            .iter()
            .any(|e| e.contains("released by the reconcile")
                && e.contains("detach from vm1 completed")),
        "{case}: {events:?}"
    );
    h.wait(
        &format!("{case}: e_addr cleaned and back in the pool"),
        || h.free_vfs().contains(&e_addr).then_some(()),
    );
    assert!(!h.config().contains("ua-vfiod-"), "{case}");
    h.interrupted_and_reset(&e, &e_addr, "detach", case);
    h.wait("every VF is cleaned and free again", || {
        (h.free_vfs().len() == 4).then_some(())
    });
}
