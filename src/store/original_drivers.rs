//! The driver each device had before vfiod first rebound it, so that restore can put it back.
//!
//! The first record wins: after bind to vfio-pci, a second bind (or a retried task) sees vfio-pci
//! as the current driver, and recording that would lose the driver to restore.

use super::{now_ms, Store, StoreError};
use crate::model::pci::PciAddress;
use rusqlite::{params, OptionalExtension};

impl Store {
    /// Records `driver` (`None`: the device had no driver) as the original driver of `address`,
    /// unless one is already recorded. Returns whether it was recorded now.
    pub fn remember_original_driver(
        &self,
        address: PciAddress,
        driver: Option<&str>,
    ) -> Result<bool, StoreError> {
        if driver.is_some_and(|d| d.trim().is_empty()) {
            return Err(StoreError::InvalidArgument {
                reason: format!(
                    "original driver of {address} is an empty name (use None for no driver)"
                ),
            });
        }
        let action = "remember an original driver";
        let conn = self.lock();
        // A single statement is atomic; DO NOTHING (not INSERT OR IGNORE) skips only the
        // conflict on the address and still reports any other failure.
        let inserted = conn
            .prepare_cached(
                "INSERT INTO original_drivers (address, driver, recorded_ms) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (address) DO NOTHING",
            )
            .and_then(|mut stmt| stmt.execute(params![address.to_string(), driver, now_ms()]))
            .map_err(|e| self.sqlite(action, e))?;
        Ok(inserted == 1)
    }

    /// The recorded original driver of `address`: `None` if nothing is recorded, `Some(None)` if
    /// the device had no driver.
    pub fn original_driver(
        &self,
        address: PciAddress,
    ) -> Result<Option<Option<String>>, StoreError> {
        let action = "read an original driver";
        let conn = self.lock();
        conn.prepare_cached("SELECT driver FROM original_drivers WHERE address = ?1")
            .and_then(|mut stmt| {
                stmt.query_row([address.to_string()], |row| row.get(0))
                    .optional()
            })
            .map_err(|e| self.sqlite(action, e))
    }

    /// Forgets the original driver of `address` (after a restore put it back). Forgetting what
    /// is not recorded is a no-op.
    pub fn forget_original_driver(&self, address: PciAddress) -> Result<(), StoreError> {
        let action = "forget an original driver";
        let conn = self.lock();
        conn.prepare_cached("DELETE FROM original_drivers WHERE address = ?1")
            .and_then(|mut stmt| stmt.execute([address.to_string()]))
            .map(drop)
            .map_err(|e| self.sqlite(action, e))
    }
}
