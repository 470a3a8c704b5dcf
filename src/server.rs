//! Assembles a running daemon: store, engine, first inventory pass, D-Bus service, start-up
//! reconcile, the bus name, and the loop. The `vfiod` binary and the integration tests start the
//! daemon the same way.

use crate::config::Settings;
use crate::dbus::{self, auth::Authorizer, BusTarget};
use crate::engine::{ConfigSource, Core, Engine, EngineError, Modprobe};
use crate::host::sysfs::Sysfs;
use crate::host::uevent::EventReceiver;
use crate::store::Store;
use std::sync::Arc;
use std::time::Duration;

/// How long a stop waits for the loop (and the work it is doing) before it lets go: SIGTERM ends
/// the daemon within a few seconds whatever it is doing. A task cut short is reported as
/// interrupted at the next start.
pub const STOP_GRACE: Duration = Duration::from_secs(3);

/// Raises the soft limit on open descriptors to the hard one (systemd's `LimitNOFILE=`, or
/// what the shell allowed), and returns the new soft limit and the hard one. Every client may
/// pass a descriptor with a message, and each costs one until it is closed: a soft limit of
/// 1,024 (the usual default) is what issue 24 ran out of. The hard limit stays what the
/// administrator set.
pub fn raise_fd_limit() -> Result<(u64, u64), nix::Error> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok((hard, hard))
}

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
    Engine(#[from] EngineError),
    #[error("cannot serve on D-Bus")]
    Dbus(#[from] dbus::ServeError),
}

pub struct Server {
    pub conn: zbus::Connection,
    pub engine: Arc<Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// The fleet reporter, when `[fleet]` is configured.
    #[cfg(feature = "fleet")]
    pub fleet: Option<crate::fleet::Reporter>,
    /// Keeps `[metrics] textfile` fresh (and writes nothing while none is configured).
    metrics: Option<crate::metrics::textfile::Writer>,
    /// Keeps the history within `[history]`'s limits (at start, then every prune interval).
    pruner: Option<crate::store::retention::Pruner>,
    /// The hook's peer-to-peer door (`STATE_DIR/hook.sock`), when it could be opened.
    hook_socket: Option<dbus::hook_socket::HookSocket>,
    /// Held while the server lives: one daemon per state directory.
    _state_lock: crate::store::lock::StateDirLock,
}

impl Server {
    pub async fn start(opts: Options) -> Result<Server, ServerError> {
        // SIGHUP is systemd's reload (`kill -HUP $MAINPID`), which may come as soon as the bus
        // name appears: listen before anything else, so that it is never the default action
        // (which ends the process) and a reload asked for while starting is done once the loop
        // runs.
        let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
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
        // Before the store is touched: a second daemon on this directory would mark the first
        // one's running tasks interrupted.
        let state_lock = crate::store::lock::StateDirLock::acquire(&s.state_dir)?;
        let s_state_dir = s.state_dir.clone();
        let state_dir = s.state_dir.clone();
        let store = tokio::task::spawn_blocking(move || -> Result<Store, ServerError> {
            let store = Store::open(&state_dir)?;
            // A task that was running when vfiod died is not silently forgotten: it ends in
            // error ("interrupted") and its device waits for an operator's ResetTask.
            for t in store.interrupt_unfinished_tasks()? {
                tracing::error!(
                    task_id = t.id,
                    device = %t.address,
                    kind = %t.kind,
                    "task {} {} on {} was interrupted by a stop of vfiod at step {:?}; the device stays in error until reset",
                    t.id, t.kind, t.address, t.step
                );
            }
            // An image add or download that a stop of vfiod cut short left its temporary file
            // (under the state lock, so no add of this daemon's is under way).
            for name in store.remove_image_leftovers() {
                tracing::info!(file = %name, "removed an unfinished image file");
            }
            Ok(store)
        })
        .await
        .map_err(EngineError::from)??;
        crate::engine::warn_about_drivers(&opts.settings);
        let core = Core::new(
            opts.settings,
            opts.source,
            opts.sysfs,
            Arc::new(store),
            Arc::new(Modprobe),
        )?;
        let (engine, events) = Engine::new(core);
        // The first pass commits before the name is taken: when clients can see vfiod, they
        // see the whole inventory.
        let pass = engine.refresh().await?;
        let c = engine.read(|core| core.store().counts()).await??;
        tracing::info!(
            "inventory: {} functions ({} usable, {} protected, {} broken), {} change(s) since the last run",
            c.total,
            c.usable,
            c.protected,
            c.broken,
            pass.changes.len()
        );
        let conn = dbus::serve(
            &opts.bus,
            Arc::clone(&engine),
            events,
            opts.authorizer,
            opts.simulated,
        )
        .await?;
        // Boot: bring every selected device to its configured mode before clients (libvirt,
        // ordered after vfiod) see the name. Devices already there get no task.
        let started = engine.reconcile("vfiod start-up").await;
        if !started.is_empty() {
            tracing::info!(
                "start-up: {} device(s) being brought to their configured mode",
                started.len()
            );
            engine.wait_tasks(&started).await;
            // Each task refreshes after it ends; one more pass settles the counts.
            engine.refresh().await?;
        }
        // Once at start, in the journal (and in `vfioctl status` until a reload runs them again):
        // whether this host can pass functions through, with the fix of each check that is not ok.
        engine.set_host_examiner(std::sync::Arc::new(|settings| {
            let report = crate::doctor::run::host_report(settings, env!("CARGO_PKG_VERSION"));
            let lines = report
                .checks
                .iter()
                .filter(|c| c.verdict != crate::doctor::Verdict::Ok)
                .map(|c| {
                    format!(
                        "doctor: {} {}: {} (fix: {})",
                        c.verdict.as_str(),
                        c.name,
                        c.evidence,
                        c.fix
                    )
                })
                .collect();
            (report.summary(), lines)
        }));
        if let Some((summary, lines)) = engine.examine_host().await {
            tracing::info!("{summary}");
            for line in lines {
                tracing::info!("{line}");
            }
        }
        // Functions a claim's end held for a clean that a stopped vfiod did not finish.
        let cleans = engine.start_cleans().await;
        if !cleans.is_empty() {
            tracing::info!("start-up: {} clean(s) resumed", cleans.len());
        }
        engine.flush().await;
        // Open before the name is taken, so that a hook that finds vfiod finds both doors. Not
        // fatal: without it the hook asks on the bus, as it did before there was one.
        let hook_socket =
            match dbus::hook_socket::HookSocket::listen(&s_state_dir, Arc::clone(&engine)) {
                Ok(h) => {
                    tracing::debug!("answering libvirt's hook on {}", h.path().display());
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(
                        "cannot open the hook socket {}: {e}; the hook asks on the bus",
                        s_state_dir.join(dbus::hook_socket::SOCKET_NAME).display()
                    );
                    None
                }
            };
        dbus::take_name(&conn).await?;
        tracing::info!("serving {} on {:?}", dbus::BUS_NAME, opts.bus);
        // The fleet comes last and runs beside the daemon: a database that is slow or gone
        // never delays the start nor anything local.
        #[cfg(feature = "fleet")]
        let fleet = engine.settings().fleet.clone().map(|f| {
            let host = crate::fleet::host_name(f.host.as_deref());
            let interval = f.report_interval.unwrap_or(engine.settings().poll_interval);
            tracing::info!(host, "reporting to the fleet database every {interval:?}");
            crate::fleet::Reporter::start(Arc::clone(&engine), &f, host, interval)
        });
        // Beside the daemon too, and it reads `[metrics]` at each write: a reload that turns
        // the textfile on, moves or removes it takes effect without a restart.
        if let Some(path) = &engine.settings().metrics.textfile {
            tracing::info!("writing metrics to {}", path.display());
        }
        let metrics = crate::metrics::textfile::Writer::start(
            Arc::clone(&engine) as Arc<dyn crate::metrics::textfile::Source>,
            engine.subscribe_changes(),
            engine.metrics().subscribe(),
        );
        // Beside the daemon as well, on the blocking pool in small batches: a prune never
        // holds the store for longer than one batch. It reads `[history]` at each run.
        let pruner = {
            let e = Arc::clone(&engine);
            crate::store::retention::Pruner::start(Arc::clone(engine.store()), move || {
                e.settings().history
            })
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let e = Arc::clone(&engine);
        let events = opts.events;
        let task = tokio::spawn(async move {
            e.run(events, hangups, async {
                let _ = stopped.await;
            })
            .await;
        });
        Ok(Server {
            conn,
            engine,
            stop: Some(stop),
            task,
            #[cfg(feature = "fleet")]
            fleet,
            metrics: Some(metrics),
            pruner: Some(pruner),
            hook_socket,
            _state_lock: state_lock,
        })
    }

    /// Returns when the bus connection is closed (the bus went away, or a read of the socket
    /// failed, as when vfiod had no descriptor left for one passed with a message): vfiod
    /// cannot answer anyone any more and must not stay up deaf.
    pub async fn connection_lost(&self) {
        self.conn.closed().await
    }

    /// Stops the loop and releases the bus name, within [`STOP_GRACE`].
    pub async fn stop(mut self) {
        #[cfg(feature = "fleet")]
        if let Some(f) = self.fleet.take() {
            f.stop().await;
        }
        if let Some(m) = self.metrics.take() {
            m.stop().await;
        }
        if let Some(p) = self.pruner.take() {
            p.stop().await;
        }
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if tokio::time::timeout(STOP_GRACE, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("the loop did not stop within {STOP_GRACE:?}; stopping anyway");
            self.task.abort();
        }
        // The hook finds neither door from here on, and decides alone.
        self.hook_socket.take();
        let _ = tokio::time::timeout(STOP_GRACE, self.conn.release_name(dbus::BUS_NAME)).await;
        // The whole store into vfiod.db, the write-ahead log emptied: a log damaged or lost
        // while vfiod is stopped then costs nothing. (A daemon killed instead leaves its last
        // changes in the log, where the next start's recovery and mark check find them.)
        let checkpoint = self
            .engine
            .read(|core| core.store().checkpoint())
            .await
            .map_err(|e| crate::error_chain(&e))
            .and_then(|r| r.map_err(|e| crate::error_chain(&e)));
        match checkpoint {
            Ok(true) => tracing::debug!("the state database's write-ahead log is checkpointed"),
            Ok(false) => tracing::warn!(
                "another reader of the state database kept its write-ahead log from being \
                 emptied at the stop; its changes are safe there"
            ),
            Err(e) => tracing::warn!("cannot checkpoint the state database at the stop: {e}"),
        }
        tracing::info!("vfiod stopped");
    }
}
