//! Authorization against a real polkitd (Debian's, on a private system bus, in its own mount
//! namespace: see `common::polkit`): root and the operator the rules grant may call every
//! mutating method; an unprivileged uid is refused with `NotAuthorized` and changes nothing;
//! reads are open to everyone; without polkitd a mutating call is refused, never allowed.
//!
//! Every test needs root and says so when skipped; CI runs them as root.

mod common;

use common::polkit::{
    scratch_dir, skip_unless_root, start_system_bus, uid_of, PolkitHarness, Polkitd, Run,
    GRANTED_USER, HOST_ACTIONS_DIR, HOST_RULES_DIRS, NOBODY, ROOT, TEST_RULES, VFIOD_ACTIONS,
};
use common::{addr, Harness};
use std::path::PathBuf;

const NOT_AUTHORIZED: &str = "org.vfiod.Vfiod1.Error.NotAuthorized";
/// Polling is slow, so only an explicit rescan or reload changes what vfiod shows.
/// The FPGA is selected so that mode changes on it can succeed for those allowed.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nclass = \"0x12\"\n";
const CHANGED_CONFIG: &str = "scenario = \"public\"\npoll_interval = 3600\n";

/// Every mutating vfioctl command and the polkit action it needs. A new mutating method
/// (SetMode, ResetTask, starting a task, ...) gets a line here.
const MUTATING: &[(&[&str], &str)] = &[
    (&["reload"], "org.vfiod.vfiod1.manage"),
    (&["rescan"], "org.vfiod.vfiod1.manage"),
    (
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
        "org.vfiod.vfiod1.manage",
    ),
    (
        &["mode", "0000:af:00.0", "pf", "--wait"],
        "org.vfiod.vfiod1.manage",
    ),
    (
        &["task", "start", "0000:af:00.0", "apply", "--wait"],
        "org.vfiod.vfiod1.manage",
    ),
];

fn assert_refused(r: &Run, action: &str, what: &str) {
    assert!(!r.ok, "{what} succeeded: {}", r.stdout);
    assert!(
        r.stderr.contains(NOT_AUTHORIZED) && r.stderr.contains(action),
        "{what}: expected {NOT_AUTHORIZED} for {action}, got: {}",
        r.stderr
    );
}

fn assert_ok(r: &Run, what: &str) {
    assert!(r.ok, "{what} failed: {}", r.stderr);
}

fn event_count(h: &Harness) -> usize {
    h.store().events(None, 0, 10_000).unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mutating_method_needs_authorization() {
    if skip_unless_root("every_mutating_method_needs_authorization") {
        return;
    }
    let p = PolkitHarness::start(CONFIG).await;
    let granted = uid_of(GRANTED_USER);
    for (args, action) in MUTATING {
        let what = format!("vfioctl {}", args.join(" "));
        let r = p.vfioctl(NOBODY, args).await;
        assert_refused(&r, action, &format!("{what} as nobody"));
        assert_ok(
            &p.vfioctl(granted, args).await,
            &format!("{what} as {GRANTED_USER}"),
        );
        assert_ok(&p.vfioctl(ROOT, args).await, &format!("{what} as root"));
    }
    // ResetTask is checked before the device's state: refused for nobody even on an idle device.
    let r = p.vfioctl(NOBODY, &["task", "reset", "0000:af:00.0"]).await;
    assert_refused(
        &r,
        "org.vfiod.vfiod1.manage",
        "vfioctl task reset as nobody",
    );
    // The decisions for the unprivileged uids came from the test rules file, so the harness
    // really runs polkitd with it (root is authorized by polkitd before any rule).
    let log = p.polkitd.log();
    for (_, action) in MUTATING {
        for user in ["nobody", GRANTED_USER] {
            let line = format!("vfiod-test rule: {action} for {user}");
            assert!(log.contains(&line), "polkitd never ran {line:?}:\n{log}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reload_changes_nothing() {
    if skip_unless_root("a_refused_reload_changes_nothing") {
        return;
    }
    let p = PolkitHarness::start(CONFIG).await;
    let m = p.h.manager().await;
    let events_before = event_count(&p.h);
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();

    let r = p.vfioctl(NOBODY, &["reload"]).await;
    assert_refused(&r, "org.vfiod.vfiod1.manage", "reload as nobody");
    assert_eq!(
        m.scenario().await.unwrap(),
        "private",
        "refused reload took effect"
    );
    assert_eq!(
        event_count(&p.h),
        events_before,
        "a refused reload recorded events"
    );

    // The same file is taken by an authorized caller: the refusal was the only obstacle.
    assert_ok(&p.vfioctl(ROOT, &["reload"]).await, "reload as root");
    assert_eq!(m.scenario().await.unwrap(), "public");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_rescan_changes_nothing() {
    if skip_unless_root("a_refused_rescan_changes_nothing") {
        return;
    }
    let p = PolkitHarness::start(CONFIG).await;
    let m = p.h.manager().await;
    let gpu = addr("0000:17:00.0");
    // The card falls off the bus; only a pass would notice.
    p.h.kernel.set_config_all_ones(gpu, true).unwrap();
    let events_before = event_count(&p.h);

    let r = p.vfioctl(NOBODY, &["rescan"]).await;
    assert_refused(&r, "org.vfiod.vfiod1.manage", "rescan as nobody");
    assert_eq!(
        m.broken_count().await.unwrap(),
        0,
        "refused rescan ran a pass"
    );
    assert_eq!(
        p.h.store().device(gpu).unwrap().unwrap().state.as_str(),
        "usable"
    );
    assert_eq!(event_count(&p.h), events_before);

    assert_ok(&p.vfioctl(ROOT, &["rescan"]).await, "rescan as root");
    assert_eq!(m.broken_count().await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_open_to_everyone() {
    if skip_unless_root("reads_are_open_to_everyone") {
        return;
    }
    let p = PolkitHarness::start(CONFIG).await;
    let reads: &[&[&str]] = &[
        &["list", "--json"],
        &["list"],
        &["show", "0000:3d:00.0", "--json"],
        &["status", "--json"],
        &["events", "--json"],
        &["events", "0000:17:00.0"],
    ];
    let devices = p.h.store().devices().unwrap().len();
    for args in reads {
        let what = format!("vfioctl {}", args.join(" "));
        let as_root = p.vfioctl(ROOT, args).await;
        let as_nobody = p.vfioctl(NOBODY, args).await;
        assert_ok(&as_root, &format!("{what} as root"));
        assert_ok(&as_nobody, &format!("{what} as nobody"));
        assert_eq!(
            as_nobody.stdout, as_root.stdout,
            "{what}: nobody and root see different things"
        );
    }
    let listed: Vec<vfiod::client::DeviceView> =
        serde_json::from_str(&p.vfioctl(NOBODY, &["list", "--json"]).await.stdout).unwrap();
    assert_eq!(listed.len(), devices);
    // Reads never asked polkit.
    assert!(
        !p.polkitd.log().contains("vfiod-test rule:"),
        "a read consulted polkit:\n{}",
        p.polkitd.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_polkitd_mutating_calls_are_refused() {
    if skip_unless_root("without_polkitd_mutating_calls_are_refused") {
        return;
    }
    let mut p = PolkitHarness::start(CONFIG).await;
    assert_ok(&p.vfioctl(ROOT, &["rescan"]).await, "rescan as root");
    p.polkitd.stop();
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();

    // Fail closed: even root is refused when nobody can say yes.
    for (args, action) in MUTATING {
        let what = format!("vfioctl {} as root without polkitd", args.join(" "));
        let r = p.vfioctl(ROOT, args).await;
        assert_refused(&r, action, &what);
        assert!(
            r.stderr.contains("polkit unreachable"),
            "{what}: the error must say polkit is unreachable: {}",
            r.stderr
        );
    }
    assert_eq!(p.h.manager().await.scenario().await.unwrap(), "private");
    // Reads do not depend on polkit.
    assert_ok(&p.vfioctl(NOBODY, &["status"]).await, "status as nobody");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_action_file_mutating_calls_are_refused() {
    if skip_unless_root("without_the_action_file_mutating_calls_are_refused") {
        return;
    }
    // A host where the policy file was not installed.
    let p = PolkitHarness::start_with(CONFIG, &[], &[TEST_RULES]).await;
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();
    for (args, action) in MUTATING {
        let what = format!("vfioctl {} as root", args.join(" "));
        let r = p.vfioctl(ROOT, args).await;
        assert_refused(&r, action, &what);
        // polkitd's own words, so an operator sees what is missing.
        assert!(
            r.stderr.contains("is not registered"),
            "{what}: {}",
            r.stderr
        );
    }
    assert_eq!(p.h.manager().await.scenario().await.unwrap(), "private");
}

/// Names, sizes and times of a directory's entries (and of the directory itself).
fn snapshot(dir: &str) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let stat = |p: PathBuf| {
        let m = std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        (p, m.len(), m.modified().unwrap())
    };
    let mut out = vec![stat(PathBuf::from(dir))];
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| stat(e.unwrap().path()))
        .collect();
    entries.sort();
    out.extend(entries);
    out
}

fn mount_points(pid: &str) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polkitd_sees_only_the_test_policy_and_the_host_is_untouched() {
    if skip_unless_root("polkitd_sees_only_the_test_policy_and_the_host_is_untouched") {
        return;
    }
    let host_dirs: Vec<&str> = std::iter::once(HOST_ACTIONS_DIR)
        .chain(HOST_RULES_DIRS)
        .collect();
    let before: Vec<_> = host_dirs.iter().map(|d| snapshot(d)).collect();

    let dir = scratch_dir();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let bus = start_system_bus(dir.path());
    let mut polkitd = Polkitd::start(
        &bus,
        &dir.path().join("polkit"),
        &[VFIOD_ACTIONS],
        &[TEST_RULES],
    )
    .await;

    // The bind mounts exist in polkitd's namespace only.
    let inside = mount_points(&polkitd.pid().to_string());
    let outside = mount_points("self");
    for d in &host_dirs {
        assert!(inside.iter().any(|m| m == d), "{d} not mounted for polkitd");
        assert!(!outside.iter().any(|m| m == d), "{d} mounted on the host");
    }
    // polkitd parses the shipped action file and knows nothing of the host's actions.
    let conn = zbus::connection::Builder::address(bus.address())
        .build()
        .await
        .unwrap();
    let authority = zbus_polkit::policykit1::AuthorityProxy::new(&conn)
        .await
        .unwrap();
    let mut ids: Vec<String> = authority
        .enumerate_actions("")
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.action_id)
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        [
            "org.vfiod.vfiod1.claim",
            "org.vfiod.vfiod1.manage",
            "org.vfiod.vfiod1.program"
        ]
    );
    // It dropped to its own user, as in production.
    let owner = std::os::unix::fs::MetadataExt::uid(
        &std::fs::metadata(format!("/proc/{}", polkitd.pid())).unwrap(),
    );
    assert_eq!(owner, uid_of("polkitd"));

    polkitd.stop();
    drop(bus);
    let after: Vec<_> = host_dirs.iter().map(|d| snapshot(d)).collect();
    assert_eq!(after, before, "the host's polkit directories changed");
}
