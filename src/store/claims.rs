//! Claims as far as the mode engine needs them today: which functions are claimed by or
//! attached to a VM. (Creating and releasing claims comes with the claims feature.)

use super::{Store, StoreError};
use crate::model::pci::PciAddress;

impl Store {
    /// Active claims (`claimed` or `attached`) on any of `addresses`: (address, VM name).
    pub fn active_claims(
        &self,
        addresses: &[PciAddress],
    ) -> Result<Vec<(PciAddress, String)>, StoreError> {
        let action = "read claims";
        let conn = self.lock();
        let mut stmt = conn
            .prepare("SELECT address, coalesce(vm_name, vm_uuid, '?') FROM claims WHERE state IN ('claimed', 'attached') ORDER BY id")
            .map_err(|e| self.sqlite(action, e))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
            .map_err(|e| self.sqlite(action, e))?;
        let mut out = Vec::new();
        for row in rows {
            let (a, vm) = row.map_err(|e| self.sqlite(action, e))?;
            if let Ok(a) = a.parse::<PciAddress>() {
                if addresses.contains(&a) {
                    out.push((a, vm));
                }
            }
        }
        Ok(out)
    }
}
