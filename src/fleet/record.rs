//! What a host reports: one record per PCI function it knows, built from the store's view at one
//! moment, and the host's active claims. Pure: the reporter reads the store, this shapes it.
//!
//! The record carries the fields as the inventory has them (a field the host could not read is
//! `None`); whether the record is complete enough to offer is the conductor's decision
//! ([`super::conductor::verdict`]), not the host's. What only the host can know (a local claim,
//! a task at work) comes as `local_reason`.

use crate::claim::Snapshot;
use crate::model::device::{Device, Role, State};
use crate::model::pci::PciAddress;
use crate::store::ClaimRecord;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// One function as reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Record {
    pub address: PciAddress,
    /// `None` when the host could not read it (a broken function it never read whole).
    pub vendor_id: Option<u16>,
    pub device_id: Option<u16>,
    pub class: Option<u32>,
    pub kind: String,
    pub role: String,
    pub parent_pf: Option<PciAddress>,
    pub iommu_group: Option<u32>,
    pub numa_node: Option<i32>,
    pub vendor_name: String,
    pub device_name: String,
    /// `usable`, `protected` or `broken`, with the reason.
    pub state: String,
    pub state_reason: String,
    pub managed: bool,
    /// Why the host itself cannot hand it out now (a local claim, a task, a group-mate), beyond
    /// its state and selection; `None` when it could claim it now.
    pub local_reason: Option<String>,
}

/// One report: every function of the host and the ids of its active claims.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    pub records: Vec<Record>,
    /// Active local claims: (claim id, address, VM).
    pub claims: Vec<(i64, PciAddress, String)>,
}

impl Report {
    /// Builds the report from a snapshot of the store and its active claims.
    pub fn build(snapshot: &Snapshot, claims: &[ClaimRecord]) -> Report {
        let mut records: Vec<Record> = snapshot
            .devices
            .iter()
            .map(|d| record(d, local_reason(snapshot, d)))
            .collect();
        records.sort_by_key(|r| r.address);
        let claims = claims
            .iter()
            .map(|c| (c.id, c.address, c.vm().to_string()))
            .collect();
        Report { records, claims }
    }

    /// A digest of the whole report: an unchanged host sends only its heartbeat.
    pub fn digest(&self) -> String {
        let bytes = serde_json::to_vec(self).unwrap_or_default();
        let sum = Sha256::digest(&bytes);
        sum.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The host-local obstacle to claiming `d`, as the local claim rules see it; state and selection
/// are left out (the record carries them and the conductor judges them).
fn local_reason(snapshot: &Snapshot, d: &Device) -> Option<String> {
    if d.state != State::Usable || !d.managed {
        return None;
    }
    crate::claim::unavailable(snapshot, d.address).map(|r| r.to_string())
}

fn record(d: &Device, local_reason: Option<String>) -> Record {
    // An unread id is all-zero (a function that broke before it was ever read whole) or
    // all-ones (config space gone).
    let id = |v: u16| (v != 0 && v != 0xffff).then_some(v);
    Record {
        address: d.address,
        vendor_id: id(d.vendor_id),
        device_id: id(d.device_id),
        class: (d.class.0 != 0 && d.class.0 != 0xff_ffff).then_some(d.class.0),
        kind: d.kind.as_str().to_string(),
        role: d.role.as_str().to_string(),
        parent_pf: d.parent_pf.filter(|_| d.role == Role::Vf),
        iommu_group: d.iommu_group,
        numa_node: d.numa_node,
        vendor_name: d.vendor_name.clone(),
        device_name: d.device_name.clone(),
        state: d.state.as_str().to_string(),
        state_reason: d.state_reason.clone(),
        managed: d.managed,
        local_reason,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::claim::Held;
    use crate::model::pci::ClassCode;

    pub fn device(addr: &str) -> Device {
        Device::example(addr)
    }

    #[test]
    fn records_carry_what_the_host_knows_and_its_local_obstacles() {
        let free = device("0000:3b:02.0");
        let claimed = Device {
            address: "0000:3b:02.1".parse().unwrap(),
            iommu_group: Some(41),
            ..device("0000:3b:02.1")
        };
        let broken_unread = Device {
            vendor_id: 0,
            device_id: 0xffff,
            class: ClassCode(0),
            iommu_group: None,
            state: State::Broken,
            state_reason: "EIO".into(),
            ..device("0000:3b:02.2")
        };
        let snapshot = Snapshot {
            devices: vec![claimed.clone(), free.clone(), broken_unread.clone()],
            held: vec![Held {
                address: claimed.address,
                claim_id: 7,
            }],
            busy: vec![],
            cleaning: vec![],
            splits: vec![],
        };
        let r = Report::build(&snapshot, &[]);
        let addrs: Vec<_> = r.records.iter().map(|r| r.address.to_string()).collect();
        assert_eq!(addrs, ["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"]);
        assert_eq!(r.records[0].local_reason, None);
        assert_eq!(
            r.records[1].local_reason.as_deref(),
            Some("is held by claim 7")
        );
        assert_eq!(r.records[2].vendor_id, None);
        assert_eq!(r.records[2].device_id, None);
        assert_eq!(r.records[2].class, None);
        assert_eq!(r.records[2].local_reason, None, "its state says it");
        // The digest changes with any field and only then.
        let again = Report::build(&snapshot, &[]);
        assert_eq!(r.digest(), again.digest());
        let mut other = r.clone();
        other.records[0].numa_node = Some(1);
        assert_ne!(r.digest(), other.digest());
    }
}
