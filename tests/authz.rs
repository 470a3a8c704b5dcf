//! Authorization against a real polkitd (Debian's, on a private system bus, in its own mount
//! namespace: see `common::polkit`): each mutating method asks polkit for the action of its verb
//! family, with details a rules file can read; root and the users the test rules grant an action
//! may call that action's methods and no others; an unprivileged uid is refused with
//! `NotAuthorized` and changes nothing; reads are open to everyone; without polkitd a mutating
//! call is refused, never allowed.
//!
//! Every test that starts polkitd needs root: `#[ignore = "needs root"]`, and CI runs them as
//! root with `--ignored`. Each asserts first that it is root, so that running them as anyone
//! else fails instead of passing untested.

mod common;

use common::polkit::{
    assert_root, scratch_dir, start_system_bus, uid_of, PolkitHarness, Polkitd, Run,
    CONFIGURE_USER, GRANTED_USER, HOST_ACTIONS_DIR, HOST_RULES_DIRS, MODE_USER, NOBODY, ONE_DEVICE,
    ONE_DEVICE_USER, ROOT, TEST_RULES, VFIOD_ACTIONS,
};
use common::{addr, Harness};
use std::path::PathBuf;
use vfiod::model::task::TaskKind;

const NOT_AUTHORIZED: &str = "org.vfiod.Vfiod1.Error.NotAuthorized";
/// Polling is slow, so only an explicit rescan or reload changes what vfiod shows.
/// The FPGA is selected so that mode changes on it can succeed for those allowed.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nclass = \"0x12\"\n";
const CHANGED_CONFIG: &str = "scenario = \"public\"\npoll_interval = 3600\n";

const CONFIGURE: &str = "org.vfiod.vfiod1.configure";
const MODE: &str = "org.vfiod.vfiod1.mode";
const CLAIM: &str = "org.vfiod.vfiod1.claim";
const PROGRAM: &str = "org.vfiod.vfiod1.program";
const MIGRATE: &str = "org.vfiod.vfiod1.migrate";
/// Every action the policy file declares.
const ACTIONS: [&str; 5] = [CONFIGURE, MODE, CLAIM, PROGRAM, MIGRATE];

/// Every mutating vfioctl command, the polkit action it needs and the details vfiod sends with
/// it, as the test rules log them. A new mutating method (SetMode, ResetTask, starting a task,
/// ...) gets a line here.
const MUTATING: &[(&[&str], &str, &str)] = &[
    (&["reload"], CONFIGURE, "verb=Reload"),
    (&["rescan"], CONFIGURE, "verb=Rescan"),
    (
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
        MODE,
        "verb=SetMode device=0000:af:00.0 mode=vf num_vfs=2",
    ),
    (
        &["mode", "0000:af:00.0", "pf", "--wait"],
        MODE,
        "verb=SetMode device=0000:af:00.0 mode=pf",
    ),
    (
        &["task", "start", "0000:af:00.0", "apply", "--wait"],
        MODE,
        "verb=Apply device=0000:af:00.0",
    ),
];

/// The test rules' users and the actions each is granted.
const GRANTS: &[(&str, &[&str])] = &[
    ("nobody", &[]),
    (CONFIGURE_USER, &[CONFIGURE]),
    (MODE_USER, &[MODE]),
    (GRANTED_USER, &ACTIONS),
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

/// The test rules logged that `user` was asked about `action` with exactly `details` ("key=value"
/// pairs in the order of the rules file, "" for none).
fn assert_asked(log: &str, action: &str, user: &str, details: &str) {
    let line = if details.is_empty() {
        format!("vfiod-test rule: {action} for {user}")
    } else {
        format!("vfiod-test rule: {action} for {user} {details}")
    };
    assert!(
        log.lines().any(|l| l.ends_with(&line)),
        "polkitd never ran {line:?}:\n{log}"
    );
}

/// What a refused call must leave as it was: the kernel's writes, the task and event records.
#[derive(Debug, PartialEq)]
struct Footprint {
    tasks: usize,
    events: usize,
}

/// Starts watching: forgets the kernel's writes so far and counts the records.
fn footprint(h: &Harness) -> Footprint {
    h.kernel.take_write_log();
    Footprint {
        tasks: h.store().tasks(None, 10_000).unwrap().len(),
        events: event_count(h),
    }
}

fn assert_unchanged(h: &Harness, before: &Footprint, what: &str) {
    let writes = h.kernel.take_write_log();
    assert!(writes.is_empty(), "{what} wrote to sysfs: {writes:?}");
    let after = Footprint {
        tasks: h.store().tasks(None, 10_000).unwrap().len(),
        events: event_count(h),
    };
    assert_eq!(&after, before, "{what} left tasks or events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn every_mutating_method_needs_authorization() {
    assert_root();
    let p = PolkitHarness::start(CONFIG).await;
    let granted = uid_of(GRANTED_USER);
    for (args, action, _) in MUTATING {
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
    assert_refused(&r, MODE, "vfioctl task reset as nobody");
    // The decisions for the unprivileged uids came from the test rules file, so the harness
    // really runs polkitd with it (root is authorized by polkitd before any rule), and vfiod
    // sent each check with its details.
    let log = p.polkitd.log();
    for (_, action, details) in MUTATING {
        for user in ["nobody", GRANTED_USER] {
            assert_asked(&log, action, user, details);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_refused_reload_changes_nothing() {
    assert_root();
    let p = PolkitHarness::start(CONFIG).await;
    let m = p.h.manager().await;
    let events_before = event_count(&p.h);
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();

    let r = p.vfioctl(NOBODY, &["reload"]).await;
    assert_refused(&r, CONFIGURE, "reload as nobody");
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
#[ignore = "needs root"]
async fn a_refused_rescan_changes_nothing() {
    assert_root();
    let p = PolkitHarness::start(CONFIG).await;
    let m = p.h.manager().await;
    let gpu = addr("0000:17:00.0");
    // The card falls off the bus; only a pass would notice.
    p.h.kernel.set_config_all_ones(gpu, true).unwrap();
    let events_before = event_count(&p.h);

    let r = p.vfioctl(NOBODY, &["rescan"]).await;
    assert_refused(&r, CONFIGURE, "rescan as nobody");
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
#[ignore = "needs root"]
async fn reads_are_open_to_everyone() {
    assert_root();
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
#[ignore = "needs root"]
async fn without_polkitd_mutating_calls_are_refused() {
    assert_root();
    let mut p = PolkitHarness::start(CONFIG).await;
    assert_ok(&p.vfioctl(ROOT, &["rescan"]).await, "rescan as root");
    p.polkitd.stop();
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();

    // Fail closed: even root is refused when nobody can say yes.
    for (args, action, _) in MUTATING {
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
#[ignore = "needs root"]
async fn without_the_action_file_mutating_calls_are_refused() {
    assert_root();
    // A host where the policy file was not installed.
    let p = PolkitHarness::start_with(CONFIG, &[], &[TEST_RULES]).await;
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();
    for (args, action, _) in MUTATING {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn each_action_allows_its_methods_and_no_others() {
    assert_root();
    let p = PolkitHarness::start(CONFIG).await;
    for (args, action, details) in MUTATING {
        for (user, granted) in GRANTS {
            let what = format!("vfioctl {} as {user}", args.join(" "));
            let before = footprint(&p.h);
            let r = p.vfioctl(uid_of(user), args).await;
            if granted.contains(action) {
                assert_ok(&r, &what);
            } else {
                assert_refused(&r, action, &what);
                assert_unchanged(&p.h, &before, &what);
            }
            assert_asked(&p.polkitd.log(), action, user, details);
        }
    }
}

/// Leaves a task of `kind` in error on the FPGA, as if vfiod had died while it ran, and starts
/// vfiod again (asking polkit).
async fn leave_failed_task(p: &mut PolkitHarness, kind: TaskKind) {
    let fpga = addr("0000:af:00.0");
    let t = p.h.store().create_task(fpga, kind, "{}", "test").unwrap();
    p.h.store().task_progress(t.id, "a step", 20).unwrap();
    p.h.stop_server().await;
    p.start_vfiod().await;
    assert_eq!(failed_task(&p.h), Some(kind), "no {kind} task in error");
}

/// The kind of the FPGA's task in error, if any.
fn failed_task(h: &Harness) -> Option<TaskKind> {
    h.store()
        .active_task(addr("0000:af:00.0"))
        .unwrap()
        .filter(|t| t.state.as_str() == "error")
        .map(|t| t.kind)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn reset_task_asks_the_action_that_owns_the_task() {
    assert_root();
    let mut p = PolkitHarness::start(CONFIG).await;
    let reset: &[&str] = &["task", "reset", "0000:af:00.0"];
    // kind, the action that owns it, a user granted it, users refused.
    let cases: &[(TaskKind, &str, &str, &[&str])] = &[
        (
            TaskKind::Split,
            MODE,
            MODE_USER,
            &["nobody", CONFIGURE_USER],
        ),
        (
            TaskKind::Program,
            PROGRAM,
            GRANTED_USER,
            &["nobody", MODE_USER],
        ),
        (
            TaskKind::Migrate,
            MIGRATE,
            GRANTED_USER,
            &["nobody", MODE_USER],
        ),
    ];
    for (kind, action, allowed, refused) in cases {
        leave_failed_task(&mut p, *kind).await;
        for user in *refused {
            let what = format!("reset of a {kind} task as {user}");
            let before = footprint(&p.h);
            assert_refused(&p.vfioctl(uid_of(user), reset).await, action, &what);
            assert_unchanged(&p.h, &before, &what);
            assert_eq!(failed_task(&p.h), Some(*kind), "{what} cleared the task");
        }
        assert_ok(
            &p.vfioctl(uid_of(allowed), reset).await,
            &format!("reset of a {kind} task as {allowed}"),
        );
        assert_eq!(failed_task(&p.h), None, "the {kind} task is still in error");
        assert_asked(
            &p.polkitd.log(),
            action,
            allowed,
            "verb=ResetTask device=0000:af:00.0",
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_rule_can_allow_mode_changes_on_one_device_only() {
    assert_root();
    // The X710 NIC is selected too: a second device the user could change if the rule did not
    // read the device.
    let config = format!("{CONFIG}[[select]]\nid = \"8086:1572\"\n");
    let p = PolkitHarness::start(&config).await;
    let user = uid_of(ONE_DEVICE_USER);
    let (fpga, nic) = (addr(ONE_DEVICE), addr("0000:3b:00.0"));

    let before = footprint(&p.h);
    let r = p
        .vfioctl(
            user,
            &["mode", "0000:3b:00.0", "vf", "--vfs", "2", "--wait"],
        )
        .await;
    assert_refused(&r, MODE, "SetMode on the NIC");
    assert_unchanged(&p.h, &before, "SetMode on the NIC");
    assert_eq!(p.h.kernel.num_vfs(nic), Some(0));
    // Other actions stay refused on the one device too.
    assert_refused(
        &p.vfioctl(user, &["rescan"]).await,
        CONFIGURE,
        "rescan by the one-device user",
    );

    let args = ["mode", ONE_DEVICE, "vf", "--vfs", "2", "--wait"];
    assert_ok(&p.vfioctl(user, &args).await, "SetMode on the FPGA");
    assert_eq!(p.h.kernel.num_vfs(fpga), Some(2));
    assert_eq!(p.h.kernel.num_vfs(nic), Some(0));

    let log = p.polkitd.log();
    for device in ["0000:3b:00.0", ONE_DEVICE] {
        let details = format!("verb=SetMode device={device} mode=vf num_vfs=2");
        assert_asked(&log, MODE, ONE_DEVICE_USER, &details);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_declared_actions_are_registered_with_polkitd() {
    use zbus_polkit::policykit1::{
        AuthorityProxy, CheckAuthorizationFlags, ImplicitAuthorization, Subject,
    };
    assert_root();
    let p = PolkitHarness::start(CONFIG).await;
    // vfiod's own client connection: root's, which may ask about any subject.
    let authority = AuthorityProxy::new(&p.h.client).await.unwrap();

    // Each registered with the documented defaults: an administrator's password, kept for a
    // while, in an active session; never without a session.
    let described = authority.enumerate_actions("").await.unwrap();
    for id in ACTIONS {
        let a = described
            .iter()
            .find(|a| a.action_id == id)
            .unwrap_or_else(|| panic!("polkitd does not know {id}"));
        assert!(!a.description.is_empty() && !a.message.is_empty(), "{a:?}");
        assert_eq!(a.implicit_any, ImplicitAuthorization::NotAuthorized, "{id}");
        assert_eq!(
            a.implicit_inactive,
            ImplicitAuthorization::NotAuthorized,
            "{id}"
        );
        assert_eq!(
            a.implicit_active,
            ImplicitAuthorization::AdministratorAuthenticationRequiredRetained,
            "{id}"
        );
    }

    // polkitd answers a check of an action it does not know with an error ("is not
    // registered"), before any rule, and one it knows with a decision, from the rules: so the
    // actions no method asks yet are known, refused to nobody, granted by a rules file.
    let sleeper = |uid: u32| {
        let mut c = std::process::Command::new("sleep");
        std::os::unix::process::CommandExt::uid(&mut c, uid);
        c.arg("60").spawn().expect("spawn sleep")
    };
    let mut nobody = sleeper(NOBODY);
    let mut granted = sleeper(uid_of(GRANTED_USER));
    let ask = |pid: u32, action: &'static str| {
        let authority = &authority;
        async move {
            let subject = Subject::new_for_pid(pid, None, None).unwrap();
            authority
                .check_authorization(
                    &subject,
                    action,
                    &Default::default(),
                    CheckAuthorizationFlags::empty(),
                    "",
                )
                .await
        }
    };
    for id in [CLAIM, PROGRAM, MIGRATE] {
        let refused = ask(nobody.id(), id)
            .await
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        assert!(
            !refused.is_authorized && !refused.is_challenge,
            "{id}: {refused:?}"
        );
        let allowed = ask(granted.id(), id)
            .await
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        assert!(allowed.is_authorized, "{id}: {allowed:?}");
        let log = p.polkitd.log();
        assert_asked(&log, id, "nobody", "");
        assert_asked(&log, id, GRANTED_USER, "");
    }
    // The action every method asked before: gone.
    let e = ask(nobody.id(), "org.vfiod.vfiod1.manage")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is not registered"), "{e}");
    for c in [&mut nobody, &mut granted] {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The same five actions in the policy file, the bus policy's comment and the operator's page,
/// and the same detail keys in the page (the README points there).
#[test]
fn the_actions_and_details_are_documented_where_operators_look() {
    let read = |p: &str| {
        let path = format!("{}/{p}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    assert_eq!(vfiod::dbus::auth::ACTIONS, ACTIONS);
    let policy = read("polkit/org.vfiod.vfiod1.policy");
    let declared: Vec<&str> = policy
        .split("<action id=\"")
        .skip(1)
        .map(|rest| &rest[..rest.find('"').unwrap()])
        .collect();
    assert_eq!(declared, ACTIONS, "polkit/org.vfiod.vfiod1.policy");
    let bus_policy = read("conf/dbus-1/system.d/org.vfiod.Vfiod1.conf");
    let page = read("docs/polkit.md");
    for id in ACTIONS {
        assert!(
            bus_policy.contains(id),
            "the bus policy's comment lacks {id}"
        );
        assert!(
            page.contains(&format!("`{id}`")),
            "docs/polkit.md lacks {id}"
        );
    }
    for key in vfiod::dbus::auth::Detail::ALL {
        let key = key.as_str();
        assert!(
            page.contains(&format!("`{key}`")),
            "docs/polkit.md lacks the detail {key}"
        );
    }
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
#[ignore = "needs root"]
async fn polkitd_sees_only_the_test_policy_and_the_host_is_untouched() {
    assert_root();
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
    let mut declared = ACTIONS.to_vec();
    declared.sort();
    assert_eq!(ids, declared);
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
