//! The libvirt worker, the engine and claims against a real libvirtd (Debian's, a child of the
//! test with its own sockets: `common::libvirtd`), serving libvirt's test driver or QEMU's
//! session driver with a TCG domain (those need `qemu-system-x86`). One binary because they
//! need libvirtd.

#[path = "../common/mod.rs"]
mod common;

mod claims_attach;
mod claims_domain_events;
mod device_events;
mod engine;
mod worker;
