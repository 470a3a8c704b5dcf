//! vfiod: a host daemon that manages PCI accelerators for libvirt/QEMU virtual machines.
//!
//! The map, one module per concept. Pure decisions (policy, plan, the task state machine in
//! store::task_state) take no I/O; sysfs, store, libvirt and dbus are the edges.

// The host and what vfiod knows of it.
pub mod config; // typed settings from conf/vfiod.toml and conf.d drop-ins, validated once at load
pub mod device; // the device record: one PCI function as vfiod knows it
pub mod inventory; // classification and change detection of PCI functions
pub mod pci; // PciAddress and class codes
pub mod simkernel; // the simulated kernel: a sysfs tree that reacts to writes like Linux
pub mod store; // SQLite state store (WAL), schema migrations: the single source of truth
pub mod sysfs; // every sysfs read and write, all paths under one root, writes bounded in time
pub mod uevent; // kernel hot-plug events (netlink or simulated), one channel type

// Modes and tasks.
pub mod convert; // runs plans against sysfs: read-back verification, progress, rollback
pub mod modes; // a device's decision, program and plan from store, settings and live sysfs
pub mod plan; // plans: the exact ordered sysfs writes of a program, printable before they run
pub mod policy; // mode policy and conversion programs: pure decisions
pub mod tasks; // the task engine: one task per device and scope, durable state, guards

// The outside world.
pub mod libvirt; // which running domains have which host PCI functions assigned

// The daemon and its clients.
pub mod client; // D-Bus client side: proxies, the JSON device view, vfioctl tables
pub mod daemon; // the engine and the loop that keeps the store in step with the kernel
pub mod dbus; // the D-Bus API: objects, named errors, polkit
pub mod private_bus; // a private dbus-daemon, for --simulate and tests
pub mod server; // assembles store, engine, D-Bus service and loop into a running daemon

/// An error and all its causes on one line ("a: b: c"), for logs and D-Bus error messages.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
