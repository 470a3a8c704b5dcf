//! `vfioctl status`: what an operator checks first, and what a script alerts on: the daemon,
//! its device counts, the libvirt connection, the tasks that hold a device in error, the claims
//! by state, the fleet report's age and whether each pool answered its last call. Read from the
//! daemon's properties and lists, and rendered by a pure function, tested below.

use super::{ClientError, DeviceView};
use crate::dbus::wire::Entry;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use zbus::Connection;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    pub version: String,
    pub scenario: String,
    pub simulated: bool,
    pub devices: u32,
    pub usable: u32,
    pub protected: u32,
    pub broken: u32,
    /// Being cleaned after a claim ended.
    pub cleaning: u32,
    pub config_sources: Vec<String>,
    /// Null when vfiod is configured without libvirt (`libvirt_uri = ""`, `--simulate`).
    pub libvirt: Option<LibvirtView>,
    /// Devices held by a task in error (not usable until `vfioctl task reset`), by address.
    pub tasks_in_error: Vec<TaskInError>,
    /// Active claims per state (claimed, attaching, attached, detaching, ...).
    pub claims: BTreeMap<String, u32>,
    /// Null when `[fleet]` is off.
    pub fleet: Option<FleetView>,
    /// The configured pools, with how their last call went.
    pub pools: Vec<PoolView>,
    /// Unix milliseconds: when this was read (the ages shown count to it).
    pub read_ms: i64,
    /// Why nothing can be passed through on this host (it has no IOMMU), with how to turn it
    /// on; absent when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_iommu: Option<String>,
    /// `vfioctl doctor`'s checks in one line, as the daemon ran them at start-up or its last
    /// reload; "" from a daemon that does not say.
    #[serde(default)]
    pub doctor: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetView {
    pub report_interval_s: u32,
    /// Unix milliseconds of the last report the fleet database took; 0 when none since vfiod
    /// started.
    pub last_report_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolView {
    pub name: String,
    /// Unix milliseconds of its last call since vfiod started; 0 when none.
    pub last_call_ms: i64,
    /// Why the last call could not reach it; "" when it answered (a refusal is an answer).
    pub last_call_error: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibvirtView {
    pub uri: String,
    /// connected, connecting or disconnected.
    pub state: String,
    /// Unix milliseconds: since when it has been in that state; 0 when not known.
    pub since_ms: i64,
    /// Why it is disconnected; "" otherwise.
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInError {
    pub address: String,
    /// The failed task's object path, if the daemon still shows it.
    pub task: Option<String>,
    /// What it said, as `vfioctl show` prints it.
    pub result: String,
}

/// Everything `vfioctl status` shows, read now.
pub async fn read(conn: &Connection) -> Result<StatusView, ClientError> {
    let m = super::manager(conn).await?;
    let link = m.libvirt().await?;
    let text = |k: &str| {
        link.get(k)
            .and_then(|v| String::try_from(v.try_clone().ok()?).ok())
            .unwrap_or_default()
    };
    let libvirt = (!link.is_empty()).then(|| LibvirtView {
        uri: text("uri"),
        state: text("state"),
        since_ms: link
            .get("since_ms")
            .and_then(|v| i64::try_from(v.try_clone().ok()?).ok())
            .unwrap_or(0),
        reason: text("reason"),
    });
    let devices = super::list_devices(conn).await?;
    let mut claims = BTreeMap::new();
    for c in super::claim::list_claims(conn).await? {
        *claims.entry(c.state).or_insert(0) += 1;
    }
    let pools = super::pool::pools(conn)
        .await?
        .list(super::Dict::new())
        .await?
        .iter()
        .map(|p| {
            let e = Entry(p);
            PoolView {
                name: e.str("name"),
                last_call_ms: e.u64("last_call_ms") as i64,
                last_call_error: e.str("last_call_error"),
            }
        })
        .collect();
    let fleet = m.fleet().await?;
    let fleet = (!fleet.is_empty()).then(|| {
        let e = Entry(&fleet);
        FleetView {
            report_interval_s: e.u32("report_interval_s"),
            last_report_ms: e.u64("last_report_ms") as i64,
        }
    });
    Ok(StatusView {
        version: m.version().await?,
        scenario: m.scenario().await?,
        simulated: m.simulated().await?,
        devices: m.device_count().await?,
        usable: m.usable_count().await?,
        protected: m.protected_count().await?,
        broken: m.broken_count().await?,
        cleaning: m.cleaning_count().await?,
        config_sources: m.config_sources().await?,
        libvirt,
        tasks_in_error: tasks_in_error(&devices),
        claims,
        fleet,
        pools,
        read_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
        no_iommu: (m.iommu().await? == crate::model::iommu::Iommu::Absent.as_str())
            .then(|| crate::model::iommu::NoIommu.to_string()),
        // An older daemon has no such property: say nothing rather than fail.
        doctor: m.doctor().await.unwrap_or_default(),
    })
}

/// An age as `vfioctl status` says it: "12 s ago", "5 min ago", "3 h ago".
fn ago(then_ms: i64, now_ms: i64) -> String {
    let secs = (now_ms - then_ms).max(0) / 1000;
    match secs {
        0..=119 => format!("{secs} s ago"),
        120..=7199 => format!("{} min ago", secs / 60),
        _ => format!("{} h ago", secs / 3600),
    }
}

/// The devices whose own task (or one that covers them) is in error.
pub fn tasks_in_error(devices: &[DeviceView]) -> Vec<TaskInError> {
    devices
        .iter()
        .filter(|d| d.task_state == "error")
        .map(|d| TaskInError {
            address: d.address.clone(),
            task: d.current_task.clone(),
            result: d.last_result.clone(),
        })
        .collect()
}

/// The text `vfioctl status` prints; `time` formats Unix milliseconds.
pub fn render(s: &StatusView, time: impl Fn(i64) -> String) -> String {
    let mut out = String::new();
    if s.simulated {
        out.push_str("SIMULATION: this vfiod runs on a simulated host\n");
    }
    out.push_str(&format!("vfiod {}  scenario {}\n", s.version, s.scenario));
    if let Some(why) = &s.no_iommu {
        out.push_str(&format!("{why}\n"));
    }
    if !s.doctor.is_empty() {
        out.push_str(&format!("{}\n", s.doctor));
    }
    out.push_str(&format!(
        "devices: {} ({} usable, {} protected, {} broken{})\n",
        s.devices,
        s.usable,
        s.protected,
        s.broken,
        if s.cleaning > 0 {
            format!(", {} cleaning", s.cleaning)
        } else {
            String::new()
        }
    ));
    match &s.libvirt {
        None => out.push_str("libvirt: off in this configuration\n"),
        Some(l) => {
            out.push_str(&format!("libvirt: {} {}", l.uri, l.state));
            // 0: not known (connecting to a URI since start-up or a reload).
            if l.since_ms > 0 {
                out.push_str(&format!(" since {}", time(l.since_ms)));
            }
            if !l.reason.is_empty() {
                out.push_str(&format!(": {}", l.reason));
            }
            out.push('\n');
        }
    }
    if s.claims.is_empty() {
        out.push_str("claims: none\n");
    } else {
        let by_state: Vec<String> = s.claims.iter().map(|(k, n)| format!("{n} {k}")).collect();
        out.push_str(&format!("claims: {}\n", by_state.join(", ")));
    }
    if s.tasks_in_error.is_empty() {
        out.push_str("tasks in error: none\n");
    } else {
        out.push_str(&format!(
            "tasks in error: {} (vfioctl task reset ADDRESS once handled)\n",
            s.tasks_in_error.len()
        ));
        for t in &s.tasks_in_error {
            let first = t.result.lines().next().unwrap_or("");
            out.push_str(&format!("  {}  {}\n", t.address, first));
        }
    }
    match &s.fleet {
        None => {}
        Some(f) if f.last_report_ms == 0 => out.push_str(&format!(
            "fleet: no report since vfiod started (every {} s)\n",
            f.report_interval_s
        )),
        Some(f) => {
            out.push_str(&format!(
                "fleet: last report {}",
                ago(f.last_report_ms, s.read_ms)
            ));
            // Two intervals without one: the database or the network is failing it.
            if s.read_ms - f.last_report_ms > 2_000 * i64::from(f.report_interval_s) {
                out.push_str(&format!(
                    ", late (every {} s): see journalctl -u vfiod",
                    f.report_interval_s
                ));
            }
            out.push('\n');
        }
    }
    for p in &s.pools {
        out.push_str(&format!("pool {}: ", p.name));
        if p.last_call_ms == 0 {
            out.push_str("no call since vfiod started\n");
        } else if p.last_call_error.is_empty() {
            out.push_str(&format!(
                "reachable (answered {})\n",
                ago(p.last_call_ms, s.read_ms)
            ));
        } else {
            out.push_str(&format!(
                "unreachable ({}): {}\n",
                ago(p.last_call_ms, s.read_ms),
                p.last_call_error
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> StatusView {
        StatusView {
            version: "0.1.0".into(),
            scenario: "private".into(),
            simulated: false,
            devices: 9,
            usable: 6,
            protected: 2,
            broken: 1,
            cleaning: 0,
            config_sources: vec![],
            libvirt: None,
            tasks_in_error: vec![],
            claims: BTreeMap::new(),
            fleet: None,
            pools: vec![],
            read_ms: 1_000_000,
            no_iommu: None,
            doctor: String::new(),
        }
    }

    #[test]
    fn each_part_is_rendered_as_it_stands() {
        let t = |ms: i64| format!("t{ms}");
        let quiet = base();
        assert_eq!(
            render(&quiet, t),
            "vfiod 0.1.0  scenario private\n\
             devices: 9 (6 usable, 2 protected, 1 broken)\n\
             libvirt: off in this configuration\n\
             claims: none\n\
             tasks in error: none\n"
        );
        let connecting = StatusView {
            libvirt: Some(LibvirtView {
                uri: "qemu:///system".into(),
                state: "connecting".into(),
                since_ms: 0,
                reason: String::new(),
            }),
            ..base()
        };
        assert!(render(&connecting, t).contains("\nlibvirt: qemu:///system connecting\n"));
        let doctored = StatusView {
            doctor: "doctor: 1 failure, run vfioctl doctor".into(),
            ..base()
        };
        assert!(
            render(&doctored, t).starts_with(
                "vfiod 0.1.0  scenario private\ndoctor: 1 failure, run vfioctl doctor\ndevices:"
            ),
            "{}",
            render(&doctored, t)
        );
        let busy = StatusView {
            simulated: true,
            libvirt: Some(LibvirtView {
                uri: "qemu:///system".into(),
                state: "disconnected".into(),
                since_ms: 5,
                reason: "libvirtd is not running".into(),
            }),
            tasks_in_error: vec![TaskInError {
                address: "0000:af:00.0".into(),
                task: Some("/org/vfiod/Vfiod1/task/3".into()),
                result: "split failed: Input/output error\nrollback restored it".into(),
            }],
            claims: BTreeMap::from([("attached".into(), 2), ("claimed".into(), 1)]),
            fleet: Some(FleetView {
                report_interval_s: 30,
                last_report_ms: 988_000,
            }),
            pools: vec![
                PoolView {
                    name: "rack1".into(),
                    last_call_ms: 997_000,
                    last_call_error: String::new(),
                },
                PoolView {
                    name: "rack2".into(),
                    last_call_ms: 700_000,
                    last_call_error: "pool unreachable: connection refused".into(),
                },
                PoolView {
                    name: "rack3".into(),
                    last_call_ms: 0,
                    last_call_error: String::new(),
                },
            ],
            ..base()
        };
        assert_eq!(
            render(&busy, t),
            "SIMULATION: this vfiod runs on a simulated host\n\
             vfiod 0.1.0  scenario private\n\
             devices: 9 (6 usable, 2 protected, 1 broken)\n\
             libvirt: qemu:///system disconnected since t5: libvirtd is not running\n\
             claims: 2 attached, 1 claimed\n\
             tasks in error: 1 (vfioctl task reset ADDRESS once handled)\n\
             \x20 0000:af:00.0  split failed: Input/output error\n\
             fleet: last report 12 s ago\n\
             pool rack1: reachable (answered 3 s ago)\n\
             pool rack2: unreachable (5 min ago): pool unreachable: connection refused\n\
             pool rack3: no call since vfiod started\n"
        );
        let late = |last_report_ms| StatusView {
            fleet: Some(FleetView {
                report_interval_s: 30,
                last_report_ms,
            }),
            ..base()
        };
        assert!(render(&late(940_000), t).ends_with("fleet: last report 60 s ago\n"));
        assert!(render(&late(939_000), t).ends_with(
            "fleet: last report 61 s ago, late (every 30 s): see journalctl -u vfiod\n"
        ));
        assert!(
            render(&late(0), t).ends_with("fleet: no report since vfiod started (every 30 s)\n")
        );
        assert!(render(&late(0), t).contains("fleet: no report"));
        let no_iommu = StatusView {
            no_iommu: Some("no IOMMU: passthrough is unsafe".into()),
            ..base()
        };
        assert_eq!(
            render(&no_iommu, t),
            "vfiod 0.1.0  scenario private\n\
             no IOMMU: passthrough is unsafe\n\
             devices: 9 (6 usable, 2 protected, 1 broken)\n\
             libvirt: off in this configuration\n\
             claims: none\n\
             tasks in error: none\n"
        );
    }

    #[test]
    fn ages_read_in_the_unit_that_fits() {
        for (secs, want) in [
            (0, "0 s ago"),
            (119, "119 s ago"),
            (120, "2 min ago"),
            (7199, "119 min ago"),
            (7200, "2 h ago"),
            (-5, "0 s ago"),
        ] {
            assert_eq!(ago(0, secs * 1000), want, "{secs} s");
        }
    }
}
