//! A VM's hold on a device, as the store records it and the D-Bus API shows it (`Claim.State`).

use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

/// Where a claim is in its life. Every state but `Released` holds the claim's functions: no other
/// claim can have them, and no task may convert them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimState {
    /// Reserved for a VM, not (yet) attached to its domain.
    Claimed,
    /// An attach is under way.
    Attaching,
    /// The domain has the device as a hostdev.
    Attached,
    /// A detach is under way, or failed and waits for libvirt's device-removed event.
    Detaching,
    /// Given back: history only.
    Released,
}

text_enum!(ClaimState as "claim state",
    Claimed => "claimed", Attaching => "attaching", Attached => "attached",
    Detaching => "detaching", Released => "released");

impl ClaimState {
    /// Whether a claim in this state holds its functions.
    pub fn holds(self) -> bool {
        self != ClaimState::Released
    }
}
