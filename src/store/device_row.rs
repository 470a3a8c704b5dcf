//! Mapping between [`Device`] and a `devices` row, and the checked decoding of stored columns.
//!
//! One column per field: enums as their `as_str()` names, identifiers as integers, `Option` as
//! NULL. Decoding never trusts the file: a value a newer vfiod (or a hand edit) wrote that this
//! version cannot represent becomes a [`DecodeError`] naming the row and column.

use crate::model::device::Device;
use crate::model::pci::ClassCode;
use rusqlite::types::FromSql;
use rusqlite::{named_params, Connection, Row};
use std::str::FromStr;

pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The columns of [`SELECT`], in its order. [`decode`] finds a column by its place in this list
/// instead of asking SQLite for the name of every column until one matches: that lookup, once
/// per value, cost more than everything else a claim does, and a claim reads every device.
const COLUMNS: [&str; 23] = [
    "address",
    "vendor_id",
    "device_id",
    "subsystem_vendor_id",
    "subsystem_device_id",
    "revision",
    "class",
    "vendor_name",
    "device_name",
    "kind",
    "driver",
    "driver_override",
    "numa_node",
    "iommu_group",
    "role",
    "separable",
    "mode",
    "total_vfs",
    "num_vfs",
    "parent_pf",
    "managed",
    "state",
    "state_reason",
];

pub(super) const SELECT: &str = "SELECT address, vendor_id, device_id, subsystem_vendor_id, \
     subsystem_device_id, revision, class, vendor_name, device_name, kind, driver, \
     driver_override, numa_node, iommu_group, role, separable, mode, total_vfs, num_vfs, \
     parent_pf, managed, state, state_reason FROM devices";

/// Inserts or replaces the row of `device.address`; a replaced row keeps its `first_seen_ms`.
pub(super) fn upsert(conn: &Connection, device: &Device, now_ms: i64) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare_cached(
        "INSERT INTO devices (address, vendor_id, device_id, subsystem_vendor_id, \
             subsystem_device_id, revision, class, vendor_name, device_name, kind, driver, \
             driver_override, numa_node, iommu_group, role, separable, mode, total_vfs, num_vfs, \
             parent_pf, managed, state, state_reason, first_seen_ms, last_seen_ms) \
         VALUES (:address, :vendor_id, :device_id, :subsystem_vendor_id, :subsystem_device_id, \
             :revision, :class, :vendor_name, :device_name, :kind, :driver, :driver_override, \
             :numa_node, :iommu_group, :role, :separable, :mode, :total_vfs, :num_vfs, \
             :parent_pf, :managed, :state, :state_reason, :now, :now) \
         ON CONFLICT (address) DO UPDATE SET \
             vendor_id = excluded.vendor_id, device_id = excluded.device_id, \
             subsystem_vendor_id = excluded.subsystem_vendor_id, \
             subsystem_device_id = excluded.subsystem_device_id, \
             revision = excluded.revision, class = excluded.class, \
             vendor_name = excluded.vendor_name, device_name = excluded.device_name, \
             kind = excluded.kind, driver = excluded.driver, \
             driver_override = excluded.driver_override, numa_node = excluded.numa_node, \
             iommu_group = excluded.iommu_group, role = excluded.role, \
             separable = excluded.separable, mode = excluded.mode, \
             total_vfs = excluded.total_vfs, num_vfs = excluded.num_vfs, \
             parent_pf = excluded.parent_pf, managed = excluded.managed, \
             state = excluded.state, \
             state_reason = excluded.state_reason, last_seen_ms = excluded.last_seen_ms",
    )?;
    stmt.execute(named_params! {
        ":address": device.address.to_string(),
        ":vendor_id": device.vendor_id,
        ":device_id": device.device_id,
        ":subsystem_vendor_id": device.subsystem_vendor_id,
        ":subsystem_device_id": device.subsystem_device_id,
        ":revision": device.revision,
        ":class": device.class.0,
        ":vendor_name": device.vendor_name,
        ":device_name": device.device_name,
        ":kind": device.kind.as_str(),
        ":driver": device.driver,
        ":driver_override": device.driver_override,
        ":numa_node": device.numa_node,
        ":iommu_group": device.iommu_group,
        ":role": device.role.as_str(),
        ":separable": device.separable,
        ":mode": device.mode.as_str(),
        ":total_vfs": device.total_vfs,
        ":num_vfs": device.num_vfs,
        ":parent_pf": device.parent_pf.map(|a| a.to_string()),
        ":managed": device.managed,
        ":state": device.state.as_str(),
        ":state_reason": device.state_reason,
        ":now": now_ms,
    })?;
    Ok(())
}

/// Builds a [`Device`] from a row of [`SELECT`].
pub(super) fn decode(row: &Row<'_>) -> Result<Device, DecodeError> {
    // The key names the row in errors, so read it leniently before anything can fail.
    let key = match row.get_ref(0) {
        Ok(value) => match value.as_str() {
            Ok(text) => text.to_string(),
            Err(_) => format!("{value:?}"),
        },
        Err(_) => "<no address>".to_string(),
    };
    let f = Fields {
        row,
        table: "devices",
        key,
        columns: &COLUMNS,
    };
    Ok(Device {
        address: f.parse("address")?,
        vendor_id: f.int("vendor_id")?,
        device_id: f.int("device_id")?,
        subsystem_vendor_id: f.int("subsystem_vendor_id")?,
        subsystem_device_id: f.int("subsystem_device_id")?,
        revision: f.int("revision")?,
        class: ClassCode(f.int("class")?),
        vendor_name: f.get("vendor_name")?,
        device_name: f.get("device_name")?,
        kind: f.parse("kind")?,
        driver: f.get("driver")?,
        driver_override: f.get("driver_override")?,
        numa_node: f.opt_int("numa_node")?,
        iommu_group: f.opt_int("iommu_group")?,
        role: f.parse("role")?,
        separable: f.flag("separable")?,
        mode: f.parse("mode")?,
        total_vfs: f.int("total_vfs")?,
        num_vfs: f.int("num_vfs")?,
        parent_pf: f.opt_parse("parent_pf")?,
        managed: f.flag("managed")?,
        state: f.parse("state")?,
        state_reason: f.get("state_reason")?,
    })
}

/// A stored value this version cannot turn back into its Rust type.
#[derive(Debug)]
pub(super) struct DecodeError {
    pub table: &'static str,
    /// The row's identity: a device's address, an event's id.
    pub key: String,
    pub column: &'static str,
    pub source: BoxError,
}

/// Typed, checked access to the columns of one row; every failure names the row and column.
pub(super) struct Fields<'a, 'stmt> {
    pub row: &'a Row<'stmt>,
    pub table: &'static str,
    pub key: String,
    /// The row's columns in their order, when the query's are known; empty: found by name.
    pub columns: &'static [&'static str],
}

impl Fields<'_, '_> {
    fn error(&self, column: &'static str, source: impl Into<BoxError>) -> DecodeError {
        DecodeError {
            table: self.table,
            key: self.key.clone(),
            column,
            source: source.into(),
        }
    }

    /// A value SQLite can hand over as `T` directly (text, `Option<String>`, `i64`).
    pub fn get<T: FromSql>(&self, column: &'static str) -> Result<T, DecodeError> {
        match self.columns.iter().position(|c| *c == column) {
            Some(index) => self.row.get(index),
            None => self.row.get(column),
        }
        .map_err(|e| self.error(column, e))
    }

    /// An integer that must fit `T`: SQLite stores every integer as i64.
    pub fn int<T: TryFrom<i64>>(&self, column: &'static str) -> Result<T, DecodeError>
    where
        T::Error: Into<BoxError>,
    {
        let raw: i64 = self.get(column)?;
        T::try_from(raw).map_err(|e| self.error(column, e))
    }

    pub fn opt_int<T: TryFrom<i64>>(&self, column: &'static str) -> Result<Option<T>, DecodeError>
    where
        T::Error: Into<BoxError>,
    {
        let raw: Option<i64> = self.get(column)?;
        raw.map(T::try_from)
            .transpose()
            .map_err(|e| self.error(column, e))
    }

    /// A text column holding a value's `Display` form (enums, addresses).
    pub fn parse<T: FromStr>(&self, column: &'static str) -> Result<T, DecodeError>
    where
        T::Err: Into<BoxError>,
    {
        let text: String = self.get(column)?;
        text.parse().map_err(|e| self.error(column, e))
    }

    pub fn opt_parse<T: FromStr>(&self, column: &'static str) -> Result<Option<T>, DecodeError>
    where
        T::Err: Into<BoxError>,
    {
        let text: Option<String> = self.get(column)?;
        text.map(|t| t.parse())
            .transpose()
            .map_err(|e| self.error(column, e))
    }

    /// A boolean stored as 0 or 1; anything else is not silently read as true.
    pub fn flag(&self, column: &'static str) -> Result<bool, DecodeError> {
        match self.get::<i64>(column)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.error(column, format!("expected 0 or 1, found {other}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_reads_the_columns_in_the_order_decode_expects() {
        assert_eq!(
            SELECT,
            format!("SELECT {} FROM devices", COLUMNS.join(", "))
        );
    }
}
