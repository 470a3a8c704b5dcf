//! The reference pool service (`vfiod-pool`): pool protocol v1 over HTTP (axum on hyper and
//! tokio), TLS with client certificates (rustls), sessions durable in SQLite, a stand-in
//! accelerator and the quiesce lease.
//!
//! [`state`] decides (pure), [`store`] persists, [`core`] applies commands and runs the data
//! plane, [`worker`] is the stand-in accelerator and the lease clock, [`http`] translates, and
//! [`tls`] builds the rustls configuration, [`serve`] accepts connections under bounds.
//! [`start`] assembles them on a listening socket; tests call it in-process, the binary calls
//! it from `main`.

pub mod core;
pub mod http;
pub mod serve;
pub mod state;
pub mod store;
pub mod tls;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use self::core::{Core, CoreError, CoreSettings};
pub use self::serve::{raise_nofile_limit, ConnectionLimits};
use self::store::{Store, StoreError};
pub use self::tls::{TlsError, TlsFiles};
use crate::protocol::PoolDevice;

/// The default quiesce lease: a quiesced session with no resume for this long resumes on its
/// last owner.
pub const DEFAULT_QUIESCE_LEASE: Duration = Duration::from_secs(60);

/// How to run a pool.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Where to listen; port 0 picks a free port ([`RunningPool::addr`] tells which).
    pub listen: SocketAddr,
    /// Where the pool keeps `pool.db`.
    pub state_dir: PathBuf,
    pub devices: Vec<PoolDevice>,
    /// TLS with client certificates; required unless `listen` is a loopback address.
    pub tls: Option<TlsFiles>,
    pub quiesce_lease: Duration,
    /// The hosts the pool serves (prepare-move and resume to another are refused early);
    /// `None`: any host.
    pub hosts: Option<Vec<String>>,
    /// How long the stand-in accelerator works on one item.
    pub item_time: Duration,
    /// How often the lease clock looks for expired leases.
    pub lease_tick: Duration,
    /// Timeouts and connection counts ([`ConnectionLimits::default`]).
    pub limits: ConnectionLimits,
}

/// `n` stand-in devices `dev0`, `dev1`, ...
pub fn standin_devices(n: u32) -> Vec<PoolDevice> {
    (0..n)
        .map(|i| PoolDevice {
            id: format!("dev{i}"),
            kind: "gpu".into(),
            model: "vfiod-pool stand-in accelerator".into(),
            session: None,
        })
        .collect()
}

impl PoolConfig {
    /// Defaults: 4 stand-in devices, no TLS, a 60 s lease, any host, 1 ms per item.
    pub fn new(listen: SocketAddr, state_dir: PathBuf) -> PoolConfig {
        PoolConfig {
            listen,
            state_dir,
            devices: standin_devices(4),
            tls: None,
            quiesce_lease: DEFAULT_QUIESCE_LEASE,
            hosts: None,
            item_time: Duration::from_millis(1),
            lease_tick: Duration::from_millis(100),
            limits: ConnectionLimits::default(),
        }
    }

    /// Refuses what must not run: plain HTTP on a non-loopback address, a zero lease, bad
    /// names.
    pub fn check(&self) -> Result<(), ServiceError> {
        if self.tls.is_none() && !self.listen.ip().is_loopback() {
            return Err(ServiceError::PlainOnNetwork { addr: self.listen });
        }
        self.limits.check().map_err(ServiceError::Invalid)?;
        if self.quiesce_lease.is_zero() {
            return Err(ServiceError::Invalid(
                "the quiesce lease must be longer than 0".into(),
            ));
        }
        for name in self
            .devices
            .iter()
            .map(|d| &d.id)
            .chain(self.hosts.iter().flatten())
        {
            if !crate::protocol::valid_name(name) {
                return Err(ServiceError::Invalid(format!(
                    "{name:?} is not a valid name"
                )));
            }
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(
        "refusing plain HTTP on {addr}: a non-loopback address needs --tls-cert, --tls-key and \
         --client-ca (plain HTTP is for loopback only)"
    )]
    PlainOnNetwork { addr: SocketAddr },
    #[error("{0}")]
    Invalid(String),
    #[error("TLS")]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What the HTTP handlers share: the core and the worker tasks.
pub struct Service {
    pub core: Core,
    stop: watch::Receiver<bool>,
    /// The workers of live sessions. A worker ends with its session's release; finished ones
    /// are reaped here at each start and each lease tick, so the table holds live sessions
    /// only, whatever the history.
    workers: Mutex<JoinSet<()>>,
    /// How long one request may take ([`ConnectionLimits::request_timeout`]).
    pub request_timeout: Duration,
}

impl Service {
    /// Starts the stand-in accelerator's worker for session `id`.
    pub fn start_worker(self: &Arc<Self>, id: &str) {
        // The engine exists before the worker runs: a quiesce right after the create waits
        // for the same engine the worker takes.
        let _ = self.core.engine(id);
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        while workers.try_join_next().is_some() {}
        workers.spawn(worker::run_worker(
            self.clone(),
            id.to_owned(),
            self.stop.clone(),
        ));
    }

    /// Drops the finished workers from the table; returns how many are still running.
    pub fn reap_workers(&self) -> usize {
        let mut workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        while workers.try_join_next().is_some() {}
        workers.len()
    }
}

/// A pool that runs.
pub struct RunningPool {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
    lease_clock: JoinHandle<()>,
    service: Arc<Service>,
}

impl RunningPool {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its URL (`http://` or `https://` and the address).
    pub fn url(&self, tls: bool) -> url::Url {
        let scheme = if tls { "https" } else { "http" };
        url::Url::parse(&format!("{scheme}://{}", self.addr)).expect("an address makes a URL")
    }

    /// The session workers running and the engines kept: both one per live session, however
    /// many sessions were released before.
    pub fn live_tasks(&self) -> (usize, usize) {
        (self.service.reap_workers(), self.service.core.engines())
    }

    /// Stops serving, stops the workers between two items, and closes the store (the state
    /// directory can be opened again when this returns).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.server.await;
        let _ = self.lease_clock.await;
        let mut workers = std::mem::take(
            &mut *self
                .service
                .workers
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        while workers.join_next().await.is_some() {}
        // Requests still being answered hold the service (and the store) for a moment.
        for _ in 0..500 {
            if Arc::strong_count(&self.service) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Starts a pool: opens the store, starts the workers of the live sessions and the lease
/// clock, and serves on `cfg.listen`.
pub async fn start(cfg: PoolConfig) -> Result<RunningPool, ServiceError> {
    cfg.check()?;
    let tls = cfg.tls.as_ref().map(tls::server_config).transpose()?;
    let store = Store::open(&cfg.state_dir)?;
    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServiceError::Listen {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ServiceError::Listen {
            addr: cfg.listen,
            source,
        })?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let settings = CoreSettings {
        devices: cfg.devices.clone(),
        lease: cfg.quiesce_lease,
        hosts: cfg.hosts.clone(),
        item_time: cfg.item_time,
    };
    let service = Arc::new(Service {
        core: Core::new(store, settings),
        stop: stop_rx.clone(),
        workers: Mutex::new(JoinSet::new()),
        request_timeout: cfg.limits.request_timeout,
    });
    // A restart picks up where the pool stopped: running sessions go on with their queues,
    // quiesced ones keep their lease deadline (the clock below resumes them when it passes).
    for id in service.core.live_sessions()? {
        service.start_worker(&id);
    }
    // Every connection is a descriptor: never more of them than the limit leaves room for.
    let nofile = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(u64::MAX, |(soft, _)| soft);
    let limits = serve::fit_to_descriptors(cfg.limits.clone(), nofile);
    if limits.max_connections < cfg.limits.max_connections {
        tracing::warn!(
            nofile,
            max_connections = limits.max_connections,
            "the descriptor limit lowers the connection limit"
        );
    }
    let lease_clock = tokio::spawn(worker::run_lease_clock(
        service.clone(),
        cfg.lease_tick,
        stop_rx.clone(),
    ));
    let app = http::router(service.clone());
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let server = tokio::spawn(serve::serve(listener, acceptor, app, limits, stop_rx));
    tracing::info!(%addr, tls = cfg.tls.is_some(), "vfiod-pool listening");
    Ok(RunningPool {
        addr,
        stop: stop_tx,
        server,
        lease_clock,
        service,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(listen: &str) -> PoolConfig {
        PoolConfig::new(listen.parse().unwrap(), "/nonexistent/pool".into())
    }

    #[test]
    fn plain_http_only_on_loopback_and_tls_anywhere() {
        assert!(cfg("127.0.0.1:7300").check().is_ok());
        assert!(cfg("[::1]:7300").check().is_ok());
        for addr in ["0.0.0.0:7300", "192.0.2.1:7300", "[::]:7300"] {
            let e = cfg(addr).check().unwrap_err();
            assert!(
                matches!(e, ServiceError::PlainOnNetwork { .. }),
                "{addr}: {e}"
            );
            assert!(e.to_string().contains("--client-ca"), "{e}");
        }
        let mut with_tls = cfg("0.0.0.0:8443");
        with_tls.tls = Some(TlsFiles {
            cert: "c.pem".into(),
            key: "k.pem".into(),
            client_ca: "ca.pem".into(),
        });
        assert!(with_tls.check().is_ok());
    }

    #[test]
    fn a_zero_lease_and_bad_names_are_refused() {
        let mut c = cfg("127.0.0.1:0");
        c.quiesce_lease = Duration::ZERO;
        assert!(matches!(c.check(), Err(ServiceError::Invalid(_))));
        let mut c = cfg("127.0.0.1:0");
        c.hosts = Some(vec!["host a".into()]);
        assert!(matches!(c.check(), Err(ServiceError::Invalid(_))));
    }

    #[tokio::test]
    async fn a_missing_tls_file_stops_the_start_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = PoolConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().join("state"));
        c.tls = Some(TlsFiles {
            cert: dir.path().join("missing.pem"),
            key: dir.path().join("missing.key"),
            client_ca: dir.path().join("ca.pem"),
        });
        let e = start(c).await.err().expect("refused");
        assert!(
            crate::error_chain(&e).contains("missing.pem"),
            "{}",
            crate::error_chain(&e)
        );
        assert!(!dir.path().join("state").exists(), "nothing created");
    }
}
