//! `org.vfiod.Vfiod1.Pools` on the root object: the remote pools (`[[pool]]`), what they offer,
//! and the pooled claims (a pool's session leased to a VM). Each standing pooled claim is an
//! object of its own ([`super::pool_claim`]), released through it as a PCI claim is.
//!
//! These members grew on `Manager` first (`HostName`, `GetPools`, `GetPoolDevices`,
//! `GetPooledClaims`, `LeasePooled`, `ReleasePooled`); they stay there for one release as
//! deprecated aliases of the same functions below and of [`super::pool_claim::release`]
//! (docs/dbus.md, "Compatibility").

use super::auth::{Check, Detail, ACTION_CLAIM};
use super::error::Error;
use super::wire::{self, Dict, Query};
use super::Objects;
use zbus::message::Header;
use zbus::{interface, Connection, OwnedObjectPath};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Pools";

pub struct Pools {
    pub objects: Objects,
}

pub(super) fn host_name(o: &Objects) -> String {
    o.engine.settings().host_name.clone()
}

pub(super) fn list(o: &Objects) -> Vec<Dict> {
    let calls = o.engine.metrics().pool_calls();
    o.engine
        .settings()
        .pools
        .iter()
        .map(|p| wire::pool(p, calls.get(&p.name)))
        .collect()
}

pub(super) async fn devices(o: &Objects, pool: &str) -> Result<Vec<Dict>, Error> {
    let devices = o.engine.pool_devices(pool).await?;
    Ok(devices.iter().map(wire::pool_device).collect())
}

pub(super) async fn claims(o: &Objects, query: Dict) -> Result<Vec<Dict>, Error> {
    let q = Query::new(query, &["history"])?;
    let history = q.bool("history")?.unwrap_or(false);
    let claims = o.engine.pooled_claims(history).await?;
    Ok(claims.iter().map(wire::pooled).collect())
}

/// Leases `device` of `pool` to the owner's VM. polkit's rules see the verb `LeasePooled`
/// whichever member was called, so that one rule covers both.
pub(super) async fn lease(
    o: &Objects,
    pool: &str,
    device: &str,
    owner: Dict,
    conn: &Connection,
    header: &Header<'_>,
) -> Result<crate::model::pool::PooledClaim, Error> {
    let q = Query::new(owner, &["vm_name", "vm_uuid"])?;
    let vm_name = q.str("vm_name")?.filter(|s| !s.is_empty());
    let vm_uuid = q.str("vm_uuid")?.filter(|s| !s.is_empty());
    let vm = vm_name
        .clone()
        .or(vm_uuid.clone())
        .ok_or_else(|| Error::InvalidArgument("owner: give vm_name or vm_uuid".into()))?;
    if pool.is_empty() || device.is_empty() {
        return Err(Error::InvalidArgument(
            "the pool and the device must be named".into(),
        ));
    }
    let check = Check::new(ACTION_CLAIM, "LeasePooled")
        .with(Detail::Vm, &vm)
        .with(Detail::Kind, "pooled");
    o.authorizer.check(conn, header, &check).await?;
    let who = o.requesters.of(conn, header).await;
    let claim = o
        .engine
        .lease_pooled(pool, device, vm_name, vm_uuid, &who)
        .await;
    o.engine.flush().await;
    Ok(claim?)
}

#[interface(name = "org.vfiod.Vfiod1.Pools")]
impl Pools {
    /// What the pools know this host as (`host_name` in the configuration).
    #[zbus(property)]
    fn host_name(&self) -> String {
        host_name(&self.objects)
    }

    /// The configured pools, each `{name: s, url: s, quiesce_at: s ("switchover", "begin"),
    /// connect_timeout_ms: u, request_timeout_ms: u, last_call_ms: t (Unix ms of its last call
    /// since vfiod started, 0 when none), last_call_error: s ("" when it answered, a refusal
    /// included; else why it could not be reached)}`. `options`: none yet.
    fn list(&self, options: Dict) -> Result<Vec<Dict>, Error> {
        Query::new(options, &[])?;
        Ok(list(&self.objects))
    }

    /// The devices pool `pool` offers (its `GET /v1/devices`), each `{id: s, kind: s, model: s,
    /// session: s ("" when free)}`. Waits for the pool at most its deadlines. `options`: none
    /// yet.
    async fn get_devices(&self, pool: &str, options: Dict) -> Result<Vec<Dict>, Error> {
        Query::new(options, &[])?;
        devices(&self.objects, pool).await
    }

    /// Pooled claims, oldest first, each `{id: x, pool: s, session: s, device: s, epoch: t,
    /// state: s (leased, moving, quiesced, released, forgotten, error), reason: s, vm_name: s,
    /// vm_uuid: s, peer_host: s, requested_by: s, created: x, updated: x (Unix ms)}`. Query
    /// keys, all optional: `history` b (the ended ones too).
    async fn get_claims(&self, query: Dict) -> Result<Vec<Dict>, Error> {
        claims(&self.objects, query).await
    }

    /// Leases device `device` of pool `pool` to a VM (the pool's `POST /v1/sessions` with this
    /// host's name), records the pooled claim and writes its session in the domain's metadata
    /// when the domain exists. Owner keys: `vm_name` s and/or `vm_uuid` s (one is needed).
    /// Returns the claim's object (`org.vfiod.Vfiod1.PooledClaim`). Waits for the pool at most
    /// its deadlines. Authorized as `org.vfiod.vfiod1.claim` with the VM and kind `pooled`.
    async fn lease(
        &self,
        pool: &str,
        device: &str,
        owner: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        let claim = lease(&self.objects, pool, device, owner, conn, &header).await?;
        Ok(super::pool_claim::pooled_path(claim.id))
    }
}
