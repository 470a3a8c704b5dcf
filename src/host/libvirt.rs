//! libvirt, as far as vfiod needs it so far: which running domains have which host PCI functions
//! assigned, so that no task takes a device away from a running VM and a refusal names the VM.
//! (Attaching claimed devices to domains comes with the claims work, here too.)
//!
//! The domain XML is parsed by a pure function ([`assigned_functions`]); the connection is the
//! `virt` crate's, read-only, opened for each question and closed after it.

use crate::model::pci::PciAddress;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum LibvirtError {
    #[error("cannot connect to libvirt at {uri}: {message}")]
    Connect { uri: String, message: String },
    #[error("libvirt at {uri} cannot list its running domains: {message}")]
    Query { uri: String, message: String },
    #[error("domain {domain}: {message}")]
    DomainXml { domain: String, message: String },
    #[error("libvirt at {uri} did not answer within {timeout:?}")]
    Timeout {
        uri: String,
        timeout: std::time::Duration,
    },
}

/// How long a question to libvirt may take. A hung libvirtd must not hang the D-Bus call that
/// asked (its caller gives up after 25 s) or the task.
pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Which running domains have which host PCI functions: what the engine's guards ask before
/// they take a function down. Asked of libvirt normally; answered from the domain XML a libvirt
/// hook was given (libvirt must never be called back from inside a hook: it would deadlock).
pub trait DomainQuery: Send + Sync {
    /// Running domains and the host PCI functions assigned to them.
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError>;
}

/// libvirt is not asked (`libvirt_uri = ""`): no domain is known to use anything.
pub struct NoLibvirt;

impl DomainQuery for NoLibvirt {
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        Ok(Vec::new())
    }
}

/// Asks the libvirt at `uri` (see [`running_domains`]).
pub struct UriQuery {
    pub uri: String,
    pub root: std::path::PathBuf,
}

impl DomainQuery for UriQuery {
    fn running_domains(&self) -> Result<Vec<DomainDevices>, LibvirtError> {
        running_domains(&self.uri, &self.root)
    }
}

/// A running domain and the host PCI functions assigned to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainDevices {
    pub domain: String,
    pub functions: Vec<PciAddress>,
}

/// The host PCI functions a domain definition assigns: `<hostdev mode='subsystem' type='pci'>`
/// and `<interface type='hostdev'>` (an SR-IOV VF given as a NIC), by their `<source><address>`.
/// Pure. Assignments by other means (a network of `forward mode='hostdev'` pools) show up in the
/// XML of a running domain as one of these two.
pub fn assigned_functions(xml: &str) -> Result<Vec<PciAddress>, String> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("invalid XML: {e}"))?;
    let root = doc.root_element();
    if !root.has_tag_name("domain") {
        return Err(format!(
            "the root element is <{}>, not <domain>",
            root.tag_name().name()
        ));
    }
    let mut out = Vec::new();
    let Some(devices) = root.children().find(|n| n.has_tag_name("devices")) else {
        return Ok(out);
    };
    for dev in devices.children().filter(|n| n.is_element()) {
        let pci = match dev.tag_name().name() {
            "hostdev" => {
                dev.attribute("mode").unwrap_or("subsystem") == "subsystem"
                    && dev.attribute("type") == Some("pci")
            }
            "interface" => dev.attribute("type") == Some("hostdev"),
            _ => false,
        };
        if !pci {
            continue;
        }
        let address = dev
            .children()
            .find(|n| n.has_tag_name("source"))
            .and_then(|s| s.children().find(|n| n.has_tag_name("address")));
        let Some(address) = address else {
            // A hostdev whose source is not given by address (e.g. not yet resolved): nothing
            // this function can name.
            continue;
        };
        if address.attribute("type").is_some_and(|t| t != "pci") {
            continue;
        }
        out.push(source_address(address)?);
    }
    Ok(out)
}

/// `<address domain='0x0000' bus='0x3b' slot='0x02' function='0x0'/>`: values are hex with
/// `0x`, or decimal, as libvirt accepts them.
fn source_address(node: roxmltree::Node<'_, '_>) -> Result<PciAddress, String> {
    let field = |name: &str, max: u32| -> Result<u32, String> {
        let text = node.attribute(name).unwrap_or("0");
        let value = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => text.parse(),
        }
        .map_err(|_| format!("hostdev source address {name}={text:?} is not a number"))?;
        if value > max {
            return Err(format!(
                "hostdev source address {name}={text:?} is out of range"
            ));
        }
        Ok(value)
    };
    let text = format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        field("domain", 0xffff)?,
        field("bus", 0xff)?,
        field("slot", 0x1f)?,
        field("function", 0x7)?
    );
    text.parse()
        .map_err(|e| format!("hostdev source address {text}: {e}"))
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
    ["run/libvirtd.pid", "run/virtqemud.pid"].iter().any(|f| {
        std::fs::read_to_string(root.join(f))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
            .is_some_and(|pid| root.join("proc").join(pid.to_string()).exists())
    })
}

/// The running domains that have host PCI functions assigned, as `uri` reports them. With a local
/// QEMU URI and no libvirt daemon running there is no domain to report (and nothing is started):
/// a QEMU that outlived its daemon still holds its VFIO group open, which vfiod checks apart.
/// Bounded by [`ANSWER_TIMEOUT`]: the question runs on its own thread, which is left behind if
/// libvirt does not answer.
pub fn running_domains(uri: &str, root: &Path) -> Result<Vec<DomainDevices>, LibvirtError> {
    running_domains_within(uri, root, ANSWER_TIMEOUT)
}

fn running_domains_within(
    uri: &str,
    root: &Path,
    timeout: std::time::Duration,
) -> Result<Vec<DomainDevices>, LibvirtError> {
    if needs_running_daemon(uri) && !local_daemon_running(root) {
        tracing::debug!("no libvirt daemon runs: no domain to ask about");
        return Ok(Vec::new());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = uri.to_string();
    std::thread::Builder::new()
        .name("libvirt-query".into())
        .spawn(move || {
            let _ = tx.send(ask(&owned));
        })
        .map_err(|e| LibvirtError::Connect {
            uri: uri.to_string(),
            message: format!("cannot start a thread: {e}"),
        })?;
    match rx.recv_timeout(timeout) {
        Ok(answer) => answer,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(LibvirtError::Timeout {
            uri: uri.to_string(),
            timeout,
        }),
        // The virt crate panics when closing a connection fails.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(LibvirtError::Query {
            uri: uri.to_string(),
            message: "the libvirt client failed while asking (see the daemon's log)".into(),
        }),
    }
}

fn ask(uri: &str) -> Result<Vec<DomainDevices>, LibvirtError> {
    quiet_libvirt();
    let conn =
        virt::connect::Connect::open_read_only(Some(uri)).map_err(|e| LibvirtError::Connect {
            uri: uri.to_string(),
            message: e.message().to_string(),
        })?;
    let query = |e: virt::error::Error| LibvirtError::Query {
        uri: uri.to_string(),
        message: e.message().to_string(),
    };
    let domains = conn
        .list_all_domains(virt::sys::VIR_CONNECT_LIST_DOMAINS_ACTIVE)
        .map_err(query)?;
    let mut out = Vec::new();
    for dom in domains {
        let name = dom.name().map_err(query)?;
        let xml = match dom.xml_desc(0) {
            Ok(x) => x,
            // The domain stopped between the listing and now: it uses nothing any more.
            Err(e)
                if matches!(
                    e.code(),
                    virt::enumutil::Enum::Known(virt::error::ErrorNumber::NoDomain)
                ) =>
            {
                continue
            }
            Err(e) => return Err(query(e)),
        };
        let functions = assigned_functions(&xml).map_err(|message| LibvirtError::DomainXml {
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

/// libvirt prints every error to stderr by default; vfiod reports them itself.
fn quiet_libvirt() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(virt::error::clear_error_callback);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn hostdevs_and_hostdev_interfaces_are_found() {
        let xml = r#"<domain type='kvm' id='3'>
          <name>web1</name>
          <devices>
            <disk type='file' device='disk'><source file='/x.qcow2'/></disk>
            <hostdev mode='subsystem' type='pci' managed='yes'>
              <driver name='vfio'/>
              <source><address domain='0x0000' bus='0x3b' slot='0x02' function='0x1'/></source>
              <address type='pci' domain='0x0000' bus='0x05' slot='0x00' function='0x0'/>
            </hostdev>
            <interface type='hostdev' managed='yes'>
              <source><address type='pci' domain='0x0000' bus='0xaf' slot='0x00' function='0x2'/></source>
            </interface>
            <interface type='network'><source network='default'/></interface>
            <hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/></source></hostdev>
            <hostdev mode='subsystem' type='pci'>
              <source><address domain='0' bus='23' slot='0' function='0'/></source>
            </hostdev>
          </devices>
        </domain>"#;
        assert_eq!(
            assigned_functions(xml).unwrap(),
            vec![a("0000:3b:02.1"), a("0000:af:00.2"), a("0000:17:00.0")]
        );
    }

    #[test]
    fn a_domain_without_devices_assigns_nothing() {
        assert_eq!(
            assigned_functions("<domain><name>x</name></domain>").unwrap(),
            vec![]
        );
    }

    #[test]
    fn bad_xml_is_an_error_that_says_why() {
        for (xml, expect) in [
            ("<domain>", "invalid XML"),
            ("<network/>", "not <domain>"),
            (
                "<domain><devices><hostdev type='pci'><source><address bus='0x1ff'/></source></hostdev></devices></domain>",
                "bus=\"0x1ff\" is out of range",
            ),
            (
                "<domain><devices><hostdev type='pci'><source><address slot='x'/></source></hostdev></devices></domain>",
                "slot=\"x\" is not a number",
            ),
        ] {
            let err = assigned_functions(xml).unwrap_err();
            assert!(err.contains(expect), "{xml}: {err}");
        }
    }

    #[test]
    fn only_local_qemu_uris_wait_for_a_running_daemon() {
        assert!(needs_running_daemon("qemu:///system"));
        assert!(needs_running_daemon("qemu+unix:///system?socket=/x"));
        assert!(!needs_running_daemon("qemu+ssh://host/system"));
        assert!(!needs_running_daemon("test:///default"));
    }

    /// A libvirtd that accepts the connection and never answers: the question gives up.
    #[test]
    fn a_libvirt_that_does_not_answer_times_out() {
        let root = tempfile::tempdir().unwrap();
        let pid = std::process::id().to_string();
        std::fs::create_dir_all(root.path().join("run")).unwrap();
        std::fs::create_dir_all(root.path().join("proc").join(&pid)).unwrap();
        std::fs::write(root.path().join("run/libvirtd.pid"), &pid).unwrap();
        let sock = root.path().join("libvirt-sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let _held = std::thread::spawn(move || {
            let conn = listener.accept();
            std::thread::sleep(std::time::Duration::from_secs(30));
            drop(conn);
        });
        let uri = format!("qemu+unix:///system?socket={}", sock.display());
        let t = std::time::Instant::now();
        let r = running_domains_within(&uri, root.path(), std::time::Duration::from_millis(300));
        assert!(matches!(r, Err(LibvirtError::Timeout { .. })), "{r:?}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
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
}
