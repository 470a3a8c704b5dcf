//! A private `dbus-daemon` for `--simulate` and for tests: a real bus, started as a child
//! process on a unix socket in a directory we own, stopped when dropped.
//!
//! It must not outlive its parent even when the parent cannot drop it (SIGKILL, a fatal
//! signal): an orphaned bus would keep a restarted `vfiod --simulate` from being reachable, or
//! delete its socket when it finally exits. So the child asks the kernel for a signal when its
//! parent dies (`PR_SET_PDEATHSIG`), and each bus gets a socket path of its own.

use std::io::{self, BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, OnceLock};

/// The socket's name inside a bus's own directory.
const SOCKET: &str = "bus.sock";
/// Prefix of a bus's own directory: `bus-<starter pid>-<n>`.
const INSTANCE_PREFIX: &str = "bus-";

#[derive(Debug, thiserror::Error)]
pub enum PrivateBusError {
    #[error("cannot write the bus configuration in {dir}")]
    Setup {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start dbus-daemon (is the dbus-daemon package installed?)")]
    Spawn(#[source] std::io::Error),
    #[error("dbus-daemon exited before printing its address (its log: {})", .log.display())]
    NoAddress { log: PathBuf },
}

/// A running private bus.
pub struct PrivateBus {
    child: Child,
    address: String,
    /// This bus's own directory (config, socket, log), removed when it stops.
    instance: PathBuf,
}

impl PrivateBus {
    /// Starts `dbus-daemon` with a permissive session-style policy on a socket under `dir`.
    /// `extra_policy` is inserted into the config (e.g. a `<policy>` that restricts owners, or
    /// `<servicedir>` entries).
    pub fn start(dir: &Path, extra_policy: &str) -> Result<PrivateBus, PrivateBusError> {
        let body = format!(
            r#"  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
    <allow user="*"/>
  </policy>
  {extra_policy}
"#
        );
        Self::launch(dir, "session", &body, Reach::AnyUser)
    }

    /// Starts `dbus-daemon` as [`PrivateBus::start`] does, for the user who starts it only (the
    /// simulation's bus): no policy admits another uid (dbus-daemon admits the uid it runs as
    /// when no rule names users), and its own directory is 0700, so another user can neither
    /// reach the socket nor connect to it. Root reaches the socket, and the bus refuses it too
    /// unless root started it.
    pub fn start_private(dir: &Path) -> Result<PrivateBus, PrivateBusError> {
        let body = r#"  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
"#;
        Self::launch(dir, "session", body, Reach::Owner)
    }

    /// Starts `dbus-daemon` as a private *system* bus: `<type>system</type>` and the policy of
    /// Debian's system bus (anyone may connect, owning names and calling methods are denied
    /// unless a policy file punches a hole), plus the `<include>`d policy files, e.g. the
    /// service's own `dbus-1/system.d/*.conf`. No service directories: nothing is ever
    /// activated on it, so a service is only there if the caller started it.
    pub fn start_system(dir: &Path, policy_files: &[&Path]) -> Result<PrivateBus, PrivateBusError> {
        let includes: String = policy_files
            .iter()
            .map(|p| format!("  <include>{}</include>\n", p.display()))
            .collect();
        let body = format!(
            r#"  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus" send_member="UpdateActivationEnvironment"/>
  </policy>
{includes}"#
        );
        Self::launch(dir, "system", &body, Reach::AnyUser)
    }

    /// Starts `dbus-daemon` in a directory of its own under `dir` (config, socket and log), so
    /// that a bus never shares a socket path with another one: dbus-daemon deletes a socket at
    /// its path when it starts and when it exits, whoever made it.
    fn launch(
        dir: &Path,
        bus_type: &str,
        body: &str,
        reach: Reach,
    ) -> Result<PrivateBus, PrivateBusError> {
        let setup = |source| PrivateBusError::Setup {
            dir: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(setup)?;
        remove_stale_instances(dir);
        let instance = new_instance_dir(dir, reach).map_err(setup)?;
        let config = instance.join("bus.conf");
        let text = format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>{bus_type}</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
{body}</busconfig>
"#,
            instance.join(SOCKET).display()
        );
        std::fs::write(&config, text).map_err(setup)?;
        // Its warnings (e.g. that it cannot raise the fd limit) go to a log beside the socket.
        let log_path = instance.join("bus.log");
        let log = std::fs::File::create(&log_path).map_err(setup)?;
        let mut cmd = Command::new("dbus-daemon");
        cmd.arg(format!("--config-file={}", config.display()))
            .arg("--nofork")
            .arg("--print-address=1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        let mut child = spawn_tied_to_process(cmd).map_err(PrivateBusError::Spawn)?;
        let no_address = || PrivateBusError::NoAddress {
            log: log_path.clone(),
        };
        let stdout = child.stdout.take().ok_or_else(no_address)?;
        let mut line = String::new();
        // dbus-daemon prints the address once it listens, so the bus is ready when we return.
        let read = BufReader::new(stdout).read_line(&mut line);
        let address = line.trim().to_string();
        if read.is_err() || address.is_empty() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(no_address());
        }
        Ok(PrivateBus {
            child,
            address,
            instance,
        })
    }

    /// The bus address, e.g. `unix:path=/tmp/x/bus.sock,guid=...`.
    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// This bus's own directory under the one given to `start`: its `bus.conf`, socket and
    /// `bus.log`.
    pub fn dir(&self) -> &Path {
        &self.instance
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.instance);
    }
}

/// Who may reach a bus's socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// Every uid that `dir` lets through (tests' callers of other uids, polkitd).
    AnyUser,
    /// The uid that started it.
    Owner,
}

/// Creates `dir/bus-<our pid>-<n>`, a name no other live process uses.
fn new_instance_dir(dir: &Path, reach: Reach) -> io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // AnyUser: the default mode (umask), so other uids (polkitd) reach the socket when `dir`
    // lets them.
    let mode = match reach {
        Reach::AnyUser => 0o777,
        Reach::Owner => 0o700,
    };
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{INSTANCE_PREFIX}{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(mode).create(&path) {
            Ok(()) => return Ok(path),
            // Left by an earlier process that had our pid and still listening: not ours.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Removes the directories of buses whose starter is dead and whose socket nobody listens on
/// (left by a starter killed before it could drop its bus). A live bus, or one whose starter
/// still runs, is never touched.
fn remove_stale_instances(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(INSTANCE_PREFIX))
            .and_then(|n| n.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
            .filter(|pid| *pid > 0)
        else {
            continue;
        };
        let starter_alive = !matches!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
            Err(nix::errno::Errno::ESRCH)
        );
        if starter_alive || std::os::unix::net::UnixStream::connect(e.path().join(SOCKET)).is_ok() {
            continue;
        }
        let _ = std::fs::remove_dir_all(e.path());
    }
}

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `cmd` so that it gets SIGTERM when this process dies.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process: a
/// bus started from a short-lived thread (a test's, tokio's blocking pool) would die with that
/// thread. So every bus is forked by one thread that lives as long as the process.
fn spawn_tied_to_process(mut cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs between fork and exec and makes only async-signal-safe calls
    // (prctl, getppid), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
            // The parent may have died between fork and prctl: then no signal will come.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        let started = std::thread::Builder::new()
            .name("private-bus-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            });
        if let Err(e) = started {
            tracing::warn!("cannot start the private bus spawner thread: {e}");
        }
        tx
    });
    let (reply, answer) = mpsc::channel();
    let gone = || io::Error::other("the private bus spawner thread is gone");
    spawner.send((cmd, reply)).map_err(|_| gone())?;
    answer.recv().map_err(|_| gone())?
}
