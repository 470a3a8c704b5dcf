//! libvirt, as far as vfiod needs it: which running domains have which host PCI functions
//! assigned (so that no task takes a device away from a running VM, and a refusal names the VM),
//! the domain calls the claims work builds on (a domain's XML, hostdev attach and detach), and
//! libvirt's domain events (lifecycle; a device removed, or its removal refused).
//!
//! - [`Libvirt`] (`process.rs`): the daemon's handle. libvirt's client library runs in a helper
//!   process (`vfiod-libvirt`: [`serve`]), so that vfiod itself links none of it; every call is
//!   bounded in time, a helper that exits is started again.
//! - [`LocalWorker`] (`worker.rs`): in the helper, the one thread that owns the connection;
//!   the worker reconnects after libvirtd restarts, and forwards events. `wire.rs`: the lines
//!   the two processes exchange.
//! - [`DomainQuery`]: what the engine's guards ask. Answered by the worker, by a domain's own XML
//!   inside a libvirt hook ([`HookDomain`]: a hook must never call libvirt back), or by nothing
//!   ([`NoLibvirt`], `libvirt_uri = ""`).
//! - [`xml`]: the domain XML, parsed without I/O. `events.rs`: the typed events
//!   ([`LibvirtEvent`]) and libvirt's event loop (through `virt`'s raw bindings, `unsafe`:
//!   the `virt` crate does not wrap event callbacks).

mod event;
mod process;
pub mod serve;
mod wire;
mod worker;
pub mod xml;

pub use event::{CloseReason, DomainEvent, DomainEventKind, LibvirtEvent};
pub use process::{helper_path, Libvirt, HELPER_ENV, HELPER_NAME};
pub use worker::{Affect, Definition, DomainDefinitions, DomainInfo, LocalWorker, Migration};
pub use xml::{assigned_functions, domain_devices, hostdev_xml, hostdevs, Hostdev};

use crate::model::pci::PciAddress;
use std::path::Path;
use std::time::Duration;

/// How long a question to libvirt may take. A hung libvirtd must not hang the D-Bus call that
/// asked (its caller gives up after 25 s) or the task.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the pid files are read while the boot rule keeps vfiod from connecting (and from
/// starting its helper): a file read, cheap, and libvirtd's start at boot is then noticed soon.
const DAEMON_POLL: Duration = Duration::from_secs(2);

/// Errors of libvirt calls. They cross from the helper process to the daemon (`wire.rs`), so
/// they hold text, not libvirt's error objects.
#[derive(Clone, Debug, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum LibvirtError {
    #[error("cannot connect to libvirt at {uri}")]
    Connect {
        uri: String,
        #[source]
        source: Cause,
    },
    /// A local QEMU URI and no daemon running: connecting would socket-activate one, which at
    /// boot waits for vfiod.
    #[error("no libvirt daemon runs for {uri} (vfiod does not start one)")]
    NoDaemon { uri: String },
    #[error("no libvirt connection is configured (libvirt_uri = \"\")")]
    NotConfigured,
    #[error("libvirt at {uri} cannot list its running domains")]
    Query {
        uri: String,
        #[source]
        source: Cause,
    },
    #[error("libvirt at {uri} has no domain {domain}")]
    NoSuchDomain { uri: String, domain: String },
    /// `action` says what was tried, e.g. "attach a device to".
    #[error("libvirt at {uri} could not {action} domain {domain}")]
    Domain {
        uri: String,
        domain: String,
        action: String,
        #[source]
        source: Cause,
    },
    #[error("cannot register for domain events at {uri}")]
    Events {
        uri: String,
        #[source]
        source: Cause,
    },
    #[error("domain {domain}: {message}")]
    DomainXml { domain: String, message: String },
    #[error("libvirt at {uri} did not answer within {timeout:?}")]
    Timeout { uri: String, timeout: Duration },
    /// The call panicked inside the client library (the `virt` crate panics when closing a
    /// connection fails); the worker lives on.
    #[error("the libvirt client failed while asking {uri} (see the daemon's log)")]
    Lost { uri: String },
    #[error("the libvirt worker has stopped")]
    Stopped,
    #[error("cannot start the libvirt worker thread: {0}")]
    Spawn(String),
    #[error("cannot start libvirt's event loop")]
    EventLoop(#[source] Cause),
    /// The helper process that runs libvirt's client could not be started or asked.
    #[error("the libvirt helper: {0}")]
    Helper(String),
}

/// libvirt's own error, by its message: the `virt` crate's `Display` adds numeric codes that
/// tell an operator nothing.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cause(pub String);

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Cause {}

impl From<virt::error::Error> for Cause {
    fn from(e: virt::error::Error) -> Cause {
        Cause(e.message().to_string())
    }
}

/// A running domain and the host PCI functions assigned to it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DomainDevices {
    pub domain: String,
    pub functions: Vec<PciAddress>,
}

/// What the engine's guards ask libvirt, behind a trait so that a request arriving from inside a
/// libvirt hook is answered from the domain XML it carries, never by calling libvirt back (that
/// would deadlock: libvirt waits for the hook).
pub trait DomainQuery: Send + Sync {
    /// Running domains and the host PCI functions assigned to them (domains with none may be
    /// left out).
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError>;
}

/// `libvirt_uri = ""`: no libvirt on this host, so no domains.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoLibvirt;

impl DomainQuery for NoLibvirt {
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        Ok(Vec::new())
    }
}

/// The one domain a libvirt hook is about, from the XML libvirt gave the hook on stdin. Other
/// domains cannot be asked about from inside a hook; the VFIO group check still sees their QEMUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookDomain(DomainDevices);

impl HookDomain {
    pub fn from_xml(xml: &str) -> Result<HookDomain, LibvirtError> {
        xml::domain_devices(xml)
            .map(HookDomain)
            .map_err(|message| LibvirtError::DomainXml {
                domain: "(from the hook's XML)".into(),
                message,
            })
    }

    pub fn devices(&self) -> &DomainDevices {
        &self.0
    }
}

impl DomainQuery for HookDomain {
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        Ok(vec![self.0.clone()])
    }
}

/// Whether asking `uri` could start a libvirt daemon instead of finding one: a local QEMU URI
/// (`qemu:///system`) reaches a socket that systemd activates on connection. At boot vfiod is
/// ordered before libvirtd, so that start would wait for vfiod while vfiod waits for it.
fn needs_running_daemon(uri: &str) -> bool {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return false;
    };
    let driver = scheme.split('+').next().unwrap_or(scheme);
    let local = rest.starts_with('/');
    driver == "qemu" && local
}

/// Whether a libvirt daemon serving QEMU runs on the host under `root`: the monolithic
/// `libvirtd` or the modular `virtqemud`, by their pid files and a live process.
fn local_daemon_running(root: &Path) -> bool {
    local_daemon(root).is_some()
}

/// A libvirt daemon serving QEMU that runs on the host under `root`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalDaemon {
    /// Its pid file, relative to the root (`run/libvirtd.pid`).
    pub pid_file: &'static str,
    pub pid: u32,
    /// When the pid file was written: when the daemon started.
    pub started: Option<std::time::SystemTime>,
}

/// The libvirt daemon that runs under `root`, found by its pid file and a live process (never
/// by its socket, which systemd would answer by starting one).
pub fn local_daemon(root: &Path) -> Option<LocalDaemon> {
    ["run/libvirtd.pid", "run/virtqemud.pid"]
        .into_iter()
        .find_map(|f| {
            let path = root.join(f);
            let pid = std::fs::read_to_string(&path)
                .ok()?
                .trim()
                .parse::<u32>()
                .ok()?;
            root.join("proc")
                .join(pid.to_string())
                .exists()
                .then(|| LocalDaemon {
                    pid_file: f,
                    pid,
                    started: std::fs::metadata(&path).and_then(|m| m.modified()).ok(),
                })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_qemu_uris_wait_for_a_running_daemon() {
        assert!(needs_running_daemon("qemu:///system"));
        assert!(needs_running_daemon("qemu+unix:///system?socket=/x"));
        assert!(!needs_running_daemon("qemu+ssh://host/system"));
        assert!(!needs_running_daemon("test:///default"));
    }

    #[test]
    fn a_daemon_runs_when_its_pid_file_names_a_live_process() {
        let root = tempfile::tempdir().unwrap();
        assert!(!local_daemon_running(root.path()));
        std::fs::create_dir_all(root.path().join("run")).unwrap();
        std::fs::write(root.path().join("run/virtqemud.pid"), "4242\n").unwrap();
        assert!(!local_daemon_running(root.path()), "stale pid file");
        std::fs::create_dir_all(root.path().join("proc/4242")).unwrap();
        assert!(local_daemon_running(root.path()));
    }

    #[test]
    fn a_hook_is_answered_from_its_xml_and_no_libvirt_from_nothing() {
        let xml = "<domain><name>web1</name><devices><interface type='hostdev'><source>\
                   <address type='pci' bus='0xaf' function='2'/></source></interface>\
                   </devices></domain>";
        let hook = HookDomain::from_xml(xml).unwrap();
        let found = DomainQuery::running_domains(&hook).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].domain, "web1");
        assert_eq!(found[0].functions, vec!["0000:af:00.2".parse().unwrap()]);
        let err = HookDomain::from_xml("<network/>").unwrap_err();
        assert!(crate::error_chain(&err).contains("not <domain>"), "{err}");
        assert_eq!(NoLibvirt.running_domains().unwrap(), vec![]);
    }
}
