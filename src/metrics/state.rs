//! The gauges of a render, counted from the store's records as they are at that moment: the
//! store is the source of truth, so nothing here is kept between renders.

use crate::model::claim::ClaimState;
use crate::model::device::{Device, Kind, State as DeviceState};
use crate::store::ClaimRecord;

/// What the gauges of one render show.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// Every kind with every state, zeros included: a series that appears only once it is
    /// non-zero makes an alert on it (`vfiod_devices{state="broken"} > 0`) see no change.
    pub devices: Vec<(Kind, DeviceState, u64)>,
    /// Every state that holds functions (not `released`, which is history), zeros included.
    pub claims: Vec<(ClaimState, u64)>,
    /// `[fleet]` is configured: the report age is shown (absent otherwise).
    pub fleet: bool,
    /// The configured pools: their error counters start at zero.
    pub pools: Vec<String>,
}

impl State {
    /// Counts `devices` (present ones) and `claims` (the active ones; a released claim is not
    /// counted whatever the caller passes).
    pub fn count(
        devices: &[Device],
        claims: &[ClaimRecord],
        fleet: bool,
        pools: Vec<String>,
    ) -> State {
        let mut by_device = Vec::new();
        for &kind in Kind::ALL {
            for &state in DeviceState::ALL {
                let n = devices
                    .iter()
                    .filter(|d| d.kind == kind && d.state == state)
                    .count();
                by_device.push((kind, state, n as u64));
            }
        }
        let by_claim = ClaimState::ALL
            .iter()
            .filter(|s| s.holds())
            .map(|&s| (s, claims.iter().filter(|c| c.state == s).count() as u64))
            .collect();
        State {
            devices: by_device,
            claims: by_claim,
            fleet,
            pools,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::device::{Mode, Role};
    use crate::model::pci::ClassCode;

    fn device(address: &str, kind: Kind, state: DeviceState) -> Device {
        Device {
            address: address.parse().unwrap(),
            vendor_id: 0x8086,
            device_id: 0x1572,
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 0,
            class: ClassCode(0x020000),
            vendor_name: String::new(),
            device_name: String::new(),
            kind,
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
            managed: true,
            state,
            state_reason: String::new(),
        }
    }

    fn claim(id: i64, state: ClaimState) -> ClaimRecord {
        ClaimRecord {
            id,
            address: "0000:3b:00.0".parse().unwrap(),
            functions: Vec::new(),
            vm_name: Some("vm1".into()),
            vm_uuid: None,
            kind: None,
            state,
            guest_address: None,
            requested_by: "test".into(),
            created_ms: 0,
            updated_ms: 0,
            lease_expires_ms: None,
            persistent: false,
            released_ms: None,
        }
    }

    #[test]
    fn counts_every_kind_state_and_claim_state_zeros_included() {
        let devices = [
            device("0000:3b:00.0", Kind::Nic, DeviceState::Usable),
            device("0000:3b:00.1", Kind::Nic, DeviceState::Usable),
            device("0000:00:1f.0", Kind::Nic, DeviceState::Protected),
            device("0000:af:00.0", Kind::Fpga, DeviceState::Broken),
        ];
        let claims = [
            claim(1, ClaimState::Attached),
            claim(2, ClaimState::Claimed),
            claim(3, ClaimState::Attached),
            claim(4, ClaimState::Released),
        ];
        let s = State::count(&devices, &claims, false, vec![]);
        assert_eq!(s.devices.len(), Kind::ALL.len() * DeviceState::ALL.len());
        let n = |k, st| {
            s.devices
                .iter()
                .find(|(kk, ss, _)| *kk == k && *ss == st)
                .unwrap()
                .2
        };
        for (kind, state, wanted) in [
            (Kind::Nic, DeviceState::Usable, 2),
            (Kind::Nic, DeviceState::Protected, 1),
            (Kind::Nic, DeviceState::Broken, 0),
            (Kind::Fpga, DeviceState::Broken, 1),
            (Kind::Gpu, DeviceState::Usable, 0),
        ] {
            assert_eq!(n(kind, state), wanted, "{kind} {state}");
        }
        assert_eq!(
            s.claims,
            vec![
                (ClaimState::Claimed, 1),
                (ClaimState::Attaching, 0),
                (ClaimState::Attached, 2),
                (ClaimState::Detaching, 0),
            ]
        );
    }
}
