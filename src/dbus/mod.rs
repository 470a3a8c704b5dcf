//! The D-Bus face of the daemon: thin adapters over the engine. Objects are published from the
//! store after each committed pass; errors are mapped in [`error`]; mutating calls are
//! authorized in [`auth`].

pub mod auth;
pub mod device;
pub mod error;
pub mod manager;
pub mod task;

/// The shapes of the manager's list replies, one definition for the service and its proxy
/// (`crate::client`): a change on one side is a change on both.
pub mod wire {
    /// GetEvents: (id, time in ms since the epoch, address or "", kind, message).
    pub type EventRow = (i64, i64, String, String, String);
    /// GetPlan: (decision, reason, program, steps as shell-like lines, plan as JSON).
    pub type Plan = (String, String, String, Vec<String>, String);
    /// GetPlans: (address, decision, reason, program, steps, plan as JSON).
    pub type PlanRow = (String, String, String, String, Vec<String>, String);
    /// GetTasks: (id, kind, address, state, step, percent, result, created ms, finished ms or
    /// 0, requested by).
    pub type TaskRow = (
        i64,
        String,
        String,
        String,
        String,
        u8,
        String,
        i64,
        i64,
        String,
    );
}

use crate::engine::{Pass, Publish, Service};
use crate::model::pci::PciAddress;
use crate::store::DeviceChange;
use device::DeviceObject;
use std::collections::HashMap;
use std::sync::Arc;
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

/// Publishes each pass on the bus: objects appear (InterfacesAdded), disappear
/// (InterfacesRemoved) and change (PropertiesChanged) as the store did.
#[derive(Clone)]
pub struct DbusPublisher {
    pub conn: Connection,
    /// What device objects need to serve their methods; set once the service exists.
    pub ctx: Arc<std::sync::OnceLock<Ctx>>,
    /// Task changes are published by one background task, in order: a method of a device
    /// object holds that object while it runs, so publishing inline from it would deadlock.
    task_updates: tokio::sync::mpsc::UnboundedSender<i64>,
}

/// The service behind the objects' methods (weak: the service owns the publisher).
pub struct Ctx {
    pub service: std::sync::Weak<Service<DbusPublisher>>,
    pub authorizer: auth::Authorizer,
}

impl DbusPublisher {
    fn device_object(&self, d: &crate::model::device::Device) -> DeviceObject {
        let store = self
            .ctx
            .get()
            .and_then(|c| c.service.upgrade())
            .map(|s| Arc::clone(s.engine.store()));
        let (task, last) = match store {
            Some(st) => (
                st.blocking_task(d.address).ok().flatten(),
                st.last_result(d.address).ok().flatten(),
            ),
            None => (None, None),
        };
        DeviceObject {
            device: d.clone(),
            task,
            last,
            ctx: Arc::clone(&self.ctx),
        }
    }
}

impl Publish for DbusPublisher {
    async fn publish(&self, pass: &Pass) {
        for change in &pass.changes {
            if let Err(e) = self.apply(change).await {
                tracing::error!(address = %change.address(), "cannot publish change on D-Bus: {e}");
            }
        }
        if !pass.changes.is_empty() {
            if let Err(e) = self.counts_changed().await {
                tracing::error!("cannot signal manager counts: {e}");
            }
        }
    }

    async fn task_changed(&self, id: i64) {
        // The task object itself is published at once, so a caller that got its path in a
        // reply can read it; the device's task properties follow through the queue.
        if let Err(e) = self.publish_task_object(id).await {
            tracing::error!("cannot publish task {id} on D-Bus: {e}");
        }
        let _ = self.task_updates.send(id);
    }

    async fn settings_changed(&self) {
        if let Err(e) = self.manager_settings_changed().await {
            tracing::error!("cannot signal manager settings: {e}");
        }
    }
}

impl DbusPublisher {
    async fn apply(&self, change: &DeviceChange) -> zbus::Result<()> {
        let server = self.conn.object_server();
        match change {
            DeviceChange::Added(d) => {
                let path = device_path(d.address);
                // A stale object (should not happen) is replaced rather than kept.
                server.remove::<DeviceObject, _>(&path).await.ok();
                server.at(&path, self.device_object(d)).await?;
            }
            DeviceChange::Removed(d) => {
                server
                    .remove::<DeviceObject, _>(device_path(d.address))
                    .await?;
            }
            DeviceChange::Changed { old, new } => {
                let path = device_path(new.address);
                let iface = server.interface::<_, DeviceObject>(&path).await?;
                iface.get_mut().await.device = new.clone();
                let changed = device::changed_properties(old, new);
                signal_changed(iface.signal_emitter(), device::INTERFACE, changed).await?;
            }
        }
        Ok(())
    }

    /// Creates or updates `/org/vfiod/Vfiod1/task/<id>` from the store. Touches no device object,
    /// so it may run inside a device method.
    async fn publish_task_object(&self, id: i64) -> zbus::Result<()> {
        let Some(service) = self.ctx.get().and_then(|c| c.service.upgrade()) else {
            return Ok(());
        };
        let Ok(Some(t)) = service.engine.store().task(id) else {
            return Ok(());
        };
        let server = self.conn.object_server();
        let path = task::task_path(id);
        match server.interface::<_, task::TaskObject>(&path).await {
            Ok(iface) => {
                let old = std::mem::replace(&mut iface.get_mut().await.task, t.clone());
                let changed = task::changed_properties(&old, &t);
                signal_changed(iface.signal_emitter(), task::INTERFACE, changed).await
            }
            Err(_) => server
                .at(&path, task::TaskObject { task: t })
                .await
                .map(|_| ()),
        }
    }

    /// Publishes the task object, then the current task and last result of every device object
    /// it concerns: its own device, each function in its scope, and its device's VFs.
    async fn publish_task(&self, id: i64) -> zbus::Result<()> {
        self.publish_task_object(id).await?;
        let Some(service) = self.ctx.get().and_then(|c| c.service.upgrade()) else {
            return Ok(());
        };
        let store = service.engine.store();
        let Ok(Some(t)) = store.task(id) else {
            return Ok(());
        };
        let mut addresses = vec![t.address];
        addresses.extend(store.task_scope(id).unwrap_or_default());
        addresses.extend(store.vfs_of(t.address).unwrap_or_default());
        let server = self.conn.object_server();
        for address in addresses {
            let Ok(iface) = server
                .interface::<_, DeviceObject>(&device_path(address))
                .await
            else {
                continue;
            };
            let active = store.blocking_task(address).ok().flatten();
            let last = store.last_result(address).ok().flatten();
            let (old_state, old_path, old_last) = {
                let d = iface.get().await;
                (d.task_state(), d.current_task(), d.last_result())
            };
            {
                let mut d = iface.get_mut().await;
                d.task = active;
                d.last = last;
            }
            let d = iface.get().await;
            let em = iface.signal_emitter();
            if d.task_state() != old_state {
                d.task_state_changed(em).await?;
            }
            if d.current_task() != old_path {
                d.current_task_changed(em).await?;
            }
            if d.last_result() != old_last {
                d.last_result_changed(em).await?;
            }
        }
        Ok(())
    }

    async fn manager(&self) -> zbus::Result<zbus::object_server::InterfaceRef<manager::Manager>> {
        self.conn
            .object_server()
            .interface::<_, manager::Manager>(ROOT_PATH)
            .await
    }

    async fn counts_changed(&self) -> zbus::Result<()> {
        let iface = self.manager().await?;
        let (m, em) = (iface.get().await, iface.signal_emitter());
        m.device_count_changed(em).await?;
        m.usable_count_changed(em).await?;
        m.protected_count_changed(em).await?;
        m.broken_count_changed(em).await
    }

    async fn manager_settings_changed(&self) -> zbus::Result<()> {
        let iface = self.manager().await?;
        let (m, em) = (iface.get().await, iface.signal_emitter());
        m.scenario_changed(em).await?;
        m.config_sources_changed(em).await
    }
}

/// Exports the API on `bus`: builds the connection, the root (Manager + ObjectManager) and one
/// object per stored device. The caller takes the name with [`take_name`] once the daemon is
/// ready, so that a client that sees the name sees a settled inventory.
pub async fn serve(
    bus: &BusTarget,
    build_service: impl FnOnce(DbusPublisher) -> Arc<Service<DbusPublisher>>,
    authorizer: auth::Authorizer,
    simulated: bool,
) -> Result<(Connection, Arc<Service<DbusPublisher>>), ServeError> {
    let conn = bus.builder().build().await.map_err(ServeError::Connect)?;
    let ctx = Arc::new(std::sync::OnceLock::new());
    let (task_updates, mut updates) = tokio::sync::mpsc::unbounded_channel::<i64>();
    let publisher = DbusPublisher {
        conn: conn.clone(),
        ctx: Arc::clone(&ctx),
        task_updates,
    };
    let p = publisher.clone();
    tokio::spawn(async move {
        while let Some(id) = updates.recv().await {
            if let Err(e) = p.publish_task(id).await {
                tracing::error!("cannot publish task {id} on D-Bus: {e}");
            }
        }
    });
    let service = build_service(publisher.clone());
    let _ = ctx.set(Ctx {
        service: Arc::downgrade(&service),
        authorizer,
    });
    let server = conn.object_server();
    server
        .at(ROOT_PATH, zbus::fdo::ObjectManager)
        .await
        .map_err(ServeError::Export)?;
    server
        .at(
            ROOT_PATH,
            manager::Manager {
                service: Arc::clone(&service),
                authorizer,
                simulated,
            },
        )
        .await
        .map_err(ServeError::Export)?;
    let devices = service
        .engine
        .store()
        .devices()
        .map_err(|e| ServeError::Store(crate::error_chain(&e)))?;
    for d in devices {
        let obj = publisher.device_object(&d);
        let tasks: Vec<i64> = obj
            .task
            .iter()
            .chain(obj.last.iter())
            .map(|t| t.id)
            .collect();
        server
            .at(device_path(d.address), obj)
            .await
            .map_err(ServeError::Export)?;
        // Active tasks and each device's last result stay visible across restarts.
        for id in tasks {
            if let Ok(Some(t)) = service.engine.store().task(id) {
                server
                    .at(task::task_path(id), task::TaskObject { task: t })
                    .await
                    .map_err(ServeError::Export)?;
            }
        }
    }
    Ok((conn, service))
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
