//! The client side of claims: `vfioctl claim`, `claims`, `release`, and the VM shown beside a
//! claimed device.

use super::{manager, prop, ClientError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use zbus::{Connection, OwnedVariant};

pub use crate::dbus::claim::INTERFACE;

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Claim",
    default_service = "org.vfiod.Vfiod1"
)]
pub trait Claim {
    fn release(&self) -> zbus::Result<()>;
    fn attach(&self, domain: &str, options: crate::dbus::wire::Dict) -> zbus::Result<()>;
    fn detach(&self) -> zbus::Result<()>;
}

/// `Claim.Attach`'s options for `flags` (`live`, `config`): each one named is true, and when
/// only one is named the other is false (`--live` alone attaches to the running domain only).
/// None: no options, the daemon decides from the domain's state.
pub fn attach_options(flags: &[&str]) -> crate::dbus::wire::Dict {
    if flags.is_empty() {
        return crate::dbus::wire::Dict::new();
    }
    ["live", "config"]
        .into_iter()
        .map(|f| (f.to_string(), crate::dbus::variant(flags.contains(&f))))
        .collect()
}

/// How far an attach or detach had come when the client stopped waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The daemon replied: done.
    Done,
    /// The claim entered this state (attaching, detaching); the daemon goes on without us.
    Started(String),
}

/// Which change of a claim an attach or detach waits for.
#[derive(Clone, Copy, Debug)]
pub enum Change<'a> {
    Attach {
        domain: &'a str,
        flags: &'a [&'a str],
    },
    Detach,
}

/// Attaches or detaches the claim at `path`. `wait`: until the daemon replies (the guest let go,
/// libvirt has the device); otherwise until the claim's state shows the work started, or the
/// daemon replied first (a refusal comes back either way).
pub async fn change(
    conn: &Connection,
    path: zbus::OwnedObjectPath,
    what: Change<'_>,
    wait: bool,
) -> Result<Progress, ClientError> {
    use futures_util::StreamExt;
    manager(conn).await?;
    let claim = ClaimProxy::builder(conn).path(path.clone()).build().await?;
    let call = async {
        match what {
            Change::Attach { domain, flags } => claim.attach(domain, attach_options(flags)).await,
            Change::Detach => claim.detach().await,
        }
    };
    if wait {
        call.await?;
        return Ok(Progress::Done);
    }
    let props = zbus::fdo::PropertiesProxy::builder(conn)
        .destination(crate::dbus::BUS_NAME)
        .path(path)
        .build()
        .await?;
    // Subscribed before the call, so that the change it causes cannot be missed.
    let mut changes = props.receive_properties_changed().await?;
    let started = async {
        while let Some(signal) = changes.next().await {
            let Ok(args) = signal.args() else { continue };
            if let Some(state) = args.changed_properties().get("State") {
                if let Ok(s) = String::try_from(state.clone()) {
                    if s == "attaching" || s == "detaching" {
                        return Some(s);
                    }
                }
            }
        }
        None
    };
    tokio::select! {
        r = call => { r?; Ok(Progress::Done) }
        Some(s) = started => Ok(Progress::Started(s)),
    }
}

/// One claim as `vfioctl claims` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimView {
    pub path: String,
    pub id: u64,
    pub address: String,
    pub functions: Vec<String>,
    /// The VM's name, else its UUID: for the table. Not in the JSON, which has both.
    #[serde(skip_serializing, default)]
    pub vm: String,
    pub vm_name: String,
    pub vm_uuid: String,
    pub kind: String,
    pub state: String,
    pub guest_address: String,
    /// Unix milliseconds.
    pub created_ms: u64,
    /// Unix milliseconds; 0 for no lease.
    pub lease_expires_ms: u64,
    pub persistent: bool,
    pub requested_by: String,
}

/// The VM a claim object's properties name.
pub(super) fn vm_of(p: &HashMap<String, OwnedVariant>) -> String {
    let get = |k: &str| prop::<String>(p, "", k).unwrap_or_default();
    let name = get("VmName");
    if name.is_empty() {
        get("VmUuid")
    } else {
        name
    }
}

fn view(path: &str, p: &HashMap<String, OwnedVariant>) -> Result<ClaimView, ClientError> {
    let s = |n: &str| prop::<String>(p, path, n);
    Ok(ClaimView {
        path: path.to_string(),
        id: u64::try_from(prop::<i64>(p, path, "Id")?).unwrap_or(0),
        address: s("Address")?,
        functions: prop(p, path, "Functions")?,
        vm: vm_of(p),
        vm_name: s("VmName")?,
        vm_uuid: s("VmUuid")?,
        kind: s("Kind")?,
        state: s("State")?,
        guest_address: s("GuestAddress")?,
        created_ms: u64::try_from(prop::<i64>(p, path, "Created")?).unwrap_or(0),
        lease_expires_ms: u64::try_from(prop::<i64>(p, path, "LeaseExpires")?).unwrap_or(0),
        persistent: prop(p, path, "Persistent")?,
        requested_by: s("RequestedBy")?,
    })
}

/// The manager's proxy, which has the claim calls (`FindDevices`, `Claim`, `GetClaims`).
pub async fn claims_proxy(conn: &Connection) -> Result<super::ManagerProxy<'static>, ClientError> {
    manager(conn).await
}

/// A claim object by path.
pub async fn claim_view(conn: &Connection, path: &str) -> Result<ClaimView, ClientError> {
    let object = zbus::OwnedObjectPath::try_from(path.to_string())?;
    let props = zbus::fdo::PropertiesProxy::builder(conn)
        .destination(crate::dbus::BUS_NAME)
        .path(object)
        .build()
        .await?;
    let all = props.get_all(INTERFACE.try_into()?).await?;
    view(path, &all.into_iter().collect())
}

/// Every active claim, oldest first.
pub async fn list_claims(conn: &Connection) -> Result<Vec<ClaimView>, ClientError> {
    let paths = claims_proxy(conn).await?.get_claims().await?;
    let mut out = Vec::new();
    for p in paths {
        match claim_view(conn, p.as_str()).await {
            Ok(c) => out.push(c),
            // Released between the list and the read: it is no longer a claim to show.
            Err(ClientError::Call(zbus::Error::FDO(e)))
                if matches!(*e, zbus::fdo::Error::UnknownObject(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// A claim's object path from what a user types: `7` or the whole path.
pub fn claim_path(text: &str) -> Result<zbus::OwnedObjectPath, String> {
    let path = match text.parse::<u64>() {
        Ok(n) => format!("{}/claim/{n}", crate::dbus::ROOT_PATH),
        Err(_) if text.starts_with(&format!("{}/claim/", crate::dbus::ROOT_PATH)) => {
            text.to_string()
        }
        Err(_) => {
            return Err(format!(
                "{text:?} is not a claim: give its number (as `vfioctl claims` shows) or its \
                 object path"
            ))
        }
    };
    zbus::OwnedObjectPath::try_from(path).map_err(|e| e.to_string())
}

/// Releases a claim.
pub async fn release(conn: &Connection, path: zbus::OwnedObjectPath) -> Result<(), ClientError> {
    manager(conn).await?;
    let claim = ClaimProxy::builder(conn).path(path).build().await?;
    Ok(claim.release().await?)
}

/// The `vfioctl claims` table.
pub fn render_claims(claims: &[ClaimView], time: impl Fn(i64) -> String) -> String {
    let rows = claims.iter().map(|c| {
        vec![
            c.id.to_string(),
            c.address.clone(),
            c.functions.len().to_string(),
            c.vm.clone(),
            c.state.clone(),
            if c.lease_expires_ms == 0 {
                "-".into()
            } else {
                format!("until {}", time(c.lease_expires_ms as i64))
            },
        ]
    });
    super::table::render(
        &["CLAIM", "DEVICE", "FUNCTIONS", "VM", "STATE", "LEASE"],
        rows,
    )
}
