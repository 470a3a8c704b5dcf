//! Inventory: turns what sysfs shows into device records, and what changed since the last pass
//! into store changes and events.
//!
//! Classification and diffing are pure functions (tested as tables); [`scan`] is the only part
//! that reads sysfs.
//!
//! A read that fails because vfiod itself ran out of something (descriptors: EMFILE, ENFILE;
//! memory: ENOMEM) says nothing about the device: the function keeps the record it had, the
//! shortage is logged once until a pass reads everything again, and nothing is marked broken
//! (issue 24: 237 "is now broken: Too many open files" events once vfiod's own descriptors ran
//! out).

use crate::config::Settings;
use crate::host::sysfs::{RawFunction, Sysfs, SysfsError};
use crate::hostuse::{self, Use};
use crate::model::device::{Device, Kind, Mode, Role, State};
use crate::model::event::EventKind;
use crate::model::pci::{ClassCode, PciAddress};
use crate::store::{DeviceChange, NewEvent};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether a failed read is vfiod's own shortage (no descriptor or memory left for it), not a
/// fact about the device.
pub fn is_own_shortage(e: &SysfsError) -> bool {
    e.is_own_shortage()
}

/// Set while passes meet a shortage: the warning is logged when it starts and the recovery
/// when it ends, not once per function per pass. Process-wide because the shortage is.
static SHORT: AtomicBool = AtomicBool::new(false);

/// Logs a shortage's start or end (each once): `hit` is one failed read of this pass, `None`
/// when the pass read everything.
fn note_shortage(hit: Option<&SysfsError>) {
    match hit {
        Some(e) => {
            if !SHORT.swap(true, Ordering::AcqRel) {
                tracing::error!(
                    "vfiod cannot read sysfs for lack of its own resources ({}); devices keep \
                     their last known state until it can",
                    crate::error_chain(e)
                );
            }
        }
        None => {
            if SHORT.swap(false, Ordering::AcqRel) {
                tracing::info!("vfiod reads sysfs again: the shortage of resources is over");
            }
        }
    }
}

/// Accelerator kind from the class code.
pub fn kind_from_class(class: ClassCode) -> Kind {
    match (class.base(), class.sub()) {
        (0x03, _) => Kind::Gpu,
        // Mass storage / non-volatile memory (NVMe is prog-if 0x02; any NVM controller counts).
        (0x01, 0x08) => Kind::Nvme,
        (0x02, _) => Kind::Nic,
        // Co-processors (QAT) and encryption controllers.
        (0x0b, 0x40) | (0x10, _) => Kind::Crypto,
        // Processing accelerators: FPGA cards present themselves this way.
        (0x12, _) => Kind::Fpga,
        _ => Kind::Other,
    }
}

/// Names from the pci.ids database compiled into the binary; empty when unknown.
pub fn names(vendor: u16, device: u16) -> (String, String) {
    use crate::model::pci_name;
    (
        pci_name::vendor(vendor).unwrap_or_default().to_string(),
        pci_name::device(vendor, device)
            .unwrap_or_default()
            .to_string(),
    )
}

/// Why the host or the operator forbids touching a function; `None` = not protected.
#[derive(Clone, Debug, Default)]
pub struct Protection {
    pub reasons: BTreeMap<PciAddress, String>,
}

/// What the configuration's selectors match a function on (its address is the key it is
/// found under).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub vendor_id: u16,
    pub device_id: u16,
    pub class: ClassCode,
}

impl From<&RawFunction> for Identity {
    fn from(r: &RawFunction) -> Identity {
        Identity {
            vendor_id: r.vendor_id,
            device_id: r.device_id,
            class: r.class,
        }
    }
}

impl From<&Device> for Identity {
    fn from(d: &Device) -> Identity {
        Identity {
            vendor_id: d.vendor_id,
            device_id: d.device_id,
            class: d.class,
        }
    }
}

/// Whether vfiod manages a function: the configuration selects it and it is not protected.
///
/// A function is selected when a `[[select]]` rule matches it; a VF (`physfn` is its PF) also
/// when a rule matches its PF, found with the PF's own address and ids. A selected PF's VFs
/// are what vfiod splits it into and hands out, and their ids usually match no rule (an X710 PF
/// is 8086:1572, its VFs 8086:154c), so every VF of a selected PF is managed, whatever its own
/// ids.
/// `identities` holds what this pass read (a PF it could not read: what the last pass knew); a
/// VF whose PF is in neither is selected only by its own ids.
pub fn is_managed(
    settings: &Settings,
    address: PciAddress,
    function: Identity,
    physfn: Option<PciAddress>,
    identities: &BTreeMap<PciAddress, Identity>,
    protected: bool,
) -> bool {
    let rule = |a: PciAddress, i: Identity| {
        settings
            .rule_for(a, i.vendor_id, i.device_id, i.class)
            .is_some()
    };
    let by_pf = physfn.is_some_and(|pf| identities.get(&pf).is_some_and(|i| rule(pf, *i)));
    !protected && (by_pf || rule(address, function))
}

/// Builds the record for a function that was read completely.
pub fn classify(
    raw: &RawFunction,
    kind_override: Option<Kind>,
    managed: bool,
    protection: Option<&str>,
) -> Device {
    let (vendor_name, device_name) = names(raw.vendor_id, raw.device_id);
    let (role, separable, total_vfs, num_vfs) = match (&raw.sriov, raw.physfn) {
        (_, Some(_)) => (Role::Vf, false, 0, 0),
        (Some(s), None) if s.total_vfs > 0 => (Role::Pf, true, s.total_vfs, s.num_vfs),
        _ => (Role::Function, false, 0, 0),
    };
    let mode = match role {
        Role::Vf => Mode::None,
        Role::Pf if num_vfs > 0 => Mode::Vf,
        _ => Mode::Pf,
    };
    let (state, state_reason) = match protection {
        Some(why) => (State::Protected, why.to_string()),
        None => (State::Usable, String::new()),
    };
    Device {
        address: raw.address,
        vendor_id: raw.vendor_id,
        device_id: raw.device_id,
        subsystem_vendor_id: raw.subsystem_vendor_id,
        subsystem_device_id: raw.subsystem_device_id,
        revision: raw.revision,
        class: raw.class,
        vendor_name,
        device_name,
        kind: kind_override.unwrap_or_else(|| kind_from_class(raw.class)),
        driver: raw.driver.clone(),
        driver_override: raw.driver_override.clone(),
        numa_node: raw.numa_node,
        iommu_group: raw.iommu_group,
        role,
        separable,
        mode,
        total_vfs,
        num_vfs,
        parent_pf: raw.physfn,
        managed,
        state,
        state_reason,
    }
}

/// The record for a function whose information could not be read completely. What was known
/// before is kept (so the operator still sees which card it is); only the state changes.
pub fn broken(address: PciAddress, previous: Option<&Device>, error: &SysfsError) -> Device {
    let reason = crate::error_chain(error);
    match previous {
        Some(p) => Device {
            state: State::Broken,
            state_reason: reason,
            ..p.clone()
        },
        None => Device {
            address,
            vendor_id: 0,
            device_id: 0,
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 0,
            class: ClassCode(0),
            vendor_name: String::new(),
            device_name: String::new(),
            kind: Kind::Other,
            driver: None,
            driver_override: None,
            numa_node: None,
            iommu_group: None,
            role: Role::Function,
            separable: false,
            mode: Mode::Pf,
            total_vfs: 0,
            num_vfs: 0,
            parent_pf: None,
            managed: false,
            state: State::Broken,
            state_reason: reason,
        },
    }
}

/// The records with what cleaning holds applied (see [`crate::model::clean`]): a function held
/// for a clean is `cleaning`, a quarantined one `broken` with the quarantine's reason (which
/// says more than the kernel's: a device a reset left reading all-ones is both). A function the
/// host uses stays `protected`, and a held one that cannot be read stays `broken` with that
/// reason until it reads again.
pub fn with_holds(
    mut devices: Vec<Device>,
    holds: &[crate::model::clean::CleanHold],
) -> Vec<Device> {
    use crate::model::clean::HoldState;
    let holds: BTreeMap<PciAddress, &crate::model::clean::CleanHold> =
        holds.iter().map(|h| (h.address, h)).collect();
    for d in &mut devices {
        let Some(h) = holds.get(&d.address) else {
            // A record from before its clean ended (the pass after it has not run yet): the
            // hold is the truth.
            if d.state == State::Cleaning {
                (d.state, d.state_reason) = (State::Usable, String::new());
            }
            continue;
        };
        match (h.state, d.state) {
            (HoldState::Pending, State::Usable) => {
                (d.state, d.state_reason) = (State::Cleaning, h.reason.clone());
            }
            (HoldState::Quarantined, State::Usable | State::Broken) => {
                (d.state, d.state_reason) = (State::Broken, format!("quarantined: {}", h.reason));
            }
            _ => {}
        }
    }
    devices
}

/// Whether the records (`devices`, from the last pass) no longer say what uses them now
/// (`now`: [`crate::hostuse::uses`] of what was just read, as [`crate::hostuse::outside_vfiod`]
/// keeps them): a holder came or went since (an LVM volume, a mount, a process with a node
/// open, a QEMU started by hand), which no PCI uevent announces. A claim asks this before it
/// chooses, the holder index's refresh after it reads, and a pass settles it. Pure.
pub fn host_use_is_stale(devices: &[Device], now: &BTreeMap<PciAddress, Vec<Use>>) -> bool {
    devices.iter().any(|d| {
        let recorded = Some(d.state_reason.as_str()).filter(|r| hostuse::is_use_reason(r));
        let used = now
            .get(&d.address)
            .and_then(|us| hostuse::protection_reason(us));
        match d.state {
            State::Usable | State::Cleaning => used.is_some(),
            // The reason too: a claim refused names the holder there is now.
            State::Protected => match (recorded, used) {
                (Some(r), Some(u)) => r != u,
                (None, None) => false,
                _ => true,
            },
            State::Broken => false,
        }
    })
}

/// The functions `[[protect]]` names among `devices`, with the reason the inventory records
/// for them ("protected by config (address=0000:17:00.0)"). Pure.
pub fn protected_by_config(
    settings: &Settings,
    devices: &[Device],
) -> BTreeMap<PciAddress, String> {
    devices
        .iter()
        .filter_map(|d| {
            let sel =
                settings.is_protected_by_config(d.address, d.vendor_id, d.device_id, d.class)?;
            Some((d.address, config_reason(&sel)))
        })
        .collect()
}

/// A `[[protect]]`ed function's reason.
fn config_reason(selector: &impl std::fmt::Display) -> String {
    format!("protected by config ({selector})")
}

pub use crate::hostuse::HOST_USE_PREFIX;

/// Reads every function under the sysfs root and classifies it. `previous` is what the store
/// holds, used to keep a broken device's identity. Only a failure to list the bus is an error:
/// a single unreadable function becomes a broken record. The host's uses are read whole here
/// (every process's descriptors); the daemon's pass uses [`scan_with`].
pub fn scan(
    sysfs: &Sysfs,
    settings: &Settings,
    previous: &BTreeMap<PciAddress, Device>,
) -> Result<Vec<Device>, SysfsError> {
    let facts = crate::host::sysfs::hostuse::read(
        sysfs,
        crate::host::sysfs::hostuse::Scope::All,
        &settings.host.allow_console_gpu,
    );
    let host: BTreeMap<PciAddress, Vec<Use>> = hostuse::host_uses(&facts)
        .into_iter()
        .map(|(f, whys)| (f, whys.into_iter().map(Use::Host).collect()))
        .collect();
    scan_with(sysfs, settings, previous, &host)
}

/// [`scan`] with the uses that protect a function given (`uses`: the host's, and VMs' outside
/// vfiod's claims, [`crate::hostuse::outside_vfiod`]), as the daemon's pass reads them through
/// its holder index.
pub fn scan_with(
    sysfs: &Sysfs,
    settings: &Settings,
    previous: &BTreeMap<PciAddress, Device>,
    uses: &BTreeMap<PciAddress, Vec<Use>>,
) -> Result<Vec<Device>, SysfsError> {
    let addresses = sysfs.list_functions()?;
    let raws = read_all(sysfs, &addresses);

    // Direct protection: host use, then the config's protect list.
    let mut protected: BTreeMap<PciAddress, String> = BTreeMap::new();
    for (a, us) in uses {
        if let Some(why) = hostuse::protection_reason(us) {
            protected.insert(*a, why);
        }
    }
    for (a, raw) in &raws {
        let Ok(raw) = raw else { continue };
        if protected.contains_key(a) {
            continue;
        }
        if let Some(sel) =
            settings.is_protected_by_config(*a, raw.vendor_id, raw.device_id, raw.class)
        {
            protected.insert(*a, config_reason(&sel));
        }
    }
    // An IOMMU group moves as a whole, so a group-mate of a protected endpoint is protected
    // too. Bridges in a group do not move and neither cause nor receive this.
    let mut group_of: BTreeMap<u32, Vec<PciAddress>> = BTreeMap::new();
    for (a, raw) in &raws {
        if let Ok(r) = raw {
            if let (Some(g), false) = (r.iommu_group, r.class.is_bridge()) {
                group_of.entry(g).or_default().push(*a);
            }
        }
    }
    let direct: BTreeSet<PciAddress> = protected.keys().copied().collect();
    for members in group_of.values() {
        if let Some(src) = members.iter().find(|m| direct.contains(m)) {
            for m in members {
                protected.entry(*m).or_insert_with(|| {
                    format!("shares its IOMMU group with protected device {src}")
                });
            }
        }
    }

    // A VF is selected through its PF: every identity, a broken function's from the last pass.
    let identities: BTreeMap<PciAddress, Identity> = raws
        .iter()
        .filter_map(|(a, raw)| match raw {
            Ok(r) => Some((*a, Identity::from(r))),
            Err(_) => previous.get(a).map(|p| (*a, Identity::from(p))),
        })
        .collect();

    let mut out = Vec::with_capacity(addresses.len());
    let mut shortage = None;
    for (a, raw) in raws {
        match raw {
            Ok(raw) => {
                let rule = settings.rule_for(a, raw.vendor_id, raw.device_id, raw.class);
                let managed = is_managed(
                    settings,
                    a,
                    Identity::from(&raw),
                    raw.physfn,
                    &identities,
                    protected.contains_key(&a),
                );
                let kind = rule.and_then(|r| r.kind);
                out.push(classify(
                    &raw,
                    kind,
                    managed,
                    protected.get(&a).map(String::as_str),
                ));
            }
            // Gone between listing and reading: not broken, just removed; the next pass (or
            // the uevent) settles it.
            Err(e) if e.is_not_found() && !sysfs.device_dir(a).exists() => continue,
            // vfiod's own shortage: the last record stands (a function not seen before waits
            // for a pass that can read it).
            Err(e) if is_own_shortage(&e) => {
                if let Some(p) = previous.get(&a) {
                    out.push(p.clone());
                }
                shortage.get_or_insert(e);
            }
            Err(e) => out.push(broken(a, previous.get(&a), &e)),
        }
    }
    note_shortage(shortage.as_ref());
    Ok(out)
}

/// Reads every function, spread over a few threads: a pass is thousands of small sysfs reads
/// that each wait on the kernel, and a big host has over a thousand functions.
fn read_all(
    sysfs: &Sysfs,
    addresses: &[PciAddress],
) -> BTreeMap<PciAddress, Result<RawFunction, SysfsError>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4);
    if threads == 1 || addresses.len() < 64 {
        return addresses
            .iter()
            .map(|a| (*a, sysfs.read_function(*a)))
            .collect();
    }
    let chunk = addresses.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = addresses
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|a| (*a, sysfs.read_function(*a)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("sysfs reader thread panicked"))
            .collect()
    })
}

/// What changed between two passes, as store changes plus an event for each (never silent).
pub fn diff(
    old: &BTreeMap<PciAddress, Device>,
    new: &[Device],
) -> (Vec<DeviceChange>, Vec<NewEvent>) {
    let mut changes = Vec::new();
    let mut events = Vec::new();
    let ev = |a: PciAddress, kind: EventKind, message: String| NewEvent {
        address: Some(a),
        kind,
        message,
    };
    let new_addrs: BTreeSet<PciAddress> = new.iter().map(|d| d.address).collect();
    for d in new {
        match old.get(&d.address) {
            None => {
                events.push(ev(
                    d.address,
                    EventKind::Added,
                    format!("{} {} appeared ({})", d.kind, d.address, describe(d)),
                ));
                if d.state == State::Broken {
                    events.push(ev(
                        d.address,
                        EventKind::Broken,
                        format!("{} is broken: {}", d.address, d.state_reason),
                    ));
                }
                changes.push(DeviceChange::Added(d.clone()));
            }
            Some(o) if o != d => {
                if o.state != d.state {
                    let kind = match (o.state, d.state) {
                        (_, State::Broken) => EventKind::Broken,
                        (State::Broken, _) => EventKind::Recovered,
                        (_, State::Protected) => EventKind::Protected,
                        (_, State::Cleaning) | (State::Cleaning, _) => EventKind::Clean,
                        _ => EventKind::Unprotected,
                    };
                    let why = if d.state_reason.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", d.state_reason)
                    };
                    events.push(ev(
                        d.address,
                        kind,
                        format!("{} is now {}{}", d.address, d.state, why),
                    ));
                }
                let fields = changed_fields(o, d);
                if !fields.is_empty() {
                    events.push(ev(
                        d.address,
                        EventKind::Changed,
                        format!("{} changed: {}", d.address, fields.join(", ")),
                    ));
                }
                changes.push(DeviceChange::Changed {
                    old: o.clone(),
                    new: d.clone(),
                });
            }
            Some(_) => {}
        }
    }
    for (a, o) in old {
        if !new_addrs.contains(a) {
            let message = match (o.role, o.parent_pf) {
                // A VF goes when its PF's VF count is lowered: expected, not a disappearance.
                (crate::model::device::Role::Vf, Some(pf)) => {
                    format!("{} VF {a} of {pf} removed", o.kind)
                }
                _ => format!("{} {} disappeared", o.kind, a),
            };
            events.push(ev(*a, EventKind::Removed, message));
            changes.push(DeviceChange::Removed(o.clone()));
        }
    }
    (changes, events)
}

fn describe(d: &Device) -> String {
    let name = if d.device_name.is_empty() {
        format!("{:04x}:{:04x}", d.vendor_id, d.device_id)
    } else {
        format!("{} {}", d.vendor_name, d.device_name)
    };
    format!("{name}, driver {}", d.driver.as_deref().unwrap_or("none"))
}

/// Human-readable "field: old -> new" list, excluding state (reported separately).
fn changed_fields(o: &Device, n: &Device) -> Vec<String> {
    let mut out = Vec::new();
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
    if o.driver != n.driver {
        out.push(format!("driver {} -> {}", opt(&o.driver), opt(&n.driver)));
    }
    if o.driver_override != n.driver_override {
        out.push(format!(
            "driver_override {} -> {}",
            opt(&o.driver_override),
            opt(&n.driver_override)
        ));
    }
    if o.num_vfs != n.num_vfs {
        out.push(format!("VFs {} -> {}", o.num_vfs, n.num_vfs));
    }
    if o.mode != n.mode {
        out.push(format!("mode {} -> {}", o.mode, n.mode));
    }
    if o.iommu_group != n.iommu_group {
        out.push(format!(
            "IOMMU group {:?} -> {:?}",
            o.iommu_group, n.iommu_group
        ));
    }
    if o.managed != n.managed {
        out.push(format!("managed {} -> {}", o.managed, n.managed));
    }
    if (o.vendor_id, o.device_id, o.class) != (n.vendor_id, n.device_id, n.class) {
        out.push(format!(
            "identity {:04x}:{:04x} {} -> {:04x}:{:04x} {}",
            o.vendor_id, o.device_id, o.class, n.vendor_id, n.device_id, n.class
        ));
    }
    if o.kind != n.kind {
        out.push(format!("kind {} -> {}", o.kind, n.kind));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn holds_show_as_cleaning_or_quarantined_over_what_the_kernel_says() {
        use crate::model::clean::{CleanHold, HoldState};
        let hold = |state| CleanHold {
            address: a("0000:01:00.1"),
            state,
            reason: "claim 3 ended".into(),
            claim_id: Some(3),
            since_ms: 0,
        };
        let table = [
            (
                State::Usable,
                Some(HoldState::Pending),
                State::Cleaning,
                "claim 3 ended",
            ),
            (
                State::Usable,
                Some(HoldState::Quarantined),
                State::Broken,
                "quarantined: claim 3 ended",
            ),
            // A device a reset left all-ones: the quarantine says more than the kernel.
            (
                State::Broken,
                Some(HoldState::Quarantined),
                State::Broken,
                "quarantined: claim 3 ended",
            ),
            // Unreadable: it stays broken with the kernel's reason until it reads again.
            (
                State::Broken,
                Some(HoldState::Pending),
                State::Broken,
                "EIO",
            ),
            // The host's use wins: vfiod never touches it.
            (
                State::Protected,
                Some(HoldState::Pending),
                State::Protected,
                "EIO",
            ),
            (
                State::Protected,
                Some(HoldState::Quarantined),
                State::Protected,
                "EIO",
            ),
            (State::Usable, None, State::Usable, "EIO"),
            // A record from before its clean ended: the hold is gone, so is the state.
            (State::Cleaning, None, State::Usable, ""),
        ];
        for (kernel, held, want, reason) in table {
            let unread = SysfsError::Parse {
                path: "x".into(),
                value: String::new(),
                reason: "fixture".into(),
            };
            let mut d = broken(a("0000:01:00.1"), None, &unread);
            d.managed = true;
            d.state = kernel;
            d.state_reason = "EIO".into();
            let holds: Vec<CleanHold> = held.map(hold).into_iter().collect();
            let out = with_holds(vec![d], &holds).pop().unwrap();
            assert_eq!(out.state, want, "{kernel:?} + {held:?}");
            assert_eq!(out.state_reason, reason, "{kernel:?} + {held:?}");
        }
    }

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    /// A claim runs a pass first when the records no longer say what the host uses.
    #[test]
    fn host_use_is_stale_when_a_holder_came_or_went() {
        let unread = SysfsError::Parse {
            path: "x".into(),
            value: String::new(),
            reason: "fixture".into(),
        };
        let used = || {
            BTreeMap::from([(
                a("0000:01:00.1"),
                vec![Use::Host(
                    "block device nvme1n1 is held by dm-0 (vg0-data)".to_string(),
                )],
            )])
        };
        let by_vm = || {
            BTreeMap::from([(
                a("0000:01:00.1"),
                vec![Use::Vm {
                    vm: Some("vm9".into()),
                    pid: 900,
                    why: "IOMMU group 7 is open by pid 900 (qemu-system-x86)".into(),
                }],
            )])
        };
        let table = [
            (State::Usable, "", BTreeMap::new(), false),
            (State::Usable, "", used(), true),
            (State::Cleaning, "claim 3 ended", used(), true),
            (
                State::Protected,
                "used by the host: block device nvme1n1 is held by dm-0 (vg0-data)",
                used(),
                false,
            ),
            (
                State::Protected,
                "used by the host: block device nvme1n1 is held by dm-0 (vg0-data)",
                BTreeMap::new(),
                true,
            ),
            (
                State::Protected,
                "used by the host: block device nvme1n1 is open by pid 9 (fio)",
                used(),
                true,
            ),
            // Config or a group-mate protects it: nothing the host's uses change.
            (
                State::Protected,
                "protected by config (address 0000:01:00.1)",
                BTreeMap::new(),
                false,
            ),
            (
                State::Protected,
                "shares its IOMMU group with protected device 0000:01:00.0",
                BTreeMap::new(),
                false,
            ),
            (
                State::Protected,
                "protected by config (address 0000:01:00.1)",
                used(),
                true,
            ),
            (State::Broken, "EIO", used(), false),
            // A QEMU outside vfiod's claims came, stayed, went.
            (State::Usable, "", by_vm(), true),
            (
                State::Protected,
                "used by VM vm9: IOMMU group 7 is open by pid 900 (qemu-system-x86)",
                by_vm(),
                false,
            ),
            (
                State::Protected,
                "used by VM vm9: IOMMU group 7 is open by pid 900 (qemu-system-x86)",
                BTreeMap::new(),
                true,
            ),
        ];
        for (state, reason, now, stale) in table {
            let mut d = broken(a("0000:01:00.1"), None, &unread);
            (d.state, d.state_reason) = (state, reason.to_string());
            assert_eq!(
                host_use_is_stale(&[d], &now),
                stale,
                "{state:?} {reason:?} {now:?}"
            );
        }
    }

    fn id(vendor_id: u16, device_id: u16, class: u32) -> Identity {
        Identity {
            vendor_id,
            device_id,
            class: ClassCode(class),
        }
    }

    /// Who is managed, as a table: PFs and plain functions by their own rule, VFs by their
    /// PF's (found with the PF's address and ids) or their own, never when protected.
    #[test]
    fn only_vfiods_own_shortages_keep_a_device_out_of_broken() {
        let read = |errno: i32| SysfsError::Read {
            path: "/sys/bus/pci/devices/0000:3b:00.0/config".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        for (errno, own) in [
            (libc::EMFILE, true),
            (libc::ENFILE, true),
            (libc::ENOMEM, true),
            (libc::EIO, false),
            (libc::ENODEV, false),
            (libc::EACCES, false),
            (libc::ENOENT, false),
        ] {
            assert_eq!(is_own_shortage(&read(errno)), own, "errno {errno}");
        }
        let parse = SysfsError::Parse {
            path: "/x".into(),
            value: "zz".into(),
            reason: "not hex".into(),
        };
        assert!(!is_own_shortage(&parse));
    }

    #[test]
    fn a_vf_is_managed_when_its_pf_is_selected() {
        let settings = Settings::from_toml_str(
            r#"
[[select]]
id = "8086:1572"
[[select]]
address = "0000:af:00.0"
[[select]]
id = "15b3:101e"
"#,
            Path::new("t.toml"),
        )
        .unwrap();
        let nic_pf = a("0000:3b:00.0");
        let fpga_pf = a("0000:af:00.0");
        let other_pf = a("0000:86:00.0");
        let gone_pf = a("0000:99:00.0");
        let identities: BTreeMap<PciAddress, Identity> = [
            (nic_pf, id(0x8086, 0x1572, 0x020000)),
            (fpga_pf, id(0x8086, 0x0b2b, 0x120000)),
            // Not selected; its VFs' ids are.
            (other_pf, id(0x15b3, 0x1017, 0x020000)),
        ]
        .into();
        let nic_vf = id(0x8086, 0x154c, 0x020000);
        let fpga_vf = id(0x8086, 0x0b2c, 0x120000);
        let other_vf = id(0x15b3, 0x1018, 0x020000);
        let selected_vf = id(0x15b3, 0x101e, 0x020000);
        #[rustfmt::skip]
        let table: &[(&str, Identity, Option<PciAddress>, bool, bool)] = &[
            // address, ids, physfn, protected, managed
            ("0000:3b:00.0", identities[&nic_pf], None, false, true),
            ("0000:3b:00.0", identities[&nic_pf], None, true, false),
            // VFs of a PF selected by id (theirs match no rule) and by address.
            ("0000:3b:02.0", nic_vf, Some(nic_pf), false, true),
            ("0000:af:00.1", fpga_vf, Some(fpga_pf), false, true),
            // A protected VF of a selected PF.
            ("0000:3b:02.1", nic_vf, Some(nic_pf), true, false),
            // A VF of an unselected PF: not managed, unless its own ids are selected.
            ("0000:86:00.2", other_vf, Some(other_pf), false, false),
            ("0000:86:00.3", selected_vf, Some(other_pf), false, true),
            ("0000:86:00.3", selected_vf, Some(other_pf), true, false),
            // A PF known to no pass: only the VF's own ids count.
            ("0000:99:00.1", nic_vf, Some(gone_pf), false, false),
            // The VF's ids alone, without a PF, select nothing.
            ("0000:3b:02.2", nic_vf, None, false, false),
        ];
        for (address, ids, physfn, protected, want) in table {
            assert_eq!(
                is_managed(
                    &settings,
                    a(address),
                    *ids,
                    *physfn,
                    &identities,
                    *protected
                ),
                *want,
                "{address} {ids:?} physfn {physfn:?} protected {protected}"
            );
        }
    }
}
