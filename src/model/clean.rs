//! What cleaning between tenants records about a device: whether it is held out of the pool for
//! a clean (and why), and how its resets have gone.

use crate::model::pci::PciAddress;
use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

/// Why a device is held out of the pool by cleaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HoldState {
    /// A claim on it ended (or an operator asked): it returns to the pool when a clean succeeds.
    Pending,
    /// A clean found it unhealthy, its reset hung, its command failed, or its reset failed twice
    /// in a row: kept out (shown as `broken`) until an operator resets the clean's task.
    Quarantined,
}

text_enum!(HoldState, Pending => "pending", Quarantined => "quarantined");

/// A device held out of the pool by cleaning.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanHold {
    pub address: PciAddress,
    pub state: HoldState,
    /// Why it is held: the claim that ended, or the quarantine's reason.
    pub reason: String,
    /// The claim whose end asked for the clean; `None` when an operator asked.
    pub claim_id: Option<i64>,
    /// Unix milliseconds: since when it is held (in this state).
    pub since_ms: i64,
}

/// How a device's resets have gone: what `vfioctl show` and `Device.ResetHealth` report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetHealth {
    /// The reset method that worked last (`flr`, `bus`, ..., `bridge` for the secondary bus
    /// reset of its bridge, `none` when the clean had no reset to do).
    pub method: Option<String>,
    /// How long that reset took.
    pub duration_ms: Option<i64>,
    /// Unix milliseconds of the last clean that succeeded.
    pub ok_ms: Option<i64>,
    /// What went wrong last, and when (Unix milliseconds).
    pub failure: Option<String>,
    pub failure_ms: Option<i64>,
    /// Cleans that failed since the last one that succeeded: at two, the device is quarantined.
    pub failures_in_row: u32,
    /// Cleans that succeeded.
    pub cleans: u32,
}
