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
//! - Also served: QEMU's session driver (`qemu+unix:///session?socket=...`, package
//!   `qemu-system-x86`), for what only a real hypervisor does (device hot-plug and its events).
//!   Its domains are TCG (`type='qemu'`: the unprivileged daemon cannot open `/dev/kvm`), have
//!   no disk and no OS ([`tcg_domain_xml`]); QEMU writes its log to a file (no `virtlogd`).
//!   Dropping the harness kills the QEMU processes the daemon started.

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
        for sub in ["sock", "run", "config", "cache", "home", "config/libvirt"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        // QEMU's output to a file: otherwise the session driver spawns a virtlogd that
        // outlives the daemon by two minutes.
        std::fs::write(
            dir.path().join("config/libvirt/qemu.conf"),
            "stdio_handler = \"file\"\n",
        )
        .unwrap();
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

    /// QEMU's session driver, served by this daemon.
    pub fn qemu_uri(&self) -> String {
        format!("qemu+unix:///session?socket={}", self.socket().display())
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("libvirtd runs").id()
    }

    /// Tells the boot rule of the simulated host under `root` that this libvirt daemon runs (its
    /// pid file and a /proc entry): vfiod then connects to a local QEMU URI, which it never does
    /// while no daemon runs (that would start one).
    pub fn announce(&self, root: &Path) {
        let pid = self.pid();
        std::fs::create_dir_all(root.join("run")).unwrap();
        std::fs::create_dir_all(root.join("proc").join(pid.to_string())).unwrap();
        std::fs::write(root.join("run/libvirtd.pid"), pid.to_string()).unwrap();
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

    /// `virsh -c URI ARGS...` on the test driver, a separate client; panics with its output if
    /// it fails.
    pub fn virsh(&self, args: &[&str]) -> String {
        self.virsh_at(&self.uri(), args)
    }

    /// `virsh -c URI ARGS...` on the given URI (e.g. [`Libvirtd::qemu_uri`]).
    pub fn virsh_at(&self, uri: &str, args: &[&str]) -> String {
        let out = Command::new(VIRSH)
            .arg("-c")
            .arg(uri)
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
        self.kill_qemus();
        self.kill();
    }
}

impl Libvirtd {
    /// kill -9 of the QEMU processes of the session driver's running domains, by their pid
    /// files (`driver.pid` there is the daemon's own lock), each checked to be a QEMU still.
    fn kill_qemus(&self) {
        let run = self.dir.path().join("run/libvirt/qemu/run");
        let Ok(entries) = std::fs::read_dir(&run) else {
            return;
        };
        for path in entries.flatten().map(|e| e.path()) {
            if path.extension().is_none_or(|e| e != "pid")
                || path.file_name().is_some_and(|n| n == "driver.pid")
            {
                continue;
            }
            let Some(pid) = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| t.trim().parse::<i32>().ok())
            else {
                continue;
            };
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.starts_with("qemu-system") {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
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

/// The emulator of [`tcg_domain_xml`]'s domains. Not installed by README's test command
/// (`libvirt-daemon` only recommends it).
pub const QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// Panics with what to install when QEMU is missing.
pub fn require_qemu() {
    assert!(
        Path::new(QEMU).exists(),
        "{QEMU} is missing: install qemu-system-x86 (tests/vm/install-deps does)"
    );
}

/// A domain for QEMU's session driver named `name`: TCG, 32 MiB, no disk, no network, no OS
/// (the firmware finds no boot device and keeps retrying), with a USB controller (`qemu-xhci`) and a
/// virtio-serial controller for devices that hot-plug and unplug without a guest's help, and
/// one spare `pcie-root-port` for a PCI device, whose unplug needs the guest.
pub fn tcg_domain_xml(name: &str) -> String {
    format!(
        "<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <emulator>{QEMU}</emulator>
    <controller type='pci' index='0' model='pcie-root'/>
    <controller type='pci' index='1' model='pcie-root-port'/>
    <controller type='pci' index='2' model='pcie-root-port'/>
    <controller type='pci' index='3' model='pcie-root-port'/>
    <controller type='usb' index='0' model='qemu-xhci'/>
    <controller type='virtio-serial' index='0'/>
    <memballoon model='none'/>
  </devices>
</domain>"
    )
}
