//! Turns the engine's events into the bus: objects appear (`InterfacesAdded`), disappear
//! (`InterfacesRemoved`) and change (`PropertiesChanged`), in the order the engine committed
//! them. One task does it, so signals never overtake each other, and it takes no interface lock:
//! it updates the [`View`] and emits the signals itself.

use super::claim::{self, ClaimObject};
use super::device::{self, DeviceObject};
use super::manager::Manager;
use super::pool_claim;
use super::task;
use super::{device_path, signal_changed, strict::Strict, Objects, ROOT_PATH};
use crate::engine::{DeviceView, EngineEvent, EventStream};
use crate::store::DeviceChange;
use zbus::object_server::SignalEmitter;

/// Finished tasks that no device shows keep their objects up to this many (the newest): the
/// bus stays small however long vfiod runs; `Manager.GetTasks` has the whole history.
pub const FINISHED_TASK_OBJECTS: usize = 200;

pub(super) async fn run(objects: Objects, mut events: EventStream) {
    while let Some(event) = events.recv().await {
        match event {
            EngineEvent::Inventory { changes, tasks } => {
                for change in &changes {
                    let tasks = tasks
                        .iter()
                        .find(|t| t.address == change.address())
                        .cloned();
                    if let Err(e) = apply(&objects, change, tasks).await {
                        tracing::error!(device = %change.address(), "cannot publish a change on D-Bus: {e}");
                    }
                }
                if !changes.is_empty() {
                    if let Err(e) = counts_changed(&objects).await {
                        tracing::error!("cannot signal the manager's counts: {e}");
                    }
                }
            }
            EngineEvent::Task { task, devices } => {
                let id = task.id;
                // Every device whose shown task state this may change: those the engine named,
                // and any that still names this task (its state is read from the task's own
                // record). Their entries before, to signal what changed.
                let mut affected: std::collections::BTreeSet<_> =
                    devices.iter().map(|t| t.address).collect();
                affected.extend(objects.view.showing_task(id));
                let before: Vec<_> = affected
                    .into_iter()
                    .filter_map(|a| objects.view.device(a).map(|e| (a, e)))
                    .collect();
                if let Err(e) = publish_task(&objects, task).await {
                    tracing::error!(task_id = id, "cannot publish a task on D-Bus: {e}");
                }
                let state_changed = !devices.is_empty();
                for t in devices {
                    objects.view.set_device_tasks(t);
                }
                for (address, old) in before {
                    let Some(new) = objects.view.device(address) else {
                        continue;
                    };
                    let changed = device::changed_task_properties(&old, &new);
                    if let Err(e) =
                        emit(&objects, device_path(address), device::INTERFACE, changed).await
                    {
                        tracing::error!(device = %address, "cannot signal a device's task state: {e}");
                    }
                }
                if state_changed {
                    prune_tasks(&objects).await;
                }
            }
            EngineEvent::Claim(c) => {
                let id = c.id;
                if let Err(e) = publish_claim(&objects, c).await {
                    tracing::error!(claim_id = id, "cannot publish a claim on D-Bus: {e}");
                }
            }
            EngineEvent::Pooled(c) => {
                let id = c.id;
                if let Err(e) = publish_pooled(&objects, c).await {
                    tracing::error!(
                        pooled_claim = id,
                        "cannot publish a pooled claim on D-Bus: {e}"
                    );
                }
            }
            EngineEvent::Settings => {
                if let Err(e) = settings_changed(&objects).await {
                    tracing::error!("cannot signal the manager's settings: {e}");
                }
            }
            // Nothing on the bus shows domains yet (attach and detach will).
            EngineEvent::Domain(_) => {}
            EngineEvent::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

async fn emit(
    objects: &Objects,
    path: zbus::OwnedObjectPath,
    interface: &'static str,
    changed: std::collections::HashMap<&'static str, zbus::OwnedVariant>,
) -> zbus::Result<()> {
    if changed.is_empty() {
        return Ok(());
    }
    let emitter = SignalEmitter::new(&objects.conn, path)?;
    signal_changed(&emitter, interface, changed).await
}

async fn apply(
    objects: &Objects,
    change: &DeviceChange,
    tasks: Option<crate::engine::DeviceTasks>,
) -> zbus::Result<()> {
    let server = objects.conn.object_server();
    match change {
        DeviceChange::Added(d) => {
            let path = device_path(d.address);
            let (active, last, health) =
                tasks.map_or((None, None, None), |t| (t.active, t.last, t.health));
            objects.view.put_device(DeviceView {
                device: d.clone(),
                active,
                last,
                health,
            });
            // A stale object (should not happen) is replaced rather than kept.
            server.remove::<Strict<DeviceObject>, _>(&path).await.ok();
            server.at(&path, objects.device_object(d.address)).await?;
        }
        DeviceChange::Removed(d) => {
            // Gone already when the objects were first exported after this pass committed.
            // The object goes before its view entry: GetManagedObjects holds the object tree
            // while it reads every object, so it sees each device whole or not at all.
            if objects.view.device(d.address).is_some() {
                server
                    .remove::<Strict<DeviceObject>, _>(device_path(d.address))
                    .await?;
                objects.view.remove_device(d.address);
            }
        }
        DeviceChange::Changed { new, .. } => {
            if let Some((old, now)) = objects.view.update_device(new.clone()) {
                let changed = device::changed_properties(&old.device, &now.device);
                emit(
                    objects,
                    device_path(new.address),
                    device::INTERFACE,
                    changed,
                )
                .await?;
            }
        }
    }
    Ok(())
}

/// Creates or updates `/org/vfiod/Vfiod1/task/<id>`.
async fn publish_task(objects: &Objects, task: crate::store::TaskRecord) -> zbus::Result<()> {
    let id = task.id;
    match objects.view.put_task(task.clone()) {
        Some(old) => {
            let changed = task::changed_properties(&old, &task);
            emit(objects, task::task_path(id), task::INTERFACE, changed).await
        }
        None => objects
            .conn
            .object_server()
            .at(task::task_path(id), objects.task_object(id))
            .await
            .map(drop),
    }
}

/// Creates, updates or (once released) removes `/org/vfiod/Vfiod1/claim/<id>`, and signals the
/// `Claim` property of every device it holds or held.
async fn publish_claim(objects: &Objects, c: crate::store::ClaimRecord) -> zbus::Result<()> {
    let server = objects.conn.object_server();
    let (id, functions) = (c.id, c.functions.clone());
    let holds = c.state.holds();
    let before: Vec<_> = functions.iter().map(|a| objects.view.holder(*a)).collect();
    match objects.view.put_claim(c.clone()) {
        Some(old) => {
            let changed = claim::changed_properties(&old, &c);
            emit(objects, claim::claim_path(id), claim::INTERFACE, changed).await?;
        }
        None if holds => {
            server
                .at(claim::claim_path(id), objects.claim_object(id))
                .await?;
        }
        // Released before its object was ever shown (a claim made and released between two
        // starts): nothing to show or remove.
        None => {}
    }
    for (a, was) in functions.iter().zip(before) {
        let now = objects.view.holder(*a);
        if now != was {
            let changed = std::collections::HashMap::from([(
                "Claim",
                super::variant(device::claim_path_of(now)),
            )]);
            emit(objects, device_path(*a), device::INTERFACE, changed).await?;
        }
    }
    if !holds {
        // The object goes before its view entry, as a device's does.
        server
            .remove::<Strict<ClaimObject>, _>(claim::claim_path(id))
            .await
            .ok();
        objects.view.forget_claim(id);
    }
    Ok(())
}

/// Creates, updates or (once ended) removes `/org/vfiod/Vfiod1/pooled/<id>`.
async fn publish_pooled(objects: &Objects, c: crate::model::pool::PooledClaim) -> zbus::Result<()> {
    let server = objects.conn.object_server();
    let (id, ended) = (c.id, c.state.ended());
    match objects.view.put_pooled(c.clone()) {
        Some(old) => {
            let changed = pool_claim::changed_properties(&old, &c);
            emit(
                objects,
                pool_claim::pooled_path(id),
                pool_claim::INTERFACE,
                changed,
            )
            .await?;
        }
        None if !ended => {
            server
                .at(pool_claim::pooled_path(id), objects.pooled_object(id))
                .await?;
        }
        None => {}
    }
    if ended {
        server
            .remove::<Strict<pool_claim::PooledObject>, _>(pool_claim::pooled_path(id))
            .await
            .ok();
        objects.view.forget_pooled(id);
    }
    Ok(())
}

/// Removes the objects of the finished tasks the view no longer keeps.
async fn prune_tasks(objects: &Objects) {
    let server = objects.conn.object_server();
    let gone = objects.view.prunable_tasks(FINISHED_TASK_OBJECTS);
    for &id in &gone {
        if let Err(e) = server
            .remove::<Strict<task::TaskObject>, _>(task::task_path(id))
            .await
        {
            tracing::error!(task_id = id, "cannot remove a finished task's object: {e}");
        }
    }
    objects.view.forget_tasks(&gone);
}

async fn manager(
    objects: &Objects,
) -> zbus::Result<zbus::object_server::InterfaceRef<Strict<Manager>>> {
    objects
        .conn
        .object_server()
        .interface::<_, Strict<Manager>>(ROOT_PATH)
        .await
}

async fn counts_changed(objects: &Objects) -> zbus::Result<()> {
    let iface = manager(objects).await?;
    let em = iface.signal_emitter();
    let m = &iface.get().await.inner;
    m.device_count_changed(em).await?;
    m.usable_count_changed(em).await?;
    m.protected_count_changed(em).await?;
    m.broken_count_changed(em).await?;
    m.cleaning_count_changed(em).await
}

async fn settings_changed(objects: &Objects) -> zbus::Result<()> {
    let iface = manager(objects).await?;
    let em = iface.signal_emitter();
    let m = &iface.get().await.inner;
    m.scenario_changed(em).await?;
    m.config_sources_changed(em).await
}
