//! A pooled device leased to a VM: a claim of kind `pooled`. The device sits in a remote pool
//! (see `docs/pool-protocol.md`); vfiod holds a session on it for the VM, fenced by the session's
//! epoch, and carries it through a live migration (see [`crate::pool`]).

use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

/// Where a pooled claim is, on this host. `Leased`, `Moving` and `Quiesced` hold the session;
/// the others are history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PooledState {
    /// The session runs for the VM on this host, at the recorded epoch.
    Leased,
    /// Destination of a live migration: the pool accepted to move the session here
    /// (prepare-move); it is resumed here once the VM runs here.
    Moving,
    /// The session's work is stopped at a clean point (a migration's switchover, or its
    /// begin in the conservative mode); it resumes where the VM runs next.
    Quiesced,
    /// Given back to the pool (DELETE): history only.
    Released,
    /// The VM went to another host, which owns the session now: history only, the pool was not
    /// called.
    Forgotten,
    /// A pool call failed in a way vfiod does not retry (`reason` says why: fenced by a newer
    /// epoch, the session gone); an operator looks, then releases or forgets it.
    Error,
}

text_enum!(PooledState as "pooled claim state",
    Leased => "leased", Moving => "moving", Quiesced => "quiesced", Released => "released",
    Forgotten => "forgotten", Error => "error");

impl PooledState {
    /// Whether a claim in this state still stands for a session this host may act on.
    pub fn holds(self) -> bool {
        matches!(
            self,
            PooledState::Leased | PooledState::Moving | PooledState::Quiesced
        )
    }

    /// Whether the claim is over (only history).
    pub fn ended(self) -> bool {
        matches!(self, PooledState::Released | PooledState::Forgotten)
    }
}

/// A pooled claim as the store records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PooledClaim {
    pub id: i64,
    /// The `[[pool]]` name.
    pub pool: String,
    /// The pool's session id ("s-17").
    pub session: String,
    /// The pool's device id.
    pub device: String,
    /// The epoch this host last knew the session at: every call to the pool carries it.
    pub epoch: u64,
    pub state: PooledState,
    /// Why the claim is in `Error` (or the last step's note); empty otherwise.
    pub reason: String,
    pub vm_name: Option<String>,
    pub vm_uuid: Option<String>,
    /// The other end of a migration: the host the session comes from (on a destination), so
    /// that a migration that fails after the destination quiesced can resume it there.
    pub peer_host: Option<String>,
    pub requested_by: String,
    pub created_ms: i64,
    pub updated_ms: i64,
}

impl PooledClaim {
    /// The VM, as a message names it.
    pub fn vm(&self) -> &str {
        self.vm_name
            .as_deref()
            .or(self.vm_uuid.as_deref())
            .unwrap_or("")
    }

    /// Whether this claim is the domain's (by UUID when both know it, else by name).
    pub fn of_domain(&self, name: &str, uuid: Option<&str>) -> bool {
        match (uuid, self.vm_uuid.as_deref()) {
            (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
            _ => self.vm_name.as_deref() == Some(name),
        }
    }
}
