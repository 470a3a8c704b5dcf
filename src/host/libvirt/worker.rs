//! The libvirt worker: one thread owns the connection and answers typed requests; callers hold a
//! cheap [`LocalWorker`] handle and wait for an answer at most their bound. It runs in the
//! libvirt helper process (`vfiod-libvirt`, see `serve.rs`), which the daemon asks through
//! [`super::LocalWorker`].
//!
//! - Bounded: a caller gives up after its timeout with [`LibvirtError::Timeout`]. Nothing else is
//!   spawned for it: if libvirt hangs inside a call, the worker hangs with it and later requests
//!   time out too until the call returns, and requests that waited in the queue past their bound
//!   are dropped unrun. A keepalive on the connection makes libvirt close it when the daemon stops
//!   answering, which ends such a hang.
//! - Reconnecting: a closed connection (libvirtd restarted, crashed, or was never there) is
//!   reopened by the next request, or in the background after 0.5 s doubling to 30 s, and logged
//!   once per outage. Domain events are registered again on each new connection.
//! - The boot rule: with a local QEMU URI and no daemon running under the sysfs root, nothing
//!   connects (that would socket-activate libvirtd, which at boot waits for vfiod) and
//!   [`LocalWorker::running_domains`] answers "none".

use super::event::{self, CloseReason, EventLoop, LibvirtEvent};
use super::{
    local_daemon_running, needs_running_daemon, Cause, DomainDevices, DomainQuery, LibvirtError,
    ANSWER_TIMEOUT, DAEMON_POLL,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use virt::connect::Connect;

/// A keepalive ping every 5 s; 3 unanswered and libvirt closes the connection: a daemon that hangs
/// is given up on after about 20 s.
const KEEPALIVE_INTERVAL: i32 = 5;
const KEEPALIVE_COUNT: u32 = 3;
/// How long [`LocalWorker::stop`] waits for the worker to finish a call in progress.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Which definition of a domain to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Definition {
    /// What runs now (with the host addresses libvirt resolved).
    Live,
    /// The persistent configuration, used at the next start.
    Persistent,
}

/// A domain as libvirt knows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DomainInfo {
    pub name: String,
    /// Lower case, as libvirt prints it.
    pub uuid: String,
    /// Running (or paused): it has a live definition.
    pub active: bool,
    /// Defined: it has a persistent definition (a transient domain has none).
    pub persistent: bool,
}

/// How a domain is migrated.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Migration {
    /// The destination's libvirt URI (`qemu+ssh://hostb/system`).
    pub destination: String,
    /// Where the memory goes (`tcp://10.0.0.2`), when not the destination's default address.
    pub migrate_uri: Option<String>,
    /// A live migration (else the domain is paused while its memory is copied).
    pub live: bool,
}

/// Migrates `domain` from the libvirt at `source` to `m.destination`, on connections of its own:
/// a migration takes seconds to minutes, and the worker's connection must keep answering
/// meanwhile. The domain is defined on the destination and undefined here when it was
/// persistent. Blocks until libvirt says the migration is over.
pub fn migrate(source: &str, domain: &str, m: &Migration) -> Result<(), LibvirtError> {
    let connect = |uri: &str| {
        Connect::open(Some(uri)).map_err(|e| LibvirtError::Connect {
            uri: uri.to_string(),
            source: Cause::from(e),
        })
    };
    // Closed when dropped.
    let src = connect(source)?;
    let dst = connect(&m.destination)?;
    let fail = |e: virt::error::Error| LibvirtError::Domain {
        uri: m.destination.clone(),
        domain: domain.to_string(),
        action: "migrate".into(),
        source: Cause::from(e),
    };
    let outcome = (|| {
        let dom = src.lookup_domain_by_name(domain).map_err(fail)?;
        let mut flags = virt::sys::VIR_MIGRATE_PERSIST_DEST;
        if m.live {
            flags |= virt::sys::VIR_MIGRATE_LIVE;
        }
        if dom.is_persistent().map_err(fail)? {
            flags |= virt::sys::VIR_MIGRATE_UNDEFINE_SOURCE;
        }
        dom.migrate(&dst, flags, None, m.migrate_uri.as_deref(), 0)
            .map(drop)
            .map_err(fail)
    })();
    outcome
}

/// A domain and its definitions, for the reconcile of claims.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DomainDefinitions {
    pub info: DomainInfo,
    /// The live XML of an active domain.
    pub live: Option<String>,
    /// The persistent XML of a defined domain.
    pub config: Option<String>,
}

/// Which definition of a domain a device change applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Affect {
    Live,
    Persistent,
    Both,
}

impl Affect {
    fn flags(self) -> u32 {
        match self {
            Affect::Live => virt::sys::VIR_DOMAIN_AFFECT_LIVE,
            Affect::Persistent => virt::sys::VIR_DOMAIN_AFFECT_CONFIG,
            Affect::Both => virt::sys::VIR_DOMAIN_AFFECT_LIVE | virt::sys::VIR_DOMAIN_AFFECT_CONFIG,
        }
    }
}

/// A handle to the libvirt worker. Clones share the worker; each clone has its own bound
/// ([`LocalWorker::with_timeout`]). The worker ends at [`LocalWorker::stop`] or when the last clone is
/// dropped.
#[derive(Clone)]
pub struct LocalWorker {
    shared: Arc<Shared>,
    timeout: Duration,
}

struct Shared {
    tx: Sender<Msg>,
    /// The URI the worker was last told, for error messages without asking the worker.
    uri: Mutex<Option<String>>,
    stopped: AtomicBool,
    /// Disconnected when the worker has ended; its thread, to join then.
    ended: Mutex<Option<(Receiver<()>, std::thread::JoinHandle<()>)>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.tx.send(Msg::Stop);
        let Some((ended, thread)) = self.ended.lock().unwrap_or_else(|p| p.into_inner()).take()
        else {
            return;
        };
        match ended.recv_timeout(STOP_TIMEOUT) {
            Err(RecvTimeoutError::Timeout) => tracing::warn!(
                "the libvirt worker is inside a call to libvirt that does not return; it ends \
                 when the call does"
            ),
            _ => {
                let _ = thread.join();
            }
        }
    }

    fn uri_text(&self) -> String {
        self.uri
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "(no URI)".into())
    }
}

impl std::fmt::Debug for LocalWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWorker")
            .field("uri", &self.shared.uri_text())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl LocalWorker {
    /// Starts the worker for `uri` (`None`: no libvirt, every question about domains answers
    /// "none"), with the boot rule read under the sysfs `root`, forwarding domain events
    /// (lifecycle, device removal) and connection changes to `events` if given. It connects at
    /// once in the background; calls wait at most [`ANSWER_TIMEOUT`].
    pub fn start(
        uri: Option<String>,
        root: PathBuf,
        events: Option<UnboundedSender<LibvirtEvent>>,
    ) -> Result<LocalWorker, LibvirtError> {
        let event_loop = EventLoop::acquire()?;
        let (tx, rx) = std::sync::mpsc::channel();
        let (ended_tx, ended_rx) = std::sync::mpsc::channel::<()>();
        let worker = Worker::new(uri.clone(), root, events, tx.clone());
        let thread = std::thread::Builder::new()
            .name("libvirt-worker".into())
            .spawn(move || {
                worker.run(rx);
                // The connection is closed by now: the event loop may end with it.
                drop(event_loop);
                drop(ended_tx);
            })
            .map_err(|e| LibvirtError::Spawn(e.to_string()))?;
        Ok(LocalWorker {
            shared: Arc::new(Shared {
                tx,
                uri: Mutex::new(uri),
                stopped: AtomicBool::new(false),
                ended: Mutex::new(Some((ended_rx, thread))),
            }),
            timeout: ANSWER_TIMEOUT,
        })
    }

    /// The same worker, with calls bounded by `timeout`.
    pub fn with_timeout(&self, timeout: Duration) -> LocalWorker {
        LocalWorker {
            shared: Arc::clone(&self.shared),
            timeout,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The URI the worker was last given.
    pub fn uri(&self) -> Option<String> {
        self.shared
            .uri
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Moves the worker to another URI (a config reload changed `libvirt_uri`): it closes the
    /// current connection and connects to the new one. Requests made after this call see it.
    pub fn set_uri(&self, uri: Option<String>) {
        *self.shared.uri.lock().unwrap_or_else(|p| p.into_inner()) = uri.clone();
        let _ = self.shared.tx.send(Msg::SetUri(uri));
    }

    /// Ends the worker (for every clone) and, with the last worker, libvirt's event loop thread.
    /// Waits for a call in progress at most a short while; later calls answer
    /// [`LibvirtError::Stopped`].
    pub fn stop(&self) {
        self.shared.stop();
    }

    /// Running domains and the host PCI functions assigned to them; domains with none are left
    /// out. No URI, or a local QEMU URI with no daemon running: none.
    pub fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        self.call(|link| match link {
            Ok(c) => list_running(c),
            Err(LibvirtError::NotConfigured | LibvirtError::NoDaemon { .. }) => Ok(Vec::new()),
            Err(e) => Err(e),
        })
    }

    /// A domain's XML, live or persistent.
    pub fn domain_xml(&self, domain: &str, which: Definition) -> Result<String, LibvirtError> {
        let domain = domain.to_string();
        let flags = match which {
            Definition::Live => 0,
            Definition::Persistent => virt::sys::VIR_DOMAIN_XML_INACTIVE,
        };
        self.call(move |link| {
            on_domain(link?, &domain, "read the definition of", |d| {
                d.xml_desc(flags)
            })
        })
    }

    /// The domain named by `domain`: a name, else a UUID.
    pub fn lookup(&self, domain: &str) -> Result<DomainInfo, LibvirtError> {
        let domain = domain.to_string();
        self.call(move |link| on_domain(link?, &domain, "look up", info))
    }

    /// Every domain libvirt has (running, or defined and stopped), with its definitions.
    pub fn all_domains(&self) -> Result<Vec<DomainDefinitions>, LibvirtError> {
        self.call(|link| list_all(link?))
    }

    /// Writes vfiod's element (`xml`, in [`super::xml::VFIOD_NS`]) in a domain's `<metadata>`,
    /// replacing what vfiod wrote before; `None` removes it.
    pub fn set_metadata(
        &self,
        domain: &str,
        xml: Option<&str>,
        affect: Affect,
    ) -> Result<(), LibvirtError> {
        let (domain, xml) = (domain.to_string(), xml.map(str::to_string));
        self.call(move |link| {
            on_domain(link?, &domain, "write the metadata of", |d| {
                d.set_metadata(
                    virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                    xml.as_deref(),
                    Some(super::xml::METADATA_KEY),
                    Some(super::xml::VFIOD_NS),
                    affect.flags(),
                )
            })
        })
    }

    /// Attaches a device (`<hostdev>` XML) to a domain. A live attach of a PCI device returns
    /// when QEMU has it.
    pub fn attach_device(
        &self,
        domain: &str,
        xml: &str,
        affect: Affect,
    ) -> Result<(), LibvirtError> {
        let (domain, xml) = (domain.to_string(), xml.to_string());
        self.call(move |link| {
            on_domain(link?, &domain, "attach a device to", |d| {
                d.attach_device_flags(&xml, affect.flags())
            })
        })
    }

    /// Asks a domain to release a device. A live PCI detach is asynchronous: this returns once
    /// the guest was asked (libvirt waits up to 5 s for the guest, then returns success all the
    /// same), and the device is gone when the live XML no longer has it; libvirt then sends a
    /// device-removed event, forwarded as [`super::DomainEventKind::DeviceRemoved`] with the
    /// device's alias (or `DeviceRemovalFailed` when the guest refuses). Devices that need no
    /// guest (a USB input, a virtio-serial channel) are removed at once, with the same event.
    pub fn detach_device(
        &self,
        domain: &str,
        xml: &str,
        affect: Affect,
    ) -> Result<(), LibvirtError> {
        let (domain, xml) = (domain.to_string(), xml.to_string());
        self.call(move |link| {
            on_domain(link?, &domain, "detach a device from", |d| {
                d.detach_device_flags(&xml, affect.flags())
            })
        })
    }

    /// Runs `f` on the worker with its connection (or why there is none), waiting at most the
    /// handle's bound.
    fn call<T, F>(&self, f: F) -> Result<T, LibvirtError>
    where
        T: Send + 'static,
        F: FnOnce(Result<Conn<'_>, LibvirtError>) -> Result<T, LibvirtError> + Send + 'static,
    {
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(LibvirtError::Stopped);
        }
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let deadline = Instant::now() + self.timeout;
        let job: Job = Box::new(move |link| {
            let _ = reply.send(f(link));
        });
        let timeout = || LibvirtError::Timeout {
            uri: self.shared.uri_text(),
            timeout: self.timeout,
        };
        self.shared
            .tx
            .send(Msg::Call(Call { deadline, job }))
            .map_err(|_| LibvirtError::Stopped)?;
        match answer.recv_timeout(self.timeout) {
            Ok(answer) => answer,
            Err(RecvTimeoutError::Timeout) => Err(timeout()),
            // The worker dropped the request: it stopped, or found it expired (the caller's own
            // wait ends at the same deadline), or the call panicked.
            Err(RecvTimeoutError::Disconnected) => {
                if self.shared.stopped.load(Ordering::Acquire) {
                    Err(LibvirtError::Stopped)
                } else if Instant::now() >= deadline {
                    Err(timeout())
                } else {
                    Err(LibvirtError::Lost {
                        uri: self.shared.uri_text(),
                    })
                }
            }
        }
    }
}

impl DomainQuery for LocalWorker {
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        LocalWorker::running_domains(self)
    }
}

/// The connection as a request sees it.
struct Conn<'a> {
    conn: &'a Connect,
    uri: &'a str,
}

type Job = Box<dyn FnOnce(Result<Conn<'_>, LibvirtError>) + Send>;

struct Call {
    /// The caller stops waiting then: a request still queued at that time is not run.
    deadline: Instant,
    job: Job,
}

enum Msg {
    Call(Call),
    SetUri(Option<String>),
    /// From the close callback of the connection of that generation.
    Closed {
        generation: u64,
        reason: CloseReason,
    },
    Stop,
}

/// What the log last said about the connection, so that an outage is logged once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Health {
    New,
    Up,
    Down { since: Instant },
    NoDaemon,
}

/// Delays between reconnection attempts: 0.5 s doubling to 30 s, from the start after a success.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(30);

    fn new() -> Backoff {
        Backoff { next: Self::FIRST }
    }

    fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(Self::MAX);
        d
    }

    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

struct Worker {
    uri: Option<String>,
    root: PathBuf,
    events: Option<UnboundedSender<LibvirtEvent>>,
    /// For the close callbacks of the connections this worker opens.
    tx: Sender<Msg>,
    session: Option<Session>,
    generation: u64,
    health: Health,
    backoff: Backoff,
    /// When to connect in the background, if not connected.
    next_try: Option<Instant>,
}

impl Worker {
    fn new(
        uri: Option<String>,
        root: PathBuf,
        events: Option<UnboundedSender<LibvirtEvent>>,
        tx: Sender<Msg>,
    ) -> Worker {
        let next_try = uri.is_some().then(Instant::now);
        Worker {
            uri,
            root,
            events,
            tx,
            session: None,
            generation: 0,
            health: Health::New,
            backoff: Backoff::new(),
            next_try,
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        loop {
            let msg = match self.next_try {
                Some(at) => match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                    Ok(msg) => msg,
                    Err(RecvTimeoutError::Timeout) => {
                        self.next_try = None;
                        let _ = self.link();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(msg) => msg,
                    Err(_) => break,
                },
            };
            if !self.handle(msg) {
                break;
            }
        }
        self.session = None;
    }

    /// Handles one message; false to stop.
    fn handle(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Call(call) => self.serve(call),
            Msg::SetUri(uri) => self.set_uri(uri),
            Msg::Closed { generation, reason } => {
                if self
                    .session
                    .as_ref()
                    .is_some_and(|s| s.generation == generation)
                {
                    self.lost(reason);
                }
            }
            Msg::Stop => return false,
        }
        true
    }

    fn serve(&mut self, call: Call) {
        if Instant::now() >= call.deadline {
            tracing::debug!("dropped a libvirt request that waited in the queue past its bound");
            return;
        }
        let link = self.link();
        let job = call.job;
        let run = std::panic::AssertUnwindSafe(|| match (link, &self.session, &self.uri) {
            (Ok(()), Some(s), Some(uri)) => job(Ok(Conn { conn: &s.conn, uri })),
            (Ok(()), _, _) => job(Err(LibvirtError::NotConfigured)),
            (Err(e), _, _) => job(Err(e)),
        });
        // A panic drops the job's reply (its caller sees that); the worker goes on.
        if std::panic::catch_unwind(run).is_err() {
            tracing::warn!("a libvirt call panicked");
        }
        // A call that failed because the daemon went away may come before the close callback.
        if self
            .session
            .as_ref()
            .is_some_and(|s| !s.conn.is_alive().unwrap_or(false))
        {
            self.lost(CloseReason::Error);
        }
    }

    /// Makes sure there is a connection, connecting now if there is none and the boot rule
    /// allows it.
    fn link(&mut self) -> Result<(), LibvirtError> {
        let Some(uri) = self.uri.clone() else {
            self.next_try = None;
            return Err(LibvirtError::NotConfigured);
        };
        if self.session.is_some() {
            return Ok(());
        }
        if needs_running_daemon(&uri) && !local_daemon_running(&self.root) {
            if self.health != Health::NoDaemon {
                tracing::info!(
                    "no libvirt daemon runs for {uri}: not connecting (that would start one); \
                     looking again every {DAEMON_POLL:?}"
                );
                self.health = Health::NoDaemon;
            }
            self.next_try = Some(Instant::now() + DAEMON_POLL);
            return Err(LibvirtError::NoDaemon { uri });
        }
        self.generation += 1;
        match Session::open(&uri, self.generation, self.events.clone(), self.tx.clone()) {
            Ok(session) => {
                match self.health {
                    Health::Down { since } => {
                        tracing::info!("libvirt at {uri} is back after {:.1?}", since.elapsed())
                    }
                    _ => tracing::info!("connected to libvirt at {uri}"),
                }
                self.health = Health::Up;
                self.backoff.reset();
                self.next_try = None;
                self.session = Some(session);
                self.emit(LibvirtEvent::Connected { uri });
                Ok(())
            }
            Err(e) => {
                let retry = self.backoff.next();
                if matches!(self.health, Health::Down { .. }) {
                    tracing::debug!("libvirt at {uri} is still unavailable: {e}");
                } else {
                    tracing::warn!("{}; retrying in the background", crate::error_chain(&e));
                    self.health = Health::Down {
                        since: Instant::now(),
                    };
                }
                self.next_try = Some(Instant::now() + retry);
                Err(e)
            }
        }
    }

    /// The connection closed under us.
    fn lost(&mut self, reason: CloseReason) {
        self.session = None;
        let Some(uri) = self.uri.clone() else {
            return;
        };
        tracing::warn!(
            "lost the connection to libvirt at {uri} ({reason}); reconnecting in the background"
        );
        self.health = Health::Down {
            since: Instant::now(),
        };
        self.next_try = Some(Instant::now() + self.backoff.next());
        self.emit(LibvirtEvent::Disconnected { uri, reason });
    }

    fn set_uri(&mut self, uri: Option<String>) {
        if uri == self.uri {
            return;
        }
        tracing::info!(
            "libvirt URI changed from {} to {}",
            self.uri.as_deref().unwrap_or("none"),
            uri.as_deref().unwrap_or("none")
        );
        self.session = None;
        self.uri = uri;
        self.health = Health::New;
        self.backoff.reset();
        self.next_try = self.uri.is_some().then(Instant::now);
    }

    fn emit(&self, event: LibvirtEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }
}

/// An open connection and what is registered on it. Dropping it deregisters, then closes.
struct Session {
    conn: Connect,
    generation: u64,
    domain_events: Option<event::DomainCallbacks>,
    close_callback: bool,
}

impl Session {
    fn open(
        uri: &str,
        generation: u64,
        events: Option<UnboundedSender<LibvirtEvent>>,
        tx: Sender<Msg>,
    ) -> Result<Session, LibvirtError> {
        // Read-write: the claims attach and detach devices. vfiod runs as root.
        let conn = Connect::open(Some(uri)).map_err(|e| LibvirtError::Connect {
            uri: uri.to_string(),
            source: Cause::from(e),
        })?;
        let mut session = Session {
            conn,
            generation,
            domain_events: None,
            close_callback: false,
        };
        // Drivers that run in this process (test:///) have no keepalive and no close callback.
        if let Err(e) = session
            .conn
            .set_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_COUNT)
        {
            tracing::debug!("no keepalive on {uri}: {}", e.message());
        }
        match event::register_close(&session.conn, move |reason| {
            let _ = tx.send(Msg::Closed { generation, reason });
        }) {
            Ok(()) => session.close_callback = true,
            Err(e) => tracing::debug!("no close callback on {uri}: {}", e.message()),
        }
        if let Some(events) = events {
            let callbacks = event::register_domain_events(&session.conn, events).map_err(|e| {
                LibvirtError::Events {
                    uri: uri.to_string(),
                    source: Cause::from(e),
                }
            })?;
            session.domain_events = Some(callbacks);
        }
        Ok(session)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The callbacks hold references on the connection: without this it would stay open.
        if let Some(callbacks) = self.domain_events.take() {
            event::deregister_domain_events(&self.conn, callbacks);
        }
        if self.close_callback {
            event::unregister_close(&self.conn);
        }
    }
}

fn list_running(c: Conn<'_>) -> Result<Vec<DomainDevices>, LibvirtError> {
    let query = |e| LibvirtError::Query {
        uri: c.uri.to_string(),
        source: Cause::from(e),
    };
    let domains = c
        .conn
        .list_all_domains(virt::sys::VIR_CONNECT_LIST_DOMAINS_ACTIVE)
        .map_err(query)?;
    let mut out = Vec::new();
    for dom in domains {
        let name = dom.name().map_err(query)?;
        let xml = match dom.xml_desc(0) {
            Ok(x) => x,
            // The domain stopped between the listing and now: it uses nothing any more.
            Err(e) if is_no_domain(&e) => continue,
            Err(e) => return Err(query(e)),
        };
        let functions =
            super::assigned_functions(&xml).map_err(|message| LibvirtError::DomainXml {
                domain: name.clone(),
                message,
            })?;
        if !functions.is_empty() {
            out.push(DomainDevices {
                domain: name,
                functions,
            });
        }
    }
    Ok(out)
}

/// Looks `domain` up and runs `f` on it; `action` names `f` in an error.
fn on_domain<T>(
    c: Conn<'_>,
    domain: &str,
    action: &'static str,
    f: impl FnOnce(&virt::domain::Domain) -> Result<T, virt::error::Error>,
) -> Result<T, LibvirtError> {
    let fail = |e: virt::error::Error| {
        if is_no_domain(&e) {
            LibvirtError::NoSuchDomain {
                uri: c.uri.to_string(),
                domain: domain.to_string(),
            }
        } else {
            LibvirtError::Domain {
                uri: c.uri.to_string(),
                domain: domain.to_string(),
                action: action.to_string(),
                source: Cause::from(e),
            }
        }
    };
    let dom = match c.conn.lookup_domain_by_name(domain) {
        Err(e) if is_no_domain(&e) && looks_like_uuid(domain) => {
            c.conn.lookup_domain_by_uuid_string(domain)
        }
        other => other,
    }
    .map_err(fail)?;
    f(&dom).map_err(fail)
}

/// 36 characters of hex digits and dashes in libvirt's UUID layout.
fn looks_like_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

fn info(d: &virt::domain::Domain) -> Result<DomainInfo, virt::error::Error> {
    Ok(DomainInfo {
        name: d.name()?,
        uuid: d.uuid_string()?.to_ascii_lowercase(),
        active: d.is_active()?,
        persistent: d.is_persistent()?,
    })
}

fn list_all(c: Conn<'_>) -> Result<Vec<DomainDefinitions>, LibvirtError> {
    let query = |e| LibvirtError::Query {
        uri: c.uri.to_string(),
        source: Cause::from(e),
    };
    let mut out = Vec::new();
    for dom in c.conn.list_all_domains(0).map_err(query)? {
        let read = || -> Result<DomainDefinitions, virt::error::Error> {
            let info = info(&dom)?;
            let live = if info.active {
                Some(dom.xml_desc(0)?)
            } else {
                None
            };
            let config = if info.persistent {
                Some(dom.xml_desc(virt::sys::VIR_DOMAIN_XML_INACTIVE)?)
            } else {
                None
            };
            Ok(DomainDefinitions { info, live, config })
        };
        match read() {
            Ok(d) => out.push(d),
            // Undefined between the listing and now: not a domain any more.
            Err(e) if is_no_domain(&e) => continue,
            Err(e) => return Err(query(e)),
        }
    }
    Ok(out)
}

fn is_no_domain(e: &virt::error::Error) -> bool {
    matches!(
        e.code(),
        virt::enumutil::Enum::Known(virt::error::ErrorNumber::NoDomain)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn backoff_doubles_to_thirty_seconds_and_starts_over_after_a_success() {
        let mut b = Backoff::new();
        let delays: Vec<u64> = (0..9).map(|_| b.next().as_millis() as u64).collect();
        assert_eq!(
            delays,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
        );
        b.reset();
        assert_eq!(b.next(), Duration::from_millis(500));
    }

    /// A request is run only while its caller still waits for it.
    #[test]
    fn a_request_that_waited_past_its_bound_is_not_run() {
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut worker = Worker::new(None, PathBuf::from("/nonexistent"), None, tx);
        let ran = Arc::new(Mutex::new(Vec::new()));
        for (name, deadline) in [
            ("expired", Instant::now() - Duration::from_millis(1)),
            ("due", Instant::now() + Duration::from_secs(60)),
        ] {
            let ran = Arc::clone(&ran);
            let job: Job = Box::new(move |link| {
                ran.lock()
                    .unwrap()
                    .push((name, matches!(link, Err(LibvirtError::NotConfigured))))
            });
            assert!(worker.handle(Msg::Call(Call { deadline, job })));
        }
        assert_eq!(*ran.lock().unwrap(), vec![("due", true)]);
        assert!(!worker.handle(Msg::Stop));
    }

    /// A socket that accepts connections and never answers; counts them. Dropping it closes
    /// the accepted connections.
    struct Mute {
        sock: PathBuf,
        accepted: Arc<Mutex<Vec<std::os::unix::net::UnixStream>>>,
    }

    impl Mute {
        fn new(sock: PathBuf) -> Mute {
            let listener = UnixListener::bind(&sock).unwrap();
            let accepted = Arc::new(Mutex::new(Vec::new()));
            let held = Arc::clone(&accepted);
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    held.lock().unwrap().push(conn);
                }
            });
            Mute { sock, accepted }
        }

        fn count(&self) -> usize {
            self.accepted.lock().unwrap().len()
        }

        /// Closes what was accepted: a hung open fails, and the worker is free again.
        fn hang_up(&self) {
            self.accepted.lock().unwrap().clear();
        }
    }

    fn daemon_pid_file(root: &std::path::Path) {
        let pid = std::process::id().to_string();
        std::fs::create_dir_all(root.join("run")).unwrap();
        std::fs::create_dir_all(root.join("proc").join(&pid)).unwrap();
        std::fs::write(root.join("run/libvirtd.pid"), &pid).unwrap();
    }

    /// A libvirtd that accepts the connection and never answers: the question gives up.
    #[test]
    fn a_libvirt_that_does_not_answer_times_out() {
        let root = tempfile::tempdir().unwrap();
        daemon_pid_file(root.path());
        let mute = Mute::new(root.path().join("libvirt-sock"));
        let uri = format!("qemu+unix:///system?socket={}", mute.sock.display());
        let libvirt = LocalWorker::start(Some(uri.clone()), root.path().into(), None)
            .unwrap()
            .with_timeout(Duration::from_millis(300));
        // The daemon never answers: a Timeout is the question given up at its bound (how soon
        // after is not asserted; it raced a loaded machine).
        let r = libvirt.running_domains();
        assert!(
            matches!(&r, Err(LibvirtError::Timeout { uri: u, .. }) if *u == uri),
            "{r:?}"
        );
        mute.hang_up();
        libvirt.stop();
        assert!(matches!(
            libvirt.running_domains(),
            Err(LibvirtError::Stopped)
        ));
    }

    /// At boot libvirtd is ordered after vfiod: connecting to its socket would start it and
    /// deadlock. No pid file of a live daemon under the root, no connection.
    #[test]
    fn a_local_qemu_uri_without_a_daemon_connects_nothing() {
        let root = tempfile::tempdir().unwrap();
        let mute = Mute::new(root.path().join("libvirt-sock"));
        let uri = format!("qemu+unix:///system?socket={}", mute.sock.display());
        let libvirt = LocalWorker::start(Some(uri), root.path().into(), None)
            .unwrap()
            .with_timeout(Duration::from_millis(300));
        assert_eq!(libvirt.running_domains().unwrap(), vec![]);
        assert!(matches!(
            libvirt.domain_xml("vm1", Definition::Live),
            Err(LibvirtError::NoDaemon { .. })
        ));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(mute.count(), 0, "something connected");
        // The same worker connects once the daemon runs (and finds this one mute).
        daemon_pid_file(root.path());
        let r = libvirt.running_domains();
        assert!(matches!(r, Err(LibvirtError::Timeout { .. })), "{r:?}");
        assert_eq!(mute.count(), 1);
        mute.hang_up();
    }

    #[test]
    fn without_a_uri_there_are_no_domains_and_nothing_to_call() {
        let libvirt = LocalWorker::start(None, PathBuf::from("/nonexistent"), None).unwrap();
        assert_eq!(libvirt.running_domains().unwrap(), vec![]);
        let err = libvirt
            .attach_device("vm1", "<hostdev/>", Affect::Live)
            .unwrap_err();
        assert!(matches!(err, LibvirtError::NotConfigured), "{err:?}");
    }

    /// libvirt's test driver, run inside this process (`test:///default`: one running domain
    /// "test", no host devices), for the calls' own errors.
    #[test]
    fn domain_calls_name_the_domain_and_what_failed() {
        let libvirt = LocalWorker::start(
            Some("test:///default".into()),
            PathBuf::from("/nonexistent"),
            None,
        )
        .unwrap();
        assert_eq!(libvirt.running_domains().unwrap(), vec![]);
        let xml = libvirt.domain_xml("test", Definition::Live).unwrap();
        assert!(xml.contains("<name>test</name>"), "{xml}");
        let err = libvirt
            .domain_xml("nope", Definition::Persistent)
            .unwrap_err();
        assert!(
            matches!(&err, LibvirtError::NoSuchDomain { domain, .. } if domain == "nope"),
            "{err:?}"
        );
        // This driver has no device hot-plug: a clear error, with libvirt's reason.
        let err = libvirt
            .attach_device("test", "<hostdev/>", Affect::Live)
            .unwrap_err();
        let chain = crate::error_chain(&err);
        assert!(
            chain.starts_with(
                "libvirt at test:///default could not attach a device to domain test: "
            ),
            "{chain}"
        );
    }
}
