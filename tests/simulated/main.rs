//! vfiod on the simulated host over a real private dbus-daemon, started in-process
//! (`common::Harness`) or as the real binaries (`vfiod --simulate`, `vfioctl`, the qemu hook):
//! the D-Bus API, claims, tasks and jobs, FPGA images, hooks, metrics, signals, a recorded host
//! replayed. One binary because they all need the same thing, a dbus-daemon and a simulated
//! host, and nothing more (libvirt only through its in-process test driver, the `vfiod-pool`
//! binary only for a pooled claim's object and its version; one hook test needs root).

#[path = "../common/mod.rs"]
mod common;

mod claims;
mod clean;
mod dbus_api;
mod dbus_interfaces;
mod doctor;
mod fpga;
mod history;
mod holder_index;
mod hooks;
mod images;
mod images_url;
mod introspection;
mod job_guards;
mod jobs;
mod late_driver;
mod metrics;
mod passthrough;
mod replay;
mod sigterm;
mod simulate;
mod stale_plan;
mod state_lock;
mod stress;
mod strict;
mod tasks;
mod vf_gap;
mod vfioctl;
