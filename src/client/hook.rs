//! libvirt's qemu hook: what `vfiod-qemu-hook` (installed as `/etc/libvirt/hooks/qemu.d/vfiod`)
//! and `vfioctl hook qemu` run, [`process`]. It forwards the run to vfiod in one call within a
//! hard deadline (on vfiod's hook socket, `STATE_DIR/hook.sock`, peer to peer; else
//! `Manager.Hook` on the bus: [`crate::dbus::hook_socket`] says why there are two), and decides
//! alone when vfiod cannot answer: a
//! notification passes (libvirt must never be held up, and a failing `reconnect` would make it
//! kill the VM), while `prepare`, `start`, `migrate` and `restore` fail closed for a domain with
//! a device vfiod manages or one the host uses (by vfiod's records), and pass for any other
//! domain. After its deadline the hook decides from what it already has: its own parse of the
//! XML runs on a thread of its own from the start, and one that has not finished by then is not
//! waited for.
//!
//! Each run is sent with when it was sent and the last moment vfiod may answer it
//! (`HookWithOptions`, [`crate::hook::deadline`]), so that vfiod never carries out a run this
//! hook has already answered alone. A start (prepare, start, restore) of a domain that assigns no
//! PCI function is answered at once, without vfiod: there is nothing for vfiod to claim, bind or
//! refuse, and such a domain must start whether vfiod answers or not.

use crate::config::{HookSettings, Settings, DEFAULT_CONFIG_PATH, DEFAULT_DROPIN_DIR};
use crate::dbus::BusTarget;
use crate::hook::deadline::{Stamp, Timing};
use crate::hook::{HostUses, Operation};
use crate::model::pci::PciAddress;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

/// The most XML read from stdin: libvirt's largest domains are far smaller.
pub const MAX_XML: usize = 16 << 20;

/// libvirt's arguments.
#[derive(Clone, Debug)]
pub struct HookArgs {
    pub domain: String,
    pub operation: String,
    pub sub_operation: String,
    pub extra: String,
}

/// What the hook process does: its exit code, its output, and a line for its stderr.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Reads the domain XML libvirt writes on the hook's stdin, at most [`MAX_XML`] bytes.
/// `Err` is the hook's answer without vfiod: an operation that may fail refuses a document over
/// the cap; a notification still passes (libvirt ignores its failure, or for `reconnect` kills
/// the VM), with the rest of its input drained so that libvirt's write completes. `reconnect`
/// needs no XML: it goes on with an empty one.
pub fn read_xml(input: impl Read, args: &HookArgs) -> Result<String, Outcome> {
    let op = Operation::parse(&args.operation);
    let mut input = input;
    let mut xml = Vec::new();
    let read = (&mut input).take(MAX_XML as u64 + 1).read_to_end(&mut xml);
    let problem = match read {
        Ok(_) if xml.len() <= MAX_XML => return Ok(String::from_utf8_lossy(&xml).into_owned()),
        Ok(_) => {
            if !op.may_fail() {
                let _ = std::io::copy(&mut input, &mut std::io::sink());
            }
            format!("the domain XML on stdin is larger than {MAX_XML} bytes")
        }
        Err(e) => format!("cannot read the domain XML on stdin: {e}"),
    };
    if op.may_fail() {
        return Err(Outcome {
            exit_code: 1,
            stdout: String::new(),
            stderr: format!("vfiod: {problem}"),
        });
    }
    if op == Operation::Reconnect {
        return Ok(String::new());
    }
    Err(Outcome {
        exit_code: 0,
        stdout: String::new(),
        stderr: format!(
            "vfiod: {} {} of {} not recorded: {problem}; the reconcile will catch up",
            args.operation, args.sub_operation, args.domain
        ),
    })
}

/// Where the hook finds the daemon's settings (for the deadlines and the state directory):
/// `$VFIOD_CONFIG` (a main file, no drop-ins), else the installed files.
pub fn settings() -> Settings {
    let loaded = match std::env::var_os("VFIOD_CONFIG") {
        Some(p) => Settings::load(Path::new(&p), None, true),
        None => Settings::load(
            Path::new(DEFAULT_CONFIG_PATH),
            Some(Path::new(DEFAULT_DROPIN_DIR)),
            false,
        ),
    };
    // A configuration the daemon would refuse: the defaults, so that the hook still answers.
    loaded.unwrap_or_default()
}

/// One whole run of the hook process, as libvirt runs it: the settings, the XML from stdin, the
/// answer (vfiod's, or the hook's own), written to stdout and stderr, and the exit code.
/// `vfiod-qemu-hook` (what libvirt runs) and `vfioctl hook qemu` (by hand) are both this.
pub async fn process(bus: &BusTarget, args: &HookArgs) -> u8 {
    let settings = settings();
    let out = match read_xml(std::io::stdin().lock(), args) {
        Ok(xml) => run(bus, args, xml, &settings.hooks, &settings.state_dir).await,
        Err(out) => out,
    };
    use std::io::Write;
    let _ = std::io::stdout().write_all(out.stdout.as_bytes());
    if !out.stderr.is_empty() {
        eprintln!("{}", out.stderr);
        if out.exit_code != 0 || out.stderr.contains("not recorded") {
            journal(&out.stderr);
        }
    }
    u8::try_from(out.exit_code.clamp(0, 255)).unwrap_or(1)
}

/// The bus the hook asks: `$VFIOD_BUS` (tests, a simulated host), else the system bus. An
/// unreadable value is said on stderr and the system bus is asked: the hook never fails for
/// its own reasons.
pub fn bus_from_env() -> BusTarget {
    match std::env::var("VFIOD_BUS") {
        Ok(v) if !v.is_empty() => v.parse().unwrap_or_else(|e| {
            eprintln!("vfiod: VFIOD_BUS: {e}");
            BusTarget::System
        }),
        _ => BusTarget::System,
    }
}

/// Runs the hook: asks vfiod, or decides alone when it cannot.
pub async fn run(
    bus: &BusTarget,
    args: &HookArgs,
    xml: String,
    hooks: &HookSettings,
    state_dir: &Path,
) -> Outcome {
    let op = Operation::parse(&args.operation);
    let deadline = Duration::from_millis(u64::from(if op.may_fail() {
        hooks.deadline_ms
    } else {
        hooks.notify_deadline_ms
    }));
    let started = Instant::now();
    let timing = Timing::of(Stamp::now(), deadline);
    if answers_alone(op, &xml) {
        return pass_unchanged();
    }
    // What the fallback needs, read at once beside the call: a slow parse is then bounded by
    // the same deadline, and none runs after it.
    let parsed = op.may_fail().then(|| parse_on_a_thread(xml.clone()));
    let socket = state_dir.join(crate::dbus::hook_socket::SOCKET_NAME);
    let asked = tokio::time::timeout(deadline, ask(bus, &socket, args, &xml, timing)).await;
    let why = match asked {
        Ok(Ok((exit_code, stdout, message))) => {
            return Outcome {
                exit_code,
                stdout,
                stderr: message,
            }
        }
        Ok(Err(e)) => e,
        Err(_) => format!("vfiod did not answer within {} ms", deadline.as_millis()),
    };
    let functions = match parsed {
        None => Ok(Vec::new()),
        Some(rx) => {
            let left = deadline.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, rx).await {
                Ok(Ok(functions)) => functions,
                Ok(Err(_)) => Err("its reader stopped".to_string()),
                Err(_) => Err(format!(
                    "not read within the hook's deadline of {} ms",
                    deadline.as_millis()
                )),
            }
        }
    };
    alone(
        op,
        args,
        functions,
        state_dir,
        hooks.guard_host_devices,
        &why,
    )
}

/// The PCI functions `xml` assigns, parsed on a thread of its own (not the runtime's blocking
/// pool, whose shutdown would wait for it: a parse still running at the deadline is abandoned
/// with the process).
fn parse_on_a_thread(
    xml: String,
) -> tokio::sync::oneshot::Receiver<Result<Vec<PciAddress>, String>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("hook-xml".into())
        .spawn(move || {
            let _ = tx.send(crate::host::libvirt::assigned_functions(&xml));
        });
    if let Err(e) = spawned {
        // The sender went with the closure: the receiver reports the reader stopped.
        tracing::warn!("cannot start the hook's XML reader: {e}");
    }
    rx
}

/// Whether the hook answers a run at once, without vfiod: a start (prepare, start, restore)
/// of a domain whose XML assigns no PCI function (vfiod would pass it too). A `migrate` is
/// always asked: its XML may carry vfiod's metadata or pooled sessions without a hostdev.
/// Pure.
pub fn answers_alone(op: Operation, xml: &str) -> bool {
    matches!(
        op,
        Operation::Prepare | Operation::Start | Operation::Restore
    ) && crate::host::libvirt::assigned_functions(xml).is_ok_and(|f| f.is_empty())
}

/// vfiod's answer: through its hook socket when one answers there, else on the bus. Once the
/// call is sent on either, its failure is the answer (the call may have been carried out:
/// asking again elsewhere could do it twice); but for a vfiod too old to know
/// `HookWithOptions`, which then carried nothing out and is asked with `Hook`.
async fn ask(
    bus: &BusTarget,
    socket: &Path,
    a: &HookArgs,
    xml: &str,
    timing: Timing,
) -> Result<(i32, String, String), String> {
    let options: crate::dbus::wire::Dict = [
        ("sent_ms", crate::dbus::variant(timing.sent.0)),
        ("deadline_ms", crate::dbus::variant(timing.deadline.0)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(conn) = direct(socket).await {
        let call = |method: &'static str| {
            let conn = conn.clone();
            let options = options.clone();
            async move {
                let path = crate::dbus::ROOT_PATH;
                let interface = Some(crate::dbus::hook_socket::INTERFACE);
                let plain = (&a.domain, &a.operation, &a.sub_operation, &a.extra, xml);
                match method {
                    "Hook" => {
                        conn.call_method(None::<&str>, path, interface, method, &plain)
                            .await
                    }
                    _ => {
                        let args = (plain.0, plain.1, plain.2, plain.3, plain.4, options);
                        conn.call_method(None::<&str>, path, interface, method, &args)
                            .await
                    }
                }
            }
        };
        let reply = match call("HookWithOptions").await {
            Err(e) if unknown_method(&e) => call("Hook").await,
            other => other,
        }
        .map_err(bus_error)?;
        return reply
            .body()
            .deserialize::<(i32, String, String)>()
            .map_err(|e| format!("vfiod's answer on {}: {e}", socket.display()));
    }
    let conn = super::connect(bus)
        .await
        .map_err(|e| crate::error_chain(&e))?;
    let m = super::manager(&conn)
        .await
        .map_err(|e| crate::error_chain(&e))?;
    match m
        .hook_with_options(
            &a.domain,
            &a.operation,
            &a.sub_operation,
            &a.extra,
            xml,
            options,
        )
        .await
    {
        Err(e) if unknown_method(&e) => {
            m.hook(&a.domain, &a.operation, &a.sub_operation, &a.extra, xml)
                .await
        }
        other => other,
    }
    .map_err(bus_error)
}

/// Whether vfiod does not know the method (an older vfiod): nothing was carried out.
fn unknown_method(e: &zbus::Error) -> bool {
    match e {
        zbus::Error::MethodError(name, _, _) => {
            name.as_str() == "org.freedesktop.DBus.Error.UnknownMethod"
        }
        zbus::Error::FDO(e) => matches!(**e, zbus::fdo::Error::UnknownMethod(_)),
        _ => false,
    }
}

/// A peer-to-peer connection to vfiod's hook socket, or `None` when nothing answers there
/// (no such file, no vfiod behind it, not allowed, every slot taken): then the bus is asked.
async fn direct(socket: &Path) -> Option<zbus::Connection> {
    let stream = tokio::net::UnixStream::connect(socket).await.ok()?;
    zbus::connection::Builder::unix_stream(stream.into_std().ok()?)
        .p2p()
        .build()
        .await
        .ok()
}

/// A D-Bus error on one line, once: its message and its name (a method error's chain repeats
/// both).
fn bus_error(e: zbus::Error) -> String {
    match e {
        zbus::Error::MethodError(name, Some(msg), _) => format!("{msg} ({name})"),
        // Its Display already says the name and the message; its source says them again.
        zbus::Error::FDO(e) => e.to_string(),
        other => crate::error_chain(&other),
    }
}

/// vfiod did not answer (`why`): pass, or refuse a domain with a function the records say the
/// host uses (unless `guard` is off), or fail closed for one with managed devices.
/// `functions` is what the hook's own parse of the XML found in time.
fn alone(
    op: Operation,
    args: &HookArgs,
    functions: Result<Vec<PciAddress>, String>,
    state_dir: &Path,
    guard: bool,
    why: &str,
) -> Outcome {
    let what = format!(
        "{} {} of {}",
        args.operation, args.sub_operation, args.domain
    );
    if !op.may_fail() {
        return Outcome {
            exit_code: 0,
            stdout: String::new(),
            stderr: format!("vfiod: {what} not recorded: {why}; the reconcile will catch up"),
        };
    }
    let functions = match functions {
        Ok(f) => f,
        Err(e) => {
            return Outcome {
                exit_code: 1,
                stdout: String::new(),
                stderr: format!(
                    "vfiod: cannot read the XML of domain {}: {e} ({why})",
                    args.domain
                ),
            }
        }
    };
    if functions.is_empty() {
        return pass_unchanged();
    }
    match records_read_only(state_dir) {
        Ok(records) => {
            if guard {
                let verb = if op == Operation::Migrate {
                    "come here"
                } else {
                    "start"
                };
                if let Err(line) =
                    crate::hook::refuse_host_devices(&args.domain, verb, &functions, &records.host)
                {
                    return Outcome {
                        exit_code: 1,
                        stdout: String::new(),
                        stderr: format!("{line} (by vfiod's records: {why})"),
                    };
                }
            }
            let ours: Vec<PciAddress> = functions
                .into_iter()
                .filter(|f| records.managed.contains(f))
                .collect();
            if ours.is_empty() {
                return pass_unchanged();
            }
            fail_closed(&what, &ours, Known::Managed, why)
        }
        // Not even the records: any PCI hostdev may be one vfiod manages, or the host's.
        Err(e) => fail_closed(
            &what,
            &functions,
            Known::Unknown,
            &format!("{why}, and its records cannot be read: {e}"),
        ),
    }
}

/// What the fallback reads of vfiod's records.
struct Records {
    /// The functions the configuration selected (and the host does not use).
    managed: Vec<PciAddress>,
    /// The functions the host uses, with the use the inventory recorded.
    host: HostUses,
}

/// The device records as the daemon last wrote them, read without a running daemon and without
/// changing anything (the database opened read-only, its file never created).
fn records_read_only(state_dir: &Path) -> Result<Records, String> {
    use rusqlite::{Connection, OpenFlags};
    let path = state_dir.join(crate::store::DB_FILE_NAME);
    let failed = |e: rusqlite::Error| format!("{}: {e}", path.display());
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(failed)?;
    let _ = conn.execute_batch("PRAGMA busy_timeout = 1000");
    let rows: Vec<(String, bool, String, String)> = conn
        .prepare("SELECT address, managed, state, state_reason FROM devices")
        .and_then(|mut stmt| {
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
                .collect::<rusqlite::Result<_>>()
        })
        .map_err(failed)?;
    let protected = crate::model::device::State::Protected.as_str();
    let mut out = Records {
        managed: Vec::new(),
        host: HostUses::new(),
    };
    for (address, managed, state, reason) in rows {
        let Ok(a) = address.parse::<PciAddress>() else {
            continue;
        };
        if managed {
            out.managed.push(a);
        }
        if state == protected {
            out.host
                .insert(a, crate::hook::recorded_use(&reason).to_string());
        }
    }
    Ok(out)
}

fn pass_unchanged() -> Outcome {
    Outcome {
        exit_code: 0,
        stdout: String::new(),
        stderr: String::new(),
    }
}

/// What the fallback knows of the functions it refuses for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    /// vfiod's records say it manages them.
    Managed,
    /// The records cannot be read: any of them may be vfiod's, or the host's own.
    Unknown,
}

fn fail_closed(what: &str, functions: &[PciAddress], known: Known, why: &str) -> Outcome {
    let list: Vec<String> = functions.iter().map(|f| f.to_string()).collect();
    let which = match known {
        Known::Managed => "that vfiod manages",
        Known::Unknown => "that vfiod may manage (or the host may use)",
    };
    Outcome {
        exit_code: 1,
        stdout: String::new(),
        stderr: format!(
            "vfiod: {what} refused: the domain has {} {which} and vfiod cannot check them \
             ({why}); start vfiod (systemctl start vfiod) and try again",
            list.join(", ")
        ),
    }
}

/// A line in the system log (the journal), for what libvirt does not show: a hook's stderr is
/// only logged by libvirtd when the hook fails.
pub fn journal(message: &str) {
    let Ok(text) = std::ffi::CString::new(message.replace('\0', " ")) else {
        return;
    };
    // SAFETY: static NUL-terminated identity and format; `text` outlives the call.
    unsafe {
        libc::openlog(c"vfiod-hook".as_ptr(), libc::LOG_PID, libc::LOG_DAEMON);
        libc::syslog(libc::LOG_WARNING, c"%s".as_ptr(), text.as_ptr());
        libc::closelog();
    }
}
