//! The daemon's handle on libvirt: the libvirt client library runs in a helper process of its
//! own (`vfiod-libvirt`, [`super::serve`]), which holds the worker thread and the connection
//! ([`super::worker`]); this handle asks it, one JSON line per request ([`super::wire`]).
//!
//! Why a process: libvirt's client library and its chain (GnuTLS, libxml2, ICU, libssh, curl,
//! Kerberos, GLib...) are most of an idle vfiod's memory (about 15 MB of its PSS on a Debian 12
//! host with nothing else mapping them), and a hang or a crash inside them must not take the
//! daemon with it. vfiod itself then links no libvirt at all: with `libvirt_uri = ""` (the
//! simulation, a host without VMs) no helper runs, and when one dies it is started again and
//! libvirt's connection events say so, as after a libvirtd restart.
//!
//! The calls are those of the worker, with the same bounds: a caller waits at most its handle's
//! timeout ([`LibvirtError::Timeout`]); the helper drops a request that waited past it. A helper
//! that exits fails every call in flight with [`LibvirtError::Lost`], emits
//! [`LibvirtEvent::Disconnected`], and is started again in the background (0.5 s, doubling to
//! 30 s) or at the next call.
//!
//! No helper runs while there is nothing to connect to: with a local QEMU URI
//! (`qemu:///system`) and no libvirt daemon running (the boot rule, `super::needs_running_daemon`:
//! connecting would start one), a call answers as the helper's worker would
//! ([`LibvirtError::NoDaemon`]; no running domains) and the pid files are read again every 2 s;
//! the helper starts when a daemon runs. A host without libvirt, or a simulation, then carries
//! none of libvirt's memory.

use super::wire::{Call, Line, Request, Value};
use super::{
    local_daemon_running, needs_running_daemon, Affect, CloseReason, Definition, DomainDefinitions,
    DomainDevices, DomainInfo, DomainQuery, LibvirtError, LibvirtEvent, Migration, ANSWER_TIMEOUT,
    DAEMON_POLL,
};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// The helper's file name, beside `vfiod` in a build tree, in `../libexec` of an installed one.
pub const HELPER_NAME: &str = "vfiod-libvirt";
/// Names the helper to run instead (a test's own build of it).
pub const HELPER_ENV: &str = "VFIOD_LIBVIRT_HELPER";
/// How long [`Libvirt::stop`] waits for the helper to end before it kills it.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);
/// Pauses before a helper that exited is started again in the background.
const FIRST_RESTART: Duration = Duration::from_millis(500);
const LONGEST_RESTART: Duration = Duration::from_secs(30);

/// Where the helper is: [`HELPER_ENV`], else beside this executable, in `../libexec` of it
/// (`/usr/sbin/vfiod`, `/usr/libexec/vfiod-libvirt`), or one directory up (a test binary in
/// `target/debug/deps`).
pub fn helper_path() -> Result<PathBuf, LibvirtError> {
    if let Some(p) = std::env::var_os(HELPER_ENV) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| LibvirtError::Helper(e.to_string()))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let candidates = [
        dir.join(HELPER_NAME),
        dir.join("../libexec").join(HELPER_NAME),
        dir.join("..").join(HELPER_NAME),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            LibvirtError::Helper(format!(
                "{HELPER_NAME} is not installed beside {} (nor in ../libexec)",
                exe.display()
            ))
        })
}

/// A handle to the libvirt helper. Clones share it; each clone has its own bound
/// ([`Libvirt::with_timeout`]). The helper ends at [`Libvirt::stop`] or when the last clone is
/// dropped.
#[derive(Clone)]
pub struct Libvirt {
    shared: Arc<Shared>,
    timeout: Duration,
}

type Reply = SyncSender<Result<Value, LibvirtError>>;

struct Shared {
    uri: Mutex<Option<String>>,
    root: PathBuf,
    events: Option<UnboundedSender<LibvirtEvent>>,
    helper: Mutex<Option<Running>>,
    /// Counts the helpers started: a reader reports the end of its own helper only.
    generation: AtomicU64,
    pending: Mutex<HashMap<u64, Reply>>,
    next_id: AtomicU64,
    stopped: AtomicBool,
    restart: Mutex<Duration>,
    /// No helper was started because no libvirt daemon ran: the watcher starts one when it does.
    awaiting_daemon: AtomicBool,
    /// The watcher thread runs (one per handle).
    watching: AtomicBool,
    /// The watcher's looks for a daemon so far ([`Libvirt::daemon_looks`]).
    looks: AtomicU64,
}

struct Running {
    child: Child,
    stdin: ChildStdin,
    generation: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn uri(&self) -> Option<String> {
        lock(&self.uri).clone()
    }

    fn uri_text(&self) -> String {
        self.uri().unwrap_or_else(|| "(no URI)".into())
    }

    /// The URI, when it is a local QEMU one and no libvirt daemon runs: then no helper is
    /// started (it could only wait for one).
    fn daemon_absent(&self) -> Option<String> {
        self.uri()
            .filter(|uri| needs_running_daemon(uri) && !local_daemon_running(&self.root))
    }

    fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(mut running) = lock(&self.helper).take() else {
            return;
        };
        // Its standard input closed: the helper stops its worker and exits.
        drop(running.stdin);
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        loop {
            match running.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if std::time::Instant::now() >= deadline => {
                    tracing::warn!(
                        "the libvirt helper is inside a call to libvirt that does not return; \
                         killed"
                    );
                    let _ = running.child.kill();
                    let _ = running.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        self.fail_pending(LibvirtError::Stopped);
    }

    fn fail_pending(&self, why: LibvirtError) {
        let pending: Vec<Reply> = lock(&self.pending).drain().map(|(_, r)| r).collect();
        for reply in pending {
            let _ = reply.try_send(Err(why.clone()));
        }
    }

    fn emit(&self, event: LibvirtEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }
}

/// Makes sure a helper runs for `shared`, unless no libvirt daemon runs for its local QEMU URI:
/// then none is started, the watcher looks again every [`DAEMON_POLL`], and the answer is
/// [`LibvirtError::NoDaemon`].
fn ensure_helper(shared: &Arc<Shared>) -> Result<(), LibvirtError> {
    let mut helper = lock(&shared.helper);
    if helper.is_some() {
        return Ok(());
    }
    if let Some(uri) = shared.daemon_absent() {
        if !shared.awaiting_daemon.swap(true, Ordering::AcqRel) {
            tracing::info!(
                "no libvirt daemon runs for {uri}: not connecting (that would start one), no \
                 libvirt helper until one does; looking again every {DAEMON_POLL:?}"
            );
        }
        watch(shared);
        return Err(LibvirtError::NoDaemon { uri });
    }
    shared.awaiting_daemon.store(false, Ordering::Release);
    *helper = Some(spawn(shared)?);
    Ok(())
}

/// [`ensure_helper`] outside a call: no daemon running is not a failure there (the watcher
/// starts the helper once one runs), only a helper that cannot be started is.
fn start_helper_if_daemon(shared: &Arc<Shared>) -> Result<(), LibvirtError> {
    match ensure_helper(shared) {
        Err(LibvirtError::NoDaemon { .. }) => Ok(()),
        other => other,
    }
}

/// Starts, once per handle, the thread that starts the helper when a libvirt daemon that did
/// not run at first runs.
fn watch(shared: &Arc<Shared>) {
    if shared.watching.swap(true, Ordering::AcqRel) {
        return;
    }
    let weak = Arc::downgrade(shared);
    let started = std::thread::Builder::new()
        .name("libvirt-watch".into())
        .spawn(move || loop {
            std::thread::sleep(DAEMON_POLL);
            let Some(shared) = weak.upgrade() else { return };
            if shared.stopped.load(Ordering::Acquire) {
                return;
            }
            if shared.awaiting_daemon.load(Ordering::Acquire)
                && shared.uri().is_some()
                && shared.daemon_absent().is_none()
            {
                tracing::info!("a libvirt daemon runs: starting the libvirt helper");
                if let Err(e) = ensure_helper(&shared) {
                    tracing::warn!("{}", crate::error_chain(&e));
                }
            }
            shared.looks.fetch_add(1, Ordering::AcqRel);
        });
    if started.is_err() {
        // Calls still start the helper when the daemon runs.
        shared.watching.store(false, Ordering::Release);
    }
}

/// Starts a helper for `shared` (its URI and root), with a thread reading its lines.
fn spawn(shared: &Arc<Shared>) -> Result<Running, LibvirtError> {
    let path = helper_path()?;
    let mut command = Command::new(&path);
    command.arg("--root").arg(&shared.root);
    if let Some(uri) = shared.uri() {
        command.arg("--uri").arg(uri);
    }
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| LibvirtError::Helper(format!("cannot run {}: {e}", path.display())))?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        return Err(LibvirtError::Helper("the helper has no pipes".into()));
    };
    let generation = shared.generation.fetch_add(1, Ordering::AcqRel) + 1;
    let weak = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("libvirt-helper".into())
        .spawn(move || read_lines(weak, stdout, generation))
        .map_err(|e| LibvirtError::Helper(format!("cannot start its reader: {e}")))?;
    Ok(Running {
        child,
        stdin,
        generation,
    })
}

/// Forwards the helper's answers to their callers and its events to the daemon, until it exits;
/// then fails what it left unanswered and starts another in the background.
fn read_lines(shared: std::sync::Weak<Shared>, stdout: std::process::ChildStdout, generation: u64) {
    for line in std::io::BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match serde_json::from_str::<Line>(&line) {
            Ok(Line::Answer { id, result }) => {
                if let Some(reply) = lock(&shared.pending).remove(&id) {
                    let _ = reply.try_send(result);
                }
            }
            Ok(Line::Event(event)) => {
                if matches!(event, LibvirtEvent::Connected { .. }) {
                    *lock(&shared.restart) = FIRST_RESTART;
                }
                shared.emit(event);
            }
            Err(e) => tracing::warn!("the libvirt helper said something unreadable: {e}"),
        }
    }
    let Some(shared) = shared.upgrade() else {
        return;
    };
    {
        let mut helper = lock(&shared.helper);
        if helper.as_ref().is_some_and(|r| r.generation == generation) {
            if let Some(mut gone) = helper.take() {
                let status = gone.child.wait();
                if !shared.stopped.load(Ordering::Acquire) {
                    tracing::warn!(
                        "the libvirt helper exited ({}); starting another",
                        status.map_or_else(|e| e.to_string(), |s| s.to_string())
                    );
                }
            }
        } else {
            return;
        }
    }
    if shared.stopped.load(Ordering::Acquire) {
        return;
    }
    let uri = shared.uri_text();
    shared.fail_pending(LibvirtError::Lost { uri: uri.clone() });
    if shared.uri().is_none() {
        return;
    }
    shared.emit(LibvirtEvent::Disconnected {
        uri,
        reason: CloseReason::Error,
    });
    let pause = {
        let mut restart = lock(&shared.restart);
        let pause = *restart;
        *restart = (pause * 2).min(LONGEST_RESTART);
        pause
    };
    let weak = Arc::downgrade(&shared);
    drop(shared);
    let _ = std::thread::Builder::new()
        .name("libvirt-restart".into())
        .spawn(move || {
            std::thread::sleep(pause);
            if let Some(shared) = weak.upgrade() {
                if !shared.stopped.load(Ordering::Acquire) && shared.uri().is_some() {
                    // The daemon may have gone too: the watcher starts the helper when it is back.
                    if let Err(e) = start_helper_if_daemon(&shared) {
                        tracing::warn!("{}", crate::error_chain(&e));
                    }
                }
            }
        });
}

impl std::fmt::Debug for Libvirt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Libvirt")
            .field("uri", &self.shared.uri_text())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Libvirt {
    /// Starts the helper for `uri` (`None`: no libvirt and no helper; every question about
    /// domains answers "none"), with the boot rule read under the sysfs `root`, forwarding
    /// domain events (lifecycle, device removal) and connection changes to `events` if given.
    /// It connects at once in the background; calls wait at most [`ANSWER_TIMEOUT`].
    pub fn start(
        uri: Option<String>,
        root: PathBuf,
        events: Option<UnboundedSender<LibvirtEvent>>,
    ) -> Result<Libvirt, LibvirtError> {
        let shared = Arc::new(Shared {
            uri: Mutex::new(uri.clone()),
            root,
            events,
            helper: Mutex::new(None),
            generation: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            restart: Mutex::new(FIRST_RESTART),
            awaiting_daemon: AtomicBool::new(false),
            watching: AtomicBool::new(false),
            looks: AtomicU64::new(0),
        });
        if uri.is_some() {
            start_helper_if_daemon(&shared)?;
        }
        Ok(Libvirt {
            shared,
            timeout: ANSWER_TIMEOUT,
        })
    }

    /// How many times the watcher has looked for a libvirt daemon (each [`DAEMON_POLL`] while
    /// none ran at first), counted after each look has acted: a test waits for a look instead
    /// of sleeping past the poll.
    pub fn daemon_looks(&self) -> u64 {
        self.shared.looks.load(Ordering::Acquire)
    }

    /// The same helper, with calls bounded by `timeout`.
    pub fn with_timeout(&self, timeout: Duration) -> Libvirt {
        Libvirt {
            shared: Arc::clone(&self.shared),
            timeout,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The URI the helper was last given.
    pub fn uri(&self) -> Option<String> {
        self.shared.uri()
    }

    /// Moves to another URI (a config reload changed `libvirt_uri`): the helper closes the
    /// current connection and connects to the new one; `None` ends the helper.
    pub fn set_uri(&self, uri: Option<String>) {
        *lock(&self.shared.uri) = uri.clone();
        let running = lock(&self.shared.helper).is_some();
        match (running, uri) {
            (true, None) => {
                if let Some(mut gone) = lock(&self.shared.helper).take() {
                    drop(gone.stdin);
                    let _ = gone.child.wait();
                }
            }
            (true, Some(uri)) => {
                let _ = self.send(Call::SetUri(Some(uri)), None);
            }
            (false, Some(_)) => {
                if let Err(e) = start_helper_if_daemon(&self.shared) {
                    tracing::warn!("{}", crate::error_chain(&e));
                }
            }
            (false, None) => {}
        }
    }

    /// Ends the helper (for every clone). Waits for a call in progress at most a short while,
    /// then kills it; later calls answer [`LibvirtError::Stopped`].
    pub fn stop(&self) {
        self.shared.stop();
    }

    /// Running domains and the host PCI functions assigned to them; domains with none are left
    /// out. No URI, or a local QEMU URI with no daemon running: none.
    pub fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        if self.shared.uri().is_none() {
            return Ok(Vec::new());
        }
        match self.call(Call::RunningDomains) {
            Ok(Value::Running(r)) => Ok(r),
            Ok(other) => Err(unexpected(&other)),
            Err(LibvirtError::NoDaemon { .. }) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// A domain's XML, live or persistent.
    pub fn domain_xml(&self, domain: &str, which: Definition) -> Result<String, LibvirtError> {
        let call = Call::DomainXml {
            domain: domain.to_string(),
            which,
        };
        match self.call(call)? {
            Value::Xml(x) => Ok(x),
            other => Err(unexpected(&other)),
        }
    }

    /// The domain named by `domain`: a name, else a UUID.
    pub fn lookup(&self, domain: &str) -> Result<DomainInfo, LibvirtError> {
        match self.call(Call::Lookup {
            domain: domain.to_string(),
        })? {
            Value::Info(i) => Ok(i),
            other => Err(unexpected(&other)),
        }
    }

    /// Every domain libvirt has (running, or defined and stopped), with its definitions.
    pub fn all_domains(&self) -> Result<Vec<DomainDefinitions>, LibvirtError> {
        match self.call(Call::AllDomains)? {
            Value::All(a) => Ok(a),
            other => Err(unexpected(&other)),
        }
    }

    /// Writes vfiod's element (`xml`, in [`super::xml::VFIOD_NS`]) in a domain's `<metadata>`,
    /// replacing what vfiod wrote before; `None` removes it.
    pub fn set_metadata(
        &self,
        domain: &str,
        xml: Option<&str>,
        affect: Affect,
    ) -> Result<(), LibvirtError> {
        self.unit(Call::SetMetadata {
            domain: domain.to_string(),
            xml: xml.map(str::to_string),
            affect,
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
        self.unit(Call::AttachDevice {
            domain: domain.to_string(),
            xml: xml.to_string(),
            affect,
        })
    }

    /// Asks a domain to release a device (see [`super::worker::LocalWorker::detach_device`]:
    /// a live PCI detach completes with libvirt's device-removed event).
    pub fn detach_device(
        &self,
        domain: &str,
        xml: &str,
        affect: Affect,
    ) -> Result<(), LibvirtError> {
        self.unit(Call::DetachDevice {
            domain: domain.to_string(),
            xml: xml.to_string(),
            affect,
        })
    }

    /// Migrates `domain` from the libvirt at `source` to `m.destination` (see
    /// [`super::worker::migrate`]), on the helper's own connections; waits until libvirt says
    /// it is over, however long that takes, or the helper is gone.
    pub fn migrate(&self, source: &str, domain: &str, m: &Migration) -> Result<(), LibvirtError> {
        let call = Call::Migrate {
            source: source.to_string(),
            domain: domain.to_string(),
            migration: m.clone(),
        };
        match self.send(call, None)?.recv() {
            Ok(r) => r.map(drop),
            Err(_) => Err(LibvirtError::Lost {
                uri: self.shared.uri_text(),
            }),
        }
    }

    fn unit(&self, call: Call) -> Result<(), LibvirtError> {
        self.call(call).map(drop)
    }

    /// Asks the helper and waits at most the handle's bound.
    fn call(&self, call: Call) -> Result<Value, LibvirtError> {
        if self.shared.uri().is_none() {
            return Err(LibvirtError::NotConfigured);
        }
        let answer = self.send(call, Some(self.timeout))?;
        match answer.recv_timeout(self.timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(LibvirtError::Timeout {
                uri: self.shared.uri_text(),
                timeout: self.timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(LibvirtError::Lost {
                uri: self.shared.uri_text(),
            }),
        }
    }

    /// Sends `call` to the helper (started first if there is none) and returns where its
    /// answer comes; `wait` tells the helper when not to run it any more.
    fn send(
        &self,
        call: Call,
        wait: Option<Duration>,
    ) -> Result<std::sync::mpsc::Receiver<Result<Value, LibvirtError>>, LibvirtError> {
        let shared = &self.shared;
        if shared.stopped.load(Ordering::Acquire) {
            return Err(LibvirtError::Stopped);
        }
        ensure_helper(shared)?;
        let id = shared.next_id.fetch_add(1, Ordering::AcqRel);
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let answered = !matches!(call, Call::SetUri(_));
        if answered {
            lock(&shared.pending).insert(id, reply);
        }
        let request = Request {
            id,
            wait_ms: wait.map(|w| w.as_millis() as u64),
            call,
        };
        let mut line =
            serde_json::to_vec(&request).map_err(|e| LibvirtError::Helper(e.to_string()))?;
        line.push(b'\n');
        let written = match lock(&shared.helper).as_mut() {
            Some(running) => running
                .stdin
                .write_all(&line)
                .and_then(|()| running.stdin.flush()),
            None => Err(std::io::Error::other("the helper is gone")),
        };
        if let Err(e) = written {
            lock(&shared.pending).remove(&id);
            return Err(LibvirtError::Helper(format!(
                "cannot ask the libvirt helper: {e}"
            )));
        }
        Ok(answer)
    }
}

fn unexpected(v: &Value) -> LibvirtError {
    LibvirtError::Helper(format!("the libvirt helper answered {v:?} to another call"))
}

impl DomainQuery for Libvirt {
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        Libvirt::running_domains(self)
    }
}
