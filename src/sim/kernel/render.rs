//! Renders the simulated kernel's state as files and relative symlinks, laid out like Linux's
//! sysfs, so that real tools (lspci, virsh's nodedev code paths, shell scripts) can read it.

use super::{viable_groups, SimDevice, SimKernel, State};
use crate::model::pci::PciAddress;
use std::fs;
use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// Creates `root/link` pointing at `root/target` with a relative path, replacing any old link.
fn rel_link(root: &Path, link: &Path, target: &Path) -> io::Result<()> {
    let depth = link.parent().map_or(0, |p| p.components().count());
    let mut rel = PathBuf::new();
    for _ in 0..depth {
        rel.push("..");
    }
    rel.push(target);
    let abs = root.join(link);
    if let Some(p) = abs.parent() {
        fs::create_dir_all(p)?;
    }
    match fs::remove_file(&abs) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    symlink(rel, abs)
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Replaces a file atomically (write a hidden sibling, rename over): a reader never sees a
/// half-written attribute, as with the kernel's sysfs.
fn write(path: &Path, content: impl AsRef<[u8]>) -> io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("attr");
    let tmp = path.with_file_name(format!(".{name}.new"));
    fs::write(&tmp, content)?;
    fs::rename(&tmp, path)
}

/// The top directories the kernel renders (everything else under the root is someone else's).
const TREES: [&str; 3] = ["sys", "dev", "proc"];

/// Removes every file the kernel rendered under `root`.
pub(super) fn wipe(root: &Path) -> io::Result<()> {
    for t in TREES {
        match fs::remove_dir_all(root.join(t)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Renders the whole tree of `st` from nothing, replacing whatever files were there: the
/// files of a reopened kernel are a function of its saved model alone.
pub(super) fn all(root: &Path, st: &State) -> io::Result<()> {
    wipe(root)?;
    skeleton(root, st)?;
    // Parents before the functions nested in their directories.
    let mut devices: Vec<&SimDevice> = st.devices.values().collect();
    devices.sort_by_key(|d| (d.dir.components().count(), d.spec.address));
    for d in devices {
        device(root, st, d)?;
        device_driver(root, st, d)?;
    }
    for d in st.devices.values() {
        let Some(sriov) = &d.spec.sriov else { continue };
        for i in 0..d.num_vfs {
            if let Some(vf) = SimKernel::vf_address(d.spec.address, sriov.offset, sriov.stride, i) {
                virtfn_link(root, &d.dir, i, vf, true)?;
            }
        }
    }
    refresh_vfio_nodes(root, st)?;
    iommu_units(root, st)?;
    host_use(root, st)
}

pub(super) fn skeleton(root: &Path, st: &State) -> io::Result<()> {
    let bus = root.join("sys/bus/pci");
    fs::create_dir_all(bus.join("devices"))?;
    fs::create_dir_all(bus.join("slots"))?;
    fs::create_dir_all(root.join("sys/kernel/iommu_groups"))?;
    fs::create_dir_all(root.join("sys/class/block"))?;
    fs::create_dir_all(root.join("sys/class/net"))?;
    fs::create_dir_all(root.join("dev/vfio"))?;
    fs::create_dir_all(root.join("proc"))?;
    write(&root.join("dev/vfio/vfio"), "")?;
    for f in ["drivers_probe", "rescan", "resource_alignment"] {
        write(&bus.join(f), "")?;
    }
    write(&bus.join("drivers_autoprobe"), "1\n")?;
    kernel(root, st)?;
    for name in st.drivers.keys() {
        driver(root, name)?;
    }
    Ok(())
}

/// A registered driver's directory under `bus/pci/drivers/`.
pub(super) fn driver(root: &Path, name: &str) -> io::Result<()> {
    let d = root.join("sys/bus/pci/drivers").join(name);
    fs::create_dir_all(&d)?;
    for f in ["bind", "unbind", "new_id", "remove_id", "uevent"] {
        write(&d.join(f), "")?;
    }
    Ok(())
}

/// The kernel's modules (`sys/module`) and its interrupts (`proc/interrupts`, whose chips are
/// `IR-` ones when interrupts are remapped), as [`super::KernelSpec`] says.
fn kernel(root: &Path, st: &State) -> io::Result<()> {
    for name in &st.kernel.modules {
        let dir = root.join("sys/module").join(name);
        fs::create_dir_all(&dir)?;
        write(&dir.join("initstate"), "live\n")?;
        if matches!(name.as_str(), "vfio_iommu_type1" | "iommufd") {
            fs::create_dir_all(dir.join("parameters"))?;
            write(&dir.join("parameters/allow_unsafe_interrupts"), "N\n")?;
        }
    }
    let ir = if st.kernel.interrupt_remapping {
        "IR-"
    } else {
        ""
    };
    let interrupts = [
        "            CPU0       CPU1".to_string(),
        format!("   0:         36          0  {ir}IO-APIC    2-edge      timer"),
        format!("   9:          0          0  {ir}IO-APIC    9-fasteoi   acpi"),
        format!("  24:          0         12  {ir}PCI-MSIX-0000:3d:00.0    0-edge      nvme0q0"),
        " NMI:          0          0   Non-maskable interrupts".to_string(),
        String::new(),
    ]
    .join("\n");
    write(&root.join("proc/interrupts"), interrupts)
}

/// The IOMMU's unit in `sys/class/iommu` (`dmar0`, as Intel VT-d names it) when any function
/// has an IOMMU group: the kernel lists its IOMMUs there.
pub(super) fn iommu_units(root: &Path, st: &State) -> io::Result<()> {
    if st.devices.values().any(|d| d.group.is_some()) {
        fs::create_dir_all(root.join("sys/class/iommu/dmar0"))?;
    }
    Ok(())
}

/// The 256-byte configuration space the kernel exposes as `config` (what lspci reads).
fn config_space(st: &State, dev: &SimDevice) -> Vec<u8> {
    let mut c = vec![0u8; 256];
    if dev.config_all_ones {
        return vec![0xff; 256];
    }
    let s = &dev.spec;
    // A VF's vendor and device registers read 0xffff in hardware; the kernel takes the ids
    // from the PF's SR-IOV capability instead.
    let (v, d) = if dev.physfn.is_some() {
        (0xffff, 0xffff)
    } else {
        (s.vendor_id, s.device_id)
    };
    c[0..2].copy_from_slice(&v.to_le_bytes());
    c[2..4].copy_from_slice(&d.to_le_bytes());
    let command: u16 = if dev.driver.is_some() { 0x0406 } else { 0x0000 };
    c[4..6].copy_from_slice(&command.to_le_bytes());
    c[6..8].copy_from_slice(&0x0010u16.to_le_bytes()); // status: capability list
    c[8] = s.revision;
    c[9] = s.class.prog_if();
    c[10] = s.class.sub();
    c[11] = s.class.base();
    let multifunction = st
        .devices
        .keys()
        .chain(std::iter::once(&s.address))
        .any(|a| {
            a.domain == s.address.domain
                && a.bus == s.address.bus
                && a.slot == s.address.slot
                && a.function != s.address.function
        })
        && dev.physfn.is_none();
    let header_type: u8 = if s.secondary_bus.is_some() { 1 } else { 0 };
    c[0x0e] = header_type | if multifunction { 0x80 } else { 0 };
    if let Some(sec) = s.secondary_bus {
        c[0x18] = s.address.bus;
        c[0x19] = sec;
        c[0x1a] = sec;
    } else {
        c[0x2c..0x2e].copy_from_slice(&s.subsystem_vendor_id.to_le_bytes());
        c[0x2e..0x30].copy_from_slice(&s.subsystem_device_id.to_le_bytes());
    }
    // One capability: PCI Express (id 0x10), endpoint or root port, then end of list.
    c[0x34] = 0x40;
    c[0x40] = 0x10;
    c[0x41] = 0x00;
    let port_type: u8 = if s.secondary_bus.is_some() { 0x4 } else { 0x0 };
    c[0x42] = 0x02 | (port_type << 4);
    c
}

fn uevent_text(dev: &SimDevice) -> String {
    let s = &dev.spec;
    let mut t = String::new();
    if let Some(d) = &dev.driver {
        t.push_str(&format!("DRIVER={d}\n"));
    }
    t.push_str(&format!(
        "PCI_CLASS={:X}\nPCI_ID={:04X}:{:04X}\nPCI_SUBSYS_ID={:04X}:{:04X}\nPCI_SLOT_NAME={}\n\
MODALIAS=pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}\n",
        s.class.0,
        s.vendor_id,
        s.device_id,
        s.subsystem_vendor_id,
        s.subsystem_device_id,
        s.address,
        s.vendor_id,
        s.device_id,
        s.subsystem_vendor_id,
        s.subsystem_device_id,
        s.class.base(),
        s.class.sub(),
        s.class.prog_if()
    ));
    t
}

fn aer_text(names: &[&str], total_name: &str, total: u64) -> String {
    let mut t = String::new();
    for n in names {
        t.push_str(&format!("{n} 0\n"));
    }
    t.push_str(&format!("{total_name} {total}\n"));
    t
}

/// Rewrites every attribute whose content depends on live state.
pub(super) fn device_attrs(root: &Path, st: &State, dev: &SimDevice) -> io::Result<()> {
    let dir = root.join(&dev.dir);
    write(&dir.join("uevent"), uevent_text(dev))?;
    write(
        &dir.join("driver_override"),
        format!("{}\n", dev.driver_override.as_deref().unwrap_or("(null)")),
    )?;
    write(
        &dir.join("enable"),
        if dev.driver.is_some() { "1\n" } else { "0\n" },
    )?;
    if let Some(sriov) = &dev.spec.sriov {
        write(
            &dir.join("sriov_totalvfs"),
            format!("{}\n", sriov.total_vfs),
        )?;
        write(&dir.join("sriov_numvfs"), format!("{}\n", dev.num_vfs))?;
        write(
            &dir.join("sriov_drivers_autoprobe"),
            if dev.autoprobe { "1\n" } else { "0\n" },
        )?;
        write(&dir.join("sriov_offset"), format!("{}\n", sriov.offset))?;
        write(&dir.join("sriov_stride"), format!("{}\n", sriov.stride))?;
        write(
            &dir.join("sriov_vf_device"),
            format!("{:04x}\n", sriov.vf_device_id),
        )?;
    }
    if dev.spec.aer {
        write(
            &dir.join("aer_dev_correctable"),
            aer_text(
                &["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout"],
                "TOTAL_ERR_COR",
                dev.aer[0],
            ),
        )?;
        write(
            &dir.join("aer_dev_nonfatal"),
            aer_text(
                &["Undefined", "DLP", "PoisonedTLP", "CompleterAbort"],
                "TOTAL_ERR_NONFATAL",
                dev.aer[1],
            ),
        )?;
        write(
            &dir.join("aer_dev_fatal"),
            aer_text(
                &["Undefined", "DLP", "SDES", "MalfTLP"],
                "TOTAL_ERR_FATAL",
                dev.aer[2],
            ),
        )?;
    }
    if !dev.spec.reset_methods.is_empty() {
        // An empty list reads as an empty file, not an empty line.
        let listed = dev.enabled_resets().join(" ");
        write(
            &dir.join("reset_method"),
            if listed.is_empty() {
                listed
            } else {
                listed + "\n"
            },
        )?;
    }
    dfl(root, dev)?;
    device_config(root, st, dev)
}

/// The FME and port a DFL card shows while `dfl-pci` drives it, and its `/dev/dfl-fme.N`.
pub(super) fn dfl(root: &Path, dev: &SimDevice) -> io::Result<()> {
    let Some(d) = &dev.spec.dfl else {
        return Ok(());
    };
    let region = root
        .join(&dev.dir)
        .join("fpga_region")
        .join(format!("region{}", d.index));
    let node = root.join(format!("dev/dfl-fme.{}", d.index));
    if dev.driver.as_deref() != Some("dfl-pci") {
        remove_if_exists(&node)?;
        return match std::fs::remove_dir_all(root.join(&dev.dir).join("fpga_region")) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    }
    let fme = region.join(format!("dfl-fme.{}", d.index));
    std::fs::create_dir_all(fme.join("pr"))?;
    write(
        &fme.join("pr/interface_id"),
        format!("{}\n", d.interface_id),
    )?;
    let port = region.join(format!("dfl-port.{}", d.index));
    std::fs::create_dir_all(&port)?;
    write(&port.join("afu_id"), format!("{}\n", d.afu_id))?;
    std::fs::create_dir_all(root.join("dev"))?;
    if !node.exists() {
        write(&node, "")?;
    }
    Ok(())
}

pub(super) fn device_config(root: &Path, st: &State, dev: &SimDevice) -> io::Result<()> {
    write(&root.join(&dev.dir).join("config"), config_space(st, dev))
}

/// Creates a function's directory with every attribute and link the kernel shows.
pub(super) fn device(root: &Path, st: &State, dev: &SimDevice) -> io::Result<()> {
    let s = &dev.spec;
    let dir = root.join(&dev.dir);
    fs::create_dir_all(&dir)?;
    write(&dir.join("vendor"), format!("0x{:04x}\n", s.vendor_id))?;
    write(&dir.join("device"), format!("0x{:04x}\n", s.device_id))?;
    write(
        &dir.join("subsystem_vendor"),
        format!("0x{:04x}\n", s.subsystem_vendor_id),
    )?;
    write(
        &dir.join("subsystem_device"),
        format!("0x{:04x}\n", s.subsystem_device_id),
    )?;
    write(&dir.join("class"), format!("0x{:06x}\n", s.class.0))?;
    write(&dir.join("revision"), format!("0x{:02x}\n", s.revision))?;
    write(&dir.join("numa_node"), format!("{}\n", s.numa_node))?;
    write(&dir.join("local_cpulist"), "0-1\n")?;
    write(&dir.join("irq"), "0\n")?;
    write(
        &dir.join("modalias"),
        uevent_text(dev)
            .lines()
            .find_map(|l| l.strip_prefix("MODALIAS="))
            .unwrap_or("")
            .to_string()
            + "\n",
    )?;
    write(
        &dir.join("resource"),
        "0x0000000000000000 0x0000000000000000 0x0000000000000000\n".repeat(7),
    )?;
    write(&dir.join("remove"), "")?;
    write(&dir.join("rescan"), "")?;
    // The kernel shows `reset` and `reset_method` when it found a reset method for the
    // function as it appeared, whatever is written to `reset_method` later.
    if !s.reset_methods.is_empty() {
        write(&dir.join("reset"), "")?;
    }
    if s.reset_subordinate && s.secondary_bus.is_some() {
        write(&dir.join("reset_subordinate"), "")?;
    }
    // The kernel shows `boot_vga` on VGA-compatible display functions only.
    if s.class.0 >> 8 == 0x0300 {
        write(
            &dir.join("boot_vga"),
            if s.boot_vga { "1\n" } else { "0\n" },
        )?;
    }
    rel_link(root, &dev.dev_rel("subsystem"), Path::new("sys/bus/pci"))?;
    if let Some(g) = dev.group {
        let gdir = PathBuf::from(format!("sys/kernel/iommu_groups/{g}"));
        fs::create_dir_all(root.join(&gdir).join("devices"))?;
        write(&root.join(&gdir).join("type"), "DMA\n")?;
        write(&root.join(&gdir).join("reserved_regions"), "")?;
        rel_link(root, &dev.dev_rel("iommu_group"), &gdir)?;
        rel_link(
            root,
            &gdir.join("devices").join(s.address.to_string()),
            &dev.dir,
        )?;
    }
    if let Some(pf) = dev.physfn {
        let pf_dir = st
            .devices
            .get(&pf)
            .map(|p| p.dir.clone())
            .unwrap_or_default();
        rel_link(root, &dev.dev_rel("physfn"), &pf_dir)?;
    }
    device_attrs(root, st, dev)?;
    // Listed on the bus last, once every attribute exists: the kernel shows a device whole.
    rel_link(
        root,
        &Path::new("sys/bus/pci/devices").join(s.address.to_string()),
        &dev.dir,
    )
}

pub(super) fn device_driver(root: &Path, st: &State, dev: &SimDevice) -> io::Result<()> {
    if let Some(d) = &dev.driver {
        let ddir = PathBuf::from("sys/bus/pci/drivers").join(d);
        rel_link(root, &dev.dev_rel("driver"), &ddir)?;
        rel_link(root, &ddir.join(dev.spec.address.to_string()), &dev.dir)?;
    }
    device_attrs(root, st, dev)
}

pub(super) fn device_driver_removed(root: &Path, dev: &SimDevice, old: &str) -> io::Result<()> {
    remove_if_exists(&root.join(dev.dev_rel("driver")))?;
    remove_if_exists(
        &root
            .join("sys/bus/pci/drivers")
            .join(old)
            .join(dev.spec.address.to_string()),
    )?;
    let dir = root.join(&dev.dir);
    write(
        &dir.join("uevent"),
        uevent_text(dev)
            .lines()
            .filter(|l| !l.starts_with("DRIVER="))
            .map(|l| format!("{l}\n"))
            .collect::<String>(),
    )?;
    write(&dir.join("enable"), "0\n")?;
    dfl(root, dev)
}

pub(super) fn remove_device(root: &Path, st: &State, dev: &SimDevice) -> io::Result<()> {
    let addr = dev.spec.address.to_string();
    remove_if_exists(&root.join("sys/bus/pci/devices").join(&addr))?;
    if let Some(g) = dev.group {
        let gdir = root.join(format!("sys/kernel/iommu_groups/{g}"));
        remove_if_exists(&gdir.join("devices").join(&addr))?;
        let still_used = st.devices.values().any(|d| d.group == Some(g));
        if !still_used {
            let _ = fs::remove_dir_all(&gdir);
        }
    }
    fs::remove_dir_all(root.join(&dev.dir))
}

pub(super) fn virtfn_link(
    root: &Path,
    pf_dir: &Path,
    index: u32,
    vf: PciAddress,
    create: bool,
) -> io::Result<()> {
    let link = pf_dir.join(format!("virtfn{index}"));
    if create {
        let vf_dir = pf_dir
            .parent()
            .unwrap_or(Path::new(""))
            .join(vf.to_string());
        rel_link(root, &link, &vf_dir)
    } else {
        remove_if_exists(&root.join(link))
    }
}

pub(super) fn refresh_vfio_nodes(root: &Path, st: &State) -> io::Result<()> {
    let dir = root.join("dev/vfio");
    let viable = viable_groups(st);
    for entry in fs::read_dir(&dir)? {
        let entry = entry?;
        if let Some(g) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        {
            if !viable.contains(&g) {
                fs::remove_file(entry.path())?;
            }
        }
    }
    for g in viable {
        let p = dir.join(g.to_string());
        if !p.exists() {
            write(&p, "")?;
        }
    }
    // The VFIO device nodes (`/dev/vfio/devices/vfioN`) of the functions on vfio-pci.
    match fs::remove_dir_all(dir.join("devices")) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    for d in st.devices.values() {
        let vfio_dev = root.join(&d.dir).join("vfio-dev");
        match d.vfio_minor {
            Some(m) => {
                let name = format!("vfio{m}");
                let sys_dir = d.dir.join("vfio-dev").join(&name);
                fs::create_dir_all(root.join(&sys_dir))?;
                node(
                    root,
                    &format!("vfio/devices/{name}"),
                    "char",
                    &format!("{VFIO_CDEV_MAJOR}:{m}"),
                    &sys_dir,
                )?;
            }
            None if vfio_dev.exists() => fs::remove_dir_all(vfio_dev)?,
            None => {}
        }
    }
    Ok(())
}

/// A simulated `/dev` node: a file that says its kind and number (`block 259:1`), which the
/// kernel's [`super::Backend::device_number`] reads back.
fn node(root: &Path, dev_path: &str, kind: &str, number: &str, sys_dir: &Path) -> io::Result<()> {
    let file = root.join("dev").join(dev_path);
    if let Some(p) = file.parent() {
        fs::create_dir_all(p)?;
    }
    write(&file, format!("{kind} {number}\n"))?;
    write(&root.join(sys_dir).join("dev"), format!("{number}\n"))?;
    rel_link(root, &Path::new("sys/dev").join(kind).join(number), sys_dir)
}

/// What a simulated `/dev` node file says: its kind and number; `None` for anything else.
pub(super) fn read_node(path: &Path) -> Option<crate::host::sysfs::DeviceNumber> {
    use crate::host::sysfs::{DeviceNumber, NodeKind};
    let text = fs::read_to_string(path).ok()?;
    let (kind, number) = text.trim().split_once(' ')?;
    let (major, minor) = number.split_once(':')?;
    let kind = match kind {
        "block" => NodeKind::Block,
        "char" => NodeKind::Char,
        _ => return None,
    };
    Some(DeviceNumber {
        kind,
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

/// Block devices' major (NVMe namespaces and partitions) and device-mapper's.
const BLOCK_EXT_MAJOR: u32 = 259;
const DM_MAJOR: u32 = 253;
const MD_MAJOR: u32 = 9;
/// The NVMe controllers' character major (`/dev/nvme0`) and VFIO devices' (`/dev/vfio/devices`).
const NVME_CHAR_MAJOR: u32 = 241;
const VFIO_CDEV_MAJOR: u32 = 511;

/// A holder's device number: `dm-N` is 253:N, `mdN` 9:N, anything else 252:0.
fn holder_number(name: &str) -> String {
    let digits = |p: &str| name.strip_prefix(p).and_then(|n| n.parse::<u32>().ok());
    match (digits("dm-"), digits("md")) {
        (Some(n), _) => format!("{DM_MAJOR}:{n}"),
        (None, Some(n)) => format!("{MD_MAJOR}:{n}"),
        _ => "252:0".into(),
    }
}

/// Holder `h` of block device `held` is gone: its directory, node and links.
pub(super) fn holder_gone(root: &Path, held_dir: Option<&Path>, h: &str) -> io::Result<()> {
    let dir = Path::new("sys/devices/virtual/block").join(h);
    match fs::remove_dir_all(root.join(&dir)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    remove_if_exists(&root.join("sys/class/block").join(h))?;
    remove_if_exists(&root.join("dev").join(h))?;
    remove_if_exists(&root.join("sys/dev/block").join(holder_number(h)))?;
    if let Some(d) = held_dir {
        remove_if_exists(&root.join(d).join("holders").join(h))?;
    }
    Ok(())
}

/// Where block device `name` of the model lives, relative to the root.
pub(super) fn block_dir(root: &Path, name: &str) -> Option<PathBuf> {
    let canon = fs::canonicalize(root.join("sys/class/block").join(name)).ok()?;
    canon.strip_prefix(root).ok().map(Path::to_path_buf)
}

/// A process of the model: `/proc/PID/comm`, `cmdline`, and `fd/N` links to its nodes (from
/// 3 up, as after stdin, stdout, stderr).
pub(super) fn process(root: &Path, p: &super::ProcessSpec) -> io::Result<()> {
    let dir = root.join("proc").join(p.pid.to_string());
    match fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    fs::create_dir_all(dir.join("fd"))?;
    write(&dir.join("comm"), format!("{}\n", p.comm))?;
    let mut cmdline = Vec::new();
    for a in &p.cmdline {
        cmdline.extend_from_slice(a.as_bytes());
        cmdline.push(0);
    }
    write(&dir.join("cmdline"), cmdline)?;
    for (i, n) in p.nodes.iter().enumerate() {
        symlink(n, dir.join("fd").join((i + 3).to_string()))?;
    }
    Ok(())
}

/// Process `pid` ended: its `/proc/PID` goes.
pub(super) fn process_gone(root: &Path, pid: u32) -> io::Result<()> {
    match fs::remove_dir_all(root.join("proc").join(pid.to_string())) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The host's own use of its devices: NVMe namespaces (mounted partitions, swap, multipath
/// heads), their holders (dm, md), interfaces that are up, processes with nodes open.
pub(super) fn host_use(root: &Path, st: &State) -> io::Result<()> {
    let mut mounts = String::new();
    let mut swaps = String::from("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n");
    mounts.push_str("proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n");
    mounts.push_str("sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n");
    mounts.push_str("tmpfs /run tmpfs rw,nosuid,nodev,size=3273516k,mode=755 0 0\n");
    let mut block_dirs: Vec<(String, PathBuf)> = Vec::new();
    for m in &st.mounts {
        let Some(ctrl) = st.devices.get(&m.controller) else {
            continue;
        };
        let ctrl_name = format!("nvme{}", m.instance);
        let disk = format!("nvme{}n1", m.instance);
        let ctrl_dir = ctrl.dir.join("nvme").join(&ctrl_name);
        fs::create_dir_all(root.join(&ctrl_dir))?;
        node(
            root,
            &ctrl_name,
            "char",
            &format!("{NVME_CHAR_MAJOR}:{}", m.instance),
            &ctrl_dir,
        )?;
        let disk_dir = if m.multipath {
            let subsys = PathBuf::from(format!(
                "sys/devices/virtual/nvme-subsystem/nvme-subsys{}",
                m.instance
            ));
            fs::create_dir_all(root.join(&subsys))?;
            rel_link(root, &subsys.join(&ctrl_name), &ctrl_dir)?;
            subsys.join(&disk)
        } else {
            ctrl_dir.join(&disk)
        };
        fs::create_dir_all(root.join(&disk_dir))?;
        rel_link(root, &Path::new("sys/class/block").join(&disk), &disk_dir)?;
        block_dirs.push((disk.clone(), disk_dir.clone()));
        for (n, target) in &m.partitions {
            let part = format!("{disk}p{n}");
            let part_dir = disk_dir.join(&part);
            fs::create_dir_all(root.join(&part_dir))?;
            write(&root.join(&part_dir).join("partition"), format!("{n}\n"))?;
            rel_link(root, &Path::new("sys/class/block").join(&part), &part_dir)?;
            block_dirs.push((part.clone(), part_dir));
            if target == "swap" {
                swaps.push_str(&format!(
                    "/dev/{part}\t\t\t\tpartition\t8388604\t\t0\t\t-2\n"
                ));
            } else if !target.is_empty() {
                mounts.push_str(&format!("/dev/{part} {target} ext4 rw,relatime 0 0\n"));
            }
        }
    }
    for (i, (name, dir)) in block_dirs.iter().enumerate() {
        node(root, name, "block", &format!("{BLOCK_EXT_MAJOR}:{i}"), dir)?;
        fs::create_dir_all(root.join(dir).join("holders"))?;
    }
    for (held, hs) in &st.holders {
        let Some((_, held_dir)) = block_dirs.iter().find(|(n, _)| n == held) else {
            continue;
        };
        for (h, dm_name) in hs {
            let h_dir = Path::new("sys/devices/virtual/block").join(h);
            fs::create_dir_all(root.join(&h_dir).join("slaves"))?;
            if let Some(dm) = dm_name {
                fs::create_dir_all(root.join(&h_dir).join("dm"))?;
                write(&root.join(&h_dir).join("dm/name"), format!("{dm}\n"))?;
            }
            rel_link(root, &h_dir.join("slaves").join(held), held_dir)?;
            rel_link(root, &held_dir.join("holders").join(h), &h_dir)?;
            rel_link(root, &Path::new("sys/class/block").join(h), &h_dir)?;
            node(root, h, "block", &holder_number(h), &h_dir)?;
        }
    }
    for p in st.processes.values() {
        process(root, p)?;
    }
    write(&root.join("proc/mounts"), mounts)?;
    write(&root.join("proc/swaps"), swaps)?;
    for i in &st.interfaces {
        let Some(dev) = st.devices.get(&i.device) else {
            continue;
        };
        let ndir = dev.dir.join("net").join(&i.name);
        fs::create_dir_all(root.join(&ndir))?;
        write(
            &root.join(&ndir).join("operstate"),
            if i.up { "up\n" } else { "down\n" },
        )?;
        write(
            &root.join(&ndir).join("flags"),
            if i.up { "0x1003\n" } else { "0x1002\n" },
        )?;
        rel_link(root, &Path::new("sys/class/net").join(&i.name), &ndir)?;
    }
    consoles(root, st)?;
    // The loopback interface: up, but no PCI device behind it.
    let lo = Path::new("sys/devices/virtual/net/lo");
    fs::create_dir_all(root.join(lo))?;
    write(&root.join(lo).join("flags"), "0x9\n")?;
    write(&root.join(lo).join("operstate"), "unknown\n")?;
    rel_link(root, Path::new("sys/class/net/lo"), lo)?;
    Ok(())
}

/// The console on framebuffers: `sys/class/graphics/fbN` (in the GPU's directory, or on the
/// firmware's platform device) and fbcon's `vtconsole`, bound; the dummy console beside it, as
/// the kernel has it. Nothing for a host without a console (the reference).
fn consoles(root: &Path, st: &State) -> io::Result<()> {
    if st.consoles.is_empty() {
        return Ok(());
    }
    for c in &st.consoles {
        let name = format!("fb{}", c.fb);
        let (device, driver) = match c.device.and_then(|a| st.devices.get(&a)) {
            Some(gpu) => (
                gpu.dir.clone(),
                format!("{}drmfb", gpu.spec.driver.as_deref().unwrap_or("")),
            ),
            None => (
                PathBuf::from("sys/devices/platform/efi-framebuffer.0"),
                "EFI VGA".to_string(),
            ),
        };
        fs::create_dir_all(root.join(&device))?;
        let fb_dir = device.join("graphics").join(&name);
        fs::create_dir_all(root.join(&fb_dir))?;
        write(&root.join(&fb_dir).join("name"), format!("{driver}\n"))?;
        rel_link(root, &fb_dir.join("device"), &device)?;
        rel_link(root, &Path::new("sys/class/graphics").join(&name), &fb_dir)?;
    }
    for (n, text, bind) in [
        (0, "(S) dummy device", "0"),
        (1, "(M) frame buffer device", "1"),
    ] {
        let dir = PathBuf::from(format!("sys/devices/virtual/vtconsole/vtcon{n}"));
        fs::create_dir_all(root.join(&dir))?;
        write(&root.join(&dir).join("name"), format!("{text}\n"))?;
        write(&root.join(&dir).join("bind"), format!("{bind}\n"))?;
        rel_link(
            root,
            &Path::new("sys/class/vtconsole").join(format!("vtcon{n}")),
            &dir,
        )?;
    }
    Ok(())
}

impl SimDevice {
    fn dev_rel(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}
