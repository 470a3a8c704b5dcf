//! The D-Bus face of the daemon: thin adapters over the engine, one module per object kind
//! (manager, image catalog, pools, device, task, claim, pooled claim; a new kind of object is a new
//! file). Objects read what they show from the [`view`], which the [`publisher`] keeps in step
//! with the engine's events; errors are mapped in [`error`]; mutating calls are authorized in
//! [`auth`]; [`strict`] checks arguments and read-only properties for every object.

pub mod auth;
pub mod claim;
pub mod device;
pub mod error;
pub mod hook_socket;
pub mod image;
pub mod manager;
pub mod pool_claim;
pub mod pool;
mod publisher;
mod event_signal;
pub mod strict;
pub mod task;
pub mod view;
pub mod wire;

use crate::engine::{Engine, EventStream};
use crate::model::pci::PciAddress;
use device::DeviceObject;
use std::collections::HashMap;
use std::sync::Arc;
use strict::Strict;
use zbus::{Connection, OwnedObjectPath};

pub const BUS_NAME: &str = "org.vfiod.Vfiod1";
pub const ROOT_PATH: &str = "/org/vfiod/Vfiod1";

/// `/org/vfiod/Vfiod1/device/pci_DDDD_BB_SS_F`.
pub fn device_path(address: PciAddress) -> OwnedObjectPath {
    OwnedObjectPath::try_from(format!("{ROOT_PATH}/device/{}", address.nodedev_name()))
        .expect("valid object path")
}

/// Which bus to serve on or talk to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BusTarget {
    System,
    Session,
    Address(String),
}

impl std::str::FromStr for BusTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "system" => Ok(BusTarget::System),
            "session" => Ok(BusTarget::Session),
            a if a.contains(':') && a.contains('=') => Ok(BusTarget::Address(a.to_string())),
            other => Err(format!(
                "bus must be system, session or a D-Bus address like unix:path=/run/x.sock, not {other:?}"
            )),
        }
    }
}

impl BusTarget {
    pub fn builder(&self) -> zbus::connection::Builder<'static> {
        match self {
            BusTarget::System => zbus::connection::Builder::system(),
            BusTarget::Session => zbus::connection::Builder::session(),
            BusTarget::Address(a) => zbus::connection::Builder::address(a.as_str()),
        }
    }
}

/// What every object needs: the connection, the engine to act through, the view to read from,
/// and how to authorize. Cheap to clone.
#[derive(Clone)]
pub struct Objects {
    pub conn: Connection,
    pub engine: Arc<Engine>,
    pub view: Arc<view::View>,
    pub authorizer: auth::Gate,
    /// Who is behind each caller, for the records (the same the gate asks).
    pub requesters: Arc<auth::Requesters>,
}

impl Objects {
    pub(crate) fn device_object(&self, address: PciAddress) -> Strict<DeviceObject> {
        Strict::new(DeviceObject {
            address,
            objects: self.clone(),
        })
    }

    pub(crate) fn claim_object(&self, id: i64) -> Strict<claim::ClaimObject> {
        Strict::new(claim::ClaimObject {
            id,
            objects: self.clone(),
        })
    }

    pub(crate) fn pooled_object(&self, id: i64) -> Strict<pool_claim::PooledObject> {
        Strict::new(pool_claim::PooledObject {
            id,
            objects: self.clone(),
        })
    }

    pub(crate) fn task_object(&self, id: i64) -> Strict<task::TaskObject> {
        Strict::new(task::TaskObject {
            id,
            objects: self.clone(),
        })
    }
}

/// Exports the API on `bus`: the root (Manager + ObjectManager), one object per stored device,
/// the tasks they show and the active claims, then publishes `events` as they come. The caller
/// takes the name with [`take_name`] once the daemon is ready, so that a client that sees the
/// name sees a settled inventory.
pub async fn serve(
    bus: &BusTarget,
    engine: Arc<Engine>,
    events: EventStream,
    authorizer: auth::Authorizer,
    simulated: bool,
) -> Result<Connection, ServeError> {
    let conn = bus.builder().build().await.map_err(ServeError::Connect)?;
    let requesters: Arc<auth::Requesters> = Arc::default();
    let objects = Objects {
        conn: conn.clone(),
        engine: Arc::clone(&engine),
        view: Arc::new(view::View::default()),
        authorizer: auth::Gate::new(authorizer, Arc::clone(&requesters)),
        requesters,
    };
    let server = conn.object_server();
    server
        .at(ROOT_PATH, zbus::fdo::ObjectManager)
        .await
        .map_err(ServeError::Export)?;
    server
        .at(
            ROOT_PATH,
            Strict::new(manager::Manager {
                objects: objects.clone(),
                simulated,
            }),
        )
        .await
        .map_err(ServeError::Export)?;
    server
        .at(ROOT_PATH, Strict::new(image::Images::new(objects.clone())))
        .await
        .map_err(ServeError::Export)?;
    server
        .at(
            ROOT_PATH,
            Strict::new(pool::Pools {
                objects: objects.clone(),
            }),
        )
        .await
        .map_err(ServeError::Export)?;
    // Events sent from here on are applied on top of this picture by the publisher.
    let devices = engine
        .read(|core| core.device_views())
        .await
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?;
    for d in devices {
        let address = d.device.address;
        // Active tasks and each device's last result stay visible across restarts.
        for t in d.active.iter().chain(d.last.iter()) {
            if objects.view.put_task(t.clone()).is_none() {
                server
                    .at(task::task_path(t.id), objects.task_object(t.id))
                    .await
                    .map_err(ServeError::Export)?;
            }
        }
        objects.view.put_device(d);
        server
            .at(device_path(address), objects.device_object(address))
            .await
            .map_err(ServeError::Export)?;
    }
    let claims = engine
        .read(|core| core.store().active_claim_records())
        .await
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?;
    for c in claims {
        let id = c.id;
        objects.view.put_claim(c);
        server
            .at(claim::claim_path(id), objects.claim_object(id))
            .await
            .map_err(ServeError::Export)?;
    }
    let pooled = engine
        .read(|core| core.store().pooled_claims(false))
        .await
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?;
    for c in pooled {
        let id = c.id;
        objects.view.put_pooled(c);
        server
            .at(pool_claim::pooled_path(id), objects.pooled_object(id))
            .await
            .map_err(ServeError::Export)?;
    }
    tokio::spawn(event_signal::run(objects.clone()));
    tokio::spawn(publisher::run(objects, events));
    Ok(conn)
}

/// A plain value as a D-Bus variant (strings, integers, booleans, arrays of them).
pub(crate) fn variant<'a>(x: impl Into<zbus::Variant<'a>>) -> zbus::OwnedVariant {
    zbus::OwnedVariant::try_from(x.into()).expect("plain values convert")
}

/// The properties of `after` that differ from `before`, for one PropertiesChanged signal.
pub(crate) fn changed(
    before: Vec<(&'static str, zbus::OwnedVariant)>,
    after: Vec<(&'static str, zbus::OwnedVariant)>,
) -> HashMap<&'static str, zbus::OwnedVariant> {
    let before: HashMap<_, _> = before.into_iter().collect();
    after
        .into_iter()
        .filter(|(k, v)| before.get(k) != Some(v))
        .collect()
}

/// One PropertiesChanged signal carrying every changed property of `interface` (none: no signal).
async fn signal_changed(
    emitter: &zbus::object_server::SignalEmitter<'_>,
    interface: &'static str,
    changed: HashMap<&'static str, zbus::OwnedVariant>,
) -> zbus::Result<()> {
    if changed.is_empty() {
        return Ok(());
    }
    let map: HashMap<&str, zbus::Variant<'_>> = changed
        .into_iter()
        .map(|(k, v)| (k, zbus::Variant::from(v)))
        .collect();
    zbus::fdo::Properties::properties_changed(
        emitter,
        interface.try_into()?,
        map,
        std::borrow::Cow::Borrowed(&[]),
    )
    .await
}

/// Takes the well-known name: from here on clients find vfiod.
pub async fn take_name(conn: &Connection) -> Result<(), ServeError> {
    conn.request_name_with_flags(BUS_NAME, zbus::fdo::RequestNameFlags::DO_NOT_QUEUE)
        .await
        .map_err(ServeError::Name)?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot connect to the D-Bus bus")]
    Connect(#[source] zbus::Error),
    #[error("cannot export objects")]
    Export(#[source] zbus::Error),
    #[error("cannot read the store: {0}")]
    Store(String),
    #[error("cannot own the bus name {BUS_NAME} (is another vfiod running, or does the bus policy forbid it?)")]
    Name(#[source] zbus::Error),
}
