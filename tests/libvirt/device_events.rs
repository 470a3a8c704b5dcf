//! libvirt's device events (added, removed) through the libvirt worker, against a real libvirtd serving
//! QEMU's session driver (tests/common/libvirtd.rs) with a TCG domain that has no OS.
//!
//! What such a domain can lose, measured with `virsh detach-device --live` and
//! `virsh event --all --loop`: devices whose unplug needs no guest (a USB tablet on a
//! `qemu-xhci` controller, a virtio-serial `<channel>`, a USB serial port) are removed at once
//! and libvirt sends DEVICE_REMOVED with their alias; a PCI device on a `pcie-root-port` (the
//! case of a `<hostdev>`) waits for the guest, so here it is never removed and no event comes,
//! while the detach call still returns success after libvirt's own 5 s wait.
//! DEVICE_REMOVAL_FAILED needs a guest that refuses the unplug: it is registered (see the unit
//! test in `src/host/libvirt/event.rs`) but not produced here.
//!
//! Needs `qemu-system-x86` besides the packages of README's test command.

use crate::common;

use crate::common::libvirtd::{eventually, require_qemu, tcg_domain_xml, Libvirtd};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use vfiod::host::libvirt::{
    Affect, Definition, DomainEvent, DomainEventKind, Libvirt, LibvirtError, LibvirtEvent,
};

/// The first start of a QEMU domain under a new daemon probes QEMU's capabilities: on this
/// 2-core machine under load that takes a while, so the calls get a generous bound.
const CALL_BOUND: Duration = Duration::from_secs(60);
/// Only ends a hung test (libvirtd and a TCG guest on a loaded machine are slow, never hung).
const SOON: Duration = Duration::from_secs(60);

/// A USB tablet and a virtio-serial channel: neither needs the guest to let go. The channel has
/// a null backend because libvirt finds a channel to detach by its source, and a pty's is only
/// known once attached. User aliases (`ua-` prefix) so the event names the device asked for.
const TABLET: &str = "<input type='tablet' bus='usb'><alias name='ua-tablet'/></input>";
const CHANNEL: &str = "<channel type='null'>
  <target type='virtio' name='org.vfiod.test.0'/>
  <alias name='ua-channel'/>
</channel>";
/// A PCI device on the spare root port: its unplug waits for the guest.
const RNG: &str = "<rng model='virtio'>
  <backend model='random'>/dev/urandom</backend>
  <alias name='ua-rng'/>
</rng>";

/// The next domain event of `name` that `matches`, skipping others, within `within`.
fn domain_event(
    rx: &mut UnboundedReceiver<LibvirtEvent>,
    within: Duration,
    name: &str,
    matches: impl Fn(&DomainEventKind) -> bool,
    what: &str,
) -> DomainEvent {
    eventually(within, what, || {
        while let Ok(e) = rx.try_recv() {
            if let LibvirtEvent::Domain(d) = e {
                if d.name == name && matches(&d.kind) {
                    return Some(d);
                }
            }
        }
        None
    })
}

fn is_removed(alias: &str) -> impl Fn(&DomainEventKind) -> bool + '_ {
    move |k| matches!(k, DomainEventKind::DeviceRemoved { alias: a } if a == alias)
}

#[test]
fn a_live_detach_without_a_guest_sends_device_removed_with_the_alias() {
    require_qemu();
    let d = Libvirtd::start();
    let daemon_root = common::fast_tempdir();
    let root = running_daemon_root(daemon_root.path(), d.pid());
    let uri = d.qemu_uri();
    let (tx, mut rx) = unbounded_channel();
    let libvirt = Libvirt::start(Some(uri.clone()), root, Some(tx))
        .unwrap()
        .with_timeout(CALL_BOUND);
    let connected = eventually(SOON, "connected", || match rx.try_recv() {
        Ok(LibvirtEvent::Connected { uri }) => Some(uri),
        _ => None,
    });
    assert_eq!(connected, uri);

    let file = d.dir.path().join("vm1.xml");
    std::fs::write(&file, tcg_domain_xml("vm1")).unwrap();
    d.virsh_at(&uri, &["define", file.to_str().unwrap()]);
    d.virsh_at(&uri, &["start", "vm1"]);
    let started = domain_event(
        &mut rx,
        SOON,
        "vm1",
        |k| *k == DomainEventKind::Started,
        "Started event for vm1",
    );
    assert_eq!(started.uuid.len(), 36, "{started:?}");

    for (xml, alias) in [(TABLET, "ua-tablet"), (CHANNEL, "ua-channel")] {
        libvirt.attach_device("vm1", xml, Affect::Live).unwrap();
        // The hot-plug is reported too (vfiod checks what was plugged in by hand).
        domain_event(
            &mut rx,
            SOON,
            "vm1",
            |k| matches!(k, DomainEventKind::DeviceAdded { alias: a } if a == alias),
            &format!("DeviceAdded {alias} for vm1"),
        );
        let live = libvirt.domain_xml("vm1", Definition::Live).unwrap();
        assert!(live.contains(&format!("<alias name='{alias}'/>")), "{live}");
        // Only what the detach causes counts: nothing said removed before it.
        let before: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert!(
            !before
                .iter()
                .any(|e| matches!(e, LibvirtEvent::Domain(d) if is_removed(alias)(&d.kind))),
            "removed before the detach: {before:?}"
        );

        libvirt.detach_device("vm1", xml, Affect::Live).unwrap();
        let removed = domain_event(
            &mut rx,
            SOON,
            "vm1",
            is_removed(alias),
            &format!("DeviceRemoved {alias} for vm1"),
        );
        assert_eq!(
            removed,
            DomainEvent {
                name: "vm1".into(),
                uuid: started.uuid.clone(),
                kind: DomainEventKind::DeviceRemoved {
                    alias: alias.into()
                },
                detail: 0,
            }
        );
        let live = libvirt.domain_xml("vm1", Definition::Live).unwrap();
        assert!(!live.contains(&format!("'{alias}'")), "{live}");
    }

    // A device that is not there: libvirt refuses, and no event.
    let err = libvirt
        .detach_device("vm1", TABLET, Affect::Live)
        .unwrap_err();
    assert!(matches!(err, LibvirtError::Domain { .. }), "{err:?}");

    // A PCI device: the detach call returns success after libvirt's own wait, but without a
    // guest to acknowledge the unplug the device stays and no event comes. (The engine's
    // detach timeout rests on this.)
    libvirt.attach_device("vm1", RNG, Affect::Live).unwrap();
    let t = Instant::now();
    libvirt.detach_device("vm1", RNG, Affect::Live).unwrap();
    let waited = t.elapsed();
    // No pause to see that nothing comes: a later unplug (the tablet's, which libvirt reports
    // at once) and its event prove libvirt and the worker have passed the RNG's detach; every
    // event before it is looked at.
    libvirt.attach_device("vm1", TABLET, Affect::Live).unwrap();
    libvirt.detach_device("vm1", TABLET, Affect::Live).unwrap();
    let mut seen = Vec::new();
    eventually(SOON, "DeviceRemoved ua-tablet for vm1, again", || {
        while let Ok(e) = rx.try_recv() {
            let last = matches!(&e, LibvirtEvent::Domain(d) if is_removed("ua-tablet")(&d.kind));
            seen.push(e);
            if last {
                return Some(());
            }
        }
        None
    });
    let rng_events: Vec<_> = seen
        .iter()
        .filter(|e| {
            !matches!(e, LibvirtEvent::Domain(DomainEvent {
                kind: DomainEventKind::DeviceAdded { alias } | DomainEventKind::DeviceRemoved { alias },
                ..
            }) if alias == "ua-tablet")
        })
        .collect();
    assert!(
        !rng_events.iter().any(|e| matches!(
            e,
            LibvirtEvent::Domain(DomainEvent {
                kind: DomainEventKind::DeviceRemoved { .. }
                    | DomainEventKind::DeviceRemovalFailed { .. },
                ..
            })
        )),
        "a device event for an unplug no guest acknowledged (detach took {waited:?}): {seen:?}"
    );
    let live = libvirt.domain_xml("vm1", Definition::Live).unwrap();
    assert!(live.contains("<alias name='ua-rng'/>"), "{live}");

    d.virsh_at(&uri, &["destroy", "vm1"]);
    domain_event(
        &mut rx,
        SOON,
        "vm1",
        |k| *k == DomainEventKind::Stopped,
        "Stopped event for vm1",
    );
    libvirt.stop();
}

/// A sysfs root where the boot rule finds a running libvirtd (pid file and a live process):
/// a `qemu+unix://` URI counts as local QEMU, and the worker would not connect otherwise.
fn running_daemon_root(dir: &Path, pid: u32) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::create_dir_all(dir.join("proc").join(pid.to_string())).unwrap();
    std::fs::write(dir.join("run/libvirtd.pid"), pid.to_string()).unwrap();
    dir.to_path_buf()
}
