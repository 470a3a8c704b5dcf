//! Inventory on the simulated reference host: the classification of every modelled device,
//! host-use protection, broken devices, change events, and a cross-check against lspci.

use crate::common;

use std::collections::BTreeMap;
use std::process::Command;
use vfiod::config::Settings;
use vfiod::inventory;
use vfiod::model::device::{Device, Kind, Mode, Role, State};
use vfiod::sim::kernel::{FunctionSpec, HostModel, SimKernel};

fn scan(kernel: &std::sync::Arc<SimKernel>, settings: &Settings) -> BTreeMap<String, Device> {
    inventory::scan(&kernel.sysfs(), settings, &BTreeMap::new())
        .unwrap()
        .into_iter()
        .map(|d| (d.address.to_string(), d))
        .collect()
}

fn demo_settings() -> Settings {
    Settings::from_toml_str(common::DEMO_CONFIG, std::path::Path::new("simulate.toml")).unwrap()
}

/// address, kind, role, separable, mode, total VFs, VFs, IOMMU group, state, managed, driver
type Expected = (
    &'static str,
    Kind,
    Role,
    bool,
    Mode,
    u32,
    u32,
    u32,
    State,
    bool,
    Option<&'static str>,
);

#[test]
fn every_modelled_device_is_classified() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(dir.path(), &HostModel::reference()).unwrap();
    let got = scan(&kernel, &demo_settings());

    use Kind::*;
    #[rustfmt::skip]
    let table: &[Expected] = &[
        ("0000:00:00.0", Other, Role::Function, false, Mode::Pf, 0, 0, 0, State::Usable, false, None),
        ("0000:00:01.0", Other, Role::Function, false, Mode::Pf, 0, 0, 1, State::Usable, false, Some("pcieport")),
        ("0000:02:00.0", Nic, Role::Function, false, Mode::Pf, 0, 0, 8, State::Protected, false, Some("igc")),
        ("0000:17:00.0", Gpu, Role::Function, false, Mode::Pf, 0, 0, 9, State::Usable, true, Some("nouveau")),
        ("0000:17:00.1", Other, Role::Function, false, Mode::Pf, 0, 0, 9, State::Usable, true, Some("snd_hda_intel")),
        ("0000:3b:00.0", Nic, Role::Pf, true, Mode::Pf, 64, 0, 10, State::Usable, true, Some("i40e")),
        ("0000:3d:00.0", Nvme, Role::Function, false, Mode::Pf, 0, 0, 11, State::Protected, false, Some("nvme")),
        ("0000:5e:00.0", Crypto, Role::Pf, true, Mode::Vf, 16, 16, 12, State::Usable, true, Some("c6xx")),
        ("0000:af:00.0", Fpga, Role::Pf, true, Mode::Pf, 4, 0, 13, State::Usable, true, Some("dfl-pci")),
        ("0000:d8:00.0", Nvme, Role::Function, false, Mode::Pf, 0, 0, 14, State::Usable, true, Some("nvme")),
    ];
    for (a, kind, role, sep, mode, total, num, group, state, managed, driver) in table {
        let d = got.get(*a).unwrap_or_else(|| panic!("{a} missing"));
        assert_eq!(
            (
                d.kind,
                d.role,
                d.separable,
                d.mode,
                d.total_vfs,
                d.num_vfs,
                d.iommu_group,
                d.state,
                d.managed,
                d.driver.as_deref()
            ),
            (
                *kind,
                *role,
                *sep,
                *mode,
                *total,
                *num,
                Some(*group),
                *state,
                *managed,
                *driver
            ),
            "{a}"
        );
    }
    // The QAT's 16 VFs: role vf, parent the PF, own groups, host VF driver, not separable.
    let vfs: Vec<&Device> = got
        .values()
        .filter(|d| d.parent_pf.map(|p| p.to_string()) == Some("0000:5e:00.0".into()))
        .collect();
    assert_eq!(vfs.len(), 16);
    let mut groups = std::collections::BTreeSet::new();
    for v in vfs {
        assert_eq!(
            (v.role, v.mode, v.separable, v.kind),
            (Role::Vf, Mode::None, false, Kind::Crypto)
        );
        assert_eq!((v.vendor_id, v.device_id), (0x8086, 0x37c9));
        assert_eq!(v.driver.as_deref(), Some("c6xxvf"));
        assert!(v.managed, "{}: a VF of a selected PF", v.address);
        assert!(
            groups.insert(v.iommu_group.unwrap()),
            "VF groups must be distinct"
        );
    }
    // Names come from pci.ids.
    assert_eq!(got["0000:17:00.0"].vendor_name, "NVIDIA Corporation");
    assert!(got["0000:17:00.0"].device_name.contains("RTX 3090"));
    assert_eq!(got["0000:af:00.0"].numa_node, Some(1));
    assert_eq!(got.len(), 32);
}

/// "Managed" means the same for every VF of a selected PF, whatever the VF's own ids: the
/// NIC's VFs (8086:154c, which no rule names) are managed as the FPGA's are (whose class the
/// FPGA's rule happens to match); a protected VF is not, nor a VF of a PF no rule selects.
#[test]
fn every_vf_of_a_selected_pf_is_managed() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(dir.path(), &HostModel::reference()).unwrap();
    let sysfs = kernel.sysfs();
    let nic = common::addr("0000:3b:00.0");
    let fpga = common::addr("0000:af:00.0");
    sysfs.write_device_attr(nic, "sriov_numvfs", "4").unwrap();
    sysfs.write_device_attr(fpga, "sriov_numvfs", "2").unwrap();
    let protected_vf = "0000:3b:02.1";
    let config = format!(
        "{}\n[[protect]]\naddress = \"{protected_vf}\"\n",
        common::DEMO_CONFIG
    );
    let got = scan(
        &kernel,
        &Settings::from_toml_str(&config, std::path::Path::new("t.toml")).unwrap(),
    );
    let vfs_of = |got: &BTreeMap<String, Device>, pf| -> Vec<Device> {
        got.values()
            .filter(|d| d.parent_pf == Some(pf))
            .cloned()
            .collect()
    };

    let nic_vfs = vfs_of(&got, nic);
    assert_eq!(nic_vfs.len(), 4);
    for v in &nic_vfs {
        assert_eq!(
            (v.role, v.vendor_id, v.device_id),
            (Role::Vf, 0x8086, 0x154c)
        );
        let a = v.address.to_string();
        if a == protected_vf {
            assert_eq!(v.state, State::Protected, "{a}");
            assert!(
                !v.managed,
                "{a}: a protected VF of a selected PF is not managed"
            );
        } else {
            assert_eq!(v.state, State::Usable, "{a}");
            assert!(v.managed, "{a}: a VF of the selected NIC is managed");
        }
    }
    let fpga_vfs = vfs_of(&got, fpga);
    assert_eq!(fpga_vfs.len(), 2);
    assert!(fpga_vfs.iter().all(|v| v.managed), "{fpga_vfs:?}");
    assert!(got["0000:3b:00.0"].managed && got["0000:af:00.0"].managed);

    // A PF that cannot be read is still known by what the last pass read: its VFs stay
    // managed. Never read at all, it selects nothing.
    let settings = demo_settings();
    let first: BTreeMap<_, _> = inventory::scan(&sysfs, &settings, &BTreeMap::new())
        .unwrap()
        .into_iter()
        .map(|d| (d.address, d))
        .collect();
    kernel.make_unreadable(nic, "numa_node", libc::EIO);
    let second = inventory::scan(&sysfs, &settings, &first).unwrap();
    assert!(second
        .iter()
        .any(|d| d.address == nic && d.state == State::Broken));
    let vfs: Vec<&Device> = second.iter().filter(|d| d.parent_pf == Some(nic)).collect();
    assert_eq!(vfs.len(), 4);
    assert!(vfs.iter().all(|v| v.managed), "{vfs:?}");
    let unknown = inventory::scan(&sysfs, &settings, &BTreeMap::new()).unwrap();
    let vfs: Vec<&Device> = unknown
        .iter()
        .filter(|d| d.parent_pf == Some(nic))
        .collect();
    assert_eq!(vfs.len(), 4);
    assert!(vfs.iter().all(|v| !v.managed), "{vfs:?}");
    kernel.make_readable(nic, "numa_node");

    // The NIC selected by its address instead of its ids: the same for its VFs.
    let by_address = "[[select]]\naddress = \"0000:3b:00.0\"\n";
    let got = scan(
        &kernel,
        &Settings::from_toml_str(by_address, std::path::Path::new("t.toml")).unwrap(),
    );
    assert!(vfs_of(&got, nic).iter().all(|v| v.managed));
    // ... and the PFs no rule selects: neither they nor their VFs are managed.
    for pf in [fpga, common::addr("0000:5e:00.0")] {
        let vfs = vfs_of(&got, pf);
        assert!(!vfs.is_empty());
        assert!(!got[&pf.to_string()].managed, "{pf}");
        assert!(vfs.iter().all(|v| !v.managed), "{pf}: {vfs:?}");
    }
}

#[test]
fn host_devices_are_protected_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(dir.path(), &HostModel::reference()).unwrap();
    let got = scan(&kernel, &demo_settings());
    let boot = &got["0000:3d:00.0"];
    assert_eq!(boot.state, State::Protected);
    assert!(
        boot.state_reason.contains("mounted at /"),
        "{}",
        boot.state_reason
    );
    assert!(boot.state_reason.contains("swap"), "{}", boot.state_reason);
    assert!(
        !boot.managed,
        "a selected but host-used device must not be managed"
    );
    let nic = &got["0000:02:00.0"];
    assert_eq!(nic.state, State::Protected);
    assert!(
        nic.state_reason.contains("enp2s0 is up"),
        "{}",
        nic.state_reason
    );

    // The config's protect list, and IOMMU group-mates of a protected device.
    let s = Settings::from_toml_str(
        "[[select]]\nclass = \"0x03\"\n[[select]]\nid = \"10de:1aef\"\n[[protect]]\nid = \"10de:1aef\"\n",
        std::path::Path::new("t.toml"),
    )
    .unwrap();
    let got = scan(&kernel, &s);
    assert_eq!(got["0000:17:00.1"].state, State::Protected);
    assert!(got["0000:17:00.1"]
        .state_reason
        .contains("protected by config"));
    let gpu = &got["0000:17:00.0"];
    assert_eq!(
        gpu.state,
        State::Protected,
        "the GPU shares its group with a protected function"
    );
    assert!(
        gpu.state_reason.contains("IOMMU group"),
        "{}",
        gpu.state_reason
    );
    assert!(!gpu.managed);
}

#[test]
fn a_host_nic_sharing_a_group_protects_its_group_mate() {
    let mut model = HostModel::reference();
    // A second function on the host NIC's card, in the same IOMMU group.
    model.functions.push(
        FunctionSpec::new("0000:02:00.1", 0x8086, 0x15f3, 0x020000)
            .driver("igc")
            .under("0000:00:1c.0")
            .group_with("0000:02:00.0"),
    );
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(dir.path(), &model).unwrap();
    let got = scan(&kernel, &Settings::default());
    assert_eq!(got["0000:02:00.1"].state, State::Protected);
    assert!(got["0000:02:00.1"].state_reason.contains("0000:02:00.0"));
    // The root port above them is a bridge: not dragged along.
    assert_eq!(got["0000:00:1c.0"].state, State::Usable);
}

#[test]
fn broken_and_vanished_devices_and_their_events() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(dir.path(), &HostModel::reference()).unwrap();
    let settings = demo_settings();
    let sysfs = kernel.sysfs();
    let first = inventory::scan(&sysfs, &settings, &BTreeMap::new()).unwrap();
    let (changes, events) = inventory::diff(&BTreeMap::new(), &first);
    assert_eq!(changes.len(), first.len());
    assert_eq!(
        events.iter().filter(|e| e.kind == "added").count(),
        first.len()
    );
    let prev: BTreeMap<_, _> = first.into_iter().map(|d| (d.address, d)).collect();

    let fpga = common::addr("0000:af:00.0");
    let nvme = common::addr("0000:d8:00.0");
    kernel.make_unreadable(fpga, "numa_node", libc::EIO);
    kernel.vanish(nvme).unwrap();
    let second = inventory::scan(&sysfs, &settings, &prev).unwrap();
    let (changes, events) = inventory::diff(&prev, &second);
    let broken = second.iter().find(|d| d.address == fpga).unwrap();
    assert_eq!(broken.state, State::Broken);
    assert!(
        broken.state_reason.contains("numa_node"),
        "{}",
        broken.state_reason
    );
    assert_eq!(
        broken.device_id, 0x0b2b,
        "identity kept from the previous pass"
    );
    assert!(second.iter().all(|d| d.address != nvme));
    let kinds: Vec<(String, String)> = events
        .iter()
        .map(|e| (e.address.unwrap().to_string(), e.kind.to_string()))
        .collect();
    assert!(
        kinds.contains(&("0000:af:00.0".into(), "broken".into())),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("0000:d8:00.0".into(), "removed".into())),
        "{kinds:?}"
    );
    let gone = events.iter().find(|e| e.kind == "removed").unwrap();
    assert_eq!(gone.message, "nvme 0000:d8:00.0 disappeared");
    assert_eq!(changes.len(), 2);

    // VFs that go because their PF's count went down are "removed", said as such.
    let nic = "0000:3b:00.0";
    let numvfs = sysfs.device_attr(common::addr(nic), "sriov_numvfs");
    sysfs.write(&numvfs, "2").unwrap();
    let prev: BTreeMap<_, _> = second.into_iter().map(|d| (d.address, d)).collect();
    let third = inventory::scan(&sysfs, &settings, &prev).unwrap();
    let prev: BTreeMap<_, _> = third.into_iter().map(|d| (d.address, d)).collect();
    sysfs.write(&numvfs, "0").unwrap();
    let fourth = inventory::scan(&sysfs, &settings, &prev).unwrap();
    let (_, events) = inventory::diff(&prev, &fourth);
    let removed: Vec<&str> = events
        .iter()
        .filter(|e| e.kind == "removed")
        .map(|e| e.message.as_str())
        .collect();
    assert_eq!(
        removed,
        [
            "nic VF 0000:3b:02.0 of 0000:3b:00.0 removed",
            "nic VF 0000:3b:02.1 of 0000:3b:00.0 removed"
        ]
    );

    // A broken device seen for the first time still gets a record, not a silent skip.
    let fresh = inventory::scan(&sysfs, &settings, &BTreeMap::new()).unwrap();
    let f = fresh.iter().find(|d| d.address == fpga).unwrap();
    assert_eq!((f.state, f.vendor_id), (State::Broken, 0));
}

/// One line of `lspci -mm -n -D`: address, class, vendor, device, revision, prog-if,
/// subsystem vendor, subsystem device.
fn parse_lspci_mm(line: &str) -> (String, u32, u16, u16, u8, u16, u16) {
    let mut quoted = Vec::new();
    let mut rest = line;
    let (addr, tail) = rest.split_once(' ').unwrap();
    rest = tail;
    let mut rev = 0u8;
    let mut progif = 0u8;
    while !rest.is_empty() {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix('"') {
            let (q, t) = r.split_once('"').unwrap();
            quoted.push(q.to_string());
            rest = t;
        } else {
            let (tok, t) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(r) = tok.strip_prefix("-r") {
                rev = u8::from_str_radix(r, 16).unwrap();
            } else if let Some(p) = tok.strip_prefix("-p") {
                progif = u8::from_str_radix(p, 16).unwrap();
            }
            rest = t;
        }
    }
    let hex = |s: &str| u16::from_str_radix(s, 16).unwrap();
    let class = (u32::from(hex(&quoted[0])) << 8) | u32::from(progif);
    let (sv, sd) = if quoted.len() >= 5 && !quoted[3].is_empty() {
        (hex(&quoted[3]), hex(&quoted[4]))
    } else {
        (0, 0)
    };
    (
        addr.to_string(),
        class,
        hex(&quoted[1]),
        hex(&quoted[2]),
        rev,
        sv,
        sd,
    )
}

#[test]
fn agrees_with_lspci_on_the_same_tree() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(dir.path(), &HostModel::reference()).unwrap();
    // Split the NIC as well, so VFs of two PFs are compared.
    let sysfs = kernel.sysfs();
    let nic = common::addr("0000:3b:00.0");
    sysfs.write_device_attr(nic, "sriov_numvfs", "8").unwrap();
    let got = scan(&kernel, &Settings::default());

    let out = Command::new("lspci")
        .args(["-A", "linux-sysfs", "-O"])
        .arg(format!(
            "sysfs.path={}",
            kernel.root().join("sys/bus/pci").display()
        ))
        .args(["-mm", "-n", "-D"])
        .output()
        // The cross-check is the point of this test: a missing lspci fails it, never skips it.
        .unwrap_or_else(|e| match e.kind() {
            std::io::ErrorKind::NotFound => panic!(
                "lspci is not installed: install pciutils (`apt-get install pciutils`; the \
                 README's test command installs it), this test cross-checks the inventory \
                 against it"
            ),
            _ => panic!("cannot run lspci: {e}"),
        });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<_> = text.lines().map(parse_lspci_mm).collect();
    assert_eq!(
        rows.len(),
        got.len(),
        "lspci and vfiod see different numbers of functions"
    );
    for (a, class, v, d, rev, sv, sd) in rows {
        let dev = got
            .get(&a)
            .unwrap_or_else(|| panic!("lspci lists {a}, vfiod does not"));
        assert_eq!((dev.vendor_id, dev.device_id), (v, d), "{a} ids");
        assert_eq!(dev.class.0, class, "{a} class");
        assert_eq!(dev.revision, rev, "{a} revision");
        if !dev.class.is_bridge() {
            assert_eq!(
                (dev.subsystem_vendor_id, dev.subsystem_device_id),
                (sv, sd),
                "{a} subsystem"
            );
        }
    }
    assert_eq!(got.values().filter(|d| d.parent_pf == Some(nic)).count(), 8);
}
