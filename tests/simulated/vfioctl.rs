//! `vfioctl` as an operator uses it, against a running vfiod on the simulated host: it ends
//! quietly when its reader goes away, shows the newest history and pages back, shows a device's
//! task state, says what is wrong with a task id or an address that does not exist; and the
//! manager's history queries name an unknown device as `GetDevice` does.

use crate::common;
// The golden files of every read command (tests/data/golden/vfioctl/).
mod golden;

use crate::common::{addr, vfioctl, Harness, STEADY_CONFIG};
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
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

/// vfioctl's exit status and its two outputs.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn ran(bus: &str, args: &[&str], unprivileged: bool) -> Ran {
    // An unprivileged caller, as root too: nobody (65534), from a copy of vfioctl every uid can
    // run. Root is allowed without polkit (as polkit allows uid 0), with or without
    // CAP_SYS_ADMIN, so only another uid shows a refusal.
    let as_nobody = unprivileged && nix::unistd::geteuid().is_root();
    let (exe, _copy) = if as_nobody {
        let (dir, copy) =
            common::polkit::binaries_for_any_uid(&[Path::new(env!("CARGO_BIN_EXE_vfioctl"))]);
        (dir.join("vfioctl"), copy)
    } else {
        (PathBuf::from(env!("CARGO_BIN_EXE_vfioctl")), None)
    };
    let mut c = Command::new(exe);
    c.args(args).env("VFIOD_BUS", bus).stdin(Stdio::null());
    if as_nobody {
        use std::os::unix::process::CommandExt;
        c.uid(65534).gid(65534);
    }
    let out = c.output().expect("run vfioctl");
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// With --json, a failure is one JSON object on stderr naming the D-Bus error.
fn json_error(r: &Ran) -> (String, String) {
    let v: serde_json::Value = serde_json::from_str(r.stderr.trim())
        .unwrap_or_else(|e| panic!("stderr is not one JSON object ({e}): {}", r.stderr));
    (
        v["error"].as_str().unwrap_or_default().to_string(),
        v["message"].as_str().unwrap_or_default().to_string(),
    )
}

/// Each kind of refusal a script acts on has its own exit status (README, vfioctl(1)): 0 done,
/// 2 usage, 3 not found, 4 busy or in use, 6 no device available, 7 refused by policy; an
/// empty `find` or `claims` prints nothing on stdout (and, stderr not being a terminal, no note
/// either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_name_each_kind_of_refusal() {
    use vfiod::client::exit;
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let code = |c: u8| Some(i32::from(c));

    let r = ran(&bus, &["list"], false);
    assert_eq!(r.code, code(exit::OK), "{}", r.stderr);
    let r = ran(&bus, &["list", "--no-such-option"], false);
    assert_eq!(r.code, code(exit::USAGE), "{}", r.stderr);

    // Nothing claimed: nothing on stdout, nothing on a stderr that is not a terminal.
    let r = ran(&bus, &["claims"], false);
    assert_eq!(
        (r.code, r.stdout.as_str(), r.stderr.as_str()),
        (code(exit::OK), "", "")
    );

    // Not found: a device, a claim, a task.
    for args in [
        &["show", "0000:99:00.0"][..],
        &["mode", "0000:99:00.0", "pf"],
        &["release", "999"],
        &["task", "show", "999"],
    ] {
        let r = ran(&bus, args, false);
        assert_eq!(r.code, code(exit::NOT_FOUND), "{args:?}: {}", r.stderr);
        assert!(r.stdout.is_empty(), "{args:?}: {}", r.stdout);
    }
    let r = ran(&bus, &["show", "0000:99:00.0", "--json"], false);
    assert_eq!(r.code, code(exit::NOT_FOUND));
    let (name, message) = json_error(&r);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.NoSuchDevice");
    assert!(message.contains("0000:99:00.0"), "{message}");

    // No device available: find prints nothing and says so in its status.
    let r = ran(&bus, &["find", "--id", "ffff:ffff"], false);
    assert_eq!(
        (r.code, r.stdout.as_str(), r.stderr.as_str()),
        (code(exit::NO_DEVICE), "", "")
    );
    let r = ran(&bus, &["find", "--id", "ffff:ffff", "--json"], false);
    assert_eq!(r.code, code(exit::NO_DEVICE));
    assert_eq!(
        serde_json::from_str::<Vec<String>>(&r.stdout).unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(json_error(&r).0, "org.vfiod.Vfiod1.Error.NoDeviceAvailable");
    let r = ran(&bus, &["claim", "--id", "ffff:ffff", "--vm", "db"], false);
    assert_eq!(r.code, code(exit::NO_DEVICE), "{}", r.stderr);
    assert!(r.stderr.contains("NoDeviceAvailable"), "{}", r.stderr);

    // A match is found and claimed; then the QAT PF cannot change mode under the VM: in use.
    let r = ran(&bus, &["find", "--parent", "0000:5e:00.0"], false);
    assert_eq!(r.code, code(exit::OK), "{}", r.stderr);
    assert!(!r.stdout.is_empty());
    let r = ran(
        &bus,
        &["claim", "--parent", "0000:5e:00.0", "--vm", "db"],
        false,
    );
    assert_eq!(r.code, code(exit::OK), "{}", r.stderr);
    let r = ran(&bus, &["mode", "0000:5e:00.0", "pf"], false);
    assert_eq!(r.code, code(exit::BUSY), "{}", r.stderr);
    assert!(
        r.stderr.contains("org.vfiod.Vfiod1.Error.InUse"),
        "{}",
        r.stderr
    );

    // Refused by policy: a protected device (the host's own NIC) and one the configuration
    // does not select.
    let r = ran(&bus, &["mode", "0000:02:00.0", "vf"], false);
    assert_eq!(r.code, code(exit::REFUSED), "{}", r.stderr);
    assert!(r.stderr.contains("Protected"), "{}", r.stderr);
}

/// Without polkitd on vfiod's bus, a caller that is not root (nobody, when the test runs as
/// root) is refused: the not-authorized status, and with --json the error object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_code_not_authorized() {
    use std::os::unix::fs::PermissionsExt;
    use vfiod::client::exit;
    let dir = common::fast_tempdir();
    // nobody reaches the bus's socket below it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let kernel = vfiod::sim::kernel::SimKernel::build(
        &dir.path().join("root"),
        &vfiod::sim::kernel::HostModel::reference(),
    )
    .unwrap();
    let private = vfiod::sim::bus::PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let mut h = Harness::assemble(dir, kernel, private, STEADY_CONFIG).await;
    let source = h.source();
    h.server = Some(
        vfiod::server::Server::start(vfiod::server::Options {
            settings: source.load().unwrap(),
            source: Some(source),
            sysfs: h.kernel.sysfs(),
            events: Some(h.kernel.subscribe()),
            bus: h.bus_target(),
            authorizer: vfiod::dbus::auth::Authorizer::Polkit,
            simulated: true,
        })
        .await
        .unwrap(),
    );
    let bus = h.bus.address().to_string();
    let r = ran(&bus, &["rescan"], true);
    assert_eq!(
        r.code,
        Some(i32::from(exit::NOT_AUTHORIZED)),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("org.vfiod.Vfiod1.Error.NotAuthorized"),
        "{}",
        r.stderr
    );
    let r = ran(
        &bus,
        &["claim", "--id", "8086:154c", "--vm", "db", "--json"],
        true,
    );
    assert_eq!(
        r.code,
        Some(i32::from(exit::NOT_AUTHORIZED)),
        "{}",
        r.stderr
    );
    assert_eq!(json_error(&r).0, "org.vfiod.Vfiod1.Error.NotAuthorized");
    // Reads stay open.
    assert_eq!(ran(&bus, &["list"], true).code, Some(0));
}

/// Every command that prints something has --json, with one naming scheme: snake_case, times
/// as `*_ms`, ids as numbers, nested objects (a task's parameters), no duplicate fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_on_every_command_one_naming_scheme() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let json = |args: &[&str]| -> serde_json::Value {
        let r = ran(&bus, args, false);
        assert_eq!(r.code, Some(0), "{args:?}: {}", r.stderr);
        serde_json::from_str(&r.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", r.stdout))
    };
    // Every key of every object, at any depth, is snake_case.
    fn keys_are_snake_case(v: &serde_json::Value, at: &str) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    assert!(
                        k.chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                        "{at}: key {k:?}"
                    );
                    keys_are_snake_case(v, at);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| keys_are_snake_case(v, at)),
            _ => {}
        }
    }

    // A mode change, waited for: the task at its end.
    let t = json(&[
        "mode",
        "0000:af:00.0",
        "vf",
        "--vfs",
        "2",
        "--wait",
        "--json",
    ]);
    keys_are_snake_case(&t, "mode");
    assert_eq!(t["state"], "success", "{t}");
    assert_eq!(t["address"], "0000:af:00.0", "{t}");
    let id = t["id"].as_i64().expect("a task's id is a number");
    let shown = json(&["task", "show", &id.to_string(), "--json"]);
    assert_eq!(shown, t, "task show gives the same object");
    let by_address = json(&["task", "show", "0000:af:00.0", "--json"]);
    keys_are_snake_case(&by_address, "task show ADDRESS");
    assert_eq!(by_address["task_state"], "idle", "{by_address}");
    assert!(by_address["task"].is_null(), "{by_address}");
    // Without --wait: the task as it starts.
    let started = json(&["mode", "0000:af:00.0", "pf", "--json"]);
    assert!(started["id"].as_i64().unwrap() > id, "{started}");

    // The history: parameters are an object, not JSON in a string; times are *_ms.
    let tasks = json(&["task", "list", "0000:af:00.0", "--json"]);
    keys_are_snake_case(&tasks, "task list");
    let split = tasks
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"].as_i64() == Some(id))
        .expect("the split in the history");
    assert!(split["parameters"].is_object(), "{split}");
    assert!(split["created_ms"].as_i64().unwrap() > 0, "{split}");

    // Claims: a number for the id, *_ms times, the VM once (vm_name, vm_uuid).
    let c = json(&["claim", "--kind", "gpu", "--vm", "desktop", "--json"]);
    keys_are_snake_case(&c, "claim");
    let cid = c["id"].as_u64().expect("a claim's id is a number");
    assert!(c["created_ms"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["lease_expires_ms"], 0, "{c}");
    assert_eq!(c["vm_name"], "desktop", "{c}");
    assert!(c.get("vm").is_none() && c.get("created").is_none(), "{c}");
    let all = json(&["claims", "--json"]);
    assert_eq!(all, serde_json::json!([c]));
    let found = json(&["find", "--kind", "fpga", "--json"]);
    assert_eq!(found, serde_json::json!(["0000:af:00.0"]));
    let ended = json(&["release", &cid.to_string(), "--json"]);
    assert_eq!(ended["id"], cid, "{ended}");
    assert_eq!(ended["state"], "released", "{ended}");

    for args in [
        &["list", "--json"][..],
        &["show", "0000:3b:00.0", "--json"],
        &["status", "--json"],
        &["events", "--limit", "5", "--json"],
        &["plan", "--json"],
    ] {
        keys_are_snake_case(&json(args), &format!("{args:?}"));
    }
    // The commands that only confirm print what they leave.
    let reloaded = json(&["reload", "--json"]);
    assert!(reloaded["config_sources"].is_array(), "{reloaded}");
    let rescanned = json(&["rescan", "--json"]);
    assert!(rescanned["devices"].as_u64().unwrap() > 0, "{rescanned}");

    // A refusal with --json: one JSON object on stderr, nothing on stdout.
    let r = ran(&bus, &["mode", "0000:02:00.0", "vf", "--json"], false);
    assert_eq!(r.code, Some(7), "{}", r.stderr);
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    assert_eq!(json_error(&r).0, "org.vfiod.Vfiod1.Error.Protected");
}

/// A pseudo-terminal of `cols` columns: (master, slave).
fn pty(cols: u16) -> (std::fs::File, std::fs::File) {
    use nix::libc;
    use std::os::fd::FromRawFd;
    // SAFETY: plain libc calls on descriptors this function owns; each result is checked.
    unsafe {
        let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        assert!(m >= 0, "posix_openpt");
        assert_eq!(libc::grantpt(m), 0);
        assert_eq!(libc::unlockpt(m), 0);
        let mut name = [0 as libc::c_char; 128];
        assert_eq!(libc::ptsname_r(m, name.as_mut_ptr(), name.len()), 0);
        let s = libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        );
        assert!(s >= 0, "open the pty's slave");
        let size = libc::winsize {
            ws_row: 24,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        assert_eq!(libc::ioctl(s, libc::TIOCSWINSZ, &size), 0);
        (std::fs::File::from_raw_fd(m), std::fs::File::from_raw_fd(s))
    }
}

/// `vfioctl mode ... --wait`: on a terminal, a progress bar that fits its width (each redraw
/// within 80 columns, so none wraps); into a pipe or a log, nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_only_on_a_terminal_and_within_its_width() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    // Each redraw as the terminal shows it: ANSI sequences taken out, split at \r and \n.
    let redraws = |raw: &str| -> Vec<String> {
        let mut out = Vec::new();
        let mut cur = String::new();
        let mut chars = raw.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\x1b' => {
                    // CSI: ESC [ params final-byte.
                    if chars.peek() == Some(&'[') {
                        chars.next();
                        for f in chars.by_ref() {
                            if ('@'..='~').contains(&f) {
                                break;
                            }
                        }
                    }
                }
                '\r' | '\n' => out.push(std::mem::take(&mut cur)),
                c => cur.push(c),
            }
        }
        out.push(cur);
        out.into_iter().filter(|l| !l.trim().is_empty()).collect()
    };

    let bus2 = bus.clone();
    let (status, stdout, drawn) = tokio::task::spawn_blocking(move || {
        let (mut master, slave) = pty(80);
        let child = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
            .args(["mode", "0000:af:00.0", "vf", "--vfs", "4", "--wait"])
            .env("VFIOD_BUS", &bus2)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(slave))
            .spawn()
            .unwrap();
        let out = child.wait_with_output().unwrap();
        // The slave's last holder is gone: reading drains what it wrote, then EIO.
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match master.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&raw).into_owned(),
        )
    })
    .await
    .unwrap();
    assert!(status.success(), "{stdout}{drawn}");
    assert!(stdout.contains("success"), "{stdout}");
    let lines = redraws(&drawn);
    assert!(
        lines.iter().any(|l| l.contains('%') && l.contains("task")),
        "a progress bar on the terminal: {drawn:?}"
    );
    for l in &lines {
        assert!(
            l.chars().count() <= 80,
            "a redraw wider than the terminal: {l:?}"
        );
    }
    assert!(!stdout.contains('%'), "no progress on stdout: {stdout}");

    // An empty find on a terminal: a note there (stdout still empty), the no-device status.
    let bus3 = bus.clone();
    let (code, stdout, drawn) = tokio::task::spawn_blocking(move || {
        let (mut master, slave) = pty(80);
        let out = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
            .args(["find", "--id", "ffff:ffff"])
            .env("VFIOD_BUS", &bus3)
            .stdin(Stdio::null())
            .stderr(Stdio::from(slave))
            .output()
            .unwrap();
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = master.read(&mut buf) {
            raw.extend_from_slice(&buf[..n]);
        }
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&raw).into_owned(),
        )
    })
    .await
    .unwrap();
    assert_eq!(code, Some(6), "{drawn}");
    assert_eq!(stdout, "");
    assert!(
        drawn.contains("no device available that matches"),
        "{drawn:?}"
    );

    // The same into a pipe: not a byte of progress.
    let r = ran(&bus, &["mode", "0000:af:00.0", "pf", "--wait"], false);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(r.stderr, "", "progress in a pipe");
}

/// Names that fit: each tool's --version names it; the internal hook is not in the help;
/// completions and the man page come from the same definitions; an address is accepted in
/// libvirt's and the object path's spelling too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_versions_completions_man_and_both_address_spellings() {
    for (bin, name) in [
        (env!("CARGO_BIN_EXE_vfioctl").to_string(), "vfioctl"),
        (common::bins::vfiod_pool(), "vfiod-pool"),
        (env!("CARGO_BIN_EXE_vfiod").to_string(), "vfiod"),
    ] {
        let out = Command::new(&bin).arg("--version").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION")),
            "{bin}"
        );
    }
    let help = ran("unix:path=/nonexistent", &["--help"], false);
    assert_eq!(help.code, Some(0));
    assert!(
        !help
            .stdout
            .lines()
            .any(|l| l.trim_start().starts_with("hook")),
        "{}",
        help.stdout
    );
    assert!(help.stdout.contains("completions"), "{}", help.stdout);
    for shell in ["bash", "zsh", "fish"] {
        let r = ran("unix:path=/nonexistent", &["completions", shell], false);
        assert_eq!(r.code, Some(0), "{shell}: {}", r.stderr);
        assert!(
            r.stdout.contains("vfioctl") && r.stdout.contains("claims"),
            "{shell}"
        );
    }
    let man = ran("unix:path=/nonexistent", &["man"], false);
    assert_eq!(man.code, Some(0), "{}", man.stderr);
    assert!(man.stdout.contains(".TH vfioctl 1"), "{}", man.stdout);
    assert!(man.stdout.contains(".SH \"EXIT STATUS\""), "{}", man.stdout);
    for (code, _) in vfiod::client::exit::TABLE {
        assert!(
            man.stdout.contains(&format!("\\fB{code}\\fR")),
            "code {code}"
        );
    }

    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let plain = ran(&bus, &["show", "0000:3b:00.0", "--json"], false);
    let nodedev = ran(&bus, &["show", "pci_0000_3b_00_0", "--json"], false);
    assert_eq!(nodedev.code, Some(0), "{}", nodedev.stderr);
    assert_eq!(nodedev.stdout, plain.stdout);
    let r = ran(
        &bus,
        &["events", "pci_0000_3b_00_0", "--json", "--limit", "3"],
        false,
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let r = ran(&bus, &["show", "pci_0000_99_00_0"], false);
    assert_eq!(r.code, Some(3), "{}", r.stderr);
    assert!(r.stderr.contains("0000:99:00.0"), "{}", r.stderr);
}

/// Tables (one renderer, comfy-table): a header on each, and in a pipe no name is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_have_headers_and_whole_names() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let listed: Vec<vfiod::client::DeviceView> =
        serde_json::from_str(&ran(&bus, &["list", "--json"], false).stdout).unwrap();
    let text = ran(&bus, &["list"], false).stdout;
    let longest = listed
        .iter()
        .map(|d| d.device_name.as_str())
        .max_by_key(|n| n.len())
        .unwrap();
    assert!(
        longest.len() > 40,
        "the reference host has a long name: {longest}"
    );
    for d in &listed {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&d.address) && l.contains(&d.device_name)),
            "{} is cut or missing:\n{text}",
            d.device_name
        );
    }
    assert!(!text.contains('…'), "{text}");
    assert!(text.starts_with("ADDRESS"), "{text}");

    let r = ran(
        &bus,
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
        false,
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for (args, header) in [
        (&["task", "list"][..], "TASK"),
        (&["events", "--limit", "3"], "ID"),
    ] {
        let out = ran(&bus, args, false).stdout;
        let first = out.lines().next().unwrap_or_default();
        assert!(
            first.split_whitespace().next() == Some(header),
            "{args:?}:\n{out}"
        );
        assert!(out.lines().count() > 1, "{args:?}:\n{out}");
        // --no-legend: the same rows without the header.
        let bare = ran(&bus, &[args, &["--no-legend"]].concat(), false).stdout;
        assert_eq!(
            bare.lines().collect::<Vec<_>>(),
            out.lines().skip(1).collect::<Vec<_>>()
        );
    }
}

/// `vfioctl events --follow --kind task --json`, started before anything happens: it prints the
/// tasks' events as the daemon records them, one JSON object per line, in id order, nothing of
/// another kind, none twice; a `Manager.Event` signal carries each entry as `GetEvents` has
/// it; and when vfiod leaves the bus the follower ends with a failure, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_prints_new_entries_as_they_come() {
    use futures_util::StreamExt;
    use std::io::BufRead;
    let mut h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let m = h.manager().await;
    let mut signals = m.receive_event().await.unwrap();
    let before = h.store().events(None, 0, 10_000).unwrap();
    let mark = before.last().map_or(0, |e| e.id);

    let since = mark.to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args([
            "events", "--follow", "--kind", "task", "--json", "--since", &since,
        ])
        .env("VFIOD_BUS", &bus)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    // Whether the follower has subscribed yet or not, the task's events must show up: those
    // before its first read are in it (--since the mark), those after come as signals.
    let (ok, out) = vfioctl(
        &bus,
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
    );
    assert!(ok, "{out}");
    let (ok, out) = vfioctl(&bus, &["reload"]);
    assert!(
        ok,
        "a config event, which the follower must not print: {out}"
    );

    let wanted: Vec<i64> = h
        .store()
        .events(None, mark, 10_000)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == vfiod::model::event::EventKind::Task)
        .map(|e| e.id)
        .collect();
    assert!(wanted.len() >= 2, "a task records several events");
    let mut seen = Vec::new();
    while seen.last() != wanted.last() {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.recv())
            .await
            .unwrap_or_else(|_| panic!("no new line; printed {seen:?}, wanted {wanted:?}"))
            .expect("the follower is still running");
        let e: vfiod::client::EventEntry = serde_json::from_str(&line)
            .unwrap_or_else(|err| panic!("not one JSON object per line: {line}: {err}"));
        assert_eq!(e.kind, "task", "{line}");
        assert!(
            seen.last().is_none_or(|&l| l < e.id),
            "out of order: {line}"
        );
        seen.push(e.id);
    }
    assert_eq!(seen, wanted, "every task event after the mark, once each");

    // The signal: each recorded entry, in id order, equal to what GetEvents returns.
    let mut signalled = Vec::new();
    while signalled
        .last()
        .is_none_or(|e: &vfiod::client::EventEntry| e.id < *wanted.last().unwrap())
    {
        let s = tokio::time::timeout(Duration::from_secs(20), signals.next())
            .await
            .expect("an Event signal")
            .unwrap();
        signalled.push(vfiod::client::EventEntry::from_dict(
            s.args().unwrap().entry(),
        ));
    }
    let stored: Vec<vfiod::client::EventEntry> = h
        .store()
        .events(None, mark, 10_000)
        .unwrap()
        .iter()
        .map(|e| vfiod::client::EventEntry::from_dict(&vfiod::dbus::wire::event(e)))
        .filter(|e| e.id <= signalled.last().unwrap().id)
        .collect();
    assert_eq!(signalled, stored, "one signal per entry, as stored");

    // The daemon stops: the follower says so and fails.
    h.stop_server().await;
    let status = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                let mut err = String::new();
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                return Some((s, err));
            }
            if std::time::Instant::now() > deadline {
                child.kill().ok();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
    let (status, err) = status.expect("the follower ends when vfiod leaves the bus");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("vfiod left the bus"), "{err}");
}

/// `vfioctl status` names what needs an operator: a device held by a failed task (until it is
/// reset), the claims by state, the libvirt connection; as text and as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_tasks_in_error_and_claims_by_state() {
    use vfiod::sim::kernel::{FaultAction, FaultTarget};
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let status = || -> vfiod::client::status::StatusView {
        let (ok, out) = vfioctl(&bus, &["status", "--json"]);
        assert!(ok, "{out}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    };
    let calm = status();
    assert!(calm.tasks_in_error.is_empty(), "{calm:?}");
    assert!(calm.claims.is_empty(), "{calm:?}");
    // The harness configures qemu:///system with no libvirtd to answer.
    let link = calm.libvirt.as_ref().expect("a libvirt URI is configured");
    assert_eq!(link.uri, "qemu:///system", "{calm:?}");
    assert_ne!(link.state, "connected", "{calm:?}");

    h.kernel.inject(
        FaultTarget::DeviceAttr(addr("0000:af:00.0"), "sriov_numvfs".into()),
        FaultAction::Errno(nix::libc::EIO),
        Some(1),
    );
    let (ok, out) = vfioctl(
        &bus,
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
    );
    assert!(!ok, "the split fails: {out}");
    let (ok, out) = vfioctl(&bus, &["claim", "--id", "10de:1aef", "--vm", "web1"]);
    assert!(ok, "{out}");

    let s = status();
    assert_eq!(
        s.tasks_in_error
            .iter()
            .map(|t| t.address.as_str())
            .collect::<Vec<_>>(),
        ["0000:af:00.0"],
        "{s:?}"
    );
    assert!(
        s.tasks_in_error[0].result.contains("Input/output error"),
        "{s:?}"
    );
    assert_eq!(s.claims.get("claimed"), Some(&1), "{s:?}");
    let (ok, text) = vfioctl(&bus, &["status"]);
    assert!(ok, "{text}");
    assert!(text.contains("tasks in error: 1"), "{text}");
    assert!(text.contains("  0000:af:00.0  "), "{text}");
    assert!(text.contains("claims: 1 claimed"), "{text}");
    assert!(text.contains("\nlibvirt: qemu:///system "), "{text}");

    // Reset: the device is no longer listed.
    let (ok, out) = vfioctl(&bus, &["task", "reset", "0000:af:00.0"]);
    assert!(ok, "{out}");
    assert!(status().tasks_in_error.is_empty());
}

/// `vfioctl plan --config DIR_OR_FILE`: what a configuration that is not installed would do on
/// this host, from a file or an /etc/vfiod-like directory with a drop-in; every error of a
/// wrong one, named before vfiod is asked; and nothing changed by any of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_config_previews_a_configuration_before_it_is_installed() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let nic = "0000:3b:00.0";
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("etc-vfiod");
    std::fs::create_dir_all(dir.join("conf.d")).unwrap();
    std::fs::write(dir.join("vfiod.toml"), "scenario = \"public\"\n").unwrap();
    std::fs::write(
        dir.join("conf.d/50-nic.toml"),
        "[[select]]\nid = \"8086:1572\"\nnum_vfs = 4\n",
    )
    .unwrap();
    let tasks_before = h.store().tasks(None, 100).unwrap().len();
    let (running, drop_in) = tokio::task::spawn_blocking({
        let (bus, dir) = (bus.clone(), dir.clone());
        move || {
            let running = ran(&bus, &["plan", nic], false);
            let d = dir.to_str().unwrap();
            (running, ran(&bus, &["plan", "--config", d], false))
        }
    })
    .await
    .unwrap();
    assert_eq!(running.code, Some(0), "{}", running.stderr);
    assert!(!running.stdout.contains("split"), "{}", running.stdout);
    assert_eq!(drop_in.code, Some(0), "{}", drop_in.stderr);
    let lines: Vec<&str> = drop_in.stdout.lines().collect();
    assert!(
        lines[0].starts_with(&format!("{nic}: split (")),
        "{}",
        drop_in.stdout
    );
    assert!(
        lines[1..]
            .iter()
            .any(|l| l.contains("sriov_numvfs") && l.contains('4')),
        "{}",
        drop_in.stdout
    );

    let (one, other, json, wrong, missing) = tokio::task::spawn_blocking({
        let (bus, dir) = (bus.clone(), dir.clone());
        move || {
            let d = dir.to_str().unwrap();
            let one = ran(&bus, &["plan", "--config", d, nic], false);
            let other = ran(&bus, &["plan", "--config", d, "0000:af:00.0"], false);
            let json = ran(&bus, &["plan", "--config", d, "--json"], false);
            // A file: the whole configuration; two errors, both named.
            let bad = dir.join("bad.toml");
            std::fs::write(
                &bad,
                "scenario = \"cloudy\"\n[[select]]\nid = \"8086:zz\"\n",
            )
            .unwrap();
            let wrong = ran(&bus, &["plan", "--config", bad.to_str().unwrap()], false);
            let missing = ran(
                &bus,
                &["plan", "--config", "/nonexistent/vfiod.toml"],
                false,
            );
            (one, other, json, wrong, missing)
        }
    })
    .await
    .unwrap();
    assert_eq!(one.code, Some(0), "{}", one.stderr);
    assert!(
        one.stdout.starts_with(&format!("{nic}: split (")),
        "{}",
        one.stdout
    );
    assert!(
        other
            .stdout
            .starts_with("0000:af:00.0: left alone (not selected by that configuration"),
        "{}",
        other.stdout
    );
    let v: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["address"], nic, "{v}");
    assert_ne!(wrong.code, Some(0), "{}", wrong.stderr);
    assert!(wrong.stdout.is_empty(), "{}", wrong.stdout);
    let errors: Vec<&str> = wrong.stderr.lines().collect();
    assert_eq!(errors.len(), 3, "{}", wrong.stderr);
    assert!(
        errors[0].contains("bad.toml:1:12: `scenario`"),
        "{}",
        wrong.stderr
    );
    assert!(
        errors[1].contains("bad.toml:3:6: `id` in [[select]] #1"),
        "{}",
        wrong.stderr
    );
    assert!(
        errors[2].starts_with("2 errors in the configuration"),
        "{}",
        wrong.stderr
    );
    assert_ne!(missing.code, Some(0));
    assert!(
        missing.stderr.contains("/nonexistent/vfiod.toml"),
        "{}",
        missing.stderr
    );

    // Nothing was changed: no task, the NIC whole.
    assert_eq!(h.store().tasks(None, 100).unwrap().len(), tasks_before);
    assert_eq!(h.store().device(addr(nic)).unwrap().unwrap().num_vfs, 0);
}
