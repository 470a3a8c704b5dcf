//! A real libvirtd for the libvirt tests, a child of the test process.
//!
//! - Debian's `/usr/sbin/libvirtd` (packages `libvirt-daemon`, `libvirt-clients` for `virsh`),
//!   as an unprivileged user: it then runs in session mode, where every directory it uses comes
//!   from the environment (`HOME`, `XDG_RUNTIME_DIR`, `XDG_CONFIG_HOME`, `XDG_CACHE_HOME`) and
//!   points into a temporary directory, so neither the host's libvirt state nor another test's
//!   daemon is touched. As root the daemon drops to `nobody` (as root it would be the system
//!   daemon, with fixed state directories under `/run` and `/var`).
//! - Its own config (`-f`): the socket in the temporary directory, no TCP, no authentication.
//! - Served through it: libvirt's test driver (`test+unix:///default?socket=...`), which needs
//!   no QEMU, no KVM and no cgroups, has a running domain `test` from the start, accepts
//!   `<hostdev>` in the domains it defines, and emits the lifecycle events of a real driver.
//!   Its state lives in the daemon: a killed daemon forgets the domains defined through it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const LIBVIRTD: &str = "/usr/sbin/libvirtd";
pub const VIRSH: &str = "/usr/bin/virsh";
/// `nobody`/`nogroup`: the daemon's user when the tests run as root.
const NOBODY: (u32, u32) = (65534, 65534);

pub struct Libvirtd {
    pub dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Libvirtd {
    /// Starts a libvirtd and waits until it answers.
    pub fn start() -> Libvirtd {
        for tool in [LIBVIRTD, VIRSH] {
            assert!(
                Path::new(tool).exists(),
                "{tool} is missing: install libvirt-daemon and libvirt-clients (see README)"
            );
        }
        let dir = super::fast_tempdir();
        for sub in ["sock", "run", "config", "cache", "home"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        let conf = format!(
            "unix_sock_dir = \"{}\"\n\
             unix_sock_rw_perms = \"0777\"\n\
             auth_unix_rw = \"none\"\n\
             auth_unix_ro = \"none\"\n\
             listen_tcp = 0\n\
             listen_tls = 0\n\
             log_outputs = \"3:stderr\"\n",
            dir.path().join("sock").display()
        );
        std::fs::write(dir.path().join("libvirtd.conf"), conf).unwrap();
        if nix::unistd::geteuid().is_root() {
            chown_tree(dir.path(), NOBODY);
        }
        let mut d = Libvirtd { dir, child: None };
        d.spawn();
        d
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("sock/libvirt-sock")
    }

    /// The test driver, served by this daemon.
    pub fn uri(&self) -> String {
        format!("test+unix:///default?socket={}", self.socket().display())
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("libvirtd runs").id()
    }

    /// kill -9, and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again with the same directories and socket.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `virsh -c URI ARGS...`, a separate client; panics with its output if it fails.
    pub fn virsh(&self, args: &[&str]) -> String {
        let out = Command::new(VIRSH)
            .arg("-c")
            .arg(self.uri())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "virsh {args:?}: {}{}\nlibvirtd's log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("libvirtd.log")).unwrap_or_default()
    }

    fn spawn(&mut self) {
        let d = self.dir.path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("libvirtd.log"))
            .unwrap();
        let mut cmd = Command::new(LIBVIRTD);
        cmd.arg("-f")
            .arg(d.join("libvirtd.conf"))
            .arg("--pid-file")
            .arg(d.join("run/libvirtd.pid"))
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("HOME", d.join("home"))
            .env("XDG_RUNTIME_DIR", d.join("run"))
            .env("XDG_CONFIG_HOME", d.join("config"))
            .env("XDG_CACHE_HOME", d.join("cache"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if nix::unistd::geteuid().is_root() {
            cmd.uid(NOBODY.0).gid(NOBODY.1);
        }
        self.child = Some(cmd.spawn().expect("start libvirtd"));
        let uri = self.uri();
        eventually(Duration::from_secs(30), "libvirtd answers", || {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("libvirtd exited ({status}):\n{}", self.log());
            }
            let ok = Command::new(VIRSH)
                .args(["-c", &uri, "uri"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            ok.then_some(())
        });
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        self.kill();
    }
}

fn chown_tree(path: &Path, (uid, gid): (u32, u32)) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            chown_tree(&entry.unwrap().path(), (uid, gid));
        }
    }
}

/// Polls `f` until it gives a value; panics naming `what` after `within` (the harness's
/// [`super::eventually_blocking`], under the name these tests know).
pub fn eventually<T>(within: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    super::eventually_blocking(within, what, f)
}

/// A domain of libvirt's test driver named `name`, with the host PCI function `address`
/// (`DDDD:BB:SS.F`) assigned as a `<hostdev>`.
pub fn test_domain_xml(name: &str, address: &str) -> String {
    let a: vfiod::model::pci::PciAddress = address.parse().expect("a PCI address");
    let (domain, bus, slot, function) = (a.domain, a.bus, a.slot, a.function);
    format!(
        "<domain type='test'>
  <name>{name}</name>
  <memory>65536</memory>
  <os><type>hvm</type></os>
  <devices>
    <hostdev mode='subsystem' type='pci' managed='no'>
      <source><address domain='0x{domain:04x}' bus='0x{bus:02x}' slot='0x{slot:02x}' function='0x{function:x}'/></source>
    </hostdev>
  </devices>
</domain>"
    )
}
