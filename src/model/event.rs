//! What an entry of the history is about (`vfioctl events`, `Manager.GetEvents`).

use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// A function appeared.
    Added,
    /// A function is gone (unplugged, or a VF whose PF's VF count went down).
    Removed,
    /// A function's record changed (driver, VF count, ...).
    Changed,
    /// A function's information can no longer be read completely.
    Broken,
    /// A broken function reads completely again.
    Recovered,
    /// The host now uses a function (or the config protects it).
    Protected,
    /// The host no longer uses it.
    Unprotected,
    /// The configuration was reloaded, or a reload was refused.
    Config,
    /// A PCIe AER report (error, recovery).
    Aer,
    /// A task was created, changed state, or was reset.
    Task,
    /// A claim was made, attached, detached, released or expired.
    Claim,
    /// The FPGA image catalog changed (added, deactivated, activated, removed).
    Image,
    /// A pooled claim's step: leased, prepare-move, quiesced, resumed, released, forgotten, or a
    /// pool call that failed.
    Pool,
    /// Cleaning between tenants: a function held for a clean, cleaned and back in the pool,
    /// quarantined, or released from quarantine.
    Clean,
    /// The state store: vfiod started on a database that lacks changes it acknowledged, as the
    /// operator accepted (`vfiod --accept-store-loss`).
    Store,
}

text_enum!(EventKind as "event kind",
    Added => "added", Removed => "removed", Changed => "changed", Broken => "broken",
    Recovered => "recovered", Protected => "protected", Unprotected => "unprotected",
    Config => "config", Aer => "aer", Task => "task", Claim => "claim", Image => "image", Pool => "pool",
    Clean => "clean", Store => "store");
