//! `org.vfiod.Vfiod1.PooledClaim`: one object per standing pooled claim (a remote pool's session
//! leased to a VM) at `/org/vfiod/Vfiod1/pooled/N`. It appears when the claim is recorded
//! (leased here, or moving here with a migration), changes with each step (PropertiesChanged:
//! epoch, state, reason) and goes when the claim ends (released, or forgotten after its VM left
//! this host). `Pools.GetClaims` lists them, and the ended ones with `history`; `Release` gives
//! one back.

use crate::model::pool::PooledClaim;
use std::collections::HashMap;
use zbus::{interface, OwnedObjectPath, OwnedVariant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.PooledClaim";

pub fn pooled_path(id: i64) -> OwnedObjectPath {
    OwnedObjectPath::try_from(format!("{}/pooled/{id}", super::ROOT_PATH))
        .expect("valid object path")
}

/// The D-Bus face of one pooled claim: its id and the view it reads from.
pub struct PooledObject {
    pub id: i64,
    pub objects: super::Objects,
}

impl PooledObject {
    fn claim(&self) -> zbus::fdo::Result<PooledClaim> {
        self.objects
            .view
            .pooled(self.id)
            .ok_or_else(|| zbus::fdo::Error::UnknownObject(format!("no pooled claim {}", self.id)))
    }
}

pub fn properties(c: &PooledClaim) -> Vec<(&'static str, OwnedVariant)> {
    use super::variant as v;
    vec![
        ("Id", v(c.id)),
        ("Pool", v(c.pool.as_str())),
        ("Session", v(c.session.as_str())),
        ("Device", v(c.device.as_str())),
        ("Epoch", v(c.epoch)),
        ("State", v(c.state.as_str())),
        ("Reason", v(c.reason.as_str())),
        ("VmName", v(c.vm_name.clone().unwrap_or_default())),
        ("VmUuid", v(c.vm_uuid.clone().unwrap_or_default())),
        ("PeerHost", v(c.peer_host.clone().unwrap_or_default())),
        ("RequestedBy", v(c.requested_by.as_str())),
        ("Created", v(c.created_ms)),
        ("Updated", v(c.updated_ms)),
    ]
}

pub fn changed_properties(
    old: &PooledClaim,
    new: &PooledClaim,
) -> HashMap<&'static str, OwnedVariant> {
    super::changed(properties(old), properties(new))
}

/// Gives pooled claim `id` back to its pool; the claim as it ends (released, or forgotten).
/// polkit's verb is `ReleasePooled`, whichever member was called.
pub(super) async fn release(
    o: &super::Objects,
    id: i64,
    conn: &zbus::Connection,
    header: &zbus::message::Header<'_>,
) -> Result<super::wire::Dict, super::error::Error> {
    let claim = o
        .engine
        .read(move |core| core.store().pooled_claim(id))
        .await??
        .ok_or_else(|| super::error::Error::NoSuchClaim(format!("no pooled claim {id}")))?;
    let check = super::auth::Check::new(super::auth::ACTION_CLAIM, "ReleasePooled")
        .with(super::auth::Detail::Vm, claim.vm())
        .with(super::auth::Detail::Kind, "pooled");
    o.authorizer.check(conn, header, &check).await?;
    let who = o.requesters.of(conn, header).await;
    let claim = o.engine.release_pooled(id, &who).await;
    o.engine.flush().await;
    Ok(super::wire::pooled(&claim?))
}

#[interface(name = "org.vfiod.Vfiod1.PooledClaim")]
impl PooledObject {
    #[zbus(property(emits_changed_signal = "const"))]
    fn id(&self) -> zbus::fdo::Result<i64> {
        Ok(self.claim()?.id)
    }
    /// The `[[pool]]` name.
    #[zbus(property(emits_changed_signal = "const"))]
    fn pool(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.pool)
    }
    /// The pool's session id.
    #[zbus(property(emits_changed_signal = "const"))]
    fn session(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.session)
    }
    /// The pool's device id.
    #[zbus(property(emits_changed_signal = "const"))]
    fn device(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.device)
    }
    /// The session's epoch as this host knows it: the fencing token of its pool calls.
    #[zbus(property)]
    fn epoch(&self) -> zbus::fdo::Result<u64> {
        Ok(self.claim()?.epoch)
    }
    /// leased, moving, quiesced, error (released and forgotten: the object goes).
    #[zbus(property)]
    fn state(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.state.as_str().into())
    }
    /// Why it is in error (fenced, the session gone), or how it ended; empty otherwise.
    #[zbus(property)]
    fn reason(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.reason)
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn vm_name(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.vm_name.unwrap_or_default())
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn vm_uuid(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.vm_uuid.unwrap_or_default())
    }
    /// The host an incoming session comes from; empty for one leased here.
    #[zbus(property(emits_changed_signal = "const"))]
    fn peer_host(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.peer_host.unwrap_or_default())
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn requested_by(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.requested_by)
    }
    /// Unix milliseconds.
    #[zbus(property(emits_changed_signal = "const"))]
    fn created(&self) -> zbus::fdo::Result<i64> {
        Ok(self.claim()?.created_ms)
    }
    /// Unix milliseconds of the last step.
    #[zbus(property)]
    fn updated(&self) -> zbus::fdo::Result<i64> {
        Ok(self.claim()?.updated_ms)
    }

    /// Gives the claim back to its pool (`DELETE` with its epoch) and returns it as it ends:
    /// `released`, or `forgotten` when the pool no longer has the session or fenced this host
    /// out, as `Pools.GetClaims` gives it. The object goes. Authorized as
    /// `org.vfiod.vfiod1.claim` (verb `ReleasePooled`) with the VM and kind `pooled`.
    async fn release(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<crate::dbus::wire::Dict, super::error::Error> {
        release(&self.objects, self.id, conn, &header).await
    }
}
