//! A real polkitd for the authorization tests, and vfiod asking it.
//!
//! - The bus: a private *system-type* `dbus-daemon` ([`PrivateBus::start_system`]) with the
//!   policies that ship: polkit's own `org.freedesktop.PolicyKit1.conf` and the repo's
//!   `conf/dbus-1/system.d/org.vfiod.Vfiod1.conf`. Its socket lives in a directory every uid can
//!   reach, so tests can call as an unprivileged user.
//! - polkitd: Debian's binary, with `DBUS_SYSTEM_BUS_ADDRESS` pointing at that bus. It reads
//!   actions and rules only from directories fixed at its build (`/usr/share/polkit-1/actions`,
//!   `/etc/polkit-1/rules.d`, `/usr/share/polkit-1/rules.d`) and has no option or variable to
//!   move them, so it runs in a private mount namespace (`unshare --mount --propagation
//!   private`) where those three directories are bind mounts of temporary ones holding the
//!   repo's `polkit/org.vfiod.vfiod1.policy` and `tests/data/polkit/*.rules`. The mounts
//!   exist only inside that namespace: the host's directories are never written, and its own
//!   rules and actions are invisible to the test polkitd. polkitd then drops to its `polkitd`
//!   user as in production.
//! - vfiod: in-process on that bus with [`Authorizer::Polkit`]; `vfioctl` runs as any uid.

use super::Harness;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vfiod::dbus::{auth::Authorizer, BusTarget};
use vfiod::server::{Options, Server};
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{HostModel, SimKernel};

pub const POLKITD: &str = "/usr/lib/polkit-1/polkitd";
pub const POLKIT_NAME: &str = "org.freedesktop.PolicyKit1";
/// polkit's bus policy as its package installs it (the polkitd package is what we test with).
pub const POLKIT_BUS_POLICY: &str = "/usr/share/dbus-1/system.d/org.freedesktop.PolicyKit1.conf";
pub const VFIOD_BUS_POLICY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/conf/dbus-1/system.d/org.vfiod.Vfiod1.conf"
);
pub const VFIOD_ACTIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/polkit/org.vfiod.vfiod1.policy"
);
pub const TEST_RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/polkit/50-vfiod-test.rules"
);
/// The example of `docs/polkit.md` that lets a group claim GPUs, for [`GPU_GROUP`]: sorted
/// before [`TEST_RULES`], so polkitd asks it first.
pub const GPU_GROUP_RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/polkit/40-vfiod-gpu-group.rules"
);

/// Where polkitd reads actions and rules: compiled in, so hidden behind bind mounts.
pub const HOST_ACTIONS_DIR: &str = "/usr/share/polkit-1/actions";
pub const HOST_RULES_DIRS: [&str; 2] = ["/etc/polkit-1/rules.d", "/usr/share/polkit-1/rules.d"];

pub const ROOT: u32 = 0;
/// `nobody`: no rule grants it anything.
pub const NOBODY: u32 = 65534;
/// The users the test rules (`tests/data/polkit/50-vfiod-test.rules`) grant something, by name
/// as the rules see them. Debian's base-passwd always has them, with fixed uids 1 to 4.
/// The operator: every vfiod action.
pub const GRANTED_USER: &str = "daemon";
/// `org.vfiod.vfiod1.configure` only.
pub const CONFIGURE_USER: &str = "bin";
/// `org.vfiod.vfiod1.mode` only, on any device.
pub const MODE_USER: &str = "sys";
/// `org.vfiod.vfiod1.mode` only, and only on [`ONE_DEVICE`] (the rule reads the `device` detail).
pub const ONE_DEVICE_USER: &str = "sync";
pub const ONE_DEVICE: &str = "0000:af:00.0";
/// In no rule of the test rules file; a member of [`GPU_GROUP`] (its primary group in Debian's
/// base-passwd, uid 7 and gid 7), which [`GPU_GROUP_RULES`] lets claim GPUs and nothing else.
pub const GPU_USER: &str = "lp";
pub const GPU_GROUP: &str = "lp";

/// Fails the test unless it runs as root. The tests that start polkitd need root (its mount
/// namespace, callers with other uids): they are `#[ignore = "needs root"]` and CI runs them as
/// root with `--ignored`; run as anyone else they fail loudly instead of passing untested.
pub fn assert_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (polkitd in a private mount namespace, callers with other uids): \
         run it as root, e.g. `sudo cargo test --test polkit -- --ignored`"
    );
}

pub fn uid_of(user: &str) -> u32 {
    nix::unistd::User::from_name(user)
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("no user {user:?} on this host"))
        .uid
        .as_raw()
}

fn make_reachable(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("({}: {e})", path.display()))
}

/// Starts a private system-type bus under `dir` (which must be reachable by every uid that
/// will connect) with the shipped polkit and vfiod bus policies.
pub fn start_system_bus(dir: &Path) -> PrivateBus {
    let bus_dir = dir.join("bus");
    PrivateBus::start_system(
        &bus_dir,
        &[Path::new(POLKIT_BUS_POLICY), Path::new(VFIOD_BUS_POLICY)],
    )
    .unwrap_or_else(|e| {
        panic!(
            "private system bus: {}; dbus-daemon said: {}",
            vfiod::error_chain(&e),
            read_log(&bus_dir.join("bus.log"))
        )
    })
}

/// A running polkitd in its own mount namespace; killed when dropped.
pub struct Polkitd {
    child: Option<Child>,
    dir: PathBuf,
}

impl Polkitd {
    /// Starts polkitd on `bus` with the given action and rules files (copied under `dir`,
    /// which polkitd's own user must be able to reach) and returns once it owns its name.
    pub async fn start(bus: &PrivateBus, dir: &Path, actions: &[&str], rules: &[&str]) -> Polkitd {
        assert!(
            Path::new(POLKITD).exists(),
            "{POLKITD} is missing: install Debian's polkitd package"
        );
        let actions_dir = dir.join("actions");
        let rules_dir = dir.join("rules.d");
        let empty_dir = dir.join("empty");
        for (d, files) in [
            (&actions_dir, actions),
            (&rules_dir, rules),
            (&empty_dir, &[]),
        ] {
            std::fs::create_dir_all(d).expect("polkit dirs");
            make_reachable(d, 0o755);
            for f in files {
                let f = Path::new(f);
                let to = d.join(f.file_name().expect("file name"));
                std::fs::copy(f, &to).unwrap_or_else(|e| panic!("copy {}: {e}", f.display()));
                make_reachable(&to, 0o644);
            }
        }
        make_reachable(dir, 0o755);
        let log = dir.join("polkitd.log");
        let out = std::fs::File::create(&log).expect("polkitd log");
        // Paths go in as positional parameters, so no quoting is involved. `exec` keeps the
        // child's pid as polkitd's.
        let script = "mount --bind \"$1\" /usr/share/polkit-1/actions \
            && mount --bind \"$2\" /usr/share/polkit-1/rules.d \
            && mount --bind \"$3\" /etc/polkit-1/rules.d \
            && exec \"$4\"";
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(script)
            .arg("polkitd-in-namespace")
            .args([&actions_dir, &rules_dir, &empty_dir])
            .arg(POLKITD)
            .env("DBUS_SYSTEM_BUS_ADDRESS", bus.address())
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log fd"))
            .stderr(out)
            .spawn()
            .expect("spawn unshare (util-linux)");
        let mut p = Polkitd {
            child: Some(child),
            dir: dir.to_path_buf(),
        };
        p.wait_ready(bus).await;
        p
    }

    async fn wait_ready(&mut self, bus: &PrivateBus) {
        let conn = zbus::connection::Builder::address(bus.address())
            .build()
            .await
            .expect("connect to the private system bus");
        let dbus = zbus::fdo::DBusProxy::new(&conn).await.expect("DBus proxy");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let name = zbus::names::BusName::try_from(POLKIT_NAME).expect("name");
            if dbus.name_has_owner(name).await.unwrap_or(false) {
                return;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                panic!(
                    "polkitd exited ({status}) before owning {POLKIT_NAME}:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "polkitd did not own {POLKIT_NAME} within 10 s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("polkitd running").id()
    }

    /// What polkitd printed (rule loading, `polkit.log()` lines of the test rules).
    pub fn log(&self) -> String {
        read_log(&self.dir.join("polkitd.log"))
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Polkitd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The result of one vfioctl run.
#[derive(Debug)]
pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// vfiod on the simulated reference host, on a private system bus with a real polkitd.
pub struct PolkitHarness {
    // Declared first so polkitd stops before the harness removes its directory.
    pub polkitd: Polkitd,
    pub h: Harness,
    vfioctl: PathBuf,
    _vfioctl_dir: Option<tempfile::TempDir>,
}

impl PolkitHarness {
    /// With the shipped actions and the test rules.
    pub async fn start(config: &str) -> PolkitHarness {
        Self::start_with(config, &[VFIOD_ACTIONS], &[TEST_RULES]).await
    }

    pub async fn start_with(config: &str, actions: &[&str], rules: &[&str]) -> PolkitHarness {
        let dir = scratch_dir();
        // polkitd (as its own user) and unprivileged callers must reach the bus socket and the
        // bind-mounted files below this directory.
        make_reachable(dir.path(), 0o755);
        let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference())
            .expect("simulated host");
        let bus = start_system_bus(dir.path());
        let polkitd = Polkitd::start(&bus, &dir.path().join("polkit"), actions, rules).await;
        let (vfioctl, vfioctl_dir) = vfioctl_for_any_uid();
        let h = Harness::assemble(dir, kernel, bus, config).await;
        let mut p = PolkitHarness {
            polkitd,
            h,
            vfioctl,
            _vfioctl_dir: vfioctl_dir,
        };
        p.start_vfiod().await;
        p
    }

    /// Starts vfiod as the binary does on a real host: asking polkit for mutating calls.
    pub async fn start_vfiod(&mut self) {
        let source = self.h.source();
        let settings = source.load().expect("test config loads");
        let server = Server::start(Options {
            settings,
            source: Some(source),
            sysfs: self.h.kernel.sysfs(),
            events: Some(self.h.kernel.subscribe()),
            bus: BusTarget::Address(self.h.bus.address().to_string()),
            authorizer: Authorizer::Polkit,
            simulated: true,
        })
        .await
        .expect("vfiod starts on the private system bus");
        self.h.server = Some(server);
    }

    /// Runs `vfioctl ARGS` as `uid` (with that user's primary group, no supplementary ones).
    pub async fn vfioctl(&self, uid: u32, args: &[&str]) -> Run {
        let mut cmd = tokio::process::Command::new(&self.vfioctl);
        cmd.args(args);
        self.run_as(uid, cmd).await
    }

    /// Runs `vfioctl ARGS` as `uid`, inside a user namespace that user makes itself, as any
    /// local user can: `unshare --user --map-user=UID --map-group=GID --keep-caps`. In it the
    /// caller keeps its uid (so the bus's EXTERNAL authentication still matches) and holds
    /// every capability, of that namespace only ([`user_namespace_view`] shows what
    /// `/proc/PID/status` says of such a process).
    pub async fn vfioctl_in_user_namespace(&self, uid: u32, args: &[&str]) -> Run {
        let mut cmd = tokio::process::Command::new("unshare");
        cmd.args(unshare_args(uid)).arg(&self.vfioctl).args(args);
        self.run_as(uid, cmd).await
    }

    /// Runs `cmd` as `uid` (with that user's primary group, no supplementary ones).
    async fn run_as(&self, uid: u32, mut cmd: tokio::process::Command) -> Run {
        let gid = gid_of(uid);
        let out = cmd
            .env("VFIOD_BUS", self.h.bus.address())
            .current_dir("/")
            .uid(uid)
            .gid(gid)
            .output()
            .await
            .expect("run vfioctl");
        Run {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

pub use super::fast_tempdir as scratch_dir;

/// `uid`'s primary group (`uid` itself for a uid with no passwd entry).
fn gid_of(uid: u32) -> u32 {
    nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or(uid, |u| u.gid.as_raw())
}

/// `unshare`'s arguments for a new user namespace made by `uid`, mapping it (and its primary
/// group) to itself, with every capability of the namespace kept across the exec.
fn unshare_args(uid: u32) -> Vec<String> {
    vec![
        "--user".into(),
        format!("--map-user={uid}"),
        format!("--map-group={}", gid_of(uid)),
        "--keep-caps".into(),
        "--".into(),
    ]
}

/// What `/proc/self/status` and `/proc/self/ns/user` show of a process that `uid` runs inside
/// a user namespace it made (as [`PolkitHarness::vfioctl_in_user_namespace`] runs vfioctl): the
/// `Uid:` and `CapEff:` lines and the namespace's link. Panics when `uid` cannot make one
/// (`user.max_user_namespaces` is 0, or a sysctl forbids unprivileged user namespaces).
pub fn user_namespace_view(uid: u32) -> (String, String, String) {
    use std::os::unix::process::CommandExt;
    let out = Command::new("unshare")
        .args(unshare_args(uid))
        .args([
            "sh",
            "-c",
            "grep -E '^(Uid|CapEff):' /proc/self/status && readlink /proc/self/ns/user",
        ])
        .uid(uid)
        .gid(gid_of(uid))
        .current_dir("/")
        .output()
        .expect("run unshare (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "uid {uid} cannot make a user namespace: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line in {stdout:?}"))
            .trim()
            .to_string()
    };
    let ns = stdout
        .lines()
        .find(|l| l.starts_with("user:["))
        .unwrap_or_else(|| panic!("no namespace link in {stdout:?}"))
        .to_string();
    (line("Uid:"), line("CapEff:"), ns)
}

/// vfioctl at a path every uid can execute. The build directory may not be reachable (a
/// checkout under /root): then a copy in a temporary directory that is.
fn vfioctl_for_any_uid() -> (PathBuf, Option<tempfile::TempDir>) {
    let (dir, copy) = binaries_for_any_uid(&[Path::new(env!("CARGO_BIN_EXE_vfioctl"))]);
    (dir.join("vfioctl"), copy)
}

/// A directory every uid can search holding `binaries` (built ones, all in one directory):
/// the build directory when every uid can reach it, else a temporary copy (returned, so that
/// it lives as long as the caller needs it).
pub fn binaries_for_any_uid(binaries: &[&Path]) -> (PathBuf, Option<tempfile::TempDir>) {
    let mode = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.permissions().mode());
    let reachable = binaries.iter().all(|exe| {
        mode(exe) & 0o005 == 0o005 && exe.ancestors().skip(1).all(|d| mode(d) & 0o001 != 0)
    });
    let built = binaries[0].parent().expect("a binary's directory");
    if reachable && binaries.iter().all(|b| b.parent() == Some(built)) {
        return (built.to_path_buf(), None);
    }
    // On disk, not in /dev/shm: the binaries are large and /dev/shm may be small.
    let dir = tempfile::tempdir().expect("tempdir for binaries");
    make_reachable(dir.path(), 0o755);
    for exe in binaries {
        let to = dir.path().join(exe.file_name().expect("file name"));
        std::fs::copy(exe, &to).unwrap_or_else(|e| panic!("copy {}: {e}", exe.display()));
        make_reachable(&to, 0o755);
    }
    (dir.path().to_path_buf(), Some(dir))
}
