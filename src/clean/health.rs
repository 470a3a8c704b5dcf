//! Whether a function came back healthy from its reset: config space readable, not all-ones,
//! its vendor, device and class unchanged, the expected driver bound again. Anything else is a
//! reason to quarantine it, in the words an operator reads ([`Unhealthy`]).
//!
//! The ids compared are those config space shows. A VF's vendor and device registers read
//! 0xffff by design (the kernel takes a VF's ids from its PF's SR-IOV capability, which is what
//! the inventory records), so for a VF the expected ids are `ffff:ffff`:
//! [`Expected::before`] takes them from an observation made before the reset, which is right
//! for every function.

use crate::model::pci::{config_is_all_ones, ClassCode};

/// What the health check reads of a function, filled by `host::sysfs::reset::observe`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// The first 64 bytes of config space (the header), or why it could not be read.
    pub config: Result<Vec<u8>, String>,
    /// The driver bound to it (its `driver` link's name), none, or why the link was unreadable.
    pub driver: Result<Option<String>, String>,
}

/// What a healthy function shows after its reset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// The ids as config space shows them (`ffff:ffff` for a VF).
    pub vendor_id: u16,
    pub device_id: u16,
    pub class: ClassCode,
    /// The driver that must be bound again; `None`: any, or none.
    pub driver: Option<String>,
}

/// Why a function is not healthy after its reset: the reason of its quarantine.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    #[error("config space unreadable: {0}")]
    ConfigUnreadable(String),
    #[error("config space unreadable: {0} bytes, short of the 64-byte header")]
    ConfigShort(usize),
    #[error("config space reads all-ones after the reset")]
    AllOnes,
    #[error("device id changed from {:04x}:{:04x} to {:04x}:{:04x}", .from.0, .from.1, .to.0, .to.1)]
    IdsChanged { from: (u16, u16), to: (u16, u16) },
    #[error("class changed from {from} to {to}")]
    ClassChanged { from: ClassCode, to: ClassCode },
    #[error("driver {expected} is no longer bound{}", .now.as_ref().map(|d| format!(" ({d} is)")).unwrap_or_default())]
    DriverLost {
        expected: String,
        now: Option<String>,
    },
    #[error("driver link unreadable: {0}")]
    DriverUnreadable(String),
}

/// The ids and class a config-space header shows.
struct Header {
    ids: (u16, u16),
    class: ClassCode,
}

/// The header of a readable function, or why there is none.
fn header(config: &Result<Vec<u8>, String>) -> Result<Header, Unhealthy> {
    let c = config
        .as_ref()
        .map_err(|e| Unhealthy::ConfigUnreadable(e.clone()))?;
    if c.len() < 64 {
        return Err(Unhealthy::ConfigShort(c.len()));
    }
    if config_is_all_ones(c) {
        return Err(Unhealthy::AllOnes);
    }
    Ok(Header {
        ids: (
            u16::from_le_bytes([c[0], c[1]]),
            u16::from_le_bytes([c[2], c[3]]),
        ),
        class: ClassCode(u32::from_le_bytes([c[9], c[10], c[11], 0])),
    })
}

impl Expected {
    /// What the function showed before its reset, to compare with after it. `None` when it
    /// was not healthy then either (its config space unreadable or all-ones, its driver link
    /// unreadable): there is nothing of its own to compare with, and [`check`] against the
    /// inventory's record says what is wrong.
    pub fn before(observed: &Observed) -> Option<Expected> {
        let h = header(&observed.config).ok()?;
        Some(Expected {
            vendor_id: h.ids.0,
            device_id: h.ids.1,
            class: h.class,
            driver: observed.driver.clone().ok()?,
        })
    }
}

/// Whether the function is healthy: the first thing wrong, in the order config space, ids,
/// class, driver.
pub fn check(expected: &Expected, observed: &Observed) -> Result<(), Unhealthy> {
    let h = header(&observed.config)?;
    let ids = (expected.vendor_id, expected.device_id);
    if h.ids != ids {
        return Err(Unhealthy::IdsChanged {
            from: ids,
            to: h.ids,
        });
    }
    if h.class != expected.class {
        return Err(Unhealthy::ClassChanged {
            from: expected.class,
            to: h.class,
        });
    }
    let now = observed
        .driver
        .as_ref()
        .map_err(|e| Unhealthy::DriverUnreadable(e.clone()))?;
    match &expected.driver {
        Some(d) if now.as_ref() != Some(d) => Err(Unhealthy::DriverLost {
            expected: d.clone(),
            now: now.clone(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-byte header with these ids and class, as a healthy function shows it.
    fn config(vendor: u16, device: u16, class: u32) -> Vec<u8> {
        let mut c = vec![0u8; 64];
        c[0..2].copy_from_slice(&vendor.to_le_bytes());
        c[2..4].copy_from_slice(&device.to_le_bytes());
        c[8] = 0x02;
        c[9..12].copy_from_slice(&class.to_le_bytes()[..3]);
        c
    }

    fn seen(config: Result<Vec<u8>, &str>, driver: Result<Option<&str>, &str>) -> Observed {
        Observed {
            config: config.map_err(str::to_string),
            driver: driver
                .map(|d| d.map(str::to_string))
                .map_err(str::to_string),
        }
    }

    fn nvme(driver: Option<&str>) -> Expected {
        Expected {
            vendor_id: 0x1b36,
            device_id: 0x0010,
            class: ClassCode(0x010802),
            driver: driver.map(str::to_string),
        }
    }

    #[test]
    fn check_table() {
        let good = || Ok(config(0x1b36, 0x0010, 0x010802));
        let vfio = Ok(Some("vfio-pci"));
        let table: Vec<(&str, Expected, Observed, Result<(), &str>)> = vec![
            (
                "healthy",
                nvme(Some("vfio-pci")),
                seen(good(), vfio),
                Ok(()),
            ),
            (
                "no driver expected: any will do",
                nvme(None),
                seen(good(), Ok(Some("nvme"))),
                Ok(()),
            ),
            (
                "no driver expected, none bound",
                nvme(None),
                seen(good(), Ok(None)),
                Ok(()),
            ),
            (
                "all-ones",
                nvme(Some("vfio-pci")),
                seen(Ok(vec![0xff; 64]), vfio),
                Err("config space reads all-ones after the reset"),
            ),
            (
                "unreadable",
                nvme(Some("vfio-pci")),
                seen(Err("Input/output error (os error 5)"), vfio),
                Err("config space unreadable: Input/output error (os error 5)"),
            ),
            (
                "short",
                nvme(Some("vfio-pci")),
                seen(Ok(vec![0; 12]), vfio),
                Err("config space unreadable: 12 bytes, short of the 64-byte header"),
            ),
            (
                "ids changed (the device came back as something else)",
                nvme(Some("vfio-pci")),
                seen(Ok(config(0x1b36, 0x0011, 0x010802)), vfio),
                Err("device id changed from 1b36:0010 to 1b36:0011"),
            ),
            (
                "ids read ffff:ffff on a function that is not a VF",
                nvme(Some("vfio-pci")),
                seen(Ok(config(0xffff, 0xffff, 0x010802)), vfio),
                Err("device id changed from 1b36:0010 to ffff:ffff"),
            ),
            (
                "class changed",
                nvme(Some("vfio-pci")),
                seen(Ok(config(0x1b36, 0x0010, 0x000000)), vfio),
                Err("class changed from 0x010802 to 0x000000"),
            ),
            (
                "driver gone",
                nvme(Some("vfio-pci")),
                seen(good(), Ok(None)),
                Err("driver vfio-pci is no longer bound"),
            ),
            (
                "another driver took it",
                nvme(Some("vfio-pci")),
                seen(good(), Ok(Some("nvme"))),
                Err("driver vfio-pci is no longer bound (nvme is)"),
            ),
            (
                "driver link unreadable",
                nvme(Some("vfio-pci")),
                seen(good(), Err("Permission denied (os error 13)")),
                Err("driver link unreadable: Permission denied (os error 13)"),
            ),
            (
                "config space is checked before the driver",
                nvme(Some("vfio-pci")),
                seen(Ok(vec![0xff; 64]), Ok(None)),
                Err("config space reads all-ones after the reset"),
            ),
        ];
        for (what, expected, observed, want) in table {
            let got = check(&expected, &observed).map_err(|e| e.to_string());
            assert_eq!(got, want.map_err(str::to_string), "{what}");
        }
    }

    #[test]
    fn a_vf_compares_with_itself_before_the_reset() {
        // A VF: vendor and device registers read 0xffff, the rest of the header is real.
        let vf = seen(Ok(config(0xffff, 0xffff, 0x020000)), Ok(Some("vfio-pci")));
        let expected = Expected::before(&vf).expect("a healthy VF");
        assert_eq!(
            expected,
            Expected {
                vendor_id: 0xffff,
                device_id: 0xffff,
                class: ClassCode(0x020000),
                driver: Some("vfio-pci".into()),
            }
        );
        assert_eq!(check(&expected, &vf), Ok(()));
        let gone = seen(Ok(vec![0xff; 64]), Ok(Some("vfio-pci")));
        assert_eq!(check(&expected, &gone), Err(Unhealthy::AllOnes));
        // Nothing to compare with when it was broken before the reset already.
        assert_eq!(Expected::before(&gone), None);
        assert_eq!(Expected::before(&seen(Err("gone"), Ok(None))), None);
        assert_eq!(
            Expected::before(&seen(Ok(config(1, 2, 3)), Err("unreadable"))),
            None
        );
    }
}
