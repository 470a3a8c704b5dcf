//! Plans: the exact, ordered sysfs writes of a conversion program, as data. A plan can be
//! printed before anything runs (`vfioctl plan`), and the executor runs exactly what it says.
//!
//! Building a plan is pure: it takes a [`Snapshot`] of the device's current state (gathered
//! from sysfs by the caller) and a [`Program`].

use crate::mode::policy::Program;
use crate::model::pci::PciAddress;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

/// A sysfs file, relative to the sysfs root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum SysPath {
    /// `bus/pci/devices/<address>/<attr>`
    Device { address: PciAddress, attr: String },
    /// `bus/pci/drivers/<driver>/<attr>`
    Driver { driver: String, attr: String },
    /// `bus/pci/<attr>`
    Bus { attr: String },
}

impl SysPath {
    fn device(address: PciAddress, attr: &str) -> Self {
        SysPath::Device {
            address,
            attr: attr.into(),
        }
    }

    pub fn resolve(&self, sysfs: &crate::host::sysfs::Sysfs) -> std::path::PathBuf {
        match self {
            SysPath::Device { address, attr } => sysfs.device_attr(*address, attr),
            SysPath::Driver { driver, attr } => sysfs.driver_dir(driver).join(attr),
            SysPath::Bus { attr } => sysfs.pci_bus_dir().join(attr),
        }
    }
}

/// The path as an operator reads it (`vfioctl plan`): the kernel's own `/sys` spelling, whatever
/// sysfs root vfiod runs on. I/O never uses this; it goes through [`SysPath::resolve`].
impl fmt::Display for SysPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SysPath::Device { address, attr } => write!(f, "/sys/bus/pci/devices/{address}/{attr}"),
            SysPath::Driver { driver, attr } => write!(f, "/sys/bus/pci/drivers/{driver}/{attr}"),
            SysPath::Bus { attr } => write!(f, "/sys/bus/pci/{attr}"),
        }
    }
}

/// One step of a plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    Write {
        path: SysPath,
        value: String,
    },
    /// The PF shows exactly `count` VFs (links and directories).
    WaitVfs {
        pf: PciAddress,
        count: u32,
    },
    /// Read back: `address` is bound to `driver` (`None`: to no driver).
    ExpectDriver {
        address: PciAddress,
        driver: Option<String>,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Write { path, value } => {
                let shown = if value == "\n" {
                    String::new()
                } else {
                    value.clone()
                };
                write!(f, "echo '{shown}' > {path}")
            }
            Step::WaitVfs { pf, count } => write!(f, "# wait until {pf} shows {count} VFs"),
            Step::ExpectDriver { address, driver } => match driver {
                Some(d) => write!(f, "# expect {address} bound to {d}"),
                None => write!(f, "# expect {address} unbound"),
            },
        }
    }
}

/// A function's binding state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    pub address: PciAddress,
    pub driver: Option<String>,
    pub driver_override: Option<String>,
}

/// What a plan is built from: the device as sysfs shows it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub pf: Binding,
    pub num_vfs: u32,
    pub autoprobe: Option<bool>,
    pub vf_offset: Option<u16>,
    pub vf_stride: Option<u16>,
    /// Existing VFs, in VF order.
    pub vfs: Vec<Binding>,
    /// The IOMMU group's endpoints (bridges excluded), the PF included.
    pub group: Vec<Binding>,
    /// Drivers to return to, recorded when vfiod first changed each function.
    pub original_drivers: BTreeMap<PciAddress, Option<String>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub device: PciAddress,
    pub program: Program,
    pub steps: Vec<Step>,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.steps {
            writeln!(f, "{s}")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("{pf} does not report its VF offset and stride; cannot tell where VFs will appear")]
    NoVfLayout { pf: PciAddress },
    #[error("VF {index} of {pf} would fall outside the PCI address space")]
    VfOutOfRange { pf: PciAddress, index: u32 },
    /// Checked here, not left to the kernel's ENOENT: the split would stop after its first write
    /// with the kernel's "no driver bound to device" in the log and nothing said to the caller.
    #[error(
        "{pf} has no driver bound, so it cannot be split {}",
        crate::mode::policy::NO_PF_DRIVER
    )]
    NoPfDriver { pf: PciAddress },
}

/// Address of VF `index` from the PF's routing id, offset and stride (SR-IOV spec 3.3.10).
pub fn vf_address(pf: PciAddress, offset: u16, stride: u16, index: u32) -> Option<PciAddress> {
    let rid = (u32::from(pf.bus) << 8) | (u32::from(pf.slot) << 3) | u32::from(pf.function);
    let vf = rid + u32::from(offset) + u32::from(stride) * index;
    (vf <= 0xffff).then(|| {
        PciAddress::new(
            pf.domain,
            (vf >> 8) as u8,
            ((vf >> 3) & 0x1f) as u8,
            (vf & 7) as u8,
        )
    })
}

fn write(path: SysPath, value: impl Into<String>) -> Step {
    Step::Write {
        path,
        value: value.into(),
    }
}

/// `echo ADDRESS > drivers/DRIVER/unbind`
fn unbind_from(driver: &str, address: PciAddress) -> Step {
    write(
        SysPath::Driver {
            driver: driver.to_string(),
            attr: "unbind".into(),
        },
        address.to_string(),
    )
}

/// `echo ADDRESS > drivers_probe`: the kernel binds the function to its override, or to the
/// driver that matches it.
fn probe(address: PciAddress) -> Step {
    write(
        SysPath::Bus {
            attr: "drivers_probe".into(),
        },
        address.to_string(),
    )
}

/// Moves one function to `driver` the safe way: override, unbind, probe; never `new_id`.
fn bind_steps(steps: &mut Vec<Step>, b: &Binding, driver: &str) {
    if b.driver.as_deref() == Some(driver) && b.driver_override.as_deref() == Some(driver) {
        return;
    }
    if b.driver_override.as_deref() != Some(driver) {
        steps.push(write(SysPath::device(b.address, "driver_override"), driver));
    }
    if b.driver.as_deref() != Some(driver) {
        if let Some(cur) = &b.driver {
            steps.push(unbind_from(cur, b.address));
        }
        steps.push(probe(b.address));
    }
    steps.push(Step::ExpectDriver {
        address: b.address,
        driver: Some(driver.to_string()),
    });
}

/// Returns one function to `original` (its pre-vfiod driver): clear the override, unbind,
/// reprobe.
fn unbind_steps(steps: &mut Vec<Step>, b: &Binding, original: Option<&str>) {
    if b.driver_override.is_some() {
        steps.push(write(SysPath::device(b.address, "driver_override"), "\n"));
    }
    if b.driver.as_deref() != original {
        if let Some(cur) = &b.driver {
            steps.push(unbind_from(cur, b.address));
        }
        if original.is_some() {
            steps.push(probe(b.address));
        }
    }
    steps.push(Step::ExpectDriver {
        address: b.address,
        driver: original.map(str::to_string),
    });
}

fn split_steps(
    steps: &mut Vec<Step>,
    s: &Snapshot,
    num_vfs: u32,
    vf_driver: &str,
) -> Result<(), PlanError> {
    let pf = s.pf.address;
    let (Some(offset), Some(stride)) = (s.vf_offset, s.vf_stride) else {
        return Err(PlanError::NoVfLayout { pf });
    };
    if s.pf.driver.is_none() {
        return Err(PlanError::NoPfDriver { pf });
    }
    // Host VF drivers must not grab the VFs between creation and our bind.
    if s.autoprobe != Some(false) {
        steps.push(write(SysPath::device(pf, "sriov_drivers_autoprobe"), "0"));
    }
    steps.push(write(
        SysPath::device(pf, "sriov_numvfs"),
        num_vfs.to_string(),
    ));
    steps.push(Step::WaitVfs { pf, count: num_vfs });
    for i in 0..num_vfs {
        let address =
            vf_address(pf, offset, stride, i).ok_or(PlanError::VfOutOfRange { pf, index: i })?;
        let fresh = Binding {
            address,
            driver: None,
            driver_override: None,
        };
        bind_steps(steps, &fresh, vf_driver);
    }
    Ok(())
}

fn restore_steps(steps: &mut Vec<Step>, s: &Snapshot) {
    let pf = s.pf.address;
    // Unbind the VFs first so no VF driver is mid-use when the kernel destroys them.
    for vf in &s.vfs {
        if let Some(d) = &vf.driver {
            steps.push(unbind_from(d, vf.address));
        }
    }
    steps.push(write(SysPath::device(pf, "sriov_numvfs"), "0"));
    steps.push(Step::WaitVfs { pf, count: 0 });
    if s.autoprobe == Some(false) {
        steps.push(write(SysPath::device(pf, "sriov_drivers_autoprobe"), "1"));
    }
}

/// The plan for `program` on the device in `snapshot`.
pub fn build(snapshot: &Snapshot, program: &Program, vf_driver: &str) -> Result<Plan, PlanError> {
    let mut steps = Vec::new();
    match program {
        Program::Nothing => {}
        Program::Split { num_vfs } => {
            // A PF vfiod moved (to vfio-pci, for a claim of it whole) goes back to the driver it
            // had first: VFs are created by the PF's own driver (vfio-pci creates none unless
            // loaded with enable_sriov, and answers ENOENT).
            let pf = &snapshot.pf;
            let returned = match snapshot.original_drivers.get(&pf.address) {
                Some(Some(orig)) if pf.driver.as_deref() != Some(orig.as_str()) => {
                    unbind_steps(&mut steps, pf, Some(orig));
                    Some(Binding {
                        driver: Some(orig.clone()),
                        driver_override: None,
                        ..pf.clone()
                    })
                }
                _ => None,
            };
            let s = match returned {
                Some(pf) => &Snapshot {
                    pf,
                    ..snapshot.clone()
                },
                None => snapshot,
            };
            split_steps(&mut steps, s, *num_vfs, vf_driver)?
        }
        Program::Restore => {
            restore_steps(&mut steps, snapshot);
            // Return the PF to the driver it had before vfiod changed it, if vfiod did.
            if let Some(orig) = snapshot.original_drivers.get(&snapshot.pf.address) {
                if snapshot.pf.driver != *orig || snapshot.pf.driver_override.is_some() {
                    unbind_steps(&mut steps, &snapshot.pf, orig.as_deref());
                }
            }
        }
        Program::Resplit { to, .. } => {
            restore_steps(&mut steps, snapshot);
            let after = Snapshot {
                autoprobe: Some(true),
                vfs: Vec::new(),
                num_vfs: 0,
                ..snapshot.clone()
            };
            split_steps(&mut steps, &after, *to, vf_driver)?;
        }
        Program::RebindVfs => {
            for vf in &snapshot.vfs {
                bind_steps(&mut steps, vf, vf_driver);
            }
        }
        Program::Bind { driver } => {
            for m in &snapshot.group {
                bind_steps(&mut steps, m, driver);
            }
        }
        Program::Unbind => {
            for m in &snapshot.group {
                if let Some(orig) = snapshot.original_drivers.get(&m.address) {
                    if m.driver != *orig || m.driver_override.is_some() {
                        unbind_steps(&mut steps, m, orig.as_deref());
                    }
                }
            }
        }
    }
    Ok(Plan {
        device: snapshot.pf.address,
        program: program.clone(),
        steps,
    })
}

/// The plan that moves `functions` (a claim's, for an attach) onto `driver`; the ones already
/// there get no step. Pure.
pub fn bind_plan(device: PciAddress, functions: &[Binding], driver: &str) -> Plan {
    let mut steps = Vec::new();
    for b in functions {
        bind_steps(&mut steps, b, driver);
    }
    Plan {
        device,
        program: Program::Bind {
            driver: driver.to_string(),
        },
        steps,
    }
}

/// The plan that takes the device from its state after a failed program back to `before`:
/// the rollback. Built from the same primitives, so it is as inspectable as the forward plan.
pub fn rollback(before: &Snapshot, now: &Snapshot) -> Plan {
    let mut steps = Vec::new();
    let pf = before.pf.address;
    if now.num_vfs != before.num_vfs {
        restore_steps(&mut steps, now);
        if before.num_vfs > 0 {
            // The kernel only goes 0 -> N; re-create the VFs and their old bindings.
            let mid = Snapshot {
                autoprobe: Some(true),
                vfs: Vec::new(),
                num_vfs: 0,
                ..now.clone()
            };
            if let Ok(()) = split_steps(&mut Vec::new(), &mid, before.num_vfs, "") {
                steps.push(write(SysPath::device(pf, "sriov_drivers_autoprobe"), "0"));
                steps.push(write(
                    SysPath::device(pf, "sriov_numvfs"),
                    before.num_vfs.to_string(),
                ));
                steps.push(Step::WaitVfs {
                    pf,
                    count: before.num_vfs,
                });
                for vf in &before.vfs {
                    let fresh = Binding {
                        address: vf.address,
                        driver: None,
                        driver_override: None,
                    };
                    match &vf.driver {
                        Some(d) => bind_steps(&mut steps, &fresh, d),
                        None => steps.push(Step::ExpectDriver {
                            address: vf.address,
                            driver: None,
                        }),
                    }
                    if vf.driver_override.is_none() && vf.driver.is_some() {
                        steps.push(write(SysPath::device(vf.address, "driver_override"), "\n"));
                    }
                }
            }
        }
    } else {
        // Same VF count: put each VF back on its driver.
        for (b, n) in before.vfs.iter().zip(&now.vfs) {
            if b != n {
                match &b.driver {
                    Some(d) => bind_steps(&mut steps, n, d),
                    None => unbind_steps(&mut steps, n, None),
                }
            }
        }
    }
    if before.autoprobe != now.autoprobe || steps.iter().any(|s| matches!(s, Step::Write { path: SysPath::Device { attr, .. }, .. } if attr == "sriov_drivers_autoprobe")) {
        if let Some(a) = before.autoprobe {
            steps.push(write(SysPath::device(pf, "sriov_drivers_autoprobe"), if a { "1" } else { "0" }));
        }
    }
    for (b, n) in before.group.iter().zip(&now.group) {
        back_to(&mut steps, b, n);
    }
    Plan {
        device: pf,
        program: Program::Nothing,
        steps,
    }
}

/// Puts one function from `now` back to `before`: its driver, and its override where it had
/// one for that driver. Nothing when it is as it was.
fn back_to(steps: &mut Vec<Step>, before: &Binding, now: &Binding) {
    if before == now {
        return;
    }
    match &before.driver {
        Some(d) if before.driver_override.as_deref() == Some(d.as_str()) => {
            bind_steps(steps, now, d)
        }
        other => unbind_steps(steps, now, other.as_deref()),
    }
}

/// The plan that gives functions back the bindings they had before a [`bind_plan`] (an attach
/// that failed after it bound them): `before` and `now` by address; a function missing from
/// `now` (gone) gets no step. Pure.
pub fn give_back(device: PciAddress, before: &[Binding], now: &[Binding]) -> Plan {
    let mut steps = Vec::new();
    for b in before {
        if let Some(n) = now.iter().find(|n| n.address == b.address) {
            back_to(&mut steps, b, n);
        }
    }
    Plan {
        device,
        program: Program::Unbind,
        steps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    /// A function's binding: address, driver, driver_override.
    fn b(address: &str, driver: Option<&str>, driver_override: Option<&str>) -> Binding {
        Binding {
            address: a(address),
            driver: driver.map(str::to_string),
            driver_override: driver_override.map(str::to_string),
        }
    }

    fn nic() -> Snapshot {
        let pf = b("0000:3b:00.0", Some("i40e"), None);
        Snapshot {
            pf: pf.clone(),
            num_vfs: 0,
            autoprobe: Some(true),
            vf_offset: Some(16),
            vf_stride: Some(1),
            vfs: vec![],
            group: vec![pf],
            original_drivers: BTreeMap::new(),
        }
    }

    #[test]
    fn vf_addresses_follow_offset_and_stride() {
        assert_eq!(
            vf_address(a("0000:3b:00.0"), 16, 1, 0),
            Some(a("0000:3b:02.0"))
        );
        assert_eq!(
            vf_address(a("0000:3b:00.0"), 16, 1, 63),
            Some(a("0000:3b:09.7"))
        );
        assert_eq!(
            vf_address(a("0000:5e:00.0"), 1, 1, 15),
            Some(a("0000:5e:02.0"))
        );
        assert_eq!(vf_address(a("0000:ff:1f.7"), 1, 1, 0), None);
    }

    #[test]
    fn split_plan_is_the_documented_sequence() {
        let p = build(&nic(), &Program::Split { num_vfs: 2 }, "vfio-pci").unwrap();
        let text = p.to_string();
        assert_eq!(
            text,
            "echo '0' > /sys/bus/pci/devices/0000:3b:00.0/sriov_drivers_autoprobe\n\
             echo '2' > /sys/bus/pci/devices/0000:3b:00.0/sriov_numvfs\n\
             # wait until 0000:3b:00.0 shows 2 VFs\n\
             echo 'vfio-pci' > /sys/bus/pci/devices/0000:3b:02.0/driver_override\n\
             echo '0000:3b:02.0' > /sys/bus/pci/drivers_probe\n\
             # expect 0000:3b:02.0 bound to vfio-pci\n\
             echo 'vfio-pci' > /sys/bus/pci/devices/0000:3b:02.1/driver_override\n\
             echo '0000:3b:02.1' > /sys/bus/pci/drivers_probe\n\
             # expect 0000:3b:02.1 bound to vfio-pci\n"
        );
        assert!(!text.contains("new_id"));
    }

    #[test]
    fn restore_unbinds_vfs_then_disables_and_returns_the_pf_driver() {
        let mut s = nic();
        s.num_vfs = 2;
        s.autoprobe = Some(false);
        s.vfs = vec![
            b("0000:3b:02.0", Some("vfio-pci"), Some("vfio-pci")),
            b("0000:3b:02.1", None, Some("vfio-pci")),
        ];
        s.pf.driver = Some("vfio-pci".into());
        s.pf.driver_override = Some("vfio-pci".into());
        s.original_drivers.insert(s.pf.address, Some("i40e".into()));
        let p = build(&s, &Program::Restore, "vfio-pci").unwrap();
        let text = p.to_string();
        let order = [
            "echo '0000:3b:02.0' > /sys/bus/pci/drivers/vfio-pci/unbind",
            "echo '0' > /sys/bus/pci/devices/0000:3b:00.0/sriov_numvfs",
            "echo '1' > /sys/bus/pci/devices/0000:3b:00.0/sriov_drivers_autoprobe",
            "echo '' > /sys/bus/pci/devices/0000:3b:00.0/driver_override",
            "echo '0000:3b:00.0' > /sys/bus/pci/drivers/vfio-pci/unbind",
            "echo '0000:3b:00.0' > /sys/bus/pci/drivers_probe",
            "# expect 0000:3b:00.0 bound to i40e",
        ];
        let mut at = 0;
        for o in order {
            let pos = text[at..]
                .find(o)
                .unwrap_or_else(|| panic!("missing or out of order: {o}\n{text}"));
            at += pos + o.len();
        }
        assert!(
            !text.contains("0000:3b:02.1' > /sys/bus/pci/drivers/"),
            "unbound VF must not be unbound"
        );
    }

    #[test]
    fn resplit_goes_through_zero() {
        let mut s = nic();
        s.num_vfs = 4;
        let p = build(&s, &Program::Resplit { from: 4, to: 8 }, "vfio-pci").unwrap();
        let writes: Vec<&Step> = p.steps.iter().filter(|s| matches!(s, Step::Write { path: SysPath::Device { attr, .. }, .. } if attr == "sriov_numvfs")).collect();
        assert_eq!(writes.len(), 2);
        assert!(matches!(writes[0], Step::Write { value, .. } if value == "0"));
        assert!(matches!(writes[1], Step::Write { value, .. } if value == "8"));
    }

    #[test]
    fn group_bind_moves_every_endpoint() {
        let gpu = b("0000:17:00.0", Some("nouveau"), None);
        let audio = b("0000:17:00.1", Some("snd_hda_intel"), None);
        let s = Snapshot {
            pf: gpu.clone(),
            num_vfs: 0,
            autoprobe: None,
            vf_offset: None,
            vf_stride: None,
            vfs: vec![],
            group: vec![gpu, audio],
            original_drivers: BTreeMap::new(),
        };
        let p = build(
            &s,
            &Program::Bind {
                driver: "vfio-pci".into(),
            },
            "vfio-pci",
        )
        .unwrap();
        let t = p.to_string();
        assert!(t.contains("echo '0000:17:00.0' > /sys/bus/pci/drivers/nouveau/unbind"));
        assert!(t.contains("echo '0000:17:00.1' > /sys/bus/pci/drivers/snd_hda_intel/unbind"));
        assert_eq!(t.matches("# expect").count(), 2);
    }

    #[test]
    fn split_without_vf_layout_is_refused() {
        let mut s = nic();
        s.vf_offset = None;
        assert_eq!(
            build(&s, &Program::Split { num_vfs: 1 }, "vfio-pci"),
            Err(PlanError::NoVfLayout { pf: s.pf.address })
        );
    }

    /// A PF left on vfio-pci after a claim of it whole: back to its own driver, then split.
    #[test]
    fn split_of_a_pf_vfiod_moved_returns_it_to_its_driver_first() {
        let mut s = nic();
        s.pf.driver = Some("vfio-pci".into());
        s.pf.driver_override = Some("vfio-pci".into());
        s.original_drivers
            .insert(s.pf.address, Some("i40e".to_string()));
        let p = build(&s, &Program::Split { num_vfs: 2 }, "vfio-pci").unwrap();
        let text: Vec<String> = p.steps.iter().map(|st| st.to_string()).collect();
        let numvfs = text
            .iter()
            .position(|t| t.contains("sriov_numvfs"))
            .unwrap();
        let returned = text
            .iter()
            .position(|t| t.contains("expect 0000:3b:00.0 bound to i40e"))
            .unwrap_or_else(|| panic!("no return to i40e in {text:#?}"));
        assert!(returned < numvfs, "{text:#?}");
        assert!(text[0].contains("driver_override"), "{text:#?}");
        // Not moved by vfiod (no record, or on its own driver): the split alone.
        for original in [None, Some("i40e")] {
            let mut s = nic();
            if let Some(o) = original {
                s.original_drivers.insert(s.pf.address, Some(o.to_string()));
            }
            let p = build(&s, &Program::Split { num_vfs: 2 }, "vfio-pci").unwrap();
            assert!(
                p.steps[0].to_string().contains("sriov_drivers_autoprobe"),
                "{:?}",
                p.steps
            );
        }
    }

    #[test]
    fn split_of_a_pf_without_a_driver_is_refused() {
        let mut s = nic();
        s.pf.driver = None;
        let e = build(&s, &Program::Split { num_vfs: 1 }, "vfio-pci").unwrap_err();
        assert_eq!(e, PlanError::NoPfDriver { pf: s.pf.address });
        assert!(
            e.to_string().contains("the split runs when one binds"),
            "{e}"
        );
    }

    #[test]
    fn rollback_of_a_half_split_returns_to_pf_mode() {
        let before = nic();
        let mut now = nic();
        now.num_vfs = 2;
        now.autoprobe = Some(false);
        now.vfs = vec![
            b("0000:3b:02.0", Some("vfio-pci"), Some("vfio-pci")),
            b("0000:3b:02.1", None, None),
        ];
        let t = rollback(&before, &now).to_string();
        assert!(
            t.contains("echo '0000:3b:02.0' > /sys/bus/pci/drivers/vfio-pci/unbind"),
            "{t}"
        );
        assert!(
            t.contains("echo '0' > /sys/bus/pci/devices/0000:3b:00.0/sriov_numvfs"),
            "{t}"
        );
        assert!(
            t.trim_end()
                .ends_with("echo '1' > /sys/bus/pci/devices/0000:3b:00.0/sriov_drivers_autoprobe"),
            "{t}"
        );
    }

    /// Issue 33: an attach that bound a GPU and its audio function to vfio-pci and then failed
    /// gives each back the binding it had; one that was on vfio-pci already, or that is gone,
    /// gets no step.
    #[test]
    fn give_back_returns_each_function_to_its_binding_before() {
        let before = [
            b("0000:17:00.0", Some("nouveau"), None),
            b("0000:17:00.1", Some("snd_hda_intel"), None),
            b("0000:3b:02.0", Some("vfio-pci"), Some("vfio-pci")),
            b("0000:3b:02.1", None, None),
            b("0000:3b:02.2", Some("vfio-pci"), None),
        ];
        let now = [
            b("0000:17:00.0", Some("vfio-pci"), Some("vfio-pci")),
            b("0000:17:00.1", Some("vfio-pci"), Some("vfio-pci")),
            b("0000:3b:02.0", Some("vfio-pci"), Some("vfio-pci")),
            b("0000:3b:02.1", Some("vfio-pci"), Some("vfio-pci")),
        ];
        let text = give_back(a("0000:17:00.0"), &before, &now).to_string();
        let order = [
            "echo '' > /sys/bus/pci/devices/0000:17:00.0/driver_override",
            "echo '0000:17:00.0' > /sys/bus/pci/drivers/vfio-pci/unbind",
            "echo '0000:17:00.0' > /sys/bus/pci/drivers_probe",
            "# expect 0000:17:00.0 bound to nouveau",
            "echo '' > /sys/bus/pci/devices/0000:17:00.1/driver_override",
            "echo '0000:17:00.1' > /sys/bus/pci/drivers/vfio-pci/unbind",
            "echo '0000:17:00.1' > /sys/bus/pci/drivers_probe",
            "# expect 0000:17:00.1 bound to snd_hda_intel",
            "echo '' > /sys/bus/pci/devices/0000:3b:02.1/driver_override",
            "echo '0000:3b:02.1' > /sys/bus/pci/drivers/vfio-pci/unbind",
        ];
        let mut at = 0;
        for o in order {
            let pos = text[at..]
                .find(o)
                .unwrap_or_else(|| panic!("missing or out of order: {o}\n{text}"));
            at += pos + o.len();
        }
        assert!(!text.contains("3b:02.0"), "unchanged: no step\n{text}");
        assert!(!text.contains("3b:02.2"), "gone: no step\n{text}");
        assert!(
            !text.contains("echo '0000:3b:02.1' > /sys/bus/pci/drivers_probe"),
            "a function that had no driver is not probed\n{text}"
        );
        assert!(give_back(a("0000:17:00.0"), &before[2..3], &now[2..3])
            .steps
            .is_empty());
    }
}
