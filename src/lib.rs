//! vfiod: a host daemon that manages PCI accelerators for libvirt/QEMU virtual machines.
//!
//! The map, one folder per concept, listed from the bottom of the dependency graph up (a module
//! uses only those above it in this list; `tests/library/architecture.rs` keeps it so). Pure
//! decisions (policy, plans, the task state machine) take no I/O; host, store and dbus are the
//! edges.
//! docs/architecture.md is the longer map: the layers (decide, carry out, record, show) and, for
//! each feature, the file of each layer.

pub mod model; // PciAddress, class codes, the device record, task and event kinds: plain values
pub mod hostuse; // who uses a PCI function (the host, a VM), decided from what the kernel says
pub mod fpga; // FPGA image headers (gbs, xclbin) and image legality: pure code
pub mod config; // settings from vfiod.toml and conf.d drop-ins, validated once at load
pub mod claim; // which device a claim gets: requirements, what is claimable, the choice
pub mod clean; // cleaning a device between tenants, decided: which reset, whether it came back healthy
pub mod store; // SQLite state store (WAL), schema migrations: the single source of truth
pub mod host; // the machine's edges: sysfs (one root, bounded writes), uevents, libvirt
pub mod pool; // pooled accelerators: the pool protocol and client, and a pooled session through a live migration, decided
pub mod sim; // the simulated kernel and a private dbus-daemon, for --simulate and tests
pub mod inventory; // classification and change detection of PCI functions
pub mod mode; // mode policy, plans of sysfs writes, and the executor that runs them
pub mod hook; // libvirt's qemu hook: what each operation answers, decided from the XML
pub mod migration; // live migration with passthrough devices: what moves, what is re-claimed
pub mod metrics; // Prometheus metrics: the registry, gauges from the store, the textfile
pub mod engine; // the engine: inventory passes, reconcile, tasks and the jobs they run
pub mod dbus; // the D-Bus API: one module per object kind, named errors, polkit
pub mod client; // D-Bus client side: proxies, the JSON device view, vfioctl tables
pub mod doctor; // `vfioctl doctor`: can this host pass devices through? checks decided from what is read
#[cfg(feature = "fleet")]
pub mod fleet; // the fleet database on PostgreSQL: reports, the conductor, reservations
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

/// Logging of the daemon's processes (`vfiod`, and `vfiod-libvirt` as `identifier`): under
/// systemd (stderr connected to the journal) natively, so that span and event fields become
/// journal fields (VFIOD_TASK_ID, VFIOD_DEVICE, VFIOD_KIND, ...) and the journal adds the
/// timestamps; else to stderr. Levels from `VFIOD_LOG` ([`log_filter`]), else `default`.
pub fn init_logging(identifier: &str, default: &str) {
    use tracing_subscriber::prelude::*;
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        if let Ok(journald) = tracing_journald::layer() {
            let journald = journald
                .with_field_prefix(Some("VFIOD".into()))
                .with_syslog_identifier(identifier.into());
            tracing_subscriber::registry()
                .with(journald.with_filter(log_filter(
                    std::env::var("VFIOD_LOG").ok().as_deref(),
                    default,
                )))
                .init();
            return;
        }
    }
    log_to_stderr(default);
}

/// Logs to stderr (with colours on a terminal) at the levels of `VFIOD_LOG`, else `default`:
/// the daemon outside systemd and the pooled demo log so.
pub fn log_to_stderr(default: &str) {
    use tracing_subscriber::prelude::*;
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_target(false),
        )
        .with(log_filter(
            std::env::var("VFIOD_LOG").ok().as_deref(),
            default,
        ))
        .init();
}

/// The log filter of `VFIOD_LOG` (`value`): a level ("debug") or levels per target
/// ("vfiod=debug,zbus=warn"), as tracing's `Targets` reads them; `default` when unset. A value
/// that does not parse is said once on stderr, and `default` applies.
pub fn log_filter(value: Option<&str>, default: &str) -> tracing_subscriber::filter::Targets {
    let fallback = || default.parse().unwrap_or_default();
    match value {
        None => fallback(),
        Some(v) => v.parse().unwrap_or_else(|e| {
            eprintln!("vfiod: VFIOD_LOG={v:?} is not a log filter ({e}); logging at {default}");
            fallback()
        }),
    }
}
