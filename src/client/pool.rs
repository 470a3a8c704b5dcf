//! The client side of pooled devices: `vfioctl pool ...` (the pools, their devices, the pooled
//! claims of this host and their history).

use crate::dbus::wire::{Dict, Entry};
use serde::{Deserialize, Serialize};

/// A pooled claim's object (`/org/vfiod/Vfiod1/pooled/N`).
#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.PooledClaim",
    default_service = "org.vfiod.Vfiod1"
)]
pub trait PooledClaim {
    #[zbus(property)]
    fn id(&self) -> zbus::Result<i64>;
    #[zbus(property)]
    fn pool(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn session(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn device(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn epoch(&self) -> zbus::Result<u64>;
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn reason(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn vm_name(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn peer_host(&self) -> zbus::Result<String>;
    /// Gives it back to its pool; the claim as it ends.
    fn release(&self) -> zbus::Result<Dict>;
}

/// `org.vfiod.Vfiod1.Pools` on the root object.
#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Pools",
    default_service = "org.vfiod.Vfiod1",
    default_path = "/org/vfiod/Vfiod1"
)]
pub trait Pools {
    #[zbus(property)]
    fn host_name(&self) -> zbus::Result<String>;
    fn list(&self, options: Dict) -> zbus::Result<Vec<Dict>>;
    fn get_devices(&self, pool: &str, options: Dict) -> zbus::Result<Vec<Dict>>;
    fn get_claims(&self, query: Dict) -> zbus::Result<Vec<Dict>>;
    fn lease(&self, pool: &str, device: &str, owner: Dict) -> zbus::Result<zbus::OwnedObjectPath>;
}

/// The root object's pools interface (no property cache: one-shot reads).
pub async fn pools(conn: &zbus::Connection) -> Result<PoolsProxy<'static>, super::ClientError> {
    Ok(PoolsProxy::builder(conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await?)
}

/// The id at the end of a pooled claim's object path (`/org/vfiod/Vfiod1/pooled/N`).
pub fn id_of_path(path: &str) -> Option<i64> {
    path.strip_prefix(crate::dbus::ROOT_PATH)?
        .strip_prefix("/pooled/")?
        .parse()
        .ok()
}

/// The object of pooled claim `id` (no property cache: one-shot reads).
pub async fn pooled_claim(
    conn: &zbus::Connection,
    id: i64,
) -> Result<PooledClaimProxy<'static>, super::ClientError> {
    Ok(PooledClaimProxy::builder(conn)
        .path(crate::dbus::pool_claim::pooled_path(id))
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await?)
}

/// One pooled claim (`vfioctl pool list --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PooledEntry {
    pub id: i64,
    pub pool: String,
    pub session: String,
    pub device: String,
    pub epoch: u64,
    pub state: String,
    pub reason: String,
    pub vm_name: String,
    pub vm_uuid: String,
    pub peer_host: String,
    pub requested_by: String,
    pub created_ms: i64,
    pub updated_ms: i64,
}

impl PooledEntry {
    pub fn from_dict(d: &Dict) -> PooledEntry {
        let e = Entry(d);
        PooledEntry {
            id: e.i64("id"),
            pool: e.str("pool"),
            session: e.str("session"),
            device: e.str("device"),
            epoch: e.u64("epoch"),
            state: e.str("state"),
            reason: e.str("reason"),
            vm_name: e.str("vm_name"),
            vm_uuid: e.str("vm_uuid"),
            peer_host: e.str("peer_host"),
            requested_by: e.str("requested_by"),
            created_ms: e.i64("created"),
            updated_ms: e.i64("updated"),
        }
    }

    fn vm(&self) -> &str {
        if self.vm_name.is_empty() {
            &self.vm_uuid
        } else {
            &self.vm_name
        }
    }
}

/// A configured pool (`vfioctl pool pools --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolEntry {
    pub name: String,
    pub url: String,
    pub quiesce_at: String,
    pub connect_timeout_ms: u32,
    pub request_timeout_ms: u32,
}

impl PoolEntry {
    pub fn from_dict(d: &Dict) -> PoolEntry {
        let e = Entry(d);
        PoolEntry {
            name: e.str("name"),
            url: e.str("url"),
            quiesce_at: e.str("quiesce_at"),
            connect_timeout_ms: e.u32("connect_timeout_ms"),
            request_timeout_ms: e.u32("request_timeout_ms"),
        }
    }
}

/// A device a pool offers (`vfioctl pool devices POOL --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDeviceEntry {
    pub id: String,
    pub kind: String,
    pub model: String,
    pub session: String,
}

impl PoolDeviceEntry {
    pub fn from_dict(d: &Dict) -> PoolDeviceEntry {
        let e = Entry(d);
        PoolDeviceEntry {
            id: e.str("id"),
            kind: e.str("kind"),
            model: e.str("model"),
            session: e.str("session"),
        }
    }
}

/// `vfioctl pool list`.
pub fn render_table(claims: &[PooledEntry]) -> String {
    let rows = claims.iter().map(|c| {
        vec![
            c.id.to_string(),
            c.pool.clone(),
            c.session.clone(),
            c.device.clone(),
            c.epoch.to_string(),
            c.state.clone(),
            if c.reason.is_empty() {
                c.vm().to_string()
            } else {
                format!("{}  ({})", c.vm(), c.reason)
            },
        ]
    });
    super::table::render(
        &["ID", "POOL", "SESSION", "DEVICE", "EPOCH", "STATE", "VM"],
        rows,
    )
}

/// `vfioctl pool show ID`.
pub fn render_details(c: &PooledEntry) -> String {
    let or_dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    format!(
        "pooled claim {}\n  pool:         {}\n  session:      {}\n  device:       {}\n  epoch:        {}\n  \
         state:        {}\n  reason:       {}\n  vm:           {} ({})\n  from host:    {}\n  \
         requested by: {}\n",
        c.id,
        c.pool,
        c.session,
        or_dash(&c.device),
        c.epoch,
        c.state,
        or_dash(&c.reason),
        or_dash(&c.vm_name),
        or_dash(&c.vm_uuid),
        or_dash(&c.peer_host),
        c.requested_by
    )
}
