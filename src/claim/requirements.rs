//! What a claim asks for (device requirements, all optional, all must match) and for whom (the
//! owner: a VM by name and/or UUID, a lease, persistence). Checked here once, so that the D-Bus
//! layer, the CLI and the hooks build the same values and get the same errors.

use crate::model::device::{Device, Kind, Role};
use crate::model::pci::PciAddress;
use std::fmt;

/// The longest VM name accepted: libvirt's own limit on a domain name is the file name length.
pub const MAX_VM_NAME: usize = 255;
pub use crate::config::MAX_LEASE_SECONDS;

/// Device requirements; `None` matches anything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requirements {
    pub address: Option<PciAddress>,
    pub kind: Option<Kind>,
    /// Vendor and device id; a device of `None` is any device of the vendor (`8086:*`).
    pub id: Option<(u16, Option<u16>)>,
    pub role: Option<Role>,
    pub numa_node: Option<i32>,
    /// The PF whose VF is wanted.
    pub parent: Option<PciAddress>,
}

impl Requirements {
    pub fn matches(&self, d: &Device) -> bool {
        self.address.is_none_or(|a| a == d.address)
            && self.kind.is_none_or(|k| k == d.kind)
            && self.id.is_none_or(|(vendor, device)| {
                vendor == d.vendor_id && device.is_none_or(|dev| dev == d.device_id)
            })
            && self.role.is_none_or(|r| r == d.role)
            && self.numa_node.is_none_or(|n| Some(n) == d.numa_node)
            && self.parent.is_none_or(|p| Some(p) == d.parent_pf)
    }

    /// Parses `VVVV:DDDD` (or `VVVV:*`) as the config's selectors do.
    pub fn parse_id(text: &str) -> Result<(u16, Option<u16>), String> {
        crate::config::parse_id(text)
    }
}

/// "kind=gpu, numa_node=1", or "any device" when nothing is required: for error messages.
impl fmt::Display for Requirements {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(a) = self.address {
            parts.push(format!("address={a}"));
        }
        if let Some(k) = self.kind {
            parts.push(format!("kind={k}"));
        }
        if let Some((v, d)) = self.id {
            parts.push(match d {
                Some(d) => format!("id={v:04x}:{d:04x}"),
                None => format!("id={v:04x}:*"),
            });
        }
        if let Some(r) = self.role {
            parts.push(format!("role={r}"));
        }
        if let Some(n) = self.numa_node {
            parts.push(format!("numa_node={n}"));
        }
        if let Some(p) = self.parent {
            parts.push(format!("parent={p}"));
        }
        if parts.is_empty() {
            f.write_str("any device")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// For whom a claim is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub vm_name: Option<String>,
    /// Lower case, with dashes: `6ba7b810-9dad-11d1-80b4-00c04fd430c8`.
    pub vm_uuid: Option<String>,
    /// Seconds until an unattached claim is released; `None` for no lease.
    pub lease_seconds: Option<u32>,
    /// Whether the claim outlives the VM's run (kept when the domain is undefined).
    pub persistent: bool,
}

impl Owner {
    /// Checks and normalizes an owner: at least one of name and UUID, a name libvirt could
    /// accept, a UUID in either of libvirt's spellings, a lease of at most a year (0 = none).
    pub fn new(
        vm_name: Option<&str>,
        vm_uuid: Option<&str>,
        lease_seconds: u32,
        persistent: bool,
    ) -> Result<Owner, String> {
        let vm_name = vm_name.filter(|n| !n.is_empty());
        let vm_uuid = vm_uuid.filter(|u| !u.is_empty());
        if vm_name.is_none() && vm_uuid.is_none() {
            return Err("the owner needs vm_name or vm_uuid (or both)".into());
        }
        if let Some(n) = vm_name {
            check_vm_name(n)?;
        }
        let vm_uuid = vm_uuid.map(normalize_uuid).transpose()?;
        if lease_seconds > MAX_LEASE_SECONDS {
            return Err(format!(
                "lease_seconds {lease_seconds} is longer than a year ({MAX_LEASE_SECONDS}); \
                 use 0 for no lease"
            ));
        }
        Ok(Owner {
            vm_name: vm_name.map(str::to_string),
            vm_uuid,
            lease_seconds: (lease_seconds > 0).then_some(lease_seconds),
            persistent,
        })
    }

    /// The name, else the UUID: how messages name the VM.
    pub fn vm(&self) -> &str {
        self.vm_name
            .as_deref()
            .or(self.vm_uuid.as_deref())
            .unwrap_or("?")
    }
}

fn check_vm_name(n: &str) -> Result<(), String> {
    if n.len() > MAX_VM_NAME {
        return Err(format!(
            "vm_name is {} bytes long, more than the {MAX_VM_NAME} a domain name may have",
            n.len()
        ));
    }
    if n.contains('/') || n.chars().any(char::is_control) {
        return Err(format!(
            "vm_name {} has a '/' or a control character, which no domain name has",
            crate::config::Quoted(n)
        ));
    }
    if let Some(c) = n.chars().find(|c| is_invisible(*c)) {
        return Err(format!(
            "vm_name {} has the invisible character U+{:04X} (a bidirectional control, a \
             zero-width or other format character): a name must read as it is; use the \
             domain's plain name",
            crate::config::Quoted(n),
            u32::from(c)
        ));
    }
    if n.trim().is_empty() {
        return Err(format!(
            "vm_name {} is blank: name the domain (or give vm_uuid only)",
            crate::config::Quoted(n)
        ));
    }
    Ok(())
}

/// Characters that change how a name reads without showing (Unicode's format characters,
/// category Cf: bidirectional controls such as U+202E, zero-width spaces and joiners, the byte
/// order mark, tags), and the line and paragraph separators: a name with one can pass for
/// another in every listing and log.
fn is_invisible(c: char) -> bool {
    matches!(
        u32::from(c),
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x2028..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

/// `6ba7b8109dad11d180b400c04fd430c8` or with dashes, any case -> lower case with dashes.
fn normalize_uuid(text: &str) -> Result<String, String> {
    let hex: String = text.chars().filter(|c| *c != '-').collect();
    let dashes_ok = text.len() == 32 || {
        let b = text.as_bytes();
        text.len() == 36 && [8, 13, 18, 23].iter().all(|&i| b[i] == b'-')
    };
    if hex.len() != 32 || !dashes_ok || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "vm_uuid {} is not a UUID (32 hex digits, with or without dashes as libvirt \
             writes them)",
            crate::config::Quoted(text)
        ));
    }
    let h = hex.to_ascii_lowercase();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_checked_and_normalized() {
        let o = Owner::new(
            Some("vm1"),
            Some("6BA7B8109DAD11D180B400C04FD430C8"),
            0,
            false,
        )
        .unwrap();
        assert_eq!(
            o.vm_uuid.as_deref(),
            Some("6ba7b810-9dad-11d1-80b4-00c04fd430c8")
        );
        assert_eq!(o.lease_seconds, None);
        assert_eq!(o.vm(), "vm1");
        let o = Owner::new(None, Some("6ba7b810-9dad-11d1-80b4-00c04fd430c8"), 60, true).unwrap();
        assert_eq!(o.vm(), "6ba7b810-9dad-11d1-80b4-00c04fd430c8");
        assert_eq!(o.lease_seconds, Some(60));

        for (name, uuid, lease, wanted) in [
            (None, None, 0, "needs vm_name or vm_uuid"),
            (Some(""), Some(""), 0, "needs vm_name or vm_uuid"),
            (Some("a/b"), None, 0, "'/'"),
            (Some("a\nb"), None, 0, "control"),
            // Issue 33: blank, or with a character that does not show.
            (Some(" "), None, 0, "is blank"),
            (Some("\u{3000}\t"), None, 0, "control"),
            (Some("\u{3000}"), None, 0, "is blank"),
            (Some("\u{202E}cba-mv"), None, 0, "U+202E"),
            (Some("vm\u{200B}1"), None, 0, "U+200B"),
            (Some("\u{2066}vm1\u{2069}"), None, 0, "U+2066"),
            (Some("vm1\u{FEFF}"), None, 0, "U+FEFF"),
            (Some("vm\u{2028}1"), None, 0, "U+2028"),
            (Some("vm\u{E0041}"), None, 0, "U+E0041"),
            (
                None,
                Some("6ba7b810-9dad-11d1-80b4-00c04fd430c"),
                0,
                "not a UUID",
            ),
            (
                None,
                Some("6ba7b8109-dad-11d1-80b4-00c04fd430c8"),
                0,
                "not a UUID",
            ),
            (
                None,
                Some("zba7b810-9dad-11d1-80b4-00c04fd430c8"),
                0,
                "not a UUID",
            ),
            (
                Some("vm"),
                None,
                MAX_LEASE_SECONDS + 1,
                "longer than a year",
            ),
        ] {
            let e = Owner::new(name, uuid, lease, false).unwrap_err();
            assert!(e.contains(wanted), "{name:?} {uuid:?}: {e}");
        }
        // Names libvirt users do write: spaces inside, accents, other scripts.
        for ok in ["web 1", "répétiteur", "虚拟机", "vm-1.example", "עברית"] {
            Owner::new(Some(ok), None, 0, false).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let long = "x".repeat(MAX_VM_NAME + 1);
        assert!(Owner::new(Some(&long), None, 0, false)
            .unwrap_err()
            .contains("256 bytes"));
    }

    #[test]
    fn requirements_read_back_as_text() {
        assert_eq!(Requirements::default().to_string(), "any device");
        let r = Requirements {
            kind: Some(Kind::Nic),
            id: Some((0x8086, None)),
            numa_node: Some(1),
            ..Default::default()
        };
        assert_eq!(r.to_string(), "kind=nic, id=8086:*, numa_node=1");
    }
}
