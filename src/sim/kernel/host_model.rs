//! Host models for the simulated kernel: what functions a host has, which drivers are loaded,
//! what the host itself has mounted and up.

use crate::model::pci::{ClassCode, PciAddress};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// SR-IOV capability of a physical function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SriovSpec {
    pub total_vfs: u32,
    pub vf_device_id: u16,
    /// Native host driver for the VFs (bound when `sriov_drivers_autoprobe` is 1).
    pub vf_driver: Option<String>,
    /// Routing-id offset and stride of the first VF, as in the SR-IOV capability.
    pub offset: u16,
    pub stride: u16,
    /// VFs enabled when the model boots.
    pub initial_vfs: u32,
}

/// Which IOMMU group a function lands in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupSpec {
    /// A group of its own (ACS-isolated).
    Own,
    /// The same group as another function (e.g. a GPU's HDMI audio).
    With(PciAddress),
    /// No IOMMU group (IOMMU off for it).
    None,
}

/// One PCI function of the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionSpec {
    pub address: PciAddress,
    pub vendor_id: u16,
    pub device_id: u16,
    pub subsystem_vendor_id: u16,
    pub subsystem_device_id: u16,
    pub class: ClassCode,
    pub revision: u8,
    pub numa_node: i32,
    /// Native driver, bound at boot when loaded.
    pub driver: Option<String>,
    pub sriov: Option<SriovSpec>,
    /// Upstream bridge (root port); `None` for functions on the root bus.
    pub parent: Option<PciAddress>,
    pub group: GroupSpec,
    /// The reset methods the kernel found for it, in its order (`reset_method` at boot, and
    /// what `default` restores); none: no `reset` nor `reset_method` attribute.
    pub reset_methods: Vec<String>,
    /// What each reset method does to it, by name; a method without an entry works. A listed
    /// method that does not work is one with a failing behaviour here. `bus` is also what a
    /// bus reset through the upstream bridge's `reset_subordinate` does to it.
    #[serde(default)]
    pub reset_behaviour: BTreeMap<String, ResetBehaviour>,
    /// For bridges: the kernel shows `reset_subordinate` (recent kernels; Debian 12's 6.1.192
    /// has it, older ones do not), which resets    /// the whole secondary bus below.
    #[serde(default)]
    pub reset_subordinate: bool,
    pub aer: bool,
    /// For bridges: the secondary bus number.
    pub secondary_bus: Option<u8>,
    /// An Intel DFL FPGA card: its FME and port, shown while the PF is on `dfl-pci`.
    #[serde(default)]
    pub dfl: Option<DflSpec>,
    /// Where the function's directory is, relative to the root, when not
    /// `sys/devices/pciDDDD:BB/...` under its parent's: a replayed host's own layout (VMD
    /// domains, bridges the recording does not have). Its VFs are made beside it.
    #[serde(default)]
    pub sysfs_dir: Option<std::path::PathBuf>,
    /// For a VGA-class function: the firmware booted on it (`boot_vga` reads 1; 0 on the
    /// others of its class, which the kernel also shows).
    #[serde(default)]
    pub boot_vga: bool,
}

/// What one reset method does to a function when the kernel runs it: the outcomes users report
/// (a listed method that never completes, a reset that hangs the host, a device that reads
/// all-ones after a reset until the host reboots, a driver lost in the reset).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResetBehaviour {
    /// The function is reset; config space is restored and the driver stays bound.
    Works,
    /// The method fails with `errno` after `delay_ms`, changing nothing. ENOTTY makes the
    /// kernel try the next listed method (a FLR that never completes ends so, after the
    /// kernel's wait); any other errno ends the reset with that error.
    Fails { errno: i32, delay_ms: u64 },
    /// The reset never comes back: the write blocks until [`super::SimKernel::release_hangs`]
    /// (then fails with EINTR, changing nothing).
    Hangs,
    /// The reset "works", but afterwards the function's config space reads all-ones.
    AllOnes,
    /// The reset works, but the function's driver is unbound by it.
    Unbinds,
}

/// A DFL FPGA card as the Linux DFL drivers show it: one FME (`dfl-fme.N`, with the static
/// region's `pr/interface_id` and the `/dev/dfl-fme.N` node partial reconfiguration goes
/// through) and one port (`dfl-port.N`, with the `afu_id` of what the green bitstream loaded).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DflSpec {
    /// N of `dfl-fme.N`, `dfl-port.N`, `region N`: unique on the host.
    pub index: u32,
    /// 32 lowercase hex digits, as `pr/interface_id` prints it.
    pub interface_id: String,
    /// The port's current AFU, 32 lowercase hex digits; partial reconfiguration changes it.
    pub afu_id: String,
}

impl FunctionSpec {
    pub fn new(address: &str, vendor_id: u16, device_id: u16, class: u32) -> Self {
        FunctionSpec {
            address: address.parse().expect("model address"),
            vendor_id,
            device_id,
            subsystem_vendor_id: vendor_id,
            subsystem_device_id: 0,
            class: ClassCode(class),
            revision: 1,
            numa_node: 0,
            driver: None,
            sriov: None,
            parent: None,
            group: GroupSpec::Own,
            reset_methods: vec!["flr".into(), "bus".into()],
            reset_behaviour: BTreeMap::new(),
            reset_subordinate: false,
            aer: true,
            secondary_bus: None,
            dfl: None,
            sysfs_dir: None,
            boot_vga: false,
        }
    }
    pub fn subsystem(mut self, vendor: u16, device: u16) -> Self {
        self.subsystem_vendor_id = vendor;
        self.subsystem_device_id = device;
        self
    }
    pub fn revision(mut self, r: u8) -> Self {
        self.revision = r;
        self
    }
    pub fn driver(mut self, d: &str) -> Self {
        self.driver = Some(d.to_string());
        self
    }
    pub fn numa(mut self, n: i32) -> Self {
        self.numa_node = n;
        self
    }
    pub fn under(mut self, parent: &str) -> Self {
        self.parent = Some(parent.parse().expect("model parent"));
        self
    }
    pub fn group_with(mut self, other: &str) -> Self {
        self.group = GroupSpec::With(other.parse().expect("model group peer"));
        self
    }
    /// The firmware booted on it (`boot_vga` = 1).
    pub fn boot_vga(mut self) -> Self {
        self.boot_vga = true;
        self
    }
    pub fn no_iommu(mut self) -> Self {
        self.group = GroupSpec::None;
        self
    }
    pub fn sriov(
        mut self,
        total_vfs: u32,
        vf_device_id: u16,
        vf_driver: &str,
        offset: u16,
    ) -> Self {
        self.sriov = Some(SriovSpec {
            total_vfs,
            vf_device_id,
            vf_driver: Some(vf_driver.to_string()),
            offset,
            stride: 1,
            initial_vfs: 0,
        });
        self
    }
    pub fn initial_vfs(mut self, n: u32) -> Self {
        if let Some(s) = self.sriov.as_mut() {
            s.initial_vfs = n;
        }
        self
    }
    /// A DFL FPGA card: FME and port number `index`, its static region's interface id and the
    /// AFU it boots with.
    pub fn dfl(mut self, index: u32, interface_id: &str, afu_id: &str) -> Self {
        self.dfl = Some(DflSpec {
            index,
            interface_id: interface_id.into(),
            afu_id: afu_id.into(),
        });
        self
    }
    pub fn bridge_to(mut self, secondary_bus: u8) -> Self {
        self.secondary_bus = Some(secondary_bus);
        self
    }
    /// The reset methods the kernel lists for it, in order (none: it cannot be reset alone).
    pub fn reset_methods(mut self, methods: &[&str]) -> Self {
        self.reset_methods = methods.iter().map(|m| m.to_string()).collect();
        self
    }
    /// What `method` does to it when run.
    pub fn reset_behaviour(mut self, method: &str, behaviour: ResetBehaviour) -> Self {
        self.reset_behaviour.insert(method.to_string(), behaviour);
        self
    }
    /// For a bridge: shows `reset_subordinate`.
    pub fn reset_subordinate(mut self) -> Self {
        self.reset_subordinate = true;
        self
    }
}

/// A kernel driver the model has loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverSpec {
    pub name: String,
    /// vendor:device pairs it binds to by itself. `vfio-pci` has none: it binds only through
    /// `driver_override` (or `new_id`).
    pub ids: Vec<(u16, u16)>,
    /// Whether it implements `sriov_configure` (else `sriov_numvfs` writes fail with ENOENT).
    pub sriov_configure: bool,
}

impl DriverSpec {
    pub fn new(name: &str, ids: &[(u16, u16)], sriov_configure: bool) -> Self {
        DriverSpec {
            name: name.to_string(),
            ids: ids.to_vec(),
            sriov_configure,
        }
    }
}

/// A block device the host has mounted (or uses as swap), on a modelled NVMe controller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountSpec {
    pub controller: PciAddress,
    /// Controller instance, e.g. 0 for nvme0.
    pub instance: u32,
    /// Partition number, mount point ("swap" for swap, "" for a partition nothing mounts).
    pub partitions: Vec<(u32, String)>,
    /// The namespace is a native NVMe multipath head
    /// (`sys/devices/virtual/nvme-subsystem/nvme-subsysN/nvmeNn1`, no PCI parent; the
    /// subsystem links the controller), as Debian's default `nvme_core.multipath=Y` shows it.
    #[serde(default)]
    pub multipath: bool,
}

impl MountSpec {
    /// A namespace `nvme<instance>n1` on `controller` with nothing mounted.
    pub fn disk(controller: &str, instance: u32) -> Self {
        MountSpec {
            controller: controller.parse().expect("model address"),
            instance,
            partitions: Vec::new(),
            multipath: false,
        }
    }
}

/// A process holding device nodes open, as `/proc/PID` shows it (`comm`, `cmdline`, one
/// `fd/N` link per node).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSpec {
    pub pid: u32,
    pub comm: String,
    /// Its arguments (`qemu-system-x86_64 -name guest=vm1,...`).
    pub cmdline: Vec<String>,
    /// The nodes it has open, as `/dev` paths (`/dev/nvme1n1`, `/dev/vfio/devices/vfio0`).
    pub nodes: Vec<String>,
}

/// A network interface on a modelled NIC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterfaceSpec {
    pub device: PciAddress,
    pub name: String,
    pub up: bool,
}

/// A framebuffer the host's console (fbcon) is bound to: `sys/class/graphics/fbN` and the
/// `vtconsole` of fbcon, bound.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleSpec {
    /// N of `fbN`.
    pub fb: u32,
    /// The GPU whose DRM driver made it; `None`: the firmware's framebuffer (`EFI VGA`), a
    /// platform device.
    pub device: Option<PciAddress>,
}

/// What the kernel itself shows of its IOMMU and VFIO beside the devices, for the checks of
/// `vfioctl doctor`: the modules `sys/module` lists and whether interrupts are remapped
/// (`proc/interrupts` names `IR-` chips). The IOMMU's own unit, `sys/class/iommu/dmar0`, is
/// there whenever any function has an IOMMU group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelSpec {
    /// Loaded modules (`sys/module/<name>/initstate` reads `live`; `vfio_iommu_type1` and
    /// `iommufd` show `parameters/allow_unsafe_interrupts`, `N`).
    pub modules: Vec<String>,
    /// The kernel remaps interrupts (VT-d/AMD-Vi with `intremap` on).
    pub interrupt_remapping: bool,
}

impl Default for KernelSpec {
    /// A kernel ready for passthrough: vfio, vfio-pci and the type1 IOMMU backend loaded,
    /// interrupts remapped.
    fn default() -> Self {
        KernelSpec {
            modules: ["vfio", "vfio_iommu_type1", "vfio_pci", "vfio_pci_core"]
                .map(String::from)
                .to_vec(),
            interrupt_remapping: true,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct HostModel {
    pub functions: Vec<FunctionSpec>,
    pub drivers: Vec<DriverSpec>,
    pub mounts: Vec<MountSpec>,
    pub interfaces: Vec<InterfaceSpec>,
    /// Framebuffers with the console on them (none: a headless host, the reference).
    pub consoles: Vec<ConsoleSpec>,
    /// The IOMMU group a function gets whenever it appears (a VF too), as a replayed host
    /// numbered them; other groups are numbered from 0 up, skipping these numbers.
    pub iommu_groups: std::collections::BTreeMap<PciAddress, u32>,
    /// The kernel's modules and interrupt remapping (default: ready for passthrough).
    pub kernel: KernelSpec,
}

const INTEL: u16 = 0x8086;
/// The reference FPGA's static region (`pr/interface_id` of `dfl-fme.0`).
pub const REFERENCE_FPGA_INTERFACE: &str = "bfac4d851ee856fe8c95865ce1bbaa2d";
/// The AFU the reference FPGA boots with (`afu_id` of `dfl-port.0`).
pub const REFERENCE_FPGA_AFU: &str = "00000000000000000000000000000001";
const NVIDIA: u16 = 0x10de;
const SAMSUNG: u16 = 0x144d;

/// A root port of the model's hosts, to secondary bus `bus`. On the root bus it has no bus
/// reset of its own, and no FLR; the kernel is new enough to show `reset_subordinate` (the
/// only reset of the reference GPU and its audio function).
fn root_port(address: &str, bus: u8) -> FunctionSpec {
    FunctionSpec::new(address, INTEL, 0x347a, 0x060400)
        .driver("pcieport")
        .revision(4)
        .bridge_to(bus)
        .reset_methods(&[])
        .reset_subordinate()
}

impl HostModel {
    /// The realistic reference host: a GPU with its HDMI audio function in one IOMMU group, an
    /// SR-IOV NIC (64 VFs), a QAT accelerator (16 VFs), an FPGA card with SR-IOV (4 VFs), a data
    /// NVMe drive, and the host's own boot NVMe (mounted) and NIC (up). The QAT boots split.
    pub fn reference() -> HostModel {
        let functions = vec![
            FunctionSpec::new("0000:00:00.0", INTEL, 0x09a2, 0x080700)
                .revision(4)
                .reset_methods(&[]),
            root_port("0000:00:01.0", 0x17),
            root_port("0000:00:02.0", 0x3b),
            root_port("0000:00:03.0", 0x5e),
            root_port("0000:00:04.0", 0xaf),
            root_port("0000:00:05.0", 0xd8),
            root_port("0000:00:1c.0", 0x02),
            root_port("0000:00:1d.0", 0x3d),
            // Host NIC, up: protected.
            FunctionSpec::new("0000:02:00.0", INTEL, 0x15f3, 0x020000)
                .subsystem(INTEL, 0x0000)
                .revision(3)
                .driver("igc")
                .under("0000:00:1c.0"),
            // GPU + HDMI audio: one IOMMU group, no SR-IOV. Neither has FLR, and a
            // multi-function device has no `bus` method (it would reset the sibling): only
            // the root port's `reset_subordinate` resets them, both at once.
            FunctionSpec::new("0000:17:00.0", NVIDIA, 0x2204, 0x030000)
                .subsystem(0x1458, 0x403b)
                .revision(0xa1)
                .driver("nouveau")
                .under("0000:00:01.0")
                .reset_methods(&[]),
            FunctionSpec::new("0000:17:00.1", NVIDIA, 0x1aef, 0x040300)
                .subsystem(0x1458, 0x403b)
                .revision(0xa1)
                .driver("snd_hda_intel")
                .under("0000:00:01.0")
                .group_with("0000:17:00.0")
                .reset_methods(&[]),
            // SR-IOV NIC: Intel X710, 64 VFs (iavf on the host when autoprobed).
            FunctionSpec::new("0000:3b:00.0", INTEL, 0x1572, 0x020000)
                .subsystem(INTEL, 0x0001)
                .revision(2)
                .driver("i40e")
                .under("0000:00:02.0")
                .sriov(64, 0x154c, "iavf", 16),
            // QAT: Intel C62x, 16 VFs, already split at boot (as a distribution's qat
            // service does), its VFs on the host's c6xxvf driver.
            FunctionSpec::new("0000:5e:00.0", INTEL, 0x37c8, 0x0b4000)
                .subsystem(INTEL, 0x35cf)
                .revision(4)
                .driver("c6xx")
                .under("0000:00:03.0")
                .sriov(16, 0x37c9, "c6xxvf", 1)
                .initial_vfs(16),
            // FPGA: Intel PAC D5005 with SR-IOV, 4 VFs, on NUMA node 1.
            FunctionSpec::new("0000:af:00.0", INTEL, 0x0b2b, 0x120000)
                .subsystem(INTEL, 0x0000)
                .driver("dfl-pci")
                .numa(1)
                .under("0000:00:04.0")
                .sriov(4, 0x0b2c, "dfl-pci", 1)
                .dfl(0, REFERENCE_FPGA_INTERFACE, REFERENCE_FPGA_AFU),
            // Data NVMe drive (non-separable).
            FunctionSpec::new("0000:d8:00.0", SAMSUNG, 0xa824, 0x010802)
                .subsystem(SAMSUNG, 0xa809)
                .driver("nvme")
                .numa(1)
                .under("0000:00:05.0"),
            // The host's boot NVMe: mounted at / and /boot, protected.
            FunctionSpec::new("0000:3d:00.0", SAMSUNG, 0xa80a, 0x010802)
                .subsystem(SAMSUNG, 0xa801)
                .driver("nvme")
                .under("0000:00:1d.0"),
        ];
        HostModel {
            functions,
            drivers: Self::standard_drivers(),
            mounts: vec![MountSpec {
                controller: "0000:3d:00.0".parse().unwrap(),
                instance: 0,
                partitions: vec![(1, "/boot/efi".into()), (2, "/".into()), (3, "swap".into())],
                multipath: false,
            }],
            interfaces: vec![InterfaceSpec {
                device: "0000:02:00.0".parse().unwrap(),
                name: "enp2s0".into(),
                up: true,
            }],
            consoles: Vec::new(),
            iommu_groups: Default::default(),
            kernel: KernelSpec::default(),
        }
    }

    /// The reference host whose GPU (`0000:17:00.0`) is the boot VGA device with the host's
    /// console on its DRM framebuffer (`fb0`, fbcon bound): a desktop or a workstation.
    pub fn console_gpu() -> HostModel {
        let mut m = HostModel::reference();
        let gpu: PciAddress = "0000:17:00.0".parse().unwrap();
        for f in m.functions.iter_mut().filter(|f| f.address == gpu) {
            f.boot_vga = true;
        }
        m.consoles.push(ConsoleSpec {
            fb: 0,
            device: Some(gpu),
        });
        m
    }

    /// The reference host with no IOMMU (VT-d off in the firmware, or a kernel booted without
    /// `intel_iommu=on`): no function has an IOMMU group.
    pub fn no_iommu() -> HostModel {
        let mut m = HostModel::reference();
        for f in &mut m.functions {
            f.group = GroupSpec::None;
        }
        // No IOMMU, no remapping of interrupts either.
        m.kernel.interrupt_remapping = false;
        m
    }

    fn standard_drivers() -> Vec<DriverSpec> {
        vec![
            DriverSpec::new("pcieport", &[(INTEL, 0x347a)], false),
            DriverSpec::new("igc", &[(INTEL, 0x15f3)], false),
            DriverSpec::new("nouveau", &[(NVIDIA, 0x2204)], false),
            DriverSpec::new("snd_hda_intel", &[(NVIDIA, 0x1aef)], false),
            DriverSpec::new("i40e", &[(INTEL, 0x1572)], true),
            DriverSpec::new("iavf", &[(INTEL, 0x154c)], false),
            DriverSpec::new("c6xx", &[(INTEL, 0x37c8)], true),
            DriverSpec::new("c6xxvf", &[(INTEL, 0x37c9)], false),
            DriverSpec::new("dfl-pci", &[(INTEL, 0x0b2b), (INTEL, 0x0b2c)], true),
            DriverSpec::new("nvme", &[(SAMSUNG, 0xa824), (SAMSUNG, 0xa80a)], true),
            // vfio-pci binds only by driver_override. It enables no VFs of a PF it owns: Linux's
            // vfio-pci answers ENOENT unless loaded with enable_sriov=1 (off by default).
            DriverSpec::new("vfio-pci", &[], false),
            DriverSpec::new("pci-stub", &[], false),
        ]
    }

    /// The reference host with a second DFL FPGA card (`0000:b1:00.0`, `dfl-fme.1`, the same
    /// static region), for tests of two cards programmed at once.
    pub fn two_fpgas() -> HostModel {
        let mut m = HostModel::reference();
        m.functions.push(root_port("0000:00:06.0", 0xb1));
        m.functions.push(
            FunctionSpec::new("0000:b1:00.0", INTEL, 0x0b2b, 0x120000)
                .subsystem(INTEL, 0x0000)
                .driver("dfl-pci")
                .numa(1)
                .under("0000:00:06.0")
                .sriov(4, 0x0b2c, "dfl-pci", 1)
                .dfl(1, REFERENCE_FPGA_INTERFACE, REFERENCE_FPGA_AFU),
        );
        m
    }

    /// A large host for benchmarks: the reference host plus `nics` X710 PFs (one per root
    /// port) each with all 64 VFs enabled. `nics = 15` gives just over 1,000 functions.
    pub fn large(nics: u8) -> HostModel {
        let mut m = HostModel::reference();
        for i in 0..nics {
            let bus = 0x60 + i;
            let port_addr = format!("0000:00:{:02x}.0", 0x06 + i);
            m.functions.push(root_port(&port_addr, bus));
            m.functions.push(
                FunctionSpec::new(&format!("0000:{bus:02x}:00.0"), INTEL, 0x1572, 0x020000)
                    .subsystem(INTEL, 0x0001)
                    .driver("i40e")
                    .numa(i32::from(i % 2))
                    .under(&port_addr)
                    .sriov(64, 0x154c, "iavf", 16)
                    .initial_vfs(64),
            );
        }
        m
    }
}
