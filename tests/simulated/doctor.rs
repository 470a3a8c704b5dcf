//! `vfioctl doctor` on the simulated kernel, as the real binary: a host ready for passthrough
//! passes every check (exit 0) and the doctor leaves its tree as it found it; each check fails
//! on a host built without what it checks (no IOMMU, no VFIO modules, no interrupt remapping,
//! a blocking group-mate, an invalid configuration), with its verdict, its fix and the exit
//! status; the services around vfiod warn (exit 8) when they are not there.

use crate::common::{fast_tempdir, Harness, STEADY_CONFIG};
use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use vfiod::client::exit;
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{HostModel, SimKernel};

/// A bus address nothing listens on: vfiod and polkitd are not reached.
const NO_BUS: &str = "unix:path=/nonexistent/vfiod-doctor-test.sock";

/// A simulated host with a configuration for the doctor.
struct Host {
    dir: tempfile::TempDir,
    kernel: Arc<SimKernel>,
    config: PathBuf,
}

impl Host {
    fn new(model: &HostModel, config: &str) -> Host {
        let dir = fast_tempdir();
        let kernel = SimKernel::build(&dir.path().join("root"), model).expect("simulated host");
        let config_path = dir.path().join("vfiod.toml");
        std::fs::write(&config_path, config).unwrap();
        Host {
            dir,
            kernel,
            config: config_path,
        }
    }

    fn root(&self) -> &Path {
        self.kernel.root()
    }

    /// A file under the root, with its directories, made executable.
    fn install(&self, rel: &str, mtime: Option<SystemTime>) {
        let path = self.root().join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        if let Some(t) = mtime {
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
    }

    /// A running libvirtd: its pid file (written at `started`) and its process.
    fn libvirtd(&self, started: SystemTime) {
        let pid = self.root().join("run/libvirtd.pid");
        std::fs::create_dir_all(pid.parent().unwrap()).unwrap();
        std::fs::write(&pid, "4242\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&pid)
            .unwrap()
            .set_modified(started)
            .unwrap();
        std::fs::create_dir_all(self.root().join("proc/4242")).unwrap();
    }

    /// `vfioctl doctor --json` on this host: its exit status and its report.
    fn doctor(&self, bus: &str) -> (i32, Value) {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfioctl"))
            .args(["doctor", "--json", "--config"])
            .arg(&self.config)
            .arg("--root")
            .arg(self.root())
            .env("VFIOD_BUS", bus)
            .output()
            .expect("run vfioctl doctor");
        let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "not a JSON report ({e}): {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out.status.code().expect("an exit code"), report)
    }

    /// `vfioctl doctor` as text.
    fn doctor_text(&self, bus: &str) -> (i32, String) {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfioctl"))
            .args(["doctor", "--config"])
            .arg(&self.config)
            .arg("--root")
            .arg(self.root())
            .env("VFIOD_BUS", bus)
            .output()
            .expect("run vfioctl doctor");
        (
            out.status.code().expect("an exit code"),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }
}

/// [`STEADY_CONFIG`] (every selected group viable) without libvirt.
fn steady_without_libvirt() -> String {
    format!("libvirt_uri = \"\"\n{STEADY_CONFIG}")
}

/// The check called `name`.
fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name:?} in {report:#}"))
}

/// The check's verdict, and that its evidence and fix hold the words given.
fn expect(report: &Value, name: &str, verdict: &str, evidence: &str, fix: &str) {
    let c = check(report, name);
    assert_eq!(c["verdict"], verdict, "{c:#}");
    let text = |k: &str| c[k].as_str().unwrap().to_string();
    assert!(
        text("evidence").contains(evidence),
        "{evidence:?} not in {c:#}"
    );
    assert!(text("fix").contains(fix), "{fix:?} not in {c:#}");
}

/// Each check's verdict, by name.
fn verdicts(report: &Value) -> BTreeMap<String, String> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["verdict"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Every path under `root` with its type, mode, time and content: what "unchanged" compares.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (u32, Option<SystemTime>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let meta = std::fs::symlink_metadata(e.path()).unwrap();
            let content = if meta.is_file() {
                std::fs::read(e.path()).unwrap()
            } else if meta.file_type().is_symlink() {
                std::fs::read_link(e.path())
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else {
                if meta.is_dir() {
                    dirs.push(e.path());
                }
                Vec::new()
            };
            out.insert(
                e.path(),
                (meta.permissions().mode(), meta.modified().ok(), content),
            );
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_ready_for_passthrough_passes_every_check() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let root = h.kernel.root().to_path_buf();
    let host = Host {
        config: h.dir.path().join("doctor.toml"),
        kernel: Arc::clone(&h.kernel),
        dir: fast_tempdir(),
    };
    std::fs::write(
        &host.config,
        format!("libvirt_uri = \"qemu:///system\"\n{STEADY_CONFIG}"),
    )
    .unwrap();
    // libvirtd runs since now; the hook was there an hour before; polkitd is installed.
    let now = SystemTime::now();
    host.install(
        "etc/libvirt/hooks/qemu.d/vfiod",
        Some(now - Duration::from_secs(3600)),
    );
    host.libvirtd(now);
    host.install("usr/lib/polkit-1/polkitd", None);

    let (code, report) = host.doctor(&bus);
    let not_ok: Vec<&Value> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["verdict"] != "ok")
        .collect();
    assert!(not_ok.is_empty(), "{not_ok:#?}");
    assert_eq!(code, i32::from(exit::OK));
    assert_eq!(report["verdict"], "ok");
    assert_eq!(report["root"], root.display().to_string());
    expect(
        &report,
        "iommu groups",
        "ok",
        "groups in /sys/kernel/iommu_groups",
        "",
    );
    expect(
        &report,
        "iommu units",
        "ok",
        "dmar0 in /sys/class/iommu (Intel VT-d)",
        "",
    );
    expect(
        &report,
        "interrupt remapping",
        "ok",
        "on: 3 interrupts on IR- chips",
        "",
    );
    expect(&report, "vfio_pci", "ok", "vfio_pci loaded", "");
    expect(
        &report,
        "vfio_iommu_type1",
        "ok",
        "vfio_iommu_type1 loaded",
        "",
    );
    // The GPU's group holds its audio function, selected too.
    expect(
        &report,
        "group 0000:17:00.0",
        "ok",
        "with 0000:17:00.1 (selected too)",
        "",
    );
    expect(&report, "acs 0000:17:00.0", "ok", "isolates it", "");
    expect(&report, "vfiod", "ok", "answers on the bus", "");
    expect(
        &report,
        "libvirtd",
        "ok",
        "runs: pid 4242 (/run/libvirtd.pid)",
        "",
    );
    expect(
        &report,
        "libvirt hook",
        "ok",
        "there before libvirtd started",
        "",
    );
    expect(
        &report,
        "polkitd",
        "ok",
        "/usr/lib/polkit-1/polkitd is installed",
        "",
    );
    // Every selected function but VFs has its group checked.
    let groups = verdicts(&report)
        .keys()
        .filter(|n| n.starts_with("group "))
        .count();
    assert!(groups >= 6, "{report:#}");

    // The text: every line within 80 columns, the verdict last.
    let (code, text) = host.doctor_text(&bus);
    assert_eq!(code, 0, "{text}");
    for line in text.lines() {
        assert!(line.chars().count() <= 80, "{line:?}\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("ok    group 0000:17:00.0   group ")),
        "{text}"
    );
    let last = text.lines().last().unwrap_or_default();
    assert!(last.starts_with("verdict: ok ("), "{text}");
}

#[test]
fn a_host_without_an_iommu_fails_the_iommu_checks() {
    let host = Host::new(&HostModel::no_iommu(), &steady_without_libvirt());
    host.install("usr/lib/polkit-1/polkitd", None);
    let (code, report) = host.doctor(NO_BUS);
    assert_eq!(code, i32::from(exit::DOCTOR_FAIL), "{report:#}");
    assert_eq!(report["verdict"], "fail");
    expect(
        &report,
        "iommu groups",
        "fail",
        "no IOMMU group in /sys/kernel/iommu_groups",
        "intel_iommu=on (or amd_iommu=on) iommu=pt",
    );
    expect(
        &report,
        "iommu units",
        "fail",
        "no DMAR or AMD-Vi unit",
        "enable VT-d/AMD-Vi in firmware",
    );
    expect(
        &report,
        "interrupt remapping",
        "fail",
        "none on IR- chips",
        "enable interrupt remapping",
    );
    expect(
        &report,
        "group 0000:17:00.0",
        "fail",
        "in no IOMMU group",
        "intel_iommu=on",
    );
    // What does not depend on the IOMMU still passes.
    expect(&report, "vfio_pci", "ok", "loaded", "");
    expect(&report, "configuration", "ok", "select", "");
}

#[test]
fn a_kernel_without_the_vfio_modules_fails_them() {
    let mut model = HostModel::reference();
    model.kernel.modules.clear();
    model.drivers.retain(|d| d.name != "vfio-pci");
    let host = Host::new(&model, &steady_without_libvirt());
    let (code, report) = host.doctor(NO_BUS);
    assert_eq!(code, i32::from(exit::DOCTOR_FAIL), "{report:#}");
    expect(&report, "vfio", "fail", "vfio not loaded", "modprobe vfio");
    expect(
        &report,
        "vfio_pci",
        "fail",
        "vfio_pci not loaded",
        "modprobe vfio_pci",
    );
    expect(
        &report,
        "vfio_iommu_type1",
        "fail",
        "vfio_iommu_type1 or iommufd not loaded",
        "modprobe vfio_iommu_type1",
    );
    expect(&report, "iommu groups", "ok", "groups", "");

    // iommufd alone is an IOMMU backend for VFIO too.
    let mut model = HostModel::reference();
    model.kernel.modules = vec!["vfio".into(), "vfio_pci".into(), "iommufd".into()];
    let host = Host::new(&model, &steady_without_libvirt());
    let (_, report) = host.doctor(NO_BUS);
    expect(&report, "vfio_iommu_type1", "ok", "iommufd loaded", "");
}

#[test]
fn a_kernel_that_does_not_remap_interrupts_fails_that_check() {
    let mut model = HostModel::reference();
    model.kernel.interrupt_remapping = false;
    let host = Host::new(&model, &steady_without_libvirt());
    let (code, report) = host.doctor(NO_BUS);
    assert_eq!(code, i32::from(exit::DOCTOR_FAIL), "{report:#}");
    expect(
        &report,
        "interrupt remapping",
        "fail",
        "off: 3 interrupts on plain IO-APIC/MSI chips",
        "boot without intremap=off",
    );
    // Cannot be read at all: unknown, a warning with how to look.
    std::fs::remove_file(host.root().join("proc/interrupts")).unwrap();
    let (_, report) = host.doctor(NO_BUS);
    expect(
        &report,
        "interrupt remapping",
        "warn",
        "unknown: cannot read /proc/interrupts",
        "dmesg | grep -i remapping",
    );
}

#[test]
fn an_unselected_group_mate_blocks_the_group_and_is_named() {
    // The GPU selected, its HDMI audio function (same IOMMU group) not.
    let config = "libvirt_uri = \"\"\n[[select]]\nclass = \"0x03\"\n";
    let host = Host::new(&HostModel::reference(), config);
    host.install("usr/lib/polkit-1/polkitd", None);
    let before = snapshot(host.root());
    let (code, report) = host.doctor(NO_BUS);
    // Read-only: the tree is as it was (files, links, modes, times).
    assert_eq!(snapshot(host.root()), before, "the doctor changed the tree");
    assert_eq!(code, i32::from(exit::DOCTOR_FAIL), "{report:#}");
    expect(
        &report,
        "group 0000:17:00.0",
        "fail",
        "also holds 0000:17:00.1 (not selected)",
        "select 0000:17:00.1 too",
    );
    // The simulated kernel shows 256 bytes of config space: ACS unknown, where it matters.
    expect(
        &report,
        "acs 0000:17:00.0",
        "warn",
        "unknown: not read (extended config space needs root)",
        "lspci -vvv",
    );
    // The text names the mate and the fix within 80 columns.
    let (code, text) = host.doctor_text(NO_BUS);
    assert_eq!(code, i32::from(exit::DOCTOR_FAIL));
    assert!(text.contains("fail  group 0000:17:00.0   group "), "{text}");
    assert!(
        text.contains("      fix: select 0000:17:00.1 too"),
        "{text}"
    );
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");

    // Protected instead of unselected: still blocking, and said so.
    let config = "libvirt_uri = \"\"\n[[select]]\nclass = \"0x03\"\n[[select]]\n\
                  id = \"10de:1aef\"\n[[protect]]\naddress = \"0000:17:00.1\"\n";
    std::fs::write(&host.config, config).unwrap();
    let (_, report) = host.doctor(NO_BUS);
    expect(
        &report,
        "group 0000:17:00.0",
        "fail",
        "0000:17:00.1 (protected by",
        "select 0000:17:00.1 too",
    );
}

#[test]
fn a_configuration_that_does_not_load_fails_and_names_its_error() {
    let host = Host::new(
        &HostModel::reference(),
        "libvirt_uri = \"\"\nno_such_key = 1\n",
    );
    let (code, report) = host.doctor(NO_BUS);
    assert_eq!(code, i32::from(exit::DOCTOR_FAIL), "{report:#}");
    expect(
        &report,
        "configuration",
        "fail",
        "no_such_key",
        "vfiod --check-config",
    );
    // Nothing selected: a warning.
    std::fs::write(&host.config, "libvirt_uri = \"\"\n").unwrap();
    let (_, report) = host.doctor(NO_BUS);
    expect(
        &report,
        "configuration",
        "warn",
        "no [[select]] rule",
        "add a [[select]] rule",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_services_warn_with_what_to_run() {
    // A host ready for passthrough; vfiod, libvirtd, the hook and polkitd are not there.
    let host = Host::new(
        &HostModel::reference(),
        &format!("libvirt_uri = \"qemu:///system\"\n{STEADY_CONFIG}"),
    );
    let bus = PrivateBus::start(&host.dir.path().join("bus"), "").expect("private dbus-daemon");
    let (code, report) = host.doctor(bus.address());
    assert_eq!(code, i32::from(exit::DOCTOR_WARN), "{report:#}");
    assert_eq!(report["verdict"], "warn");
    expect(
        &report,
        "vfiod",
        "warn",
        "not running: no org.vfiod.Vfiod1",
        "systemctl status vfiod",
    );
    expect(
        &report,
        "libvirtd",
        "warn",
        "not running",
        "systemctl start libvirtd",
    );
    expect(
        &report,
        "libvirt hook",
        "warn",
        "no /etc/libvirt/hooks/qemu.d/vfiod",
        "ln -s /usr/libexec/vfiod-qemu-hook /etc/libvirt/hooks/qemu.d/vfiod",
    );
    expect(
        &report,
        "polkitd",
        "warn",
        "org.freedesktop.PolicyKit1 is not on the bus",
        "apt install polkitd",
    );
    // No bus at all: vfiod's check says so.
    let (code, report) = host.doctor(NO_BUS);
    assert_eq!(code, i32::from(exit::DOCTOR_WARN), "{report:#}");
    expect(
        &report,
        "vfiod",
        "warn",
        "cannot reach the bus",
        "systemctl status dbus vfiod",
    );

    // libvirtd started before the hook was installed: it has not read it.
    let now = SystemTime::now();
    host.libvirtd(now - Duration::from_secs(3600));
    host.install("etc/libvirt/hooks/qemu.d/vfiod", Some(now));
    let (_, report) = host.doctor(NO_BUS);
    expect(&report, "libvirtd", "ok", "runs: pid 4242", "");
    expect(
        &report,
        "libvirt hook",
        "warn",
        "newer than the running libvirtd",
        "systemctl restart libvirtd",
    );
    // A hook libvirt cannot run.
    let hook = host.root().join("etc/libvirt/hooks/qemu.d/vfiod");
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (_, report) = host.doctor(NO_BUS);
    expect(
        &report,
        "libvirt hook",
        "warn",
        "is not executable",
        "chmod 0755",
    );
}
