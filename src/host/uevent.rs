//! Kernel uevents: the hot-plug feed the inventory follows.
//!
//! Both the real kernel (a `NETLINK_KOBJECT_UEVENT` socket) and the simulated kernel deliver
//! events into the same channel type, so the inventory cannot tell them apart.

use std::collections::BTreeMap;
use tokio::sync::mpsc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Add,
    Remove,
    Change,
    Move,
    Online,
    Offline,
    Bind,
    Unbind,
}

impl Action {
    pub fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "add" => Action::Add,
            "remove" => Action::Remove,
            "change" => Action::Change,
            "move" => Action::Move,
            "online" => Action::Online,
            "offline" => Action::Offline,
            "bind" => Action::Bind,
            "unbind" => Action::Unbind,
            _ => return None,
        })
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Add => "add",
            Action::Remove => "remove",
            Action::Change => "change",
            Action::Move => "move",
            Action::Online => "online",
            Action::Offline => "offline",
            Action::Bind => "bind",
            Action::Unbind => "unbind",
        }
    }
}

/// One kernel event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uevent {
    pub action: Action,
    /// Path under /sys, e.g. `/devices/pci0000:00/0000:00:01.0/0000:01:00.0`.
    pub devpath: String,
    /// All `KEY=VALUE` pairs (SUBSYSTEM, PCI_SLOT_NAME, DRIVER, ERROR_EVENT, ...).
    pub vars: BTreeMap<String, String>,
}

impl Uevent {
    pub fn subsystem(&self) -> Option<&str> {
        self.vars.get("SUBSYSTEM").map(String::as_str)
    }

    /// The PCI function this event is about, for PCI events.
    pub fn pci_address(&self) -> Option<crate::model::pci::PciAddress> {
        if self.subsystem() != Some("pci") {
            return None;
        }
        self.vars
            .get("PCI_SLOT_NAME")
            .and_then(|s| s.parse().ok())
            .or_else(|| self.devpath.rsplit('/').next()?.parse().ok())
    }

    /// AER recovery reports (`ERROR_EVENT=BEGIN_RECOVERY`, `SUCCESSFUL_RECOVERY`,
    /// `FAILED_RECOVERY`) and whether the device is back online.
    pub fn aer_event(&self) -> Option<(&str, Option<bool>)> {
        let ev = self.vars.get("ERROR_EVENT")?;
        let online = self.vars.get("DEVICE_ONLINE").map(|v| v == "1");
        Some((ev.as_str(), online))
    }

    /// Parses a kernel netlink message: `ACTION@DEVPATH\0KEY=VALUE\0...`. Messages from udevd
    /// (which start with `libudev\0`) are not kernel events and are ignored.
    pub fn parse(buf: &[u8]) -> Option<Uevent> {
        let mut parts = buf.split(|&b| b == 0).filter(|p| !p.is_empty());
        let header = std::str::from_utf8(parts.next()?).ok()?;
        let (action, devpath) = header.split_once('@')?;
        let action = Action::parse(action)?;
        let mut vars = BTreeMap::new();
        for p in parts {
            let Ok(s) = std::str::from_utf8(p) else {
                continue;
            };
            if let Some((k, v)) = s.split_once('=') {
                vars.insert(k.to_string(), v.to_string());
            }
        }
        Some(Uevent {
            action,
            devpath: devpath.to_string(),
            vars,
        })
    }

    /// The wire form, as the kernel sends it (used by the simulation and tests).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("{}@{}", self.action.as_str(), self.devpath).into_bytes();
        out.push(0);
        for (k, v) in &self.vars {
            out.extend_from_slice(format!("{k}={v}").as_bytes());
            out.push(0);
        }
        out
    }
}

pub type EventReceiver = mpsc::UnboundedReceiver<Uevent>;

/// Opens the kernel's uevent netlink socket and forwards PCI events from a reader thread.
/// Reading needs no privilege beyond the socket; nothing is ever written to the kernel here.
pub fn netlink_source() -> std::io::Result<EventReceiver> {
    use nix::sys::socket::{
        bind, recv, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
    };
    use std::os::fd::AsRawFd;

    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkKObjectUEvent,
    )?;
    // Group 1: kernel events (udevd re-broadcasts on group 2, which we don't want).
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 1))?;
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("uevent".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                    Ok(n) => {
                        if let Some(ev) = Uevent::parse(&buf[..n]) {
                            if ev.subsystem() == Some("pci") && tx.send(ev).is_err() {
                                return;
                            }
                        }
                    }
                    // ENOBUFS: the kernel dropped events; the periodic poll catches up.
                    Err(nix::errno::Errno::ENOBUFS) | Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        tracing::error!(error = %e, "uevent socket failed; relying on polling");
                        return;
                    }
                }
            }
        })?;
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_messages() {
        let raw = b"change@/devices/pci0000:00/0000:00:01.0/0000:01:00.0\0ACTION=change\0\
DEVPATH=/devices/pci0000:00/0000:00:01.0/0000:01:00.0\0SUBSYSTEM=pci\0ERROR_EVENT=SUCCESSFUL_RECOVERY\0\
DEVICE_ONLINE=1\0PCI_SLOT_NAME=0000:01:00.0\0SEQNUM=42\0";
        let ev = Uevent::parse(raw).unwrap();
        assert_eq!(ev.action, Action::Change);
        assert_eq!(ev.pci_address().unwrap().to_string(), "0000:01:00.0");
        assert_eq!(ev.aer_event(), Some(("SUCCESSFUL_RECOVERY", Some(true))));
        assert_eq!(Uevent::parse(&ev.to_bytes()).unwrap(), ev);
    }

    #[test]
    fn ignores_udev_and_garbage() {
        assert!(Uevent::parse(b"libudev\0\xfe\xed").is_none());
        assert!(Uevent::parse(b"").is_none());
        assert!(Uevent::parse(b"explode@/devices/x\0").is_none());
    }
}
