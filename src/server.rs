//! Assembles a running daemon: store, engine, first inventory pass, D-Bus service, and the
//! loop. The `vfiod` binary and the integration tests start the daemon the same way.

use crate::config::Settings;
use crate::dbus::{self, auth::Authorizer, BusTarget, DbusPublisher};
use crate::engine::{ConfigSource, Engine, Service};
use crate::host::sysfs::Sysfs;
use crate::host::uevent::EventReceiver;
use crate::store::Store;
use std::sync::Arc;

pub struct Options {
    pub settings: Settings,
    /// Where a reload re-reads the settings from; `None` = reload keeps them.
    pub source: Option<ConfigSource>,
    pub sysfs: Sysfs,
    pub events: Option<EventReceiver>,
    pub bus: BusTarget,
    pub authorizer: Authorizer,
    pub simulated: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot take the state directory")]
    StateLock(#[from] crate::store::lock::LockError),
    #[error("cannot open the state store")]
    Store(#[from] crate::store::StoreError),
    #[error("first inventory pass failed")]
    Engine(#[from] crate::engine::EngineError),
    #[error("cannot serve on D-Bus")]
    Dbus(#[from] dbus::ServeError),
}

pub struct Server {
    pub conn: zbus::Connection,
    pub service: Arc<Service<DbusPublisher>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// Held while the server lives: one daemon per state directory.
    _state_lock: crate::store::lock::StateDirLock,
}

impl Server {
    pub async fn start(opts: Options) -> Result<Server, ServerError> {
        let s = &opts.settings;
        tracing::info!(
            "vfiod {} starting: config from [{}], scenario {}, sysfs root {}, state in {}",
            env!("CARGO_PKG_VERSION"),
            s.sources
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            s.scenario.as_str(),
            s.sysfs_root.display(),
            s.state_dir.display()
        );
        // Before the store is touched: a second daemon on this directory would mark the
        // first one's running tasks interrupted.
        let state_lock = crate::store::lock::StateDirLock::acquire(&s.state_dir)?;
        let store = Arc::new(Store::open(&s.state_dir)?);
        // A task that was running when vfiod died is not silently forgotten: it ends in
        // error ("interrupted") and its device waits for an operator's ResetTask.
        for t in store.interrupt_unfinished_tasks()? {
            tracing::error!(
                "task {} {} on {} was interrupted by a stop of vfiod at step {:?}; the device stays in error until reset",
                t.id, t.kind, t.address, t.step
            );
        }
        let engine = Arc::new(Engine::new(opts.settings, opts.source, opts.sysfs, store));
        // The first pass commits before the name is taken: when clients can see vfiod, they
        // see the whole inventory.
        let e = Arc::clone(&engine);
        let pass = tokio::task::spawn_blocking(move || e.refresh())
            .await
            .map_err(crate::engine::EngineError::from)??;
        let c = engine.counts()?;
        tracing::info!(
            "inventory: {} functions ({} usable, {} protected, {} broken), {} change(s) since the last run",
            c.total,
            c.usable,
            c.protected,
            c.broken,
            pass.changes.len()
        );
        let (conn, service) = dbus::serve(
            &opts.bus,
            |p| Arc::new(Service::new(Arc::clone(&engine), p)),
            opts.authorizer,
            opts.simulated,
        )
        .await?;
        // Boot: bring every selected device to its configured mode before clients (libvirt,
        // ordered after vfiod) see the name. Devices already there get no task.
        let started = service.reconcile("vfiod start-up").await;
        if !started.is_empty() {
            tracing::info!(
                "start-up: {} device(s) being brought to their configured mode",
                started.len()
            );
            service.wait_tasks(&started).await;
            // run_task refreshes after each task; one more pass settles the counts.
            service.refresh().await.map_err(ServerError::Engine)?;
        }
        dbus::take_name(&conn).await?;
        tracing::info!("serving {} on {:?}", dbus::BUS_NAME, opts.bus);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let svc = Arc::clone(&service);
        let events = opts.events;
        let task = tokio::spawn(async move {
            svc.run(events, async {
                let _ = stopped.await;
            })
            .await;
        });
        Ok(Server {
            conn,
            service,
            stop: Some(stop),
            task,
            _state_lock: state_lock,
        })
    }

    /// Stops the loop and releases the bus name.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
        let _ = self.conn.release_name(dbus::BUS_NAME).await;
        tracing::info!("vfiod stopped");
    }
}
