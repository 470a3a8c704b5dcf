//! Linux DFL FPGA cards (Intel PAC, N3000, N6000 class) as sysfs and `/dev` show them: the FME
//! (`fpga_region/regionN/dfl-fme.N`, its `pr/interface_id`, the `/dev/dfl-fme.N` node) and the
//! port (`dfl-port.N`, its `afu_id`), and partial reconfiguration through the
//! `DFL_FPGA_FME_PORT_PR` ioctl.
//!
//! The ioctl is reached through [`super::Backend::fpga_port_pr`]: on a real host the backend
//! issues it on the node; the simulated kernel performs the same operation on its own files
//! (see `sim::kernel`). What is legal to program, and what a verify concludes, is decided once
//! for both (`fpga::program`).

use super::{Sysfs, SysfsError};
use crate::model::pci::PciAddress;
use std::io;
use std::path::{Path, PathBuf};

/// What a DFL card shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DflCard {
    /// `/dev/dfl-fme.N` under the sysfs root.
    pub fme_node: PathBuf,
    pub index: u32,
    /// The static region's id, 32 lowercase hex digits.
    pub interface_id: Option<String>,
    /// The port's current AFU id, 32 lowercase hex digits.
    pub afu_id: Option<String>,
}

fn uuid_at(sysfs: &Sysfs, path: &Path) -> Result<Option<String>, SysfsError> {
    match sysfs.read_text(path) {
        Ok(text) => Ok(crate::fpga::image::normalize_uuid(&text).ok()),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The DFL card behind `address`, or `None` when the function shows no FME (not a DFL card,
/// or not on `dfl-pci` now).
pub fn read_card(sysfs: &Sysfs, address: PciAddress) -> Result<Option<DflCard>, SysfsError> {
    let regions = sysfs.device_dir(address).join("fpga_region");
    let names = match sysfs.backend().read_dir(&regions) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SysfsError::Read {
                path: regions,
                source,
            })
        }
    };
    for region in names {
        let region = regions.join(region);
        let Ok(entries) = sysfs.backend().read_dir(&region) else {
            continue;
        };
        let mut fme = None;
        let mut port = None;
        for e in entries {
            let name = e.to_string_lossy().into_owned();
            if let Some(n) = name
                .strip_prefix("dfl-fme.")
                .and_then(|n| n.parse::<u32>().ok())
            {
                fme = Some((n, region.join(&name)));
            } else if name.starts_with("dfl-port.") {
                port = Some(region.join(&name));
            }
        }
        if let Some((index, fme_dir)) = fme {
            return Ok(Some(DflCard {
                fme_node: sysfs.path(format!("dev/dfl-fme.{index}")),
                index,
                interface_id: uuid_at(sysfs, &fme_dir.join("pr/interface_id"))?,
                afu_id: match &port {
                    Some(p) => uuid_at(sysfs, &p.join("afu_id"))?,
                    None => None,
                },
            }));
        }
    }
    Ok(None)
}

/// `struct dfl_fpga_fme_port_pr` of `<linux/fpga-dfl.h>`.
#[repr(C)]
struct PortPr {
    argsz: u32,
    flags: u32,
    port_id: u32,
    buffer_size: u32,
    buffer_address: u64,
}

/// `DFL_FPGA_FME_PORT_PR`: `_IO(DFL_FPGA_MAGIC 0xB6, DFL_FME_BASE 0x80 + 0)`.
const DFL_FPGA_FME_PORT_PR: u64 = 0xB680;

/// Partial reconfiguration of port `port_id` with `bitstream` (the green bitstream without
/// its GBS header) through the FME node: the ioctl a real host runs.
pub fn port_pr_ioctl(fme_node: &Path, port_id: u32, bitstream: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let size =
        u32::try_from(bitstream.len()).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(fme_node)?;
    let arg = PortPr {
        argsz: std::mem::size_of::<PortPr>() as u32,
        flags: 0,
        port_id,
        buffer_size: size,
        buffer_address: bitstream.as_ptr() as u64,
    };
    // SAFETY: the argument is the kernel's struct, alive for the call; the buffer it points
    // to is `bitstream`, borrowed for the call and only read by the kernel.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), DFL_FPGA_FME_PORT_PR as _, &arg) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
