//! The checks as tables: each row is what an edge read, the verdict, and words the evidence or
//! the fix must hold.

use super::*;
use std::time::{Duration, UNIX_EPOCH};

fn a(text: &str) -> PciAddress {
    text.parse().unwrap()
}

/// The check's verdict, and that its evidence and fix hold the words given ("" for no fix).
fn expect(c: &Check, verdict: Verdict, evidence: &str, fix: &str) {
    assert_eq!(c.verdict, verdict, "{c:?}");
    assert!(c.evidence.contains(evidence), "{evidence:?} not in {c:?}");
    if fix.is_empty() {
        assert!(c.fix.is_empty(), "an unexpected fix: {c:?}");
    } else {
        assert!(c.fix.contains(fix), "{fix:?} not in {c:?}");
    }
    assert_eq!(c.verdict == Verdict::Ok, c.fix.is_empty(), "{c:?}");
}

#[test]
fn iommu_groups_decide_as_the_daemon_does() {
    let table = [
        (0, 0, Verdict::Fail, "no IOMMU group", "intel_iommu=on"),
        (
            24,
            0,
            Verdict::Ok,
            "24 groups in /sys/kernel/iommu_groups",
            "",
        ),
        (0, 3, Verdict::Ok, "3 functions link an iommu_group", ""),
    ];
    for (groups, functions_in_a_group, verdict, evidence, fix) in table {
        let facts = IommuFacts {
            groups,
            functions_in_a_group,
        };
        expect(&iommu_groups(facts), verdict, evidence, fix);
    }
}

#[test]
fn iommu_units_name_the_hardware() {
    let units = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let many = units(&["dmar0", "dmar1", "dmar2", "dmar3", "dmar4", "dmar5"]);
    type Row = (
        Option<Vec<String>>,
        Iommu,
        Verdict,
        &'static str,
        &'static str,
    );
    let table: [Row; 6] = [
        (
            Some(units(&["dmar0"])),
            Iommu::Present,
            Verdict::Ok,
            "dmar0 in /sys/class/iommu (Intel VT-d)",
            "",
        ),
        (
            Some(units(&["ivhd0", "ivhd1"])),
            Iommu::Present,
            Verdict::Ok,
            "ivhd0, ivhd1 in /sys/class/iommu (AMD-Vi)",
            "",
        ),
        (
            Some(many),
            Iommu::Present,
            Verdict::Ok,
            "dmar0, dmar1, dmar2, dmar3 and 2 more",
            "",
        ),
        (
            Some(Vec::new()),
            Iommu::Absent,
            Verdict::Fail,
            "no DMAR or AMD-Vi unit",
            "intel_iommu=on",
        ),
        (
            None,
            Iommu::Absent,
            Verdict::Fail,
            "no DMAR or AMD-Vi unit",
            "amd_iommu=on",
        ),
        (
            None,
            Iommu::Present,
            Verdict::Warn,
            "lists no unit",
            "dmesg | grep",
        ),
    ];
    for (found, iommu, verdict, evidence, fix) in table {
        expect(
            &iommu_units(found.as_deref(), iommu),
            verdict,
            evidence,
            fix,
        );
    }
}

#[test]
fn interrupt_remapping_is_read_from_the_chips_and_unknown_warns() {
    let table = [
        (
            Some((12, 0)),
            false,
            Verdict::Ok,
            "on: 12 interrupts on IR- chips",
            "",
        ),
        // Remapped: allowing unsafe interrupts changes nothing.
        (Some((1, 5)), true, Verdict::Ok, "on: 1 interrupts", ""),
        (
            Some((0, 7)),
            false,
            Verdict::Fail,
            "off: 7 interrupts on plain",
            "intremap",
        ),
        (
            Some((0, 7)),
            true,
            Verdict::Warn,
            "allow_unsafe_interrupts=Y",
            "intremap=on",
        ),
        (
            Some((0, 0)),
            false,
            Verdict::Warn,
            "unknown",
            "dmesg | grep -i remapping",
        ),
        (
            None,
            false,
            Verdict::Warn,
            "unknown: cannot read /proc/interrupts",
            "dmesg | grep -i remapping",
        ),
    ];
    for (lines, allow_unsafe, verdict, evidence, fix) in table {
        let facts = InterruptFacts {
            lines,
            allow_unsafe,
        };
        expect(&interrupt_remapping(&facts), verdict, evidence, fix);
    }
}

#[test]
fn proc_interrupts_chips_are_counted() {
    let text = "           CPU0       CPU1\n\
                  0:         36          0   IR-IO-APIC    2-edge      timer\n\
                 24:          0         12   IR-PCI-MSIX-0000:3d:00.0    0-edge  nvme0q0\n\
                 25:          0          0   PCI-MSI-0000:00:1f.6    0-edge  eno1\n\
                  9:          0          0   IO-APIC    9-fasteoi   acpi\n\
                NMI:          0          0   Non-maskable interrupts\n\
                LOC:     123456     123456   Local timer interrupts\n";
    assert_eq!(read::count_chips(text), (2, 2));
    assert_eq!(read::count_chips(""), (0, 0));
}

#[test]
fn modules_loaded_or_built_in_pass_and_the_best_alternative_counts() {
    use ModuleState::*;
    type Row = (
        &'static [(&'static str, ModuleState)],
        Verdict,
        &'static str,
        &'static str,
    );
    let table: [Row; 7] = [
        (&[("vfio_pci", Loaded)], Verdict::Ok, "vfio_pci loaded", ""),
        (
            &[("vfio", BuiltIn)],
            Verdict::Ok,
            "vfio built into the kernel",
            "",
        ),
        (
            &[("vfio_pci", Installed)],
            Verdict::Warn,
            "installed but not loaded",
            "modprobe vfio_pci",
        ),
        (
            &[("vfio_pci", Unknown)],
            Verdict::Fail,
            "no module index",
            "modprobe vfio_pci",
        ),
        (
            &[("vfio_pci", Missing)],
            Verdict::Fail,
            "not built in, not installed",
            "CONFIG_VFIO_PCI",
        ),
        (
            &[("vfio_iommu_type1", Missing), ("iommufd", Loaded)],
            Verdict::Ok,
            "iommufd loaded",
            "",
        ),
        (
            &[("vfio_iommu_type1", Unknown), ("iommufd", Unknown)],
            Verdict::Fail,
            "vfio_iommu_type1 or iommufd not loaded",
            "modprobe vfio_iommu_type1",
        ),
    ];
    for (alternatives, verdict, evidence, fix) in table {
        expect(&module("m", alternatives), verdict, evidence, fix);
    }
}

#[test]
fn the_configuration_must_load_and_select_something() {
    let loaded = |rules, selected| ConfigFacts::Loaded {
        sources: vec!["/etc/vfiod/vfiod.toml".into()],
        rules,
        selected,
    };
    let table = [
        (
            loaded(2, 3),
            Verdict::Ok,
            "2 [[select]] rules in /etc/vfiod/vfiod.toml select 3",
            "",
        ),
        (
            loaded(0, 0),
            Verdict::Warn,
            "no [[select]] rule",
            "add a [[select]] rule",
        ),
        (
            loaded(1, 0),
            Verdict::Warn,
            "match no PCI function",
            "vfiod --check-config",
        ),
        (
            ConfigFacts::Loaded {
                sources: Vec::new(),
                rules: 0,
                selected: 0,
            },
            Verdict::Warn,
            "the defaults (no file)",
            "[[select]]",
        ),
        (
            ConfigFacts::Invalid {
                error: "vfiod.toml:3:1: unknown key".into(),
            },
            Verdict::Fail,
            "does not load: vfiod.toml:3:1: unknown key",
            "vfiod --check-config",
        ),
    ];
    for (facts, verdict, evidence, fix) in table {
        expect(&config(&facts), verdict, evidence, fix);
    }
}

fn mate(address: &str, bridge: bool, standing: Standing) -> Mate {
    Mate {
        address: a(address),
        bridge,
        standing,
    }
}

fn device(group: Option<u32>, mates: Vec<Mate>, upstream: Vec<(PciAddress, Acs)>) -> DeviceFacts {
    DeviceFacts {
        address: a("0000:17:00.0"),
        group,
        mates,
        upstream,
    }
}

#[test]
fn a_group_is_viable_when_every_mate_but_bridges_is_selected() {
    use Standing::*;
    let table = [
        (
            device(Some(3), vec![], vec![]),
            Verdict::Ok,
            "group 3: it alone",
            "",
        ),
        (
            device(Some(3), vec![mate("0000:17:00.1", false, Selected)], vec![]),
            Verdict::Ok,
            "group 3: with 0000:17:00.1 (selected too)",
            "",
        ),
        // A bridge in the group stays with the host: it blocks nothing.
        (
            device(
                Some(3),
                vec![mate("0000:00:01.0", true, NotSelected)],
                vec![],
            ),
            Verdict::Ok,
            "group 3: it alone",
            "",
        ),
        (
            device(
                Some(3),
                vec![
                    mate("0000:00:01.0", true, NotSelected),
                    mate("0000:17:00.1", false, NotSelected),
                ],
                vec![],
            ),
            Verdict::Fail,
            "group 3 also holds 0000:17:00.1 (not selected)",
            "select 0000:17:00.1 too",
        ),
        (
            device(
                Some(3),
                vec![
                    mate(
                        "0000:17:00.1",
                        false,
                        Protected("address 0000:17:00.1".into()),
                    ),
                    mate("0000:17:00.2", false, NotSelected),
                ],
                vec![],
            ),
            Verdict::Fail,
            "0000:17:00.1 (protected by address 0000:17:00.1), 0000:17:00.2 (not selected)",
            "select 0000:17:00.1, 0000:17:00.2 too",
        ),
        (
            device(None, vec![], vec![]),
            Verdict::Fail,
            "in no IOMMU group",
            "intel_iommu=on",
        ),
    ];
    for (d, verdict, evidence, fix) in table {
        let c = group(&d);
        assert_eq!(c.name, "group 0000:17:00.0");
        expect(&c, verdict, evidence, fix);
    }
}

#[test]
fn acs_explains_a_shared_group_and_unknown_warns_only_there() {
    let port = a("0000:00:01.0");
    let on = Acs::Controls { off: Vec::new() };
    let table = [
        // A viable group is the kernel's proof of isolation, whatever ACS reads.
        (
            device(Some(3), vec![], vec![(port, Acs::Unknown)]),
            true,
            Verdict::Ok,
            "not read (extended config space needs root); group 3 isolates it",
            "",
        ),
        (
            device(Some(3), vec![], vec![(port, on.clone())]),
            true,
            Verdict::Ok,
            "on at 0000:00:01.0; group 3 isolates it",
            "",
        ),
        (
            device(Some(3), vec![], vec![]),
            true,
            Verdict::Ok,
            "no bridge above it",
            "",
        ),
        (
            device(Some(3), vec![], vec![(port, Acs::Absent)]),
            false,
            Verdict::Warn,
            "0000:00:01.0 has no ACS: why group 3 is shared",
            "a port with ACS",
        ),
        (
            device(
                Some(3),
                vec![],
                vec![(
                    port,
                    Acs::Controls {
                        off: vec!["RR", "CR"],
                    },
                )],
            ),
            false,
            Verdict::Warn,
            "0000:00:01.0 has ACS RR, CR off",
            "a port with ACS",
        ),
        (
            device(Some(3), vec![], vec![(port, Acs::Unknown)]),
            false,
            Verdict::Warn,
            "unknown: not read",
            "sudo",
        ),
        (
            device(Some(3), vec![], vec![(port, on)]),
            false,
            Verdict::Warn,
            "shared by functions of one card",
            "select",
        ),
        // No group at all: the group check says it.
        (
            device(None, vec![], vec![(port, Acs::Absent)]),
            false,
            Verdict::Ok,
            "its group",
            "",
        ),
    ];
    for (d, viable, verdict, evidence, fix) in table {
        let c = acs(&d, viable);
        assert_eq!(c.name, "acs 0000:17:00.0");
        expect(&c, verdict, evidence, fix);
    }
}

/// A 4096-byte config space whose extended capabilities are `caps` (id, control), chained
/// from 0x100.
fn config_with(caps: &[(u16, u16)]) -> Vec<u8> {
    let mut c = vec![0u8; 4096];
    for (i, (id, control)) in caps.iter().enumerate() {
        let at = 0x100 + i * 0x40;
        let next = if i + 1 < caps.len() { at + 0x40 } else { 0 };
        let header = u32::from(*id) | (1 << 16) | ((next as u32) << 20);
        c[at..at + 4].copy_from_slice(&header.to_le_bytes());
        c[at + 6..at + 8].copy_from_slice(&control.to_le_bytes());
    }
    c
}

#[test]
fn acs_is_read_from_the_extended_capabilities() {
    let table = [
        (vec![0u8; 256], Acs::Unknown),
        (config_with(&[]), Acs::Absent),
        (config_with(&[(0x0001, 0)]), Acs::Absent),
        (
            config_with(&[(0x000d, 0x1d)]),
            Acs::Controls { off: vec![] },
        ),
        (
            config_with(&[(0x0001, 0), (0x000d, 0x01)]),
            Acs::Controls {
                off: vec!["RR", "CR", "UF"],
            },
        ),
        (
            config_with(&[(0x000d, 0)]),
            Acs::Controls {
                off: vec!["SV", "RR", "CR", "UF"],
            },
        ),
    ];
    for (config, want) in table {
        assert_eq!(acs_from_config(&config), want);
    }
    // A list that loops on itself ends.
    let mut looped = config_with(&[(0x0001, 0)]);
    looped[0x100..0x104].copy_from_slice(&(0x0001u32 | (0x100 << 20)).to_le_bytes());
    assert_eq!(acs_from_config(&looped), Acs::Absent);
}

#[test]
fn vfiod_not_reached_warns_with_where_to_look() {
    let bus = "system bus".to_string();
    let table = [
        (
            VfiodFacts::Answers {
                bus: bus.clone(),
                version: "0.1.0".into(),
                iommu: "present".into(),
            },
            Verdict::Ok,
            "vfiod 0.1.0 answers on the system bus, IOMMU present",
            "",
        ),
        (
            VfiodFacts::NotRunning { bus: bus.clone() },
            Verdict::Warn,
            "no org.vfiod.Vfiod1 on the system bus",
            "systemctl status vfiod",
        ),
        (
            VfiodFacts::NoBus {
                bus,
                error: "No such file or directory".into(),
            },
            Verdict::Warn,
            "cannot reach the system bus: No such file",
            "systemctl status dbus vfiod",
        ),
    ];
    for (facts, verdict, evidence, fix) in table {
        expect(&vfiod(&facts), verdict, evidence, fix);
    }
}

#[test]
fn libvirtd_runs_and_has_read_the_hook() {
    let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
    let hook = |executable, modified: Option<u64>| HookState::Installed {
        path: "/etc/libvirt/hooks/qemu.d/vfiod".into(),
        executable,
        modified: modified.map(t),
    };
    let runs = |started: Option<u64>| {
        Some(LocalDaemon {
            pid_file: "run/libvirtd.pid",
            pid: 4242,
            started: started.map(t),
        })
    };
    let socket = || vec!["/run/libvirt/libvirt-sock".to_string()];
    let facts = |daemon, sockets, hook| LibvirtFacts {
        uri: Some("qemu:///system".into()),
        daemon,
        sockets,
        hook,
    };
    let missing = |qemu_script| HookState::Missing {
        path: "/etc/libvirt/hooks/qemu.d/vfiod".into(),
        qemu_script,
    };
    type Expected = (Verdict, &'static str, &'static str);
    let table: Vec<(LibvirtFacts, Expected, Expected)> = vec![
        (
            facts(runs(Some(200)), socket(), hook(true, Some(100))),
            (Verdict::Ok, "runs: pid 4242 (/run/libvirtd.pid)", ""),
            (Verdict::Ok, "there before libvirtd started", ""),
        ),
        (
            facts(runs(Some(100)), socket(), hook(true, Some(200))),
            (Verdict::Ok, "runs", ""),
            (
                Verdict::Warn,
                "newer than the running libvirtd",
                "systemctl restart libvirtd",
            ),
        ),
        // Not running: the next start reads the hook, whenever it was installed.
        (
            facts(None, socket(), hook(true, Some(200))),
            (
                Verdict::Ok,
                "not running now; /run/libvirt/libvirt-sock starts it on demand",
                "",
            ),
            (
                Verdict::Ok,
                "/etc/libvirt/hooks/qemu.d/vfiod, executable",
                "",
            ),
        ),
        (
            facts(runs(None), Vec::new(), hook(false, Some(200))),
            (Verdict::Ok, "runs", ""),
            (
                Verdict::Warn,
                "not executable",
                "chmod 0755 /etc/libvirt/hooks/qemu.d/vfiod",
            ),
        ),
        (
            facts(None, Vec::new(), missing(false)),
            (
                Verdict::Warn,
                "not running: no live pid",
                "apt install libvirt-daemon-system",
            ),
            (
                Verdict::Warn,
                "no /etc/libvirt/hooks/qemu.d/vfiod",
                "ln -s /usr/libexec/vfiod-qemu-hook",
            ),
        ),
        (
            facts(runs(Some(1)), Vec::new(), missing(true)),
            (Verdict::Ok, "runs", ""),
            (
                Verdict::Warn,
                "a hooks/qemu script is there",
                "qemu.d/vfiod",
            ),
        ),
    ];
    for (f, (dv, de, dfix), (hv, he, hfix)) in table {
        let [daemon, hook] = libvirt(&f);
        assert_eq!(
            (daemon.name.as_str(), hook.name.as_str()),
            ("libvirtd", "libvirt hook")
        );
        expect(&daemon, dv, de, dfix);
        expect(&hook, hv, he, hfix);
    }
    // Configured without libvirt: nothing to check.
    let unused = LibvirtFacts {
        uri: None,
        daemon: None,
        sockets: Vec::new(),
        hook: missing(false),
    };
    for c in libvirt(&unused) {
        expect(&c, Verdict::Ok, "not used: libvirt_uri = \"\"", "");
    }
}

#[test]
fn polkitd_on_the_bus_or_installed() {
    let bin = Some("/usr/lib/polkit-1/polkitd".to_string());
    let table = [
        (
            Some(true),
            None,
            Verdict::Ok,
            "org.freedesktop.PolicyKit1 is on the bus",
            "",
        ),
        (
            Some(false),
            bin.clone(),
            Verdict::Ok,
            "/usr/lib/polkit-1/polkitd is installed",
            "",
        ),
        (None, bin, Verdict::Ok, "is installed", ""),
        (
            Some(false),
            None,
            Verdict::Warn,
            "is not on the bus, no polkitd binary",
            "apt install polkitd",
        ),
        (
            None,
            None,
            Verdict::Warn,
            "bus not reached, no polkitd binary",
            "apt install polkitd",
        ),
    ];
    for (on_bus, binary, verdict, evidence, fix) in table {
        expect(
            &polkit(&PolkitFacts { on_bus, binary }),
            verdict,
            evidence,
            fix,
        );
    }
}

#[test]
fn the_worst_verdict_decides_the_exit_code_and_the_summary() {
    use crate::client::exit;
    let c = |v| Check {
        name: "x".into(),
        verdict: v,
        evidence: "e".into(),
        fix: if v == Verdict::Ok {
            String::new()
        } else {
            "f".into()
        },
    };
    use Verdict::*;
    let table: [(&[Verdict], Verdict, u8, &str, &str); 5] = [
        (&[], Ok, exit::OK, "doctor: all 0 checks ok", "0 ok"),
        (&[Ok, Ok], Ok, exit::OK, "doctor: all 2 checks ok", "2 ok"),
        (
            &[Ok, Warn, Warn],
            Warn,
            exit::DOCTOR_WARN,
            "doctor: 2 warnings, run vfioctl doctor",
            "2 warnings, 1 ok",
        ),
        (
            &[Fail, Ok, Warn],
            Fail,
            exit::DOCTOR_FAIL,
            "doctor: 1 failure, 1 warning, run vfioctl doctor",
            "1 failure, 1 warning, 1 ok",
        ),
        (
            &[Fail, Fail],
            Fail,
            exit::DOCTOR_FAIL,
            "doctor: 2 failures, run vfioctl doctor",
            "2 failures, 0 ok",
        ),
    ];
    for (verdicts, worst, code, summary, tally) in table {
        let r = Report::new("/", verdicts.iter().map(|v| c(*v)).collect());
        assert_eq!(r.verdict, worst);
        assert_eq!(r.exit_code(), code);
        assert_eq!(r.summary(), summary);
        assert_eq!(r.tally(), tally);
    }
    let json = serde_json::to_value(Report::new("/", vec![c(Warn)])).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"root": "/", "verdict": "warn", "checks": [
            {"name": "x", "verdict": "warn", "evidence": "e", "fix": "f"}
        ]})
    );
}
