//! Prometheus metrics (issue 21) against the real daemon on the simulated host and a private
//! bus: what `Manager.GetMetrics` and `vfioctl metrics` show after a mode task and a hook
//! call, the textfile for node_exporter (written whole, the same text; absent when not
//! configured; a missing directory costs a warning, never the daemon), and names and types
//! checked by `promtool check metrics` (Debian's prometheus package, installed by the README's
//! test command: a missing promtool fails the test).

use crate::common;

use crate::common::{eventually, eventually_async, Harness, STEADY_CONFIG};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The writer's gap between writes is 5 s: a change is in the file within about that.
const FILE_WITHIN: Duration = Duration::from_secs(20);

fn config_with_textfile(path: &Path) -> String {
    format!(
        "{STEADY_CONFIG}\n[metrics]\ntextfile = \"{}\"\n",
        path.display()
    )
}

const XML: &str = "<domain type='kvm'><name>vm1</name>\
    <uuid>6f1b2c3d-0000-4000-8000-00000000a001</uuid><memory>65536</memory><devices/></domain>";

async fn metrics(h: &Harness) -> String {
    h.manager().await.get_metrics().await.expect("GetMetrics")
}

/// The value of the sample line `series` (name and labels, exactly as rendered).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| v.parse().expect("a number"))
    })
}

/// `promtool check metrics` on `text`: its lint findings, if any, fail the test.
fn promtool_check(text: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect(
            "promtool runs (apt-get install --no-install-recommends prometheus, as the README's \
             test command does)",
        );
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics refused the metrics:\n{}{}\n--- text:\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every file in `dir`, by name.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mode_task_and_a_hook_call_show_in_the_metrics_and_the_textfile() {
    let out = tempfile::tempdir().unwrap();
    let textfile = out.path().join("vfiod.prom");
    let h = Harness::start(&config_with_textfile(&textfile)).await;
    let before = metrics(&h).await;
    let split = "vfiod_tasks_total{kind=\"split\",result=\"success\"}";
    assert_eq!(sample(&before, split), Some(0.0), "{before}");

    let nic = vfiod::client::device(&h.client, "0000:3b:00.0")
        .await
        .unwrap();
    nic.set_mode("vf", vfiod::client::mode_options(Some(8)))
        .await
        .unwrap();
    let m = h.manager().await;
    let (code, _, _) = m.hook("vm1", "started", "begin", "-", XML).await.unwrap();
    assert_eq!(code, 0);

    // The task is counted when it ends; its VFs are recorded by the inventory pass after it:
    // wait for both, so that the device gauges below are read after the pass.
    let nic_vfs = |h: &Harness| {
        h.store()
            .devices()
            .unwrap()
            .iter()
            .filter(|d| d.kind.as_str() == "nic" && d.state.as_str() == "usable")
            .count()
    };
    let text = eventually_async(
        Duration::from_secs(30),
        "the split counted and recorded",
        || async {
            if nic_vfs(&h) < 9 {
                return None;
            }
            let t = metrics(&h).await;
            (sample(&t, split) == Some(1.0)).then_some(t)
        },
    )
    .await;
    for (series, wanted) in [
        ("vfiod_tasks_total{kind=\"split\",result=\"error\"}", 0.0),
        ("vfiod_task_duration_seconds_count{kind=\"split\"}", 1.0),
        (
            "vfiod_task_duration_seconds_bucket{kind=\"split\",le=\"+Inf\"}",
            1.0,
        ),
        (
            "vfiod_hook_duration_seconds_count{operation=\"started\",result=\"pass\"}",
            1.0,
        ),
        ("vfiod_claims{state=\"attached\"}", 0.0),
        ("vfiod_metrics_textfile_errors_total", 0.0),
    ] {
        assert_eq!(sample(&text, series), Some(wanted), "{series}\n{text}");
    }
    // The device gauges are the store's counts at the render (the split added 8 NIC VFs).
    let devices = h.store().devices().unwrap();
    let count = |kind: &str, state: &str| {
        devices
            .iter()
            .filter(|d| d.kind.as_str() == kind && d.state.as_str() == state)
            .count() as f64
    };
    assert!(count("nic", "usable") >= 9.0);
    for (kind, state) in [("nic", "usable"), ("nic", "protected"), ("gpu", "usable")] {
        let series = format!("vfiod_devices{{kind=\"{kind}\",state=\"{state}\"}}");
        assert_eq!(sample(&text, &series), Some(count(kind, state)), "{series}");
    }
    // No [fleet]: no report age.
    assert!(!text.contains("vfiod_fleet_report_age_seconds"), "{text}");
    promtool_check(&text);

    // The textfile catches up with the same text, and is the only file left in its directory
    // (the temporary file was renamed onto it).
    let in_file = eventually_async(FILE_WITHIN, "the textfile holds the metrics", || {
        let textfile = textfile.clone();
        let h = &h;
        async move {
            let now = metrics(h).await;
            let file = std::fs::read_to_string(&textfile).ok()?;
            (file == now).then_some(file)
        }
    })
    .await;
    assert_eq!(sample(&in_file, split), Some(1.0));
    assert_eq!(names_in(out.path()), vec!["vfiod.prom".to_string()]);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&textfile).unwrap().permissions(),
    );
    assert_eq!(
        mode & 0o777,
        0o644,
        "node_exporter reads it as another user"
    );

    // vfioctl metrics prints the same exposition text.
    let (ok, printed) = common::vfioctl(h.bus.address(), &["metrics"]);
    assert!(ok, "{printed}");
    assert_eq!(sample(&printed, split), Some(1.0), "{printed}");
    promtool_check(&printed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_textfile_is_written_when_none_is_configured() {
    let mut h = Harness::start(STEADY_CONFIG).await;
    let m = h.manager().await;
    let (code, _, _) = m.hook("vm1", "started", "begin", "-", XML).await.unwrap();
    assert_eq!(code, 0);
    let text = metrics(&h).await;
    assert_eq!(
        sample(
            &text,
            "vfiod_hook_duration_seconds_count{operation=\"started\",result=\"pass\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(h
        .server
        .as_ref()
        .unwrap()
        .engine
        .settings()
        .metrics
        .textfile
        .is_none());
    // The writer's first turn runs before it looks at its stop: once the daemon has stopped
    // (which waits for the writer's task), every turn it would take is past, and there is still
    // no .prom file anywhere vfiod writes. An event, where this used to be a 1 s pause.
    h.stop_server().await;
    fn proms(dir: &Path, found: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                proms(&p, found);
            } else if p.to_string_lossy().contains(".prom") {
                found.push(p);
            }
        }
    }
    let mut found = Vec::new();
    proms(&h.dir.path().join("state"), &mut found);
    proms(h.dir.path(), &mut found);
    assert!(found.is_empty(), "{found:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_textfile_directory_is_counted_and_vfiod_keeps_answering() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("node-exporter");
    let textfile = dir.join("vfiod.prom");
    let h = Harness::start(&config_with_textfile(&textfile)).await;
    // The first write fails (the directory does not exist): counted, and the daemon answers.
    let text = eventually_async(
        Duration::from_secs(10),
        "the failed write counted",
        || async {
            let t = metrics(&h).await;
            (sample(&t, "vfiod_metrics_textfile_errors_total").unwrap_or(0.0) >= 1.0).then_some(t)
        },
    )
    .await;
    promtool_check(&text);
    let devices = vfiod::client::list_devices(&h.client).await.unwrap();
    assert!(!devices.is_empty());
    assert!(!textfile.exists());
    // Once the directory is there, the next turn (woken by a hook call) writes the file.
    std::fs::create_dir(&dir).unwrap();
    let m = h.manager().await;
    m.hook("vm1", "started", "begin", "-", XML).await.unwrap();
    eventually(
        FILE_WITHIN,
        "the textfile written once its directory exists",
        || {
            std::fs::read_to_string(&textfile)
                .ok()
                .filter(|t| t.contains("operation=\"started\""))
        },
    )
    .await;
    assert_eq!(names_in(&dir), vec!["vfiod.prom".to_string()]);
}

#[test]
fn a_bad_textfile_is_refused_with_its_place_and_reason() {
    for (value, reason) in [
        ("vfiod.prom", "is not an absolute path"),
        (
            "/var/lib/prometheus/node-exporter/vfiod.txt",
            "ending in .prom",
        ),
        ("/var/lib/prometheus/node-exporter/", "names a directory"),
    ] {
        let text = format!("[metrics]\ntextfile = \"{value}\"\n");
        let e = vfiod::config::Settings::from_toml_str(&text, Path::new("vfiod.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vfiod.toml:2:") && e.contains("metrics.textfile") && e.contains(reason),
            "{value}: {e}"
        );
    }
    let on = vfiod::config::Settings::from_toml_str(
        "[metrics]\ntextfile = \"/run/vfiod.prom\"\n",
        Path::new("vfiod.toml"),
    )
    .unwrap();
    assert_eq!(
        on.metrics.textfile.as_deref(),
        Some(Path::new("/run/vfiod.prom"))
    );
    let off =
        vfiod::config::Settings::from_toml_str("[metrics]\ntextfile = \"\"\n", Path::new("x"))
            .unwrap();
    assert_eq!(off.metrics.textfile, None);
    let unknown =
        vfiod::config::Settings::from_toml_str("[metrics]\nfile = \"/x.prom\"\n", Path::new("x"))
            .unwrap_err()
            .to_string();
    assert!(unknown.contains("file"), "{unknown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pool_call_is_counted_by_pool_and_error() {
    // A port nothing listens on: the pool is unreachable.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = format!(
        "{STEADY_CONFIG}\n[[pool]]\nname = \"rack1\"\nurl = \"http://127.0.0.1:{port}\"\n\
         connect_timeout_ms = 500\nrequest_timeout_ms = 500\n"
    );
    let h = Harness::start(&config).await;
    let unreachable = "vfiod_pool_call_errors_total{error=\"unreachable\",pool=\"rack1\"}";
    let before = metrics(&h).await;
    assert_eq!(sample(&before, unreachable), Some(0.0), "{before}");
    let m = h.manager().await;
    assert!(m.get_pool_devices("rack1").await.is_err());
    let after = metrics(&h).await;
    assert_eq!(sample(&after, unreachable), Some(1.0), "{after}");
    assert_eq!(
        sample(
            &after,
            "vfiod_pool_call_errors_total{error=\"refused\",pool=\"rack1\"}"
        ),
        Some(0.0)
    );
    promtool_check(&after);
}
