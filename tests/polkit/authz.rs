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

use crate::common::polkit::{
    assert_root, scratch_dir, start_system_bus, uid_of, user_namespace_view, PolkitHarness,
    Polkitd, Run, CONFIGURE_USER, GPU_GROUP, GPU_GROUP_RULES, GPU_USER, GRANTED_USER,
    HOST_ACTIONS_DIR, HOST_RULES_DIRS, MODE_USER, NOBODY, ONE_DEVICE, ONE_DEVICE_USER, ROOT,
    TEST_RULES, VFIOD_ACTIONS,
};
use crate::common::{addr, eventually_async, Harness};
use std::path::PathBuf;
use std::time::Duration;
use vfiod::model::task::TaskKind;
use vfiod::store::ClaimRecord;

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
/// The actions no method asks yet: checked with polkitd directly. Every other action is asked
/// by a method that [`MUTATING`], [`CLAIMING`] or [`PROGRAMMING`] lists.
const NOT_ASKED_YET: [&str; 0] = [];

/// The FPGA task calls (vfioctl command, action, details as the test rules log them), made
/// with image `nlb` in the catalog (see [`start_for_programming`]). The catalog's own calls are
/// in `the_image_catalog_is_read_by_all_and_changed_under_the_program_action`.
const PROGRAMMING: &[(&[&str], &str, &str)] = &[
    (
        &["fpga", "program", "0000:af:00.0", "nlb", "--wait"],
        PROGRAM,
        "verb=Program device=0000:af:00.0 image=nlb",
    ),
    (
        &["fpga", "verify", "0000:af:00.0", "nlb", "--wait"],
        PROGRAM,
        "verb=Verify device=0000:af:00.0 image=nlb",
    ),
];

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
    (
        &["clean", "0000:af:00.0", "--wait"],
        MODE,
        "verb=Clean device=0000:af:00.0",
    ),
];

/// [`CONFIG`] with the GPU's IOMMU group (the GPU and its HDMI audio function) and the X710 NIC
/// selected too: with the FPGA, three devices of three kinds to claim.
fn claim_config() -> String {
    format!(
        "{CONFIG}[[select]]\nclass = \"0x03\"\n[[select]]\nid = \"10de:1aef\"\n\
         [[select]]\nid = \"8086:1572\"\n"
    )
}

const GPU: &str = "0000:17:00.0";
const GPU_AUDIO: &str = "0000:17:00.1";
const NIC: &str = "0000:3b:00.0";
/// What root claims before the [`CLAIMING`] calls: the GPU group for "desktop", claim 1.
const CLAIM_THE_GPU: &[&str] = &["claim", "--kind", "gpu", "--vm", "desktop"];

/// The claim calls (vfioctl command, action, details as the test rules log them), made while
/// claim 1 ([`CLAIM_THE_GPU`]) holds the GPU group and every other device of [`claim_config`]
/// is free: each would change something if it were allowed. A Claim that names no kind is
/// asked with an empty `kind`.
const CLAIMING: &[(&[&str], &str, &str)] = &[
    (
        &["claim", "--kind", "nic", "--vm", "db"],
        CLAIM,
        "verb=Claim vm=db kind=nic",
    ),
    (
        &["claim", "--address", "0000:af:00.0", "--vm", "db"],
        CLAIM,
        "verb=Claim device=0000:af:00.0 vm=db kind=",
    ),
    (&["claim", "--vm", "db"], CLAIM, "verb=Claim vm=db kind="),
    (
        &["release", "1"],
        CLAIM,
        "verb=Release device=0000:17:00.0 vm=desktop kind=gpu",
    ),
    (
        &["attach", "1", "desktop", "--wait"],
        CLAIM,
        "verb=Attach device=0000:17:00.0 vm=desktop kind=gpu",
    ),
    (
        &["detach", "1", "--wait"],
        CLAIM,
        "verb=Detach device=0000:17:00.0 vm=desktop kind=gpu",
    ),
    (
        &["migrate", "desktop", "qemu+ssh://hostb/system", "--wait"],
        MIGRATE,
        "verb=Migrate vm=desktop",
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

/// Every claim the store holds, released ones too (ids count up from 1 and are never reused).
fn claim_rows(h: &Harness) -> Vec<ClaimRecord> {
    let store = h.store();
    (1..)
        .map_while(|id| store.claim_record(id).unwrap())
        .collect()
}

/// What a refused call must leave as it was: the kernel's writes, the task, event and claim
/// records.
#[derive(Debug, PartialEq)]
struct Footprint {
    tasks: usize,
    events: usize,
    claim_events: usize,
    claims: Vec<ClaimRecord>,
}

fn records(h: &Harness) -> Footprint {
    let events = h.store().events(None, 0, 10_000).unwrap();
    Footprint {
        tasks: h.store().tasks(None, 10_000).unwrap().len(),
        events: events.len(),
        claim_events: events.iter().filter(|e| e.kind.as_str() == "claim").count(),
        claims: claim_rows(h),
    }
}

/// Starts watching: forgets the kernel's writes so far and reads the records.
fn footprint(h: &Harness) -> Footprint {
    h.kernel.take_write_log();
    records(h)
}

fn assert_unchanged(h: &Harness, before: &Footprint, what: &str) {
    let writes = h.kernel.take_write_log();
    assert!(writes.is_empty(), "{what} wrote to sysfs: {writes:?}");
    assert_eq!(&records(h), before, "{what} left tasks, events or claims");
}

/// The claim number in `vfioctl claim`'s output ("claim 3: 0000:17:00.0 + ... for vm (path)").
/// Each read works for root and for nobody, and shows both the same.
async fn nobody_reads_what_root_reads(p: &PolkitHarness, reads: &[&[&str]]) {
    for args in reads {
        let what = format!("vfioctl {}", args.join(" "));
        let as_root = p.vfioctl(ROOT, args).await;
        let as_nobody = p.vfioctl(NOBODY, args).await;
        // A find with no match exits with the no-device status, for both alike.
        if !(args[0] == "find" && as_root.stdout.is_empty()) {
            assert_ok(&as_root, &format!("{what} as root"));
            assert_ok(&as_nobody, &format!("{what} as nobody"));
        }
        assert_eq!(as_nobody.ok, as_root.ok, "{what}: {}", as_nobody.stderr);
        // `status --json` says when it was read (`read_ms`): that differs, by design.
        let seen = |out: &str| -> String {
            out.lines()
                .filter(|l| !l.trim_start().starts_with("\"read_ms\""))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            seen(&as_nobody.stdout),
            seen(&as_root.stdout),
            "{what}: nobody and root see different things"
        );
    }
}

fn claim_id(r: &Run) -> String {
    r.stdout
        .strip_prefix("claim ")
        .and_then(|rest| rest.split(':').next())
        .filter(|n| n.parse::<u64>().is_ok())
        .unwrap_or_else(|| panic!("no claim number in {:?}", r.stdout))
        .to_string()
}

/// What every client sees of the claims on the bus, as root reads it: the claim objects
/// (`GetClaims` and their properties) and each device's `Claim`.
async fn claims_on_the_bus(p: &PolkitHarness) -> (String, String) {
    let claims = p.vfioctl(ROOT, &["claims", "--json"]).await;
    assert_ok(&claims, "vfioctl claims --json as root");
    let list = p.vfioctl(ROOT, &["list", "--json"]).await;
    assert_ok(&list, "vfioctl list --json as root");
    (claims.stdout, list.stdout)
}

/// vfiod with [`claim_config`] and these rules files, once every selected device is claimable.
async fn start_for_claims(actions: &[&str], rules: &[&str]) -> PolkitHarness {
    let p = PolkitHarness::start_with(&claim_config(), actions, rules).await;
    let harness = &p;
    eventually_async(
        Duration::from_secs(30),
        "the GPU group, the NIC and the FPGA are claimable",
        || async move {
            let r = harness.vfioctl(ROOT, &["find"]).await;
            let found: Vec<&str> = r.stdout.lines().collect();
            (found == [GPU, GPU_AUDIO, NIC, "0000:af:00.0"]).then_some(())
        },
    )
    .await;
    p
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
    // really runs polkitd with it (root, holding CAP_SYS_ADMIN, is not asked), and vfiod
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
        &["find"],
        &["find", "--kind", "fpga"],
        &["claims", "--json"],
        &["claims"],
    ];
    let devices = p.h.store().devices().unwrap().len();
    nobody_reads_what_root_reads(&p, reads).await;
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

/// As systemd's daemons do: without polkitd, a caller without CAP_SYS_ADMIN is refused and
/// told that polkitd is missing, and root (CAP_SYS_ADMIN) is allowed without asking anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn without_polkitd_root_is_allowed_and_others_are_told_polkitd_is_missing() {
    assert_root();
    let mut p = start_for_claims(&[VFIOD_ACTIONS], &[TEST_RULES]).await;
    assert_ok(
        &p.vfioctl(ROOT, CLAIM_THE_GPU).await,
        "claim of the GPU as root",
    );
    p.polkitd.stop();
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();
    let claims = claim_rows(&p.h);

    // Fail closed for everyone polkit would have to answer for.
    for (args, action, _) in MUTATING.iter().chain(CLAIMING) {
        let what = format!("vfioctl {} as nobody without polkitd", args.join(" "));
        let r = p.vfioctl(NOBODY, args).await;
        assert_refused(&r, action, &what);
        assert!(
            r.stderr.contains("polkitd is not running"),
            "{what}: the error must say polkitd is missing: {}",
            r.stderr
        );
    }
    assert_eq!(p.h.manager().await.scenario().await.unwrap(), "private");
    assert_eq!(
        claim_rows(&p.h),
        claims,
        "a refused call changed the claims"
    );
    // Reads do not depend on polkit.
    assert_ok(&p.vfioctl(NOBODY, &["status"]).await, "status as nobody");
    assert_ok(&p.vfioctl(NOBODY, &["claims"]).await, "claims as nobody");

    // Root needs no polkitd: it claims, releases, rescans and reloads.
    let r = p
        .vfioctl(ROOT, &["claim", "--kind", "nic", "--vm", "db"])
        .await;
    assert_ok(&r, "claim of the NIC as root without polkitd");
    let id = claim_id(&r);
    assert_eq!(claim_rows(&p.h).len(), claims.len() + 1);
    assert_ok(
        &p.vfioctl(ROOT, &["release", &id]).await,
        "release as root without polkitd",
    );
    let rows = claim_rows(&p.h);
    let nic = rows
        .iter()
        .find(|c| c.id.to_string() == id)
        .expect("the NIC claim");
    assert_eq!(
        nic.state,
        vfiod::model::claim::ClaimState::Released,
        "{nic:?}"
    );
    assert_ok(&p.vfioctl(ROOT, &["rescan"]).await, "rescan as root");
    assert_ok(&p.vfioctl(ROOT, &["reload"]).await, "reload as root");
    assert_eq!(p.h.manager().await.scenario().await.unwrap(), "public");
}

/// A host where the policy file is not installed: polkitd refuses every action it does not
/// know, in its own words; root, which polkit is not asked about, still manages the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn without_the_action_file_others_are_refused_and_root_is_not_asked() {
    assert_root();
    let mut p = start_for_claims(&[], &[TEST_RULES]).await;
    // Claim 1 is recorded as an earlier vfiod would have.
    claim_the_gpu_in_the_store(&mut p).await;
    std::fs::write(&p.h.config_path, CHANGED_CONFIG).unwrap();
    let claims = claim_rows(&p.h);
    for (args, action, _) in MUTATING.iter().chain(CLAIMING) {
        let what = format!("vfioctl {} as nobody", args.join(" "));
        let r = p.vfioctl(NOBODY, args).await;
        assert_refused(&r, action, &what);
        // polkitd's own words, so an operator sees what is missing.
        assert!(
            r.stderr.contains("is not registered"),
            "{what}: {}",
            r.stderr
        );
    }
    assert_eq!(p.h.manager().await.scenario().await.unwrap(), "private");
    assert_eq!(
        claim_rows(&p.h),
        claims,
        "a refused call changed the claims"
    );
    assert_ok(&p.vfioctl(ROOT, &["reload"]).await, "reload as root");
    assert_eq!(p.h.manager().await.scenario().await.unwrap(), "public");
}

/// Claim 1 as [`CLAIM_THE_GPU`] makes it, written to the store directly (as a vfiod that could
/// ask polkit would have), and vfiod started again to show it.
async fn claim_the_gpu_in_the_store(p: &mut PolkitHarness) {
    let req = vfiod::claim::Requirements {
        kind: Some(vfiod::model::device::Kind::Gpu),
        ..Default::default()
    };
    let owner = vfiod::claim::Owner::new(Some("desktop"), None, 0, false).unwrap();
    let claim = p.h.store().claim(&req, &owner, "the test").unwrap();
    assert_eq!((claim.id, claim.address), (1, addr(GPU)));
    p.h.stop_server().await;
    p.start_vfiod().await;
    let shown = p.vfioctl(ROOT, &["claims", "--json"]).await;
    assert!(
        shown.stdout.contains("/org/vfiod/Vfiod1/claim/1"),
        "{shown:?}"
    );
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

/// Reads of claims are open: an unprivileged caller finds devices and reads the claims and the
/// devices' `Claim` as root does. Claim, Release, Attach and Detach are refused with
/// NotAuthorized naming the claim action, asked with their details, and change nothing: no claim
/// record, no event, no sysfs write, the same objects on the bus. Root may then do what was
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn an_unprivileged_caller_reads_claims_but_cannot_claim_release_attach_or_detach() {
    assert_root();
    let p = start_for_claims(&[VFIOD_ACTIONS], &[TEST_RULES]).await;
    let r = p.vfioctl(ROOT, CLAIM_THE_GPU).await;
    assert_ok(&r, "claim of the GPU as root");
    assert_eq!(claim_id(&r), "1");

    let reads: &[&[&str]] = &[
        &["find"],
        &["find", "--kind", "nic"],
        &["find", "--kind", "gpu"],
        &["claims", "--json"],
        &["claims"],
        &["show", GPU_AUDIO, "--json"],
        &["list", "--json"],
    ];
    nobody_reads_what_root_reads(&p, reads).await;
    // What nobody read is the claim: the free devices (the FPGA first, on the NUMA node
    // without claims), the claim's properties, and the audio function's Claim.
    let found = p.vfioctl(NOBODY, &["find"]).await.stdout;
    assert_eq!(found.lines().collect::<Vec<_>>(), ["0000:af:00.0", NIC]);
    let seen: Vec<vfiod::client::claim::ClaimView> =
        serde_json::from_str(&p.vfioctl(NOBODY, &["claims", "--json"]).await.stdout).unwrap();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        (seen[0].address.as_str(), seen[0].vm_name.as_str()),
        (GPU, "desktop")
    );
    assert_eq!(seen[0].functions, [GPU, GPU_AUDIO]);
    let audio = p.vfioctl(NOBODY, &["show", GPU_AUDIO, "--json"]).await;
    let audio: vfiod::client::DeviceView = serde_json::from_str(&audio.stdout).unwrap();
    assert_eq!(audio.claim.as_deref(), Some("/org/vfiod/Vfiod1/claim/1"));
    assert!(
        !p.polkitd
            .log()
            .contains("vfiod-test rule: org.vfiod.vfiod1.claim for nobody"),
        "a read consulted polkit:\n{}",
        p.polkitd.log()
    );

    let bus = claims_on_the_bus(&p).await;
    for (args, action, details) in CLAIMING {
        let what = format!("vfioctl {} as nobody", args.join(" "));
        let before = footprint(&p.h);
        assert_refused(&p.vfioctl(NOBODY, args).await, action, &what);
        assert_unchanged(&p.h, &before, &what);
        assert_eq!(
            claims_on_the_bus(&p).await,
            bus,
            "{what} changed the claims on the bus"
        );
        assert_asked(&p.polkitd.log(), action, "nobody", details);
    }

    // The refusals were the only obstacle.
    assert_ok(&p.vfioctl(ROOT, &["release", "1"]).await, "release as root");
    let r = p.vfioctl(ROOT, &["claim", "--vm", "db"]).await;
    assert_ok(&r, "claim as root");
    assert_eq!(claim_id(&r), "2");
    let held: Vec<_> = claim_rows(&p.h)
        .into_iter()
        .map(|c| (c.id, c.state.as_str().to_string()))
        .collect();
    assert_eq!(held, [(1, "released".into()), (2, "claimed".into())]);
}

/// Claim and Release ask org.vfiod.vfiod1.claim with the VM, the kind and (Release) the device:
/// a user granted it claims and releases, and the claim names that user; users granted other
/// actions only are refused both, changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_claim_action_allows_claim_and_release_and_no_other_action_does() {
    assert_root();
    let p = start_for_claims(&[VFIOD_ACTIONS], &[TEST_RULES]).await;
    for (user, granted) in GRANTS {
        let uid = uid_of(user);
        let allowed = granted.contains(&CLAIM);

        let what = format!("claim of the GPU as {user}");
        let before = footprint(&p.h);
        let r = p.vfioctl(uid, CLAIM_THE_GPU).await;
        let (id, by) = if allowed {
            assert_ok(&r, &what);
            (claim_id(&r), uid)
        } else {
            assert_refused(&r, CLAIM, &what);
            assert_unchanged(&p.h, &before, &what);
            let r = p.vfioctl(ROOT, CLAIM_THE_GPU).await;
            assert_ok(&r, "claim of the GPU as root");
            (claim_id(&r), ROOT)
        };
        let record = p.h.store().claim_record(id.parse().unwrap()).unwrap();
        let record = record.expect("the claim is recorded");
        assert_eq!(record.functions, [addr(GPU), addr(GPU_AUDIO)]);
        assert!(
            record.requested_by.starts_with(&format!("uid {by} ")),
            "claim {id} names {:?}, not uid {by}",
            record.requested_by
        );

        let what = format!("release of claim {id} as {user}");
        let before = footprint(&p.h);
        let r = p.vfioctl(uid, &["release", &id]).await;
        if allowed {
            assert_ok(&r, &what);
        } else {
            assert_refused(&r, CLAIM, &what);
            assert_unchanged(&p.h, &before, &what);
            assert_ok(&p.vfioctl(ROOT, &["release", &id]).await, "release as root");
        }
        let record = p.h.store().claim_record(id.parse().unwrap()).unwrap();
        assert_eq!(record.unwrap().state.as_str(), "released");
        // Its clean (a reset of the GPU's bus) is vfiod's own work, done before the next round
        // watches for writes.
        crate::common::cleaned(&p.h, GPU).await;

        let log = p.polkitd.log();
        assert_asked(&log, CLAIM, user, "verb=Claim vm=desktop kind=gpu");
        assert_asked(
            &log,
            CLAIM,
            user,
            "verb=Release device=0000:17:00.0 vm=desktop kind=gpu",
        );
    }
}

/// The documented rules file that lets a group claim GPUs, and nothing else, is honoured: a
/// member claims the GPU (with its audio function) and releases it; the same member is refused
/// a claim of another kind, a claim that names no kind (even of the GPU by its address) and
/// the release of a NIC's claim; a user outside the group is refused the GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_rules_file_can_let_a_group_claim_gpus_only() {
    assert_root();
    // polkitd reads the groups from the host's group database, as `id` does.
    let group = nix::unistd::Group::from_name(GPU_GROUP)
        .unwrap()
        .unwrap_or_else(|| panic!("no group {GPU_GROUP} on this host"));
    let primary = |u: u32| {
        nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(u))
            .unwrap()
            .unwrap()
            .gid
    };
    assert_eq!(primary(uid_of(GPU_USER)), group.gid);
    assert!(primary(NOBODY) != group.gid && !group.mem.iter().any(|m| m == "nobody"));

    let p = start_for_claims(&[VFIOD_ACTIONS], &[GPU_GROUP_RULES, TEST_RULES]).await;
    let member = uid_of(GPU_USER);

    // Not a GPU, or no kind asked: the group rule passes, the test rules refuse.
    let refused: &[(&[&str], &str)] = &[
        (
            &["claim", "--kind", "nic", "--vm", "web1"],
            "verb=Claim vm=web1 kind=nic",
        ),
        (
            &["claim", "--kind", "fpga", "--vm", "web1"],
            "verb=Claim vm=web1 kind=fpga",
        ),
        (&["claim", "--vm", "web1"], "verb=Claim vm=web1 kind="),
        (
            &["claim", "--address", GPU, "--vm", "web1"],
            "verb=Claim device=0000:17:00.0 vm=web1 kind=",
        ),
        (
            &[
                "claim",
                "--kind",
                "other",
                "--address",
                GPU_AUDIO,
                "--vm",
                "web1",
            ],
            "verb=Claim device=0000:17:00.1 vm=web1 kind=other",
        ),
    ];
    for (args, details) in refused {
        let what = format!("vfioctl {} as {GPU_USER}", args.join(" "));
        let before = footprint(&p.h);
        assert_refused(&p.vfioctl(member, args).await, CLAIM, &what);
        assert_unchanged(&p.h, &before, &what);
        assert_asked(&p.polkitd.log(), CLAIM, GPU_USER, details);
    }
    // The group is what grants it.
    let gpu: &[&str] = &["claim", "--kind", "gpu", "--vm", "desktop"];
    let before = footprint(&p.h);
    assert_refused(
        &p.vfioctl(NOBODY, gpu).await,
        CLAIM,
        "claim of the GPU as nobody",
    );
    assert_unchanged(&p.h, &before, "claim of the GPU as nobody");

    let r = p.vfioctl(member, gpu).await;
    assert_ok(&r, &format!("claim of the GPU as {GPU_USER}"));
    let gpu_claim = claim_id(&r);
    let record =
        p.h.store()
            .claim_record(gpu_claim.parse().unwrap())
            .unwrap();
    let record = record.expect("the GPU's claim is recorded");
    assert_eq!(record.functions, [addr(GPU), addr(GPU_AUDIO)]);
    assert_eq!(record.vm_name.as_deref(), Some("desktop"));
    assert!(
        record.requested_by.starts_with(&format!("uid {member} ")),
        "{:?}",
        record.requested_by
    );
    // Nothing found: nothing on stdout, and the no-device exit status (not a success).
    let r = p.vfioctl(member, &["find", "--kind", "gpu"]).await;
    assert!(!r.ok && r.stdout.trim().is_empty(), "{}", r.stdout);

    // Another kind's claim, made by root: the member may not release it.
    let r = p
        .vfioctl(ROOT, &["claim", "--kind", "nic", "--vm", "db"])
        .await;
    assert_ok(&r, "claim of the NIC as root");
    let nic_claim = claim_id(&r);
    let what = format!("release of the NIC's claim as {GPU_USER}");
    let before = footprint(&p.h);
    assert_refused(
        &p.vfioctl(member, &["release", &nic_claim]).await,
        CLAIM,
        &what,
    );
    assert_unchanged(&p.h, &before, &what);
    assert_asked(
        &p.polkitd.log(),
        CLAIM,
        GPU_USER,
        "verb=Release device=0000:3b:00.0 vm=db kind=nic",
    );

    // Its own GPU claim: Release is asked with the GPU's kind, so the rule grants it.
    assert_ok(
        &p.vfioctl(member, &["release", &gpu_claim]).await,
        &format!("release of the GPU's claim as {GPU_USER}"),
    );
    let active: Vec<_> =
        p.h.store()
            .active_claim_records()
            .unwrap()
            .into_iter()
            .map(|c| c.address.to_string())
            .collect();
    assert_eq!(active, [NIC], "only the NIC's claim is left");
    crate::common::cleaned(&p.h, GPU).await;
    assert_eq!(
        p.vfioctl(member, &["find", "--kind", "gpu"])
            .await
            .stdout
            .trim(),
        GPU,
        "the GPU is free again"
    );
    // The member's granted calls were decided by the group rule: the test rules never saw them.
    let log = p.polkitd.log();
    for granted in [
        "verb=Claim vm=desktop kind=gpu",
        "verb=Release device=0000:17:00.0 vm=desktop kind=gpu",
    ] {
        let line = format!("vfiod-test rule: {CLAIM} for {GPU_USER} {granted}");
        assert!(
            !log.contains(&line),
            "{line:?} reached the test rules:\n{log}"
        );
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
    for id in NOT_ASKED_YET {
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
    // Each verb the tested methods send, among the `verb` values the page lists.
    for (_, _, details) in MUTATING.iter().chain(CLAIMING).chain(PROGRAMMING) {
        let verb = details
            .strip_prefix("verb=")
            .and_then(|d| d.split(' ').next())
            .unwrap_or_else(|| panic!("no verb in {details:?}"));
        assert!(
            page.contains(&format!("`{verb}`")),
            "docs/polkit.md lacks the verb {verb}"
        );
    }
}

/// Each declared action is asked by a method that the tables above exercise against polkitd,
/// or is one that no method asks yet (checked with polkitd directly): none is left untested.
#[test]
fn every_declared_action_is_exercised() {
    let mut asked: Vec<&str> = MUTATING
        .iter()
        .chain(CLAIMING)
        .chain(PROGRAMMING)
        .map(|(_, action, _)| *action)
        .collect();
    asked.sort();
    asked.dedup();
    for id in NOT_ASKED_YET {
        assert!(
            !asked.contains(&id),
            "{id} is asked: take it out of NOT_ASKED_YET"
        );
    }
    let mut covered: Vec<&str> = asked.iter().copied().chain(NOT_ASKED_YET).collect();
    covered.sort();
    let mut declared = ACTIONS.to_vec();
    declared.sort();
    assert_eq!(covered, declared);
}

/// The rules file the group test installs is the example docs/polkit.md gives operators, with
/// the group of the test's user in place of `gpu-users`: what is documented is what is tested.
#[test]
fn the_documented_gpu_group_rule_is_the_tested_one() {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    let page = read(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/polkit.md"));
    let example = page
        .split("A group that may claim the host's GPUs")
        .nth(1)
        .and_then(|rest| rest.split("```js\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .expect("docs/polkit.md has the GPU group example");
    assert!(example.contains("\"gpu-users\""), "{example}");
    let tested = example.replace("gpu-users", GPU_GROUP);
    assert!(
        read(GPU_GROUP_RULES).contains(&tested),
        "{GPU_GROUP_RULES} no longer holds the documented rule:\n{tested}"
    );
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

/// libvirt runs its hooks as root: `Manager.Hook` (and `HookWithOptions`, which the hook calls) is
/// accepted from uid 0 only, without asking
/// polkit (a hook cannot wait for an agent). Another user's hook call is refused, which the
/// hook reports: a `prepare` fails (its XML cannot be checked), a notification passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_hook_call_is_accepted_from_root_only() {
    assert_root();
    let p = start_for_claims(&[VFIOD_ACTIONS], &[TEST_RULES]).await;
    let before = footprint(&p.h);
    let r = p
        .vfioctl(NOBODY, &["hook", "qemu", "vm1", "prepare", "begin", "-"])
        .await;
    assert!(!r.ok, "{}", r.stdout);
    assert!(
        r.stderr
            .contains("Manager.HookWithOptions is accepted from root only")
            && r.stderr.contains(NOT_AUTHORIZED),
        "{}",
        r.stderr
    );
    let r = p
        .vfioctl(NOBODY, &["hook", "qemu", "vm1", "stopped", "end", "-"])
        .await;
    assert!(r.ok, "a notification never fails: {}", r.stderr);
    assert!(r.stderr.contains("root only"), "{}", r.stderr);
    assert_unchanged(&p.h, &before, "hook calls as nobody");
    // Root is answered by vfiod itself (here: the empty XML is refused).
    let r = p
        .vfioctl(ROOT, &["hook", "qemu", "vm1", "prepare", "begin", "-"])
        .await;
    assert!(!r.ok);
    assert!(
        r.stderr.contains("cannot read the XML of domain vm1") && !r.stderr.contains("root only"),
        "{}",
        r.stderr
    );
    assert!(
        !p.polkitd.log().contains("org.vfiod.vfiod1"),
        "the hook call asked polkit:\n{}",
        p.polkitd.log()
    );
}

/// The image catalog: everyone reads it; adding (from a descriptor), deactivating, activating
/// and removing ask `program` with the image's name, and an unprivileged caller is refused
/// with NotAuthorized and changes nothing; adding from a path is root's only, without polkit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn the_image_catalog_is_read_by_all_and_changed_under_the_program_action() {
    use std::os::unix::fs::PermissionsExt;
    assert_root();
    let p = PolkitHarness::start(CONFIG).await;
    let gbs = vfiod::fpga::image::build::gbs(
        "3a00972e7aac41debbd13901124e8cda",
        &["d8424dc4a4a3c413f89e433683f9040b"],
        b"bits",
    );
    let file = p.h.dir.path().join("nlb.gbs");
    std::fs::write(&file, &gbs).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let f = file.to_str().unwrap();
    let digest: String = {
        use sha2::Digest;
        sha2::Sha256::digest(&gbs)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let add = |name: &'static str| -> Vec<String> {
        ["image", "add", name, f, "--sha256", &digest]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    assert_ok(
        &p.vfioctl(ROOT, &strs(&add("nlb"))).await,
        "image add as root",
    );
    let reads: &[&[&str]] = &[
        &["image", "list", "--json"],
        &["image", "list"],
        &["image", "show", "nlb", "--json"],
    ];
    nobody_reads_what_root_reads(&p, reads).await;

    let before = event_count(&p.h);
    let changes: Vec<(Vec<String>, &str)> = vec![
        (add("other"), "verb=AddImage image=other"),
        (
            vec!["image".into(), "deactivate".into(), "nlb".into()],
            "verb=DeactivateImage image=nlb",
        ),
        (
            vec!["image".into(), "activate".into(), "nlb".into()],
            "verb=ActivateImage image=nlb",
        ),
        (
            vec!["image".into(), "remove".into(), "nlb".into()],
            "verb=RemoveImage image=nlb",
        ),
    ];
    for (cmd, _) in &changes {
        let what = format!("vfioctl {} as nobody", cmd.join(" "));
        assert_refused(&p.vfioctl(NOBODY, &strs(cmd)).await, PROGRAM, &what);
        let what = format!("vfioctl {} as {MODE_USER}", cmd.join(" "));
        assert_refused(
            &p.vfioctl(uid_of(MODE_USER), &strs(cmd)).await,
            PROGRAM,
            &what,
        );
    }
    // A download: refused before any connection (nothing listens on port 9 of loopback, and
    // the granted user's attempt shows that it would have been tried only then).
    let from_url: Vec<String> = [
        "image",
        "add",
        "fetched",
        "--url",
        "https://127.0.0.1:9/nlb.gbs",
        "--sha256",
        &digest,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for user in [NOBODY, uid_of(MODE_USER)] {
        let what = format!("vfioctl {} as uid {user}", from_url.join(" "));
        assert_refused(&p.vfioctl(user, &strs(&from_url)).await, PROGRAM, &what);
    }
    let mut from_path = add("other");
    from_path.push("--from-path".into());
    let r = p.vfioctl(NOBODY, &strs(&from_path)).await;
    assert!(
        !r.ok
            && r.stderr
                .contains("Images.AddFromPath is accepted from root only"),
        "{}",
        r.stderr
    );
    assert_eq!(
        event_count(&p.h),
        before,
        "refused catalog calls left events"
    );
    let names: Vec<String> =
        p.h.store()
            .images()
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect();
    assert_eq!(names, ["nlb"]);

    let granted = uid_of(GRANTED_USER);
    for (cmd, _) in &changes {
        let what = format!("vfioctl {} as {GRANTED_USER}", cmd.join(" "));
        assert_ok(&p.vfioctl(granted, &strs(cmd)).await, &what);
    }
    let cancel = ["image", "cancel", "fetched"];
    for user in [NOBODY, uid_of(MODE_USER)] {
        let what = format!("vfioctl image cancel as uid {user}");
        assert_refused(&p.vfioctl(user, &cancel).await, PROGRAM, &what);
    }
    // Authorized, it finds no download under way.
    let r = p.vfioctl(granted, &cancel).await;
    assert!(
        !r.ok && r.stderr.contains("NoSuchImage") && r.stderr.contains("no download"),
        "{}",
        r.stderr
    );
    let r = p.vfioctl(granted, &strs(&from_url)).await;
    assert!(
        !r.ok && r.stderr.contains("DownloadFailed") && r.stderr.contains("127.0.0.1:9"),
        "image add --url as {GRANTED_USER}: {}",
        r.stderr
    );
    let mut root_path = from_path.clone();
    root_path[2] = "root-copy".into();
    assert_ok(
        &p.vfioctl(ROOT, &strs(&root_path)).await,
        "image add --from-path as root",
    );
    let log = p.polkitd.log();
    for (_, details) in &changes {
        for user in ["nobody", GRANTED_USER] {
            assert_asked(&log, PROGRAM, user, details);
        }
    }
    for user in ["nobody", MODE_USER, GRANTED_USER] {
        assert_asked(&log, PROGRAM, user, "verb=AddImageFromUrl image=fetched");
        assert_asked(&log, PROGRAM, user, "verb=CancelDownload image=fetched");
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// vfiod with the FPGA card's NLB image `nlb` in its catalog (added by root).
async fn start_for_programming() -> PolkitHarness {
    use std::os::unix::fs::PermissionsExt;
    let p = PolkitHarness::start(CONFIG).await;
    let gbs = vfiod::fpga::image::build::gbs(
        vfiod::sim::kernel::REFERENCE_FPGA_INTERFACE,
        &["d8424dc4a4a3c413f89e433683f9040b"],
        b"bits",
    );
    let file = p.h.dir.path().join("nlb.gbs");
    std::fs::write(&file, &gbs).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let digest: String = {
        use sha2::Digest;
        sha2::Sha256::digest(&gbs)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let r = p
        .vfioctl(
            ROOT,
            &[
                "image",
                "add",
                "nlb",
                file.to_str().unwrap(),
                "--sha256",
                &digest,
            ],
        )
        .await;
    assert_ok(&r, "image add as root");
    p
}

/// Program and Verify: an unprivileged caller (and one granted only the mode action) reads the
/// device's task state and gets NotAuthorized naming the program action, asked with the device
/// and the image, and nothing changes; whoever is granted the action (and root) programs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn program_and_verify_need_the_program_action() {
    assert_root();
    let p = start_for_programming().await;
    nobody_reads_what_root_reads(
        &p,
        &[&["show", "0000:af:00.0", "--json"], &["task", "list"]],
    )
    .await;
    for (args, action, details) in PROGRAMMING {
        for user in ["nobody", MODE_USER] {
            let what = format!("vfioctl {} as {user}", args.join(" "));
            let before = footprint(&p.h);
            assert_refused(&p.vfioctl(uid_of(user), args).await, action, &what);
            assert_unchanged(&p.h, &before, &what);
        }
        for uid in [uid_of(GRANTED_USER), ROOT] {
            let what = format!("vfioctl {} as uid {uid}", args.join(" "));
            assert_ok(&p.vfioctl(uid, args).await, &what);
            // The next call finds the card idle once the task's end is published.
            let h = &p.h;
            eventually_async(Duration::from_secs(30), "the FPGA is idle", || async move {
                h.store()
                    .active_task(addr("0000:af:00.0"))
                    .unwrap()
                    .is_none()
                    .then_some(())
            })
            .await;
        }
        let log = p.polkitd.log();
        for user in ["nobody", GRANTED_USER] {
            assert_asked(&log, action, user, details);
        }
    }
    assert_eq!(
        p.h.kernel.afu_id_of(addr("0000:af:00.0")).as_deref(),
        Some("d8424dc4a4a3c413f89e433683f9040b")
    );
}

/// CAP_SYS_ADMIN's bit in a `CapEff:` mask (`linux/capability.h`).
const CAP_SYS_ADMIN: u32 = 21;

/// The mutating calls that issue 33 found passing from a user namespace (vfioctl command,
/// action), made on [`start_for_claims`]'s host with image `nlb` in the catalog and claim 1
/// ([`CLAIM_THE_GPU`]) held by root. In this order each succeeds for root.
fn userns_calls(add_other: &[String]) -> Vec<(Vec<String>, &'static str)> {
    let v = |args: &[&str]| args.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        (v(&["reload"]), CONFIGURE),
        (v(&["rescan"]), CONFIGURE),
        (v(&["claim", "--kind", "nic", "--vm", "db"]), CLAIM),
        (add_other.to_vec(), PROGRAM),
        (v(&["image", "deactivate", "nlb"]), PROGRAM),
        (v(&["image", "activate", "nlb"]), PROGRAM),
        (v(&["image", "remove", "nlb"]), PROGRAM),
        (
            v(&["task", "start", "0000:af:00.0", "apply", "--wait"]),
            MODE,
        ),
        (v(&["clean", "0000:af:00.0", "--wait"]), MODE),
        (v(&["release", "1"]), CLAIM),
    ]
}

/// Issue 33, item 1: a user namespace is no way past authorization. Inside one that `nobody`
/// made itself (`unshare --user --map-user=65534 --keep-caps`) it shows every capability and
/// its own uid in `/proc`, as root with CAP_SYS_ADMIN would: each of the ten mutating calls
/// that passed so is refused `NotAuthorized` naming its action, asked of polkit as `nobody`,
/// and changes nothing, exactly as outside the namespace; root (uid 0 as the bus reports it)
/// then makes every one, and the release is recorded as root's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_user_namespace_gives_an_unprivileged_caller_no_authority() {
    use std::os::unix::fs::PermissionsExt;
    assert_root();
    // What the old check trusted: in its own namespace nobody keeps its uid and holds
    // CAP_SYS_ADMIN, in a namespace that is not vfiod's. Without that the test proves nothing.
    let (uid_line, cap_eff, ns) = user_namespace_view(NOBODY);
    assert!(uid_line.starts_with("65534"), "Uid: {uid_line}");
    let caps = u64::from_str_radix(&cap_eff, 16).expect("CapEff is hex");
    assert_ne!(caps & (1 << CAP_SYS_ADMIN), 0, "CapEff: {cap_eff}");
    assert_ne!(
        std::fs::read_link("/proc/self/ns/user")
            .unwrap()
            .to_string_lossy(),
        ns,
        "unshare made no new user namespace"
    );

    let mut p = start_for_claims(&[VFIOD_ACTIONS], &[TEST_RULES]).await;
    claim_the_gpu_in_the_store(&mut p).await;
    let gbs = vfiod::fpga::image::build::gbs(
        vfiod::sim::kernel::REFERENCE_FPGA_INTERFACE,
        &["d8424dc4a4a3c413f89e433683f9040b"],
        b"bits",
    );
    let file = p.h.dir.path().join("nlb.gbs");
    std::fs::write(&file, &gbs).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let digest: String = {
        use sha2::Digest;
        sha2::Sha256::digest(&gbs)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let add = |name: &str| -> Vec<String> {
        let f = file.to_str().unwrap();
        ["image", "add", name, f, "--sha256", &digest]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    assert_ok(
        &p.vfioctl(ROOT, &strs(&add("nlb"))).await,
        "image add as root",
    );
    let calls = userns_calls(&add("other"));
    assert_eq!(calls.len(), 10, "the ten calls of the issue");

    for (cmd, action) in &calls {
        let args = strs(cmd);
        let line = args.join(" ");
        let bus = claims_on_the_bus(&p).await;
        let before = footprint(&p.h);
        let what = format!("vfioctl {line} as nobody in its own user namespace");
        let r = p.vfioctl_in_user_namespace(NOBODY, &args).await;
        assert_refused(&r, action, &what);
        assert_unchanged(&p.h, &before, &what);
        let what = format!("vfioctl {line} as nobody");
        assert_refused(&p.vfioctl(NOBODY, &args).await, action, &what);
        assert_unchanged(&p.h, &before, &what);
        assert_eq!(claims_on_the_bus(&p).await, bus, "vfioctl {line} as nobody");
    }
    let images: Vec<String> =
        p.h.store()
            .images()
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect();
    assert_eq!(images, ["nlb"], "nobody changed the catalog");
    // polkitd was asked about nobody (the bus's uid), never about a privileged caller.
    let log = p.polkitd.log();
    for action in [CONFIGURE, CLAIM, PROGRAM, MODE] {
        assert!(
            log.contains(&format!("vfiod-test rule: {action} for nobody")),
            "polkitd was not asked {action} for nobody:\n{log}"
        );
    }

    for (cmd, _) in &calls {
        let args = strs(cmd);
        assert_ok(
            &p.vfioctl(ROOT, &args).await,
            &format!("vfioctl {} as root", args.join(" ")),
        );
    }
    let released = p.h.store().events(None, 0, 10_000).unwrap();
    assert!(
        released
            .iter()
            .any(|e| e.message.contains("released by uid 0 ")),
        "the release names the bus's uid 0: {:#?}",
        released.iter().map(|e| &e.message).collect::<Vec<_>>()
    );
}
