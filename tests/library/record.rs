//! `vfioctl record`'s recorder and `vfiod --simulate --replay`'s replay, on the simulated
//! reference host: a recording holds what vfiod reads and nothing it must not (no BARs, no ROM,
//! no config space past 256 bytes, of another process only its name and the device nodes it
//! holds); who holds the host's devices (holders, exclusive opens, processes) replays the same; read back, read-only or
//! booted in the simulated kernel, it gives the inventory the host gives; a missing or failed
//! read makes the function broken with the host's reason; a tree another tool made replays; a
//! recording is written atomically and never over a file unless asked.

use crate::common::{addr, fast_tempdir, STEADY_CONFIG};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vfiod::config::Settings;
use vfiod::host::record::{self, Member, Options};
use vfiod::host::sysfs::{Backend, Sysfs};
use vfiod::model::device::{Device, State};
use vfiod::sim::kernel::{HostModel, SimKernel};
use vfiod::sim::replay::Replay;

const NIC: &str = "0000:3b:00.0";
const GPU: &str = "0000:17:00.0";

fn options() -> Options {
    Options {
        tool: "test".into(),
        with_hostname: false,
    }
}

fn settings() -> Settings {
    Settings::from_toml_str(STEADY_CONFIG, Path::new("steady.toml")).expect("config")
}

fn scan(sysfs: &Sysfs) -> Vec<Device> {
    vfiod::inventory::scan(sysfs, &settings(), &BTreeMap::new()).expect("scan")
}

/// The reference host with the NIC split by hand as vfiod leaves it (autoprobe off, 4 VFs, VF 0
/// on vfio-pci through driver_override), so that a recording has every kind of state.
fn split_host() -> (tempfile::TempDir, Arc<SimKernel>) {
    let dir = fast_tempdir();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let w = |rel: &str, v: &str| {
        Backend::write(kernel.as_ref(), &kernel.root().join(rel), v.as_bytes()).unwrap()
    };
    w(
        &format!("sys/bus/pci/devices/{NIC}/sriov_drivers_autoprobe"),
        "0",
    );
    w(&format!("sys/bus/pci/devices/{NIC}/sriov_numvfs"), "4");
    w(
        "sys/bus/pci/devices/0000:3b:02.0/driver_override",
        "vfio-pci",
    );
    w("sys/bus/pci/drivers_probe", "0000:3b:02.0");
    assert_eq!(
        kernel.driver_of(addr("0000:3b:02.0")).as_deref(),
        Some("vfio-pci")
    );
    (dir, kernel)
}

/// The tarball's members: path -> (entry type, content or link target).
fn members(tarball: &[u8]) -> BTreeMap<PathBuf, (tar::EntryType, Vec<u8>)> {
    let mut a = tar::Archive::new(flate2::read::GzDecoder::new(tarball));
    let mut out = BTreeMap::new();
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let path = e.path().unwrap().into_owned();
        let kind = e.header().entry_type();
        let body = if kind == tar::EntryType::Symlink {
            e.link_name()
                .unwrap()
                .unwrap()
                .to_string_lossy()
                .into_owned()
                .into_bytes()
        } else {
            let mut b = Vec::new();
            e.read_to_end(&mut b).unwrap();
            b
        };
        out.insert(path, (kind, body));
    }
    out
}

/// Records `root` into `dir/name.tar.gz`.
fn record_to(root: &Path, dir: &Path, name: &str) -> PathBuf {
    let rec = record::record(root, &options()).expect("record");
    let file = dir.join(format!("{name}.tar.gz"));
    rec.write_file(&file, false).expect("write");
    file
}

/// Devices without what a replay cannot know about its root: the absolute path in a broken
/// function's reason.
fn rooted(devices: Vec<Device>, root: &Path) -> Vec<Device> {
    devices
        .into_iter()
        .map(|mut d| {
            d.state_reason = d
                .state_reason
                .replace(&root.display().to_string(), "<root>");
            d
        })
        .collect()
}

#[test]
fn a_recording_holds_what_vfiod_reads_and_nothing_it_must_not() {
    let (dir, kernel) = split_host();
    let root = kernel.root();
    let gpu_dir = std::fs::canonicalize(root.join(format!("sys/bus/pci/devices/{GPU}"))).unwrap();
    // What a real function has beside what vfiod reads: BARs, a ROM, 4 KiB of config space.
    std::fs::write(gpu_dir.join("resource0"), b"BAR0 secret").unwrap();
    std::fs::write(gpu_dir.join("resource1_wc"), b"BAR1").unwrap();
    std::fs::write(gpu_dir.join("rom"), b"option rom").unwrap();
    let mut config = std::fs::read(gpu_dir.join("config")).unwrap();
    config.resize(4096, 0xab);
    std::fs::write(gpu_dir.join("config"), &config).unwrap();
    // Another process holding a VFIO group: only who it is (its comm) and what it holds (in the
    // manifest) are the recording's business.
    std::fs::create_dir_all(root.join("proc/4242/fd")).unwrap();
    std::os::unix::fs::symlink("/dev/vfio/7", root.join("proc/4242/fd/9")).unwrap();
    std::fs::write(root.join("proc/4242/comm"), "qemu-system-x86\n").unwrap();

    let file = record_to(root, dir.path(), "rec");
    let m = members(&std::fs::read(&file).unwrap());
    let names: Vec<String> = m.keys().map(|p| p.display().to_string()).collect();
    for n in &names {
        let last = n.rsplit('/').next().unwrap();
        assert!(
            !last.starts_with("resource") && last != "rom",
            "{n} must never be read"
        );
        assert!(
            !n.starts_with("proc/4242") || n == "proc/4242" || n == "proc/4242/comm",
            "{n}: another process's files"
        );
    }
    assert_eq!(names[0], record::MANIFEST, "the manifest comes first");
    let rel_config = gpu_dir.strip_prefix(root).unwrap().join("config");
    let (_, recorded) = &m[&rel_config];
    assert_eq!(recorded.len(), 256, "256 bytes of config space, of 4096");
    assert!(recorded.as_slice() == &config[..256], "the first 256 bytes");
    for (path, (kind, body)) in &m {
        if path.file_name().is_some_and(|n| n == "config") {
            assert!(
                body.len() <= 256,
                "{}: {} bytes",
                path.display(),
                body.len()
            );
        }
        if *kind == tar::EntryType::Symlink {
            assert!(
                !body.starts_with(b"/"),
                "{} links to an absolute path",
                path.display()
            );
        }
    }
    // The mount table keeps block devices only: the simulated host's proc, sysfs and tmpfs go.
    let mounts = String::from_utf8(m[Path::new("proc/mounts")].1.clone()).unwrap();
    assert!(mounts.lines().all(|l| l.starts_with("/dev/")), "{mounts}");
    assert!(mounts.contains("/dev/nvme0n1p2 / "), "{mounts}");
    // What vfiod reads is there: a VF's physfn, the PF's virtfn links, the group links, the DFL
    // card's ids, the up NIC's flags, the loaded drivers.
    for want in [
        "sys/bus/pci/devices/0000:3b:02.0",
        "sys/kernel/iommu_groups/0/devices/0000:00:00.0",
        "sys/bus/pci/drivers/vfio-pci",
        "sys/class/net/enp2s0",
        "sys/class/block/nvme0n1p2",
    ] {
        assert!(
            m.contains_key(Path::new(want)),
            "{want} missing: {names:#?}"
        );
    }
    for suffix in [
        "0000:3b:02.0/physfn",
        "0000:3b:00.0/virtfn3",
        "0000:3b:02.0/driver_override",
        "dfl-fme.0/pr/interface_id",
        "dfl-port.0/afu_id",
        "net/enp2s0/flags",
    ] {
        assert!(
            names.iter().any(|n| n.ends_with(suffix)),
            "no member ends with {suffix}"
        );
    }
    let manifest: record::Manifest =
        serde_json::from_slice(&m[Path::new(record::MANIFEST)].1).unwrap();
    assert_eq!(manifest.counts.functions, kernel.addresses().len());
    assert_eq!(
        manifest.host_name, None,
        "the host name is left out by default"
    );
    assert!(manifest.left_out.iter().any(|l| l.contains("resource*")));
    assert!(manifest.unreadable.is_empty(), "{:?}", manifest.unreadable);
}

#[test]
fn a_replay_gives_the_inventory_the_host_gives_read_only_or_writable() {
    let (dir, kernel) = split_host();
    let original = scan(&kernel.sysfs());
    let file = record_to(kernel.root(), dir.path(), "rec");

    let replay = Replay::open(&file, &dir.path().join("unpacked")).expect("open");
    assert!(replay.manifest().is_some());
    let read_only = scan(&replay.sysfs());
    assert_eq!(read_only, original, "read-only replay");
    assert_eq!(
        vfiod::host::sysfs::hostuse::detect(&replay.sysfs(), &[]),
        vfiod::host::sysfs::hostuse::detect(&kernel.sysfs(), &[]),
        "the host's own use of its devices"
    );

    // What a reset reads: each function's methods, and the bus below the GPU's root port.
    let gpu_group = [addr(GPU), addr("0000:17:00.1")];
    let resets = |sysfs: &Sysfs| {
        let methods: Vec<_> = kernel
            .addresses()
            .into_iter()
            .map(|a| vfiod::host::sysfs::reset::read_methods(sysfs, a).unwrap())
            .collect();
        let bus = vfiod::host::sysfs::reset::read_bus(sysfs, &gpu_group).unwrap();
        (methods, bus)
    };
    let host_resets = resets(&kernel.sysfs());
    assert!(
        host_resets.1.as_ref().is_some_and(|b| b.reset_subordinate),
        "{:?}",
        host_resets.1
    );
    assert_eq!(resets(&replay.sysfs()), host_resets, "read-only: resets");
    let (writable, notes) = replay
        .build_writable(&dir.path().join("writable"))
        .expect("writable");
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(scan(&writable.sysfs()), original, "writable replay");
    assert_eq!(resets(&writable.sysfs()), host_resets, "writable: resets");
    assert!(
        writable.take_write_log().is_empty(),
        "reaching the recorded state is not the replay's history"
    );
    // The simulated kernel's behaviour applies: the split NIC goes back to whole, then 8 VFs.
    let w = |rel: &str, v: &str| {
        Backend::write(writable.as_ref(), &writable.root().join(rel), v.as_bytes())
    };
    w("sys/bus/pci/drivers/vfio-pci/unbind", "0000:3b:02.0").unwrap();
    let busy = w(&format!("sys/bus/pci/devices/{NIC}/sriov_numvfs"), "8").unwrap_err();
    assert_eq!(
        busy.raw_os_error(),
        Some(libc::EBUSY),
        "non-zero to non-zero"
    );
    w(&format!("sys/bus/pci/devices/{NIC}/sriov_numvfs"), "0").unwrap();
    w(&format!("sys/bus/pci/devices/{NIC}/sriov_numvfs"), "8").unwrap();
    assert_eq!(writable.num_vfs(addr(NIC)), Some(8));
    // ... while the read-only replay refuses every write as sysfs refuses a read-only file.
    let ro = replay.sysfs();
    let e = ro
        .write(&ro.device_attr(addr(NIC), "sriov_numvfs"), "0")
        .unwrap_err();
    assert_eq!(e.errno(), Some(libc::EACCES), "{e}");
    assert_eq!(scan(&replay.sysfs()), original, "nothing changed");
}

#[test]
fn missing_and_failed_reads_make_the_function_broken_with_the_reason() {
    let (dir, kernel) = split_host();
    // The GPU's config space cannot be read on the host (a directory in its place fails the
    // read with EISDIR): the recording lists it and the replay fails it the same way.
    let gpu_dir =
        std::fs::canonicalize(kernel.root().join(format!("sys/bus/pci/devices/{GPU}"))).unwrap();
    std::fs::remove_file(gpu_dir.join("config")).unwrap();
    std::fs::create_dir(gpu_dir.join("config")).unwrap();
    let host = scan(&kernel.sysfs());
    let on_host = host.iter().find(|d| d.address == addr(GPU)).unwrap();
    assert_eq!(on_host.state, State::Broken);
    let file = record_to(kernel.root(), dir.path(), "rec");
    let replay = Replay::open(&file, &dir.path().join("unpacked")).unwrap();
    let m = replay.manifest().unwrap();
    assert_eq!(m.unreadable.len(), 1, "{:?}", m.unreadable);
    assert_eq!(m.unreadable[0].errno, libc::EISDIR);
    let want = rooted(host, kernel.root());
    assert_eq!(rooted(scan(&replay.sysfs()), replay.root()), want);
    let (writable, _) = replay.build_writable(&dir.path().join("w")).unwrap();
    assert_eq!(rooted(scan(&writable.sysfs()), writable.root()), want);

    // An attribute the recording does not have (another tool skipped it, or the user removed
    // it): the function is broken there, saying which file is missing.
    let unpacked = dir.path().join("unpacked");
    let nic_dir =
        std::fs::canonicalize(unpacked.join(format!("sys/bus/pci/devices/{NIC}"))).unwrap();
    std::fs::remove_file(nic_dir.join("uevent")).unwrap();
    let replay = Replay::open(&unpacked, &dir.path().join("unused")).unwrap();
    let nic = scan(&replay.sysfs())
        .into_iter()
        .find(|d| d.address == addr(NIC))
        .unwrap();
    assert_eq!(nic.state, State::Broken);
    assert!(
        nic.state_reason
            .contains(&format!("sys/bus/pci/devices/{NIC}/uevent"))
            && nic.state_reason.contains("No such file or directory"),
        "{}",
        nic.state_reason
    );
    let (writable, _) = replay.build_writable(&dir.path().join("w2")).unwrap();
    let again = scan(&writable.sysfs())
        .into_iter()
        .find(|d| d.address == addr(NIC))
        .unwrap();
    assert_eq!(
        again
            .state_reason
            .replace(&writable.root().display().to_string(), ""),
        nic.state_reason
            .replace(&replay.root().display().to_string(), ""),
        "writable: the same reason"
    );
}

#[test]
fn a_tree_made_by_another_tool_replays_from_a_directory_or_a_tarball() {
    let (dir, kernel) = split_host();
    let original = scan(&kernel.sysfs());
    // The simulated kernel's whole tree, copied a few levels down, no manifest: what a plain
    // `cp -a /sys` style recorder leaves (resource files and all).
    let nested = dir.path().join("bug-1234/attachments/host-a");
    std::fs::create_dir_all(&nested).unwrap();
    for top in ["sys", "proc", "dev"] {
        let ok = std::process::Command::new("cp")
            .arg("-a")
            .arg(kernel.root().join(top))
            .arg(&nested)
            .status()
            .unwrap()
            .success();
        assert!(ok, "cp -a {top}");
    }
    let replay = Replay::open(&dir.path().join("bug-1234"), &dir.path().join("x")).unwrap();
    assert_eq!(replay.root(), std::fs::canonicalize(&nested).unwrap());
    assert!(replay.manifest().is_none());
    assert_eq!(scan(&replay.sysfs()), original, "directory");
    // The same as a plain (not gzip'd) tarball.
    let tarball = dir.path().join("other.tar");
    let ok = std::process::Command::new("tar")
        .arg("cf")
        .arg(&tarball)
        .arg("-C")
        .arg(dir.path())
        .arg("bug-1234")
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let replay = Replay::open(&tarball, &dir.path().join("from-tar")).unwrap();
    assert_eq!(scan(&replay.sysfs()), original, "tarball");
    // Not a host at all: a clear error naming the file.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = Replay::open(&empty, &dir.path().join("y"));
    let text = vfiod::error_chain(&e.unwrap_err());
    assert!(text.contains("holds no sys/bus/pci/devices"), "{text}");
}

#[test]
fn a_recording_is_written_atomically_and_never_over_a_file_unless_forced() {
    let (dir, kernel) = split_host();
    let rec = record::record(kernel.root(), &options()).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let file = out.join("r.tar.gz");
    std::fs::write(&file, b"someone's file").unwrap();
    let e = rec.write_file(&file, false).unwrap_err();
    assert!(matches!(e, record::RecordError::Exists { .. }), "{e}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"someone's file",
        "left alone"
    );
    let size = rec.write_file(&file, true).unwrap();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), size);
    let left: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 1, "no temporary file left: {left:?}");
    assert!(members(&std::fs::read(&file).unwrap()).contains_key(Path::new(record::MANIFEST)));
    // Not a host: a clear error.
    let e = record::record(&out, &options()).unwrap_err();
    assert!(vfiod::error_chain(&e).contains("is"), "{e}");
    assert!(matches!(e, record::RecordError::NoPciBus { .. }));
    // In memory, the members are what the tarball holds.
    let dirs = rec
        .members()
        .values()
        .filter(|m| **m == Member::Dir)
        .count();
    assert_eq!(dirs, rec.manifest.counts.directories);
}

#[test]
fn a_manifest_of_a_newer_format_is_refused() {
    let (dir, kernel) = split_host();
    let file = record_to(kernel.root(), dir.path(), "rec");
    let unpacked = dir.path().join("u");
    Replay::open(&file, &unpacked).unwrap();
    let path = unpacked.join(record::MANIFEST);
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["format"] = serde_json::json!(record::FORMAT + 1);
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let e = Replay::open(&unpacked, &dir.path().join("v")).unwrap_err();
    assert!(vfiod::error_chain(&e).contains("is format"), "{e}");
}

#[test]
fn the_mount_table_is_the_running_vfiods_own() {
    let (dir, kernel) = split_host();
    let root = kernel.root();
    // A vfiod under systemd: its pid in the state directory's lock file, and its mount
    // namespace has the sandbox's bind mounts of the boot disk.
    std::fs::create_dir_all(root.join("var/lib/vfiod")).unwrap();
    std::fs::write(root.join("var/lib/vfiod/vfiod.lock"), "4242\n").unwrap();
    std::fs::create_dir_all(root.join("proc/4242")).unwrap();
    let own = std::fs::read_to_string(root.join("proc/mounts")).unwrap();
    let sandboxed = format!("{own}/dev/nvme0n1p2 /var/lib/vfiod ext4 rw,relatime 0 0\n");
    std::fs::write(root.join("proc/4242/mounts"), &sandboxed).unwrap();
    let mounted_at = |rec: &record::Recording| {
        let Member::File(m) = &rec.members()[Path::new("proc/mounts")] else {
            panic!("proc/mounts is not a file")
        };
        String::from_utf8(m.clone()).unwrap()
    };

    // The pid is not vfiod's (a stale lock file, the pid reused): the recorder's own table.
    std::fs::write(root.join("proc/4242/comm"), "bash\n").unwrap();
    let rec = record::record(root, &options()).unwrap();
    assert!(!mounted_at(&rec).contains("/var/lib/vfiod"));
    assert!(
        rec.manifest.mount_table.contains("own"),
        "{}",
        rec.manifest.mount_table
    );

    std::fs::write(root.join("proc/4242/comm"), "vfiod\n").unwrap();
    let rec = record::record(root, &options()).unwrap();
    assert!(
        mounted_at(&rec).contains("/dev/nvme0n1p2 /var/lib/vfiod "),
        "{}",
        mounted_at(&rec)
    );
    assert!(
        rec.manifest.mount_table.contains("pid 4242"),
        "{}",
        rec.manifest.mount_table
    );
    assert!(
        !rec.members().keys().any(|p| p.starts_with("proc/4242")),
        "nothing else of the process"
    );
    let file = dir.path().join("ns.tar.gz");
    rec.write_file(&file, false).unwrap();
    let replay = Replay::open(&file, &dir.path().join("u")).unwrap();
    let uses = vfiod::host::sysfs::hostuse::detect(&replay.sysfs(), &[]);
    let boot = uses[&addr("0000:3d:00.0")].join("; ");
    assert!(boot.contains("mounted at /var/lib/vfiod"), "{boot}");
}

/// The console GPU (its `boot_vga`, the framebuffer console on it, fbcon bound) is recorded and
/// replayed, read-only and writable, as the same host use; a host without an IOMMU replays
/// without one.
#[test]
fn a_replay_shows_the_console_gpu_and_a_missing_iommu_as_the_host_does() {
    use vfiod::host::sysfs::{console, hostuse, iommu};
    use vfiod::model::iommu::Iommu;
    let dir = fast_tempdir();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::console_gpu()).unwrap();
    let uses = hostuse::detect(&kernel.sysfs(), &[]);
    assert_eq!(
        uses[&addr(GPU)],
        ["boot VGA device driving the host console (fb0)"]
    );
    assert!(!hostuse::detect(&kernel.sysfs(), &[addr(GPU)]).contains_key(&addr(GPU)));
    let facts = console::read_facts(&kernel.sysfs());
    assert_eq!(facts.boot_vga, [addr(GPU)]);
    assert_eq!(facts.framebuffers[0].driver, "nouveaudrmfb");

    let file = record_to(kernel.root(), dir.path(), "console");
    let replay = Replay::open(&file, &dir.path().join("unpacked")).expect("open");
    assert_eq!(console::read_facts(&replay.sysfs()), facts, "read-only");
    assert_eq!(hostuse::detect(&replay.sysfs(), &[]), uses, "read-only");
    let (writable, _) = replay
        .build_writable(&dir.path().join("writable"))
        .expect("writable");
    assert_eq!(console::read_facts(&writable.sysfs()), facts, "writable");
    assert_eq!(hostuse::detect(&writable.sysfs(), &[]), uses, "writable");
    assert_eq!(iommu::read(&writable.sysfs()), Iommu::Present);

    let none = SimKernel::build(&dir.path().join("none"), &HostModel::no_iommu()).unwrap();
    assert_eq!(iommu::read(&none.sysfs()), Iommu::Absent);
    assert_eq!(iommu::read(&kernel.sysfs()), Iommu::Present);
    let file = record_to(none.root(), dir.path(), "none");
    let replay = Replay::open(&file, &dir.path().join("none-unpacked")).expect("open");
    assert_eq!(iommu::read(&replay.sysfs()), Iommu::Absent, "read-only");
    let (writable, _) = replay
        .build_writable(&dir.path().join("none-writable"))
        .expect("writable");
    assert_eq!(iommu::read(&writable.sysfs()), Iommu::Absent, "writable");
}

/// Issue 32: who holds the host's devices replays as recorded: the data NVMe drive held by an
/// LVM volume, a multipath head held exclusively, a process with a disk open and a QEMU holding
/// a VF through its VFIO device node give the same uses read-only and booted writable.
#[test]
fn the_hosts_holders_replay_as_recorded() {
    use vfiod::host::sysfs::hostuse::{self, Scope};
    use vfiod::sim::kernel::ProcessSpec;
    let (dir, kernel) = split_host();
    let data = addr("0000:d8:00.0");
    kernel.add_disk(data, 1, false).unwrap();
    kernel.add_disk(data, 2, true).unwrap();
    kernel
        .add_holder("nvme1n1", "dm-0", Some("vg0-data"))
        .unwrap();
    kernel.hold_exclusively("nvme2n1", true).unwrap();
    let node = kernel.vfio_device_node(addr("0000:3b:02.0")).unwrap();
    let spawn = |pid: u32, comm: &str, args: &[&str], nodes: &[&str]| {
        kernel
            .spawn(ProcessSpec {
                pid,
                comm: comm.into(),
                cmdline: args.iter().map(|a| a.to_string()).collect(),
                nodes: nodes.iter().map(|n| n.to_string()).collect(),
            })
            .unwrap()
    };
    spawn(
        812,
        "fio",
        &["fio", "--secret=1"],
        &["/dev/nvme1n1", "socket:[1]"],
    );
    spawn(
        900,
        "qemu-system-x86",
        &[
            "qemu-system-x86_64",
            "-name",
            "guest=vm1",
            "-object",
            "secret,id=s0,data=x",
        ],
        &[&node],
    );
    let uses = |sysfs: &Sysfs| vfiod::hostuse::uses(&hostuse::read(sysfs, Scope::All, &[]));
    let original = uses(&kernel.sysfs());
    assert_eq!(original[&data].len(), 3, "{original:?}");
    assert_eq!(original[&addr("0000:3b:02.0")].len(), 1, "{original:?}");

    let rec = record::record_with(
        kernel.root(),
        Arc::clone(&kernel) as Arc<dyn Backend>,
        &options(),
    )
    .expect("record");
    // The boot drive's mounted partitions (and its disk) are busy too.
    assert_eq!(
        rec.manifest.uses.busy,
        vec![
            "nvme0n1",
            "nvme0n1p1",
            "nvme0n1p2",
            "nvme0n1p3",
            "nvme1n1",
            "nvme2n1"
        ]
    );
    assert_eq!(rec.manifest.uses.open.len(), 2, "{:?}", rec.manifest.uses);
    let cmdline = match &rec.members()[Path::new("proc/900/cmdline")] {
        Member::File(b) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("{other:?}"),
    };
    assert!(
        !cmdline.contains("secret"),
        "only the guest name: {cmdline:?}"
    );
    assert!(!rec.members().contains_key(Path::new("proc/812/cmdline")));
    let file = dir.path().join("held.tar.gz");
    rec.write_file(&file, false).expect("write");

    let replay = Replay::open(&file, &dir.path().join("unpacked")).expect("open");
    assert_eq!(uses(&replay.sysfs()), original, "read-only replay");
    let (writable, _) = replay
        .build_writable(&dir.path().join("writable"))
        .expect("writable");
    assert_eq!(uses(&writable.sysfs()), original, "writable replay");
}
