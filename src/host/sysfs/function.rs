//! Reading one PCI function: identity, driver, NUMA node, IOMMU group, SR-IOV, health.

use super::{Sysfs, SysfsError};
use crate::model::pci::{config_is_all_ones, ClassCode, PciAddress};
use std::path::Path;

/// SR-IOV attributes of a physical function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SriovInfo {
    pub total_vfs: u32,
    pub num_vfs: u32,
    pub drivers_autoprobe: bool,
    /// `virtfnN` links, in N order.
    pub vfs: Vec<PciAddress>,
    /// `sriov_vf_device`, when the kernel shows it.
    pub vf_device_id: Option<u16>,
    /// Routing-id offset and stride of the VFs (`sriov_offset`, `sriov_stride`): where VF n
    /// will appear, known before the VFs exist.
    pub vf_offset: Option<u16>,
    pub vf_stride: Option<u16>,
}

/// AER counters (`TOTAL_ERR_*` lines) where the kernel exposes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AerCounters {
    pub correctable: u64,
    pub nonfatal: u64,
    pub fatal: u64,
}

/// What sysfs shows about one PCI function, parsed but not interpreted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFunction {
    pub address: PciAddress,
    pub vendor_id: u16,
    pub device_id: u16,
    pub subsystem_vendor_id: u16,
    pub subsystem_device_id: u16,
    pub class: ClassCode,
    pub revision: u8,
    pub driver: Option<String>,
    pub driver_override: Option<String>,
    pub numa_node: Option<i32>,
    pub iommu_group: Option<u32>,
    /// Present when the function is SR-IOV capable (`sriov_totalvfs` exists).
    pub sriov: Option<SriovInfo>,
    /// For a VF: its PF (`physfn`).
    pub physfn: Option<PciAddress>,
}

/// Health details that the inventory does not need on every pass: how the function can be
/// reset and its AER counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    pub reset_methods: Vec<String>,
    pub aer: Option<AerCounters>,
}

fn parse_hex(path: &Path, text: &str) -> Result<u32, SysfsError> {
    let digits = text.strip_prefix("0x").unwrap_or(text);
    u32::from_str_radix(digits, 16).map_err(|e| SysfsError::Parse {
        path: path.to_path_buf(),
        value: text.to_string(),
        reason: e.to_string(),
    })
}

fn parse_dec<T: std::str::FromStr>(path: &Path, text: &str) -> Result<T, SysfsError>
where
    T::Err: std::fmt::Display,
{
    text.parse().map_err(|e: T::Err| SysfsError::Parse {
        path: path.to_path_buf(),
        value: text.to_string(),
        reason: e.to_string(),
    })
}

fn narrow<T: TryFrom<u32>>(path: &Path, value: u32) -> Result<T, SysfsError> {
    T::try_from(value).map_err(|_| SysfsError::Parse {
        path: path.to_path_buf(),
        value: format!("{value:#x}"),
        reason: "out of range".into(),
    })
}

/// Parses `aer_dev_*` files: lines of `NAME COUNT`, with a `TOTAL_ERR_*` line.
pub(crate) fn parse_aer_total(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        let name = it.next()?;
        if name.starts_with("TOTAL_ERR_") {
            it.next()?.parse().ok()
        } else {
            None
        }
    })
}

impl RawFunction {
    /// Reads everything; a required attribute that cannot be read or parsed is an error (the
    /// inventory then treats the function as broken, or gone if its directory vanished).
    pub fn read(sysfs: &Sysfs, address: PciAddress) -> Result<RawFunction, SysfsError> {
        let attr = |name: &str| sysfs.device_attr(address, name);
        let hex_attr = |name: &str| -> Result<u32, SysfsError> {
            let p = attr(name);
            let t = sysfs.read_text(&p)?;
            parse_hex(&p, &t)
        };

        let config_path = attr("config");
        let header = sysfs.read_bytes(&config_path)?;
        if header.len() < 64 {
            return Err(SysfsError::Parse {
                path: config_path,
                value: format!("{} bytes", header.len()),
                reason: "config space shorter than a 64-byte header".into(),
            });
        }
        if config_is_all_ones(&header) {
            return Err(SysfsError::ConfigAllOnes { path: config_path });
        }

        // One read of `uevent` gives the kernel's own view of vendor, device, class,
        // subsystem ids and driver (the same values as the separate attributes, VF ids and
        // class quirks included); a pass is thousands of such reads, so this matters. The
        // separate attributes remain the fallback for anything missing there.
        let uevent_path = attr("uevent");
        let uevent = sysfs.read_text(&uevent_path)?;
        let keys: std::collections::HashMap<&str, &str> =
            uevent.lines().filter_map(|l| l.split_once('=')).collect();
        let id_pair = |key: &str| -> Result<Option<(u16, u16)>, SysfsError> {
            let Some(v) = keys.get(key) else {
                return Ok(None);
            };
            let bad = || SysfsError::Parse {
                path: uevent_path.clone(),
                value: format!("{key}={v}"),
                reason: "expected VVVV:DDDD".into(),
            };
            let (a, b) = v.split_once(':').ok_or_else(bad)?;
            let a = u16::from_str_radix(a, 16).map_err(|_| bad())?;
            let b = u16::from_str_radix(b, 16).map_err(|_| bad())?;
            Ok(Some((a, b)))
        };
        let (vendor_id, device_id) = match id_pair("PCI_ID")? {
            Some(p) => p,
            None => (
                narrow(&attr("vendor"), hex_attr("vendor")?)?,
                narrow(&attr("device"), hex_attr("device")?)?,
            ),
        };
        let class = match keys.get("PCI_CLASS") {
            Some(c) => ClassCode(parse_hex(&uevent_path, c)? & 0xff_ffff),
            None => ClassCode(hex_attr("class")? & 0xff_ffff),
        };
        // The header was read anyway (for the all-ones check): take the revision from it.
        let revision = header[8];
        let (subsystem_vendor_id, subsystem_device_id) = match id_pair("PCI_SUBSYS_ID")? {
            Some(p) => p,
            None => (
                narrow(&attr("subsystem_vendor"), hex_attr("subsystem_vendor")?)?,
                narrow(&attr("subsystem_device"), hex_attr("subsystem_device")?)?,
            ),
        };
        let driver = keys.get("DRIVER").map(|d| d.to_string());
        let driver_override = match sysfs.read_text(&attr("driver_override")) {
            Ok(t) if t.is_empty() || t == "(null)" => None,
            Ok(t) => Some(t),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };
        let numa_node = match sysfs.read_text(&attr("numa_node")) {
            Ok(t) => {
                let n: i32 = parse_dec(&attr("numa_node"), &t)?;
                (n >= 0).then_some(n)
            }
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };
        let iommu_group = match sysfs.read_optional_link_name(&attr("iommu_group"))? {
            Some(n) => Some(parse_dec(&attr("iommu_group"), &n)?),
            None => None,
        };

        let physfn =
            match sysfs.read_optional_link_name(&attr("physfn"))? {
                Some(n) => Some(n.parse().map_err(|e: crate::model::pci::AddressError| {
                    SysfsError::Parse {
                        path: attr("physfn"),
                        value: n.clone(),
                        reason: e.to_string(),
                    }
                })?),
                None => None,
            };
        // A VF cannot itself be SR-IOV capable: skip the lookup (most functions on a split
        // host are VFs).
        let sriov = match sysfs.read_text(&attr("sriov_totalvfs")) {
            _ if physfn.is_some() => None,
            Ok(t) => Some(Self::read_sriov(sysfs, address, &t)?),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };

        Ok(RawFunction {
            address,
            vendor_id,
            device_id,
            subsystem_vendor_id,
            subsystem_device_id,
            class,
            revision,
            driver,
            driver_override,
            numa_node,
            iommu_group,
            sriov,
            physfn,
        })
    }

    fn read_sriov(
        sysfs: &Sysfs,
        address: PciAddress,
        total_text: &str,
    ) -> Result<SriovInfo, SysfsError> {
        let attr = |name: &str| sysfs.device_attr(address, name);
        let total_vfs = parse_dec(&attr("sriov_totalvfs"), total_text)?;
        let num_vfs = {
            let p = attr("sriov_numvfs");
            parse_dec(&p, &sysfs.read_text(&p)?)?
        };
        let drivers_autoprobe = {
            let p = attr("sriov_drivers_autoprobe");
            match sysfs.read_text(&p) {
                Ok(t) => parse_dec::<u8>(&p, &t)? != 0,
                // Kernels before 4.12 lack the switch; VFs are then always probed.
                Err(e) if e.is_not_found() => true,
                Err(e) => return Err(e),
            }
        };
        let vf_device_id = match sysfs.read_text(&attr("sriov_vf_device")) {
            Ok(t) => Some(narrow(
                &attr("sriov_vf_device"),
                parse_hex(&attr("sriov_vf_device"), &t)?,
            )?),
            Err(_) => None,
        };
        let small = |name: &str| -> Option<u16> { sysfs.read_text(&attr(name)).ok()?.parse().ok() };
        let (vf_offset, vf_stride) = (small("sriov_offset"), small("sriov_stride"));
        let mut vfs = Vec::with_capacity(num_vfs as usize);
        for n in 0..num_vfs {
            let link = attr(&format!("virtfn{n}"));
            match sysfs.read_optional_link_name(&link)? {
                Some(name) => {
                    vfs.push(name.parse().map_err(|e: crate::model::pci::AddressError| {
                        SysfsError::Parse {
                            path: link.clone(),
                            value: name.clone(),
                            reason: e.to_string(),
                        }
                    })?)
                }
                // VFs appear one by one while the kernel enables them; a missing link is
                // normal mid-change and the next uevent brings it.
                None => continue,
            }
        }
        Ok(SriovInfo {
            total_vfs,
            num_vfs,
            drivers_autoprobe,
            vfs,
            vf_device_id,
            vf_offset,
            vf_stride,
        })
    }

    /// Reset methods and AER counters; absent attributes are simply empty (no reset possible,
    /// an old kernel, no AER capability), never an error.
    pub fn read_health(sysfs: &Sysfs, address: PciAddress) -> Health {
        let reset_methods = sysfs
            .read_text(&sysfs.device_attr(address, "reset_method"))
            .map(|t| t.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default();
        Health {
            reset_methods,
            aer: Self::read_aer(sysfs, address),
        }
    }

    fn read_aer(sysfs: &Sysfs, address: PciAddress) -> Option<AerCounters> {
        let total = |name: &str| -> Option<u64> {
            let t = sysfs.read_text(&sysfs.device_attr(address, name)).ok()?;
            parse_aer_total(&t)
        };
        let correctable = total("aer_dev_correctable");
        let nonfatal = total("aer_dev_nonfatal");
        let fatal = total("aer_dev_fatal");
        if correctable.is_none() && nonfatal.is_none() && fatal.is_none() {
            return None;
        }
        Some(AerCounters {
            correctable: correctable.unwrap_or(0),
            nonfatal: nonfatal.unwrap_or(0),
            fatal: fatal.unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aer_totals() {
        let t = "RxErr 0\nBadTLP 2\nTOTAL_ERR_COR 5\n";
        assert_eq!(parse_aer_total(t), Some(5));
        assert_eq!(parse_aer_total("garbage"), None);
    }
}
