//! `vfioctl` as an operator uses it, against a running vfiod on the simulated host: it ends
//! quietly when its reader goes away, shows the newest history and pages back, shows a device's
//! task state, says what is wrong with a task id or an address that does not exist; and the
//! manager's history queries name an unknown device as `GetDevice` does.

mod common;

use common::{vfioctl, Harness, STEADY_CONFIG};
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

fn error_name(e: zbus::Error) -> (String, String) {
    match e {
        zbus::Error::MethodError(n, m, _) => (n.to_string(), m.unwrap_or_default()),
        other => panic!("not a D-Bus error reply: {other}"),
    }
}

/// `vfioctl list --json | head -1`: the reader goes away; vfioctl must end as other Unix tools
/// do (killed by SIGPIPE, or exit 0), never panic on EPIPE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_goes_away_ends_vfioctl_quietly() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let (status, stderr) = tokio::task::spawn_blocking(move || {
        // Its stdout is a pipe whose reading end is already closed: its first write fails.
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let mut child = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
            .args(["list", "--json"])
            .env("VFIOD_BUS", &bus)
            .stdout(Stdio::from(write))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (child.wait().unwrap(), err)
    })
    .await
    .unwrap();
    assert!(
        status.success() || status.signal() == Some(nix::libc::SIGPIPE),
        "vfioctl ended with {status}: {stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_show_the_newest_and_page_back() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let store = h.store();
    let all = store.events(None, 0, 10_000).unwrap();
    assert!(
        all.len() > 20,
        "the host's first pass records an event per function"
    );
    let ids = |text: &str| -> Vec<i64> {
        text.lines()
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect()
    };
    let last = |ids: Vec<i64>, n: usize| ids[ids.len().saturating_sub(n)..].to_vec();
    let newest = last(all.iter().map(|e| e.id).collect(), 8);
    let (ok, out) = vfioctl(&bus, &["events", "--limit", "8"]);
    assert!(ok, "{out}");
    assert_eq!(ids(&out), newest, "the newest eight, oldest first:\n{out}");

    // Page back from the first id shown.
    let before = newest[0].to_string();
    let (ok, out) = vfioctl(&bus, &["events", "--limit", "8", "--before", &before]);
    assert!(ok, "{out}");
    let previous = last(
        all.iter()
            .filter(|e| e.id < newest[0])
            .map(|e| e.id)
            .collect(),
        8,
    );
    assert_eq!(ids(&out), previous, "{out}");

    // Follow from an id: the entries after it, oldest first.
    let (ok, out) = vfioctl(&bus, &["events", "--limit", "5", "--since", "0"]);
    assert!(ok, "{out}");
    let oldest: Vec<i64> = all.iter().take(5).map(|e| e.id).collect();
    assert_eq!(ids(&out), oldest, "{out}");

    // One device's events, as JSON.
    let (ok, out) = vfioctl(&bus, &["events", "0000:3b:00.0", "--json"]);
    assert!(ok, "{out}");
    let listed: Vec<vfiod::client::EventEntry> = serde_json::from_str(&out).unwrap();
    assert!(!listed.is_empty());
    assert!(listed.iter().all(|e| e.address == "0000:3b:00.0"), "{out}");

    let (ok, out) = vfioctl(&bus, &["events", "--since", "1", "--before", "5"]);
    assert!(!ok, "since and before together are refused: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_tells_the_task_state_and_task_show_names_a_missing_task() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let (ok, out) = vfioctl(&bus, &["show", "0000:af:00.0"]);
    assert!(ok, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("task:") && l.ends_with("idle")),
        "{out}"
    );

    // A failed split holds the FPGA in error: show says so, and how to reset it.
    h.kernel.inject(
        vfiod::sim::kernel::FaultTarget::DeviceAttr(
            "0000:af:00.0".parse().unwrap(),
            "sriov_numvfs".into(),
        ),
        vfiod::sim::kernel::FaultAction::Errno(nix::libc::EIO),
        Some(1),
    );
    let (ok, out) = vfioctl(
        &bus,
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
    );
    assert!(!ok, "{out}");
    let shown = common::eventually(Duration::from_secs(30), "show reports the error", || {
        let (_, out) = vfioctl(&bus, &["show", "0000:af:00.0"]);
        out.lines()
            .any(|l| l.starts_with("task:") && l.contains("error") && l.contains("task reset"))
            .then_some(out)
    })
    .await;
    assert!(shown.contains("last task:"), "{shown}");
    let (ok, json) = vfioctl(&bus, &["show", "0000:af:00.0", "--json"]);
    assert!(ok);
    let d: vfiod::client::DeviceView = serde_json::from_str(&json).unwrap();
    assert_eq!(d.task_state, "error");
    assert!(d.current_task.is_some());

    let (ok, out) = vfioctl(&bus, &["task", "show", "0"]);
    assert!(!ok);
    assert!(out.contains("no task 0"), "{out}");
    assert!(!out.contains("UnknownObject"), "{out}");

    let (ok, out) = vfioctl(&bus, &["mode", "0000:99:00.0", "pf"]);
    assert!(!ok);
    assert!(
        out.contains("org.vfiod.Vfiod1.Error.NoSuchDevice") && out.contains("0000:99:00.0"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_queries_name_an_unknown_device() {
    let h = Harness::start(STEADY_CONFIG).await;
    let m = h.manager().await;
    let q = |a: &str| vfiod::client::query(vec![("address", Some(a.to_string().into()))]);
    for call in ["GetEvents", "GetTasks"] {
        let result = match call {
            "GetEvents" => m.get_events(q("0000:99:00.0")).await,
            _ => m.get_tasks(q("0000:99:00.0")).await,
        };
        let (name, msg) = error_name(result.unwrap_err());
        assert_eq!(name, "org.vfiod.Vfiod1.Error.NoSuchDevice", "{call}: {msg}");
        assert!(msg.contains("0000:99:00.0"), "{call}: {msg}");
    }
    // A known device answers, and an unknown query key is named.
    assert!(!m.get_events(q("0000:3b:00.0")).await.unwrap().is_empty());
    let bad = vfiod::client::query(vec![("adress", Some("0000:3b:00.0".to_string().into()))]);
    let (name, msg) = error_name(m.get_tasks(bad).await.unwrap_err());
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument");
    assert!(msg.contains("adress"), "{msg}");
}
