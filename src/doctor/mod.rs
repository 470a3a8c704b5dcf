//! `vfioctl doctor`: whether this host can pass PCI functions through at all, as a list of
//! checks, each with a verdict (ok, warn, fail), the evidence read and the one fix an operator
//! can act on.
//!
//! The checks are pure functions of what the edges read ([`Facts`]), tested as tables: the
//! IOMMU (its groups, its units, interrupt remapping), the VFIO modules, the configuration,
//! each selected device's IOMMU group and the ACS above it, and the services around vfiod
//! (vfiod itself on the bus, libvirtd and the hook it reads, polkitd). [`read`] reads the host
//! under one root (the configuration's `sysfs_root`, so a simulated kernel is read the same
//! way), [`bus`] asks the bus; both only read: nothing is written, no device node is opened.
//! [`render`] prints the report for 80 columns.

pub mod bus;
pub mod read;
pub mod render;
pub mod run;

pub use crate::host::libvirt::LocalDaemon;
use crate::model::iommu::{Iommu, IommuFacts, ENABLE_IOMMU};
use crate::model::pci::PciAddress;
use serde::Serialize;
use std::time::SystemTime;

/// How a check came out; the worst one decides the exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Nothing to do.
    Ok,
    /// Passthrough can work, but something is unknown, unsafe or will bite later.
    Warn,
    /// Passthrough cannot work (or not safely) until the fix is made.
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked: `iommu groups`, `vfio_pci`, `group 0000:17:00.0`, ...
    pub name: String,
    pub verdict: Verdict,
    /// What was read, and what it means.
    pub evidence: String,
    /// The one thing to do about it; empty when the verdict is ok.
    pub fix: String,
}

fn ok(name: impl Into<String>, evidence: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        verdict: Verdict::Ok,
        evidence: evidence.into(),
        fix: String::new(),
    }
}

fn warn(name: impl Into<String>, evidence: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        verdict: Verdict::Warn,
        evidence: evidence.into(),
        fix: fix.into(),
    }
}

fn fail(name: impl Into<String>, evidence: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        verdict: Verdict::Fail,
        evidence: evidence.into(),
        fix: fix.into(),
    }
}

/// Every check of one run, and the host root they read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The root the host was read under (`/` on a real host).
    pub root: String,
    /// The worst verdict of the checks (ok when there are none).
    pub verdict: Verdict,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(root: impl Into<String>, checks: Vec<Check>) -> Report {
        let verdict = checks
            .iter()
            .map(|c| c.verdict)
            .max()
            .unwrap_or(Verdict::Ok);
        Report {
            root: root.into(),
            verdict,
            checks,
        }
    }

    /// How many checks came out `v`.
    pub fn count(&self, v: Verdict) -> usize {
        self.checks.iter().filter(|c| c.verdict == v).count()
    }

    /// vfioctl's exit status for this report: 0 when every check is ok, `DOCTOR_WARN` when the
    /// worst is a warning, `DOCTOR_FAIL` when any check fails.
    pub fn exit_code(&self) -> u8 {
        use crate::client::exit;
        match self.verdict {
            Verdict::Ok => exit::OK,
            Verdict::Warn => exit::DOCTOR_WARN,
            Verdict::Fail => exit::DOCTOR_FAIL,
        }
    }

    /// The counts, worst first: "1 failure, 2 warnings, 11 ok".
    pub fn tally(&self) -> String {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let mut parts = Vec::new();
        let (fails, warns) = (self.count(Verdict::Fail), self.count(Verdict::Warn));
        if fails > 0 {
            parts.push(plural(fails, "failure", "failures"));
        }
        if warns > 0 {
            parts.push(plural(warns, "warning", "warnings"));
        }
        parts.push(format!("{} ok", self.count(Verdict::Ok)));
        parts.join(", ")
    }

    /// One line for `vfioctl status`: "doctor: all 14 checks ok", "doctor: 2 warnings, run
    /// vfioctl doctor", "doctor: 1 failure, 2 warnings, run vfioctl doctor".
    pub fn summary(&self) -> String {
        if self.verdict == Verdict::Ok {
            return format!("doctor: all {} checks ok", self.checks.len());
        }
        let tally = self.tally();
        let worst = tally.rsplit_once(", ").map_or(tally.as_str(), |(w, _)| w);
        format!("doctor: {worst}, run vfioctl doctor")
    }
}

/// Everything the checks decide from, as the edges read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    pub config: ConfigFacts,
    pub iommu: IommuFacts,
    /// Entries of `/sys/class/iommu` (`dmar0`, `ivhd0`, ...); `None` when it cannot be read.
    pub iommu_units: Option<Vec<String>>,
    pub interrupts: InterruptFacts,
    pub modules: ModuleFacts,
    /// The selected functions (not VFs: they follow their PF), in address order.
    pub devices: Vec<DeviceFacts>,
    pub vfiod: VfiodFacts,
    pub libvirt: LibvirtFacts,
    pub polkit: PolkitFacts,
}

/// Every check, in the order an operator fixes things: the IOMMU, the modules, the
/// configuration and its devices, the services.
pub fn checks(f: &Facts) -> Vec<Check> {
    let mut out = vec![
        iommu_groups(f.iommu),
        iommu_units(f.iommu_units.as_deref(), Iommu::decide(f.iommu)),
        interrupt_remapping(&f.interrupts),
        module("vfio", &[("vfio", f.modules.vfio)]),
        module("vfio_pci", &[("vfio_pci", f.modules.vfio_pci)]),
        module(
            "vfio_iommu_type1",
            &[
                ("vfio_iommu_type1", f.modules.vfio_iommu_type1),
                ("iommufd", f.modules.iommufd),
            ],
        ),
        config(&f.config),
    ];
    for d in &f.devices {
        let g = group(d);
        let viable = g.verdict == Verdict::Ok;
        out.push(g);
        out.push(acs(d, viable));
    }
    out.push(vfiod(&f.vfiod));
    out.extend(libvirt(&f.libvirt));
    out.push(polkit(&f.polkit));
    out
}

/// IOMMU groups under `/sys/kernel/iommu_groups`, decided as the daemon decides it
/// ([`Iommu::decide`]).
pub fn iommu_groups(facts: IommuFacts) -> Check {
    const NAME: &str = "iommu groups";
    match Iommu::decide(facts) {
        Iommu::Present if facts.groups > 0 => ok(
            NAME,
            format!("{} groups in /sys/kernel/iommu_groups", facts.groups),
        ),
        Iommu::Present => ok(
            NAME,
            format!(
                "{} functions link an iommu_group (none listed in /sys/kernel/iommu_groups)",
                facts.functions_in_a_group
            ),
        ),
        Iommu::Absent => fail(
            NAME,
            "no IOMMU group in /sys/kernel/iommu_groups: the IOMMU is off, so vfiod passes \
             nothing through",
            ENABLE_IOMMU,
        ),
    }
}

/// The IOMMU's hardware units the kernel registered (`/sys/class/iommu`): `dmar*` is Intel
/// VT-d (DMAR), `ivhd*` AMD-Vi.
pub fn iommu_units(units: Option<&[String]>, iommu: Iommu) -> Check {
    const NAME: &str = "iommu units";
    let units = units.unwrap_or_default();
    if units.is_empty() {
        return match iommu {
            Iommu::Absent => fail(
                NAME,
                "no DMAR or AMD-Vi unit in /sys/class/iommu",
                ENABLE_IOMMU,
            ),
            Iommu::Present => warn(
                NAME,
                "IOMMU groups exist but /sys/class/iommu lists no unit",
                "see which IOMMU the kernel found: dmesg | grep -iE 'DMAR|AMD-Vi|IOMMU'",
            ),
        };
    }
    let kind = |u: &String| {
        if u.starts_with("dmar") {
            "Intel VT-d"
        } else if u.starts_with("ivhd") {
            "AMD-Vi"
        } else {
            "other"
        }
    };
    let mut kinds: Vec<&str> = units.iter().map(kind).collect();
    kinds.sort();
    kinds.dedup();
    let shown: Vec<&str> = units.iter().take(4).map(String::as_str).collect();
    let more = units.len().saturating_sub(shown.len());
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    ok(
        NAME,
        format!(
            "{} in /sys/class/iommu ({})",
            shown.join(", ") + &more,
            kinds.join(", ")
        ),
    )
}

/// What `/proc/interrupts` and the VFIO modules' parameters show of interrupt remapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InterruptFacts {
    /// `None` when `/proc/interrupts` cannot be read; else (lines whose chip is an `IR-` one,
    /// lines of IO-APIC or MSI chips without it).
    pub lines: Option<(usize, usize)>,
    /// `allow_unsafe_interrupts` of `vfio_iommu_type1` or `iommufd` reads Y.
    pub allow_unsafe: bool,
}

/// Interrupt remapping: without it a device given to a VM can inject interrupts into the host,
/// and VFIO refuses to attach one unless told `allow_unsafe_interrupts`. The kernel shows it
/// on in `/proc/interrupts`: remapped chips are named `IR-IO-APIC`, `IR-PCI-MSI`.
pub fn interrupt_remapping(facts: &InterruptFacts) -> Check {
    const NAME: &str = "interrupt remapping";
    const CHECK: &str = "dmesg | grep -i remapping";
    match facts.lines {
        Some((remapped, _)) if remapped > 0 => ok(
            NAME,
            format!("on: {remapped} interrupts on IR- chips in /proc/interrupts"),
        ),
        Some((0, plain)) if plain > 0 && facts.allow_unsafe => warn(
            NAME,
            format!(
                "off ({plain} interrupts on plain IO-APIC/MSI chips in /proc/interrupts), \
                 and allow_unsafe_interrupts=Y lets VFIO assign devices anyway: a guest can \
                 inject interrupts into the host"
            ),
            "boot with intremap=on, then drop allow_unsafe_interrupts",
        ),
        Some((0, plain)) if plain > 0 => fail(
            NAME,
            format!(
                "off: {plain} interrupts on plain IO-APIC/MSI chips, none on IR- chips in \
                 /proc/interrupts; VFIO refuses to assign a device"
            ),
            "enable interrupt remapping in firmware, boot without intremap=off",
        ),
        Some(_) => warn(
            NAME,
            "unknown: /proc/interrupts shows no IO-APIC or MSI chip",
            CHECK,
        ),
        None => warn(NAME, "unknown: cannot read /proc/interrupts", CHECK),
    }
}

/// Where a kernel module stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleState {
    /// Loaded now (`/sys/module/NAME/initstate` reads `live`, or its PCI driver is registered).
    Loaded,
    /// Built into the kernel (`/sys/module/NAME` without `initstate`, or `modules.builtin`).
    BuiltIn,
    /// Not loaded; installed as a module (`modules.dep`).
    Installed,
    /// Not loaded, and the module index has no such module.
    Missing,
    /// Not loaded, and there is no module index to ask.
    Unknown,
}

/// The VFIO modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleFacts {
    pub vfio: ModuleState,
    pub vfio_pci: ModuleState,
    pub vfio_iommu_type1: ModuleState,
    pub iommufd: ModuleState,
}

/// A module (or the best of alternatives, such as `vfio_iommu_type1` or `iommufd`): loaded
/// or built in is ok; installed but not loaded warns; absent fails.
pub fn module(name: &str, alternatives: &[(&str, ModuleState)]) -> Check {
    use ModuleState::*;
    let rank = |s: ModuleState| match s {
        Loaded | BuiltIn => 0,
        Installed => 1,
        Unknown => 2,
        Missing => 3,
    };
    let Some(&(found, state)) = alternatives.iter().min_by_key(|(_, s)| rank(*s)) else {
        return warn(name, "nothing to check", "");
    };
    let names = alternatives
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(" or ");
    match state {
        Loaded => ok(name, format!("{found} loaded")),
        BuiltIn => ok(name, format!("{found} built into the kernel")),
        Installed => warn(
            name,
            format!("{found} installed but not loaded"),
            format!("modprobe {found}"),
        ),
        Unknown => fail(
            name,
            format!("{names} not loaded, and no module index in /lib/modules to tell more"),
            format!("modprobe {found}"),
        ),
        Missing => fail(
            name,
            format!("{names} not loaded, not built in, not installed"),
            format!("boot a kernel built with {found} (CONFIG_VFIO_PCI, CONFIG_VFIO_IOMMU_TYPE1)"),
        ),
    }
}

/// The configuration as vfioctl read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigFacts {
    Loaded {
        /// The files read (none: the defaults, no file).
        sources: Vec<String>,
        /// `[[select]]` rules.
        rules: usize,
        /// Functions they select now (VFs of a selected PF left out).
        selected: usize,
    },
    /// It does not load; the error chain.
    Invalid { error: String },
}

/// The configuration loads and selects something.
pub fn config(facts: &ConfigFacts) -> Check {
    const NAME: &str = "configuration";
    match facts {
        ConfigFacts::Invalid { error } => fail(
            NAME,
            format!("does not load: {error}"),
            "vfiod --check-config names every error",
        ),
        ConfigFacts::Loaded {
            sources,
            rules,
            selected,
        } => {
            let from = if sources.is_empty() {
                "the defaults (no file)".to_string()
            } else {
                sources.join(", ")
            };
            if *rules == 0 {
                warn(
                    NAME,
                    format!("no [[select]] rule in {from}: vfiod manages no device"),
                    "add a [[select]] rule to /etc/vfiod/conf.d/ (vfiod.toml(5))",
                )
            } else if *selected == 0 {
                warn(
                    NAME,
                    format!("{rules} [[select]] rules in {from} match no PCI function here"),
                    "vfiod --check-config says which rule matches nothing",
                )
            } else {
                ok(
                    NAME,
                    format!("{rules} [[select]] rules in {from} select {selected} functions"),
                )
            }
        }
    }
}

/// How a group-mate stands with the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Selected too: it moves with the device.
    Selected,
    /// No `[[select]]` rule matches it.
    NotSelected,
    /// A `[[protect]]` selector matches it (the selector).
    Protected(String),
}

/// Another function in a selected device's IOMMU group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mate {
    pub address: PciAddress,
    /// Bridges stay with the host and do not block a group.
    pub bridge: bool,
    pub standing: Standing,
}

/// What ACS an upstream bridge shows (its PCIe extended capability 0x0d).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acs {
    /// Its extended configuration space cannot be read (only root reads past 256 bytes).
    Unknown,
    /// It has no ACS capability.
    Absent,
    /// ACS, with these isolating controls off (`SV`, `RR`, `CR`, `UF`); empty: all on.
    Controls { off: Vec<&'static str> },
}

/// ACS from a function's configuration space (`config`): the capability's control register.
/// Pure, for the edge and for tests.
pub fn acs_from_config(config: &[u8]) -> Acs {
    const ACS_ID: u32 = 0x000d;
    if config.len() <= 256 {
        return Acs::Unknown;
    }
    let dword = |at: usize| -> Option<u32> {
        config
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut at = 0x100;
    // A list of at most (4096 - 256) / 4 capabilities; a loop in it ends here.
    for _ in 0..960 {
        let Some(header) = dword(at) else {
            return Acs::Absent;
        };
        if header == 0 || header == 0xffff_ffff {
            return Acs::Absent;
        }
        if header & 0xffff == ACS_ID {
            let Some(control) = config.get(at + 6..at + 8) else {
                return Acs::Absent;
            };
            let control = u16::from_le_bytes([control[0], control[1]]);
            let off = [(0x01, "SV"), (0x04, "RR"), (0x08, "CR"), (0x10, "UF")]
                .into_iter()
                .filter(|(bit, _)| control & bit == 0)
                .map(|(_, name)| name)
                .collect();
            return Acs::Controls { off };
        }
        let next = ((header >> 20) & 0xffc) as usize;
        if next < 0x100 {
            return Acs::Absent;
        }
        at = next;
    }
    Acs::Absent
}

/// A selected function: its IOMMU group and what sits above it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    pub address: PciAddress,
    pub group: Option<u32>,
    /// The other functions of its group, in address order.
    pub mates: Vec<Mate>,
    /// The bridges above it, nearest first, with what ACS each shows.
    pub upstream: Vec<(PciAddress, Acs)>,
}

impl DeviceFacts {
    /// The group-mates that keep the group from moving to VFIO: functions (not bridges) the
    /// configuration does not select.
    pub fn blocking(&self) -> Vec<&Mate> {
        self.mates
            .iter()
            .filter(|m| !m.bridge && m.standing != Standing::Selected)
            .collect()
    }
}

/// A selected device's IOMMU group can go to VFIO as a whole: every other function in it
/// (bridges aside) is selected too. A claim takes the whole group, so one unselected or
/// protected mate keeps the device from being claimed.
pub fn group(d: &DeviceFacts) -> Check {
    let name = format!("group {}", d.address);
    let Some(g) = d.group else {
        return fail(
            name,
            "in no IOMMU group: no passthrough for it",
            ENABLE_IOMMU,
        );
    };
    let blocking = d.blocking();
    if blocking.is_empty() {
        let with: Vec<String> = d
            .mates
            .iter()
            .filter(|m| !m.bridge)
            .map(|m| m.address.to_string())
            .collect();
        return ok(
            name,
            if with.is_empty() {
                format!("group {g}: it alone")
            } else {
                format!("group {g}: with {} (selected too)", with.join(", "))
            },
        );
    }
    let why: Vec<String> = blocking
        .iter()
        .map(|m| match &m.standing {
            Standing::Protected(by) => format!("{} (protected by {by})", m.address),
            _ => format!("{} (not selected)", m.address),
        })
        .collect();
    let addresses: Vec<String> = blocking.iter().map(|m| m.address.to_string()).collect();
    fail(
        name,
        format!(
            "group {g} also holds {}: the group moves to VFIO whole",
            why.join(", ")
        ),
        format!(
            "select {} too, or move the card to a slot with its own group",
            addresses.join(", ")
        ),
    )
}

/// ACS on the bridges above a selected device. The kernel builds IOMMU groups from ACS, so a
/// group that holds only selected functions is the proof of isolation whatever ACS reads; ACS
/// explains a shared group. Unknown ACS warns only where the group is shared.
pub fn acs(d: &DeviceFacts, group_viable: bool) -> Check {
    let name = format!("acs {}", d.address);
    let group = d
        .group
        .map_or("its group".to_string(), |g| format!("group {g}"));
    let lacking: Vec<String> = d
        .upstream
        .iter()
        .filter_map(|(a, acs)| match acs {
            Acs::Absent => Some(format!("{a} has no ACS")),
            Acs::Controls { off } if !off.is_empty() => {
                Some(format!("{a} has ACS {} off", off.join(", ")))
            }
            _ => None,
        })
        .collect();
    let unknown = d.upstream.iter().any(|(_, a)| *a == Acs::Unknown);
    let said = if d.upstream.is_empty() {
        "no bridge above it".to_string()
    } else if !lacking.is_empty() {
        lacking.join("; ")
    } else if unknown {
        "not read (extended config space needs root)".to_string()
    } else {
        let bridges: Vec<String> = d.upstream.iter().map(|(a, _)| a.to_string()).collect();
        format!("on at {}", bridges.join(", "))
    };
    if group_viable || d.group.is_none() {
        return ok(name, format!("{said}; {group} isolates it"));
    }
    if !lacking.is_empty() {
        return warn(
            name,
            format!("{said}: why {group} is shared"),
            "use a slot below a port with ACS (the group check names the mates)",
        );
    }
    if unknown {
        return warn(
            name,
            format!("unknown: {said}; {group} is shared"),
            "sudo vfioctl doctor, or: sudo lspci -vvv | grep -i acsctl",
        );
    }
    warn(
        name,
        format!("{said}: {group} is shared by functions of one card"),
        "select the card's other functions too",
    )
}

/// vfiod on the bus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VfiodFacts {
    /// `org.vfiod.Vfiod1` answered: its version, and its IOMMU as it decided it.
    Answers {
        bus: String,
        version: String,
        iommu: String,
    },
    /// The bus has no `org.vfiod.Vfiod1`.
    NotRunning { bus: String },
    /// The bus itself cannot be reached.
    NoBus { bus: String, error: String },
}

pub fn vfiod(facts: &VfiodFacts) -> Check {
    const NAME: &str = "vfiod";
    match facts {
        VfiodFacts::Answers {
            bus,
            version,
            iommu,
        } => {
            let iommu = if iommu.is_empty() {
                String::new()
            } else {
                format!(", IOMMU {iommu}")
            };
            ok(NAME, format!("vfiod {version} answers on the {bus}{iommu}"))
        }
        VfiodFacts::NotRunning { bus } => warn(
            NAME,
            format!("not running: no org.vfiod.Vfiod1 on the {bus}"),
            "systemctl status vfiod",
        ),
        VfiodFacts::NoBus { bus, error } => warn(
            NAME,
            format!("cannot reach the {bus}: {error}"),
            "systemctl status dbus vfiod",
        ),
    }
}

/// The hook where libvirt reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookState {
    Installed {
        path: String,
        executable: bool,
        modified: Option<SystemTime>,
    },
    /// Not at `qemu.d/vfiod`; whether a `hooks/qemu` script is there (it may call ours).
    Missing { path: String, qemu_script: bool },
}

/// libvirt as vfiod uses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibvirtFacts {
    /// The configuration's `libvirt_uri`; `None`: configured without libvirt.
    pub uri: Option<String>,
    /// The daemon that runs now (`libvirtd` or `virtqemud`), by its pid file.
    pub daemon: Option<LocalDaemon>,
    /// libvirt's sockets that are there (systemd starts the daemon when one is connected to).
    pub sockets: Vec<String>,
    pub hook: HookState,
}

/// libvirtd runs (or its socket starts it on demand), and has read vfiod's qemu hook: libvirt
/// looks for hooks when it starts. Found without connecting to libvirt: a connection would
/// start the daemon.
pub fn libvirt(f: &LibvirtFacts) -> [Check; 2] {
    const DAEMON: &str = "libvirtd";
    const HOOK: &str = "libvirt hook";
    if f.uri.is_none() {
        let why = "not used: libvirt_uri = \"\" in the configuration";
        return [ok(DAEMON, why), ok(HOOK, why)];
    }
    let daemon = match (&f.daemon, f.sockets.first()) {
        (Some(d), _) => ok(DAEMON, format!("runs: pid {} (/{})", d.pid, d.pid_file)),
        (None, Some(socket)) => ok(
            DAEMON,
            format!("not running now; {socket} starts it on demand"),
        ),
        (None, None) => warn(
            DAEMON,
            "not running: no live pid in /run/libvirtd.pid or /run/virtqemud.pid, no socket \
             in /run/libvirt",
            "apt install libvirt-daemon-system; systemctl start libvirtd",
        ),
    };
    let install =
        "ln -s /usr/libexec/vfiod-qemu-hook /etc/libvirt/hooks/qemu.d/vfiod; restart libvirtd";
    let started = f.daemon.as_ref().and_then(|d| d.started);
    let hook = match &f.hook {
        HookState::Missing { path, qemu_script } => warn(
            HOOK,
            if *qemu_script {
                format!(
                    "no {path}; a hooks/qemu script is there (it must run vfiod-qemu-hook): \
                     without the hook vfiod cannot refuse a VM that would take a device in use"
                )
            } else {
                format!(
                    "no {path}: without it vfiod cannot refuse a VM that would take a device \
                     in use"
                )
            },
            install,
        ),
        HookState::Installed {
            path,
            executable: false,
            ..
        } => warn(
            HOOK,
            format!("{path} is not executable: libvirt skips it"),
            format!("chmod 0755 {path}"),
        ),
        HookState::Installed {
            path,
            modified: Some(modified),
            ..
        } if started.is_some_and(|s| *modified > s) => warn(
            HOOK,
            format!(
                "{path} is newer than the running libvirtd, which looked for hooks when it \
                 started"
            ),
            "systemctl restart libvirtd",
        ),
        HookState::Installed { path, .. } => ok(
            HOOK,
            match started {
                Some(_) => format!("{path}, there before libvirtd started"),
                None => format!("{path}, executable"),
            },
        ),
    };
    [daemon, hook]
}

/// polkitd, which vfiod asks about every change from a caller other than root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolkitFacts {
    /// `org.freedesktop.PolicyKit1` is owned or activatable on the bus; `None`: no bus.
    pub on_bus: Option<bool>,
    /// The polkitd binary found, if any.
    pub binary: Option<String>,
}

pub fn polkit(f: &PolkitFacts) -> Check {
    const NAME: &str = "polkitd";
    match (f.on_bus, &f.binary) {
        (Some(true), _) => ok(NAME, "org.freedesktop.PolicyKit1 is on the bus"),
        (_, Some(path)) => ok(NAME, format!("{path} is installed (started on demand)")),
        (on_bus, None) => warn(
            NAME,
            format!(
                "{}, no polkitd binary: only root may change anything through vfiod",
                if on_bus.is_some() {
                    "org.freedesktop.PolicyKit1 is not on the bus"
                } else {
                    "bus not reached"
                }
            ),
            "apt install polkitd",
        ),
    }
}

#[cfg(test)]
mod tests;
