//! The pool protocol against the reference pool service over real HTTP on loopback: the
//! service in-process on a real socket (or the real `vfiod-pool` binary where a process must
//! die or refuse to start), the real client, the real driver.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vfiod_pool::driver::{self, DriverConfig};
use vfiod_pool::service::{self, PoolConfig, RunningPool, ServiceError, TlsFiles};
use vfiod_pool_protocol::client::{PoolClient, PoolEndpoint, PoolError};
use vfiod_pool_protocol::protocol::{self as p, SessionState, WorkItem};

const LOOPBACK: &str = "127.0.0.1:0";

async fn start(dir: &Path, tweak: impl FnOnce(&mut PoolConfig)) -> RunningPool {
    let mut cfg = PoolConfig::new(LOOPBACK.parse().unwrap(), dir.to_owned());
    tweak(&mut cfg);
    service::start(cfg).await.expect("the pool starts")
}

fn client_for(url: url::Url) -> PoolClient {
    PoolClient::new(&PoolEndpoint::new(url)).unwrap()
}

fn client(pool: &RunningPool) -> PoolClient {
    client_for(pool.url(false))
}

/// Polls `f` until it is true or 10 s pass.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fetches results as `host` until `n` arrived (10 s at most); each must come once, right.
async fn collect_results(c: &PoolClient, id: &str, host: &str, n: usize) -> BTreeSet<u64> {
    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} results",
            seen.len()
        );
        let ack = seen.last().copied().unwrap_or(0);
        for r in c.fetch_results(id, host, ack, None).await.unwrap().results {
            assert!(seen.insert(r.seq), "result {} twice", r.seq);
            assert_eq!(r.value, p::work_value(r.seq, r.seq * 3), "result {}", r.seq);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seen
}

fn items(range: std::ops::RangeInclusive<u64>) -> Vec<WorkItem> {
    range
        .map(|seq| WorkItem {
            seq,
            payload: seq * 3,
        })
        .collect()
}

#[tokio::test]
async fn a_stale_epoch_is_refused_with_the_current_one() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    assert_eq!(
        (s.id.as_str(), s.epoch, s.state),
        ("s-1", 1, SessionState::Running)
    );
    c.quiesce(&s.id, 1).await.unwrap();
    let moved = c.resume(&s.id, 1, "host-b").await.unwrap();
    assert_eq!((moved.epoch, moved.host.as_str()), (2, "host-b"));

    // The partitioned source, still at epoch 1, can neither quiesce, move, resume nor release.
    for r in [
        c.quiesce(&s.id, 1).await.map(drop),
        c.prepare_move(&s.id, 1, "host-a").await.map(drop),
        c.resume(&s.id, 1, "host-a").await.map(drop),
        c.release(&s.id, 1).await,
    ] {
        assert!(
            matches!(r, Err(PoolError::StaleEpoch { current: 2 })),
            "{r:?}"
        );
    }
    // On the wire: 409 and the documented body.
    let raw = reqwest::Client::new()
        .post(format!("{}{}", c.base_url(), p::quiesce_path(&s.id)))
        .json(&serde_json::json!({"epoch": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 409);
    let body: serde_json::Value = raw.json().await.unwrap();
    assert_eq!(body["error"], "stale_epoch");
    assert_eq!(body["current_epoch"], 2);
    // Nothing changed.
    let now = c.session(&s.id).await.unwrap();
    assert_eq!(
        (now.epoch, now.state, now.host.as_str()),
        (2, SessionState::Running, "host-b")
    );
    pool.stop().await;
}

#[tokio::test]
async fn quiesce_is_idempotent_and_stops_at_a_clean_point() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |c| c.item_time = Duration::from_millis(10)).await;
    let c = client(&pool);
    let s = c.create_session("dev1", "host-a", "vm1").await.unwrap();
    c.submit_items(&s.id, "host-a", &items(1..=200))
        .await
        .unwrap();
    // Let the worker get some of them done.
    eventually("a few results", || async {
        c.session(&s.id).await.unwrap().undelivered >= 5
    })
    .await;
    let q1 = c.quiesce(&s.id, 1).await.unwrap();
    assert_eq!((q1.epoch, q1.state), (1, SessionState::Quiesced));
    assert!(q1.in_flight > 0, "items still queued: {q1:?}");
    // No item is half-done: every item is queued or has its result.
    assert_eq!(q1.in_flight + q1.undelivered, 200, "{q1:?}");
    // The worker stays stopped...
    tokio::time::sleep(Duration::from_millis(100)).await;
    let q2 = c.quiesce(&s.id, 1).await.unwrap();
    // ...and a repeat is the same answer: same epoch, same lease deadline, same counts.
    assert_eq!(q1, q2);
    // Resume picks up where it stopped; all 200 results arrive, each once.
    let r = c.resume(&s.id, 1, "host-b").await.unwrap();
    assert_eq!(r.epoch, 2);
    let seen = collect_results(&c, &s.id, "host-b", 200).await;
    assert_eq!(seen.len(), 200);
    pool.stop().await;
}

#[tokio::test]
async fn quiesce_answers_once_the_item_in_progress_is_done() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |c| c.item_time = Duration::from_millis(400)).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    c.submit_items(&s.id, "host-a", &items(1..=2))
        .await
        .unwrap();
    // The worker is inside item 1 (400 ms of work) when the quiesce comes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let q = c.quiesce(&s.id, 1).await.unwrap();
    let took = t0.elapsed();
    assert_eq!(
        (q.undelivered, q.in_flight),
        (1, 1),
        "item 1 completed, item 2 queued: {q:?}"
    );
    assert!(
        took >= Duration::from_millis(200),
        "the reply waited for item 1: {took:?}"
    );
    pool.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_concurrent_resumes_with_one_epoch_exactly_one_wins() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    c.quiesce(&s.id, 1).await.unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            let id = s.id.clone();
            tokio::spawn(async move { (i, c.resume(&id, 1, &format!("host-{i}")).await) })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (i, Ok(r)) => {
                assert_eq!(r.epoch, 2);
                winners.push(i);
            }
            (_, Err(PoolError::StaleEpoch { current: 2 })) => {}
            (i, Err(e)) => panic!("host-{i}: {e}"),
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let now = c.session(&s.id).await.unwrap();
    assert_eq!((now.epoch, now.host), (2, format!("host-{}", winners[0])));
    pool.stop().await;
}

#[tokio::test]
async fn resume_only_after_quiesce_and_a_retried_resume_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    assert!(matches!(
        c.resume(&s.id, 1, "host-b").await,
        Err(PoolError::NotQuiesced)
    ));
    assert_eq!(
        c.session(&s.id).await.unwrap().epoch,
        1,
        "a refused resume changes nothing"
    );
    c.quiesce(&s.id, 1).await.unwrap();
    let r = c.resume(&s.id, 1, "host-b").await.unwrap();
    assert_eq!((r.epoch, r.state), (2, SessionState::Running));
    // Running again: a new resume needs a new quiesce.
    assert!(matches!(
        c.resume(&s.id, 2, "host-b").await,
        Err(PoolError::NotQuiesced)
    ));
    // The destination's retry of the resume whose reply it lost: answered, epoch stays 2.
    let again = c.resume(&s.id, 1, "host-b").await.unwrap();
    assert_eq!((again.epoch, again.host.as_str()), (2, "host-b"));
    pool.stop().await;
}

#[tokio::test]
async fn an_expired_quiesce_lease_resumes_on_the_last_owner() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |c| c.quiesce_lease = Duration::from_millis(300)).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    c.prepare_move(&s.id, 1, "host-b").await.unwrap();
    let q = c.quiesce(&s.id, 1).await.unwrap();
    assert!(q.quiesce_deadline.is_some());
    // The destination never resumes.
    eventually("the lease expiry", || async {
        c.session(&s.id).await.unwrap().state == SessionState::Running
    })
    .await;
    let now = c.session(&s.id).await.unwrap();
    assert_eq!((now.epoch, now.host.as_str()), (2, "host-a"));
    assert_eq!((now.moving_to, now.quiesce_deadline), (None, None));
    let note = now.last_note.unwrap();
    assert!(
        note.contains("quiesce lease") && note.contains("host-a"),
        "{note}"
    );
    // The late destination is fenced off.
    assert!(matches!(
        c.resume(&s.id, 1, "host-b").await,
        Err(PoolError::StaleEpoch { current: 2 })
    ));
    // And the data plane serves the last owner again.
    c.submit_items(&s.id, "host-a", &items(1..=3))
        .await
        .unwrap();
    pool.stop().await;
}

#[tokio::test]
async fn a_device_has_one_session_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |c| c.devices = service::standin_devices(1)).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    let e = c.create_session("dev0", "host-b", "vm2").await.unwrap_err();
    assert_eq!(e.code(), Some("device_taken"), "{e}");
    let e = c.create_session("dev9", "host-b", "vm2").await.unwrap_err();
    assert!(matches!(e, PoolError::NotFound), "{e}");
    let devices = c.devices().await.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].session.as_deref(), Some("s-1"));
    c.release(&s.id, 1).await.unwrap();
    c.release(&s.id, 1).await.unwrap(); // idempotent
    assert_eq!(
        c.session(&s.id).await.unwrap().state,
        SessionState::Released
    );
    assert_eq!(c.devices().await.unwrap()[0].session, None);
    let s2 = c.create_session("dev0", "host-b", "vm2").await.unwrap();
    assert_eq!(s2.id, "s-2", "ids are never reused");
    pool.stop().await;
}

#[tokio::test]
async fn the_data_plane_serves_only_the_current_owner() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    c.submit_items(&s.id, "host-a", &items(1..=5))
        .await
        .unwrap();
    let e = c
        .submit_items(&s.id, "host-b", &items(6..=6))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some("not_owner"), "{e}");
    c.quiesce(&s.id, 1).await.unwrap();
    let e = c.fetch_results(&s.id, "host-a", 0, None).await.unwrap_err();
    assert_eq!(
        e.code(),
        Some("quiesced"),
        "results wait for the resume: {e}"
    );
    c.resume(&s.id, 1, "host-b").await.unwrap();
    // The old host gets nothing: no result of the session reaches it.
    for e in [
        c.fetch_results(&s.id, "host-a", 0, None).await.unwrap_err(),
        c.submit_items(&s.id, "host-a", &items(6..=6))
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.code(), Some("not_owner"), "{e}");
    }
    // The new owner gets the results the old one never fetched.
    eventually("5 results on host-b", || async {
        c.fetch_results(&s.id, "host-b", 0, None)
            .await
            .unwrap()
            .results
            .len()
            == 5
    })
    .await;
    // A retried submission is recognised, not queued twice.
    let sub = c
        .submit_items(&s.id, "host-b", &items(4..=7))
        .await
        .unwrap();
    assert_eq!((sub.accepted, sub.repeated, sub.last_seq), (2, 2, 7));
    pool.stop().await;
}

async fn drive_through_a_move(follow_session: bool) {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    let mut cfg = DriverConfig::new(&s.id, "host-a", 1200);
    cfg.follow_session = follow_session;
    let (d, handle) = driver::driver(client(&pool), cfg);
    let run = tokio::spawn(d.run());
    handle.wait_received(300).await;
    // The migration: quiesce at the switchover, the VM's downtime, resume on the destination.
    let q = c.quiesce(&s.id, 1).await.unwrap();
    let quiesced_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(80)).await;
    let r = c.resume(&s.id, q.epoch, "host-b").await.unwrap();
    let window = quiesced_at.elapsed();
    if !follow_session {
        handle.move_to("host-b");
    }
    let report = run.await.unwrap().unwrap();
    eprintln!("{report}");
    assert!(report.complete, "{report}");
    assert_eq!(
        (report.submitted, report.received),
        (1200, 1200),
        "{report}"
    );
    assert_eq!(
        (report.lost, report.duplicated, report.wrong),
        (0, 0, 0),
        "{report}"
    );
    assert_eq!(report.host, "host-b");
    assert_eq!(report.moves.len(), 1, "{report}");
    assert_eq!(
        (report.moves[0].from.as_str(), report.moves[0].to.as_str()),
        ("host-a", "host-b")
    );
    assert_eq!(
        report.moves[0].how,
        if follow_session { "session" } else { "told" }
    );
    // The pause the driver saw covers the quiesce window.
    assert!(report.longest_gap >= Duration::from_millis(80), "{report}");
    assert!(
        report.longest_gap <= window + Duration::from_secs(2),
        "{report}"
    );
    assert_eq!(r.epoch, 2);
    pool.stop().await;
}

#[tokio::test]
async fn the_driver_streams_through_a_move_with_nothing_lost_or_duplicated() {
    drive_through_a_move(true).await;
}

#[tokio::test]
async fn the_driver_told_of_its_new_host_follows_too() {
    drive_through_a_move(false).await;
}

#[tokio::test]
async fn a_second_driver_on_a_numbered_session_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let s = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    let (d, _handle) = driver::driver(client(&pool), DriverConfig::new(&s.id, "host-a", 100));
    let first = d.run().await.unwrap();
    assert_eq!((first.received, first.lost), (100, 0), "{first}");
    // Its items 1..=100 are the session's: a new driver numbering from 1 again would wait for
    // results that went to the first one, until it gave up. It says so at its first batch.
    let mut cfg = DriverConfig::new(&s.id, "host-a", 500);
    cfg.give_up = Duration::from_secs(60);
    let (d, _handle) = driver::driver(client(&pool), cfg);
    // Refused at its first batch, not given up on after `give_up` (60 s): the message says
    // which ("within 10 s" raced a loaded machine).
    let err = d
        .run()
        .await
        .expect_err("a second driver on a numbered session ran");
    let msg = err.to_string();
    assert!(
        msg.contains("items up to 100") && msg.contains("another driver"),
        "{msg}"
    );
    pool.stop().await;
}

#[tokio::test]
async fn every_protocol_route_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |_| {}).await;
    let c = client(&pool);
    let http = reqwest::Client::new();
    for r in p::ROUTES {
        let url = format!("{}{}", c.base_url(), r.path.replace("{id}", "s-404"));
        let method = reqwest::Method::from_bytes(r.method.as_bytes()).unwrap();
        let resp = http
            .request(method, &url)
            .json(&serde_json::json!({}))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.text().await.unwrap();
        assert_ne!(status, 405, "{} {}", r.method, r.path);
        assert!(
            !body.contains("no such path"),
            "{} {} fell through: {body}",
            r.method,
            r.path
        );
    }
    // And one that is not a route is refused with the protocol's body.
    let resp = http
        .get(format!("{}/v1/nothing", c.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    pool.stop().await;
}

/// The (method, path) pairs of the OpenAPI file.
fn openapi() -> yaml_rust2::Yaml {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/pool-openapi.yaml"
    ))
    .expect("docs/pool-openapi.yaml");
    let mut docs = yaml_rust2::YamlLoader::load_from_str(&text).expect("pool-openapi.yaml parses");
    docs.remove(0)
}

#[test]
fn the_openapi_file_documents_exactly_the_served_routes() {
    let doc = openapi();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_hash().expect("paths") {
        for (method, _) in item.as_hash().unwrap() {
            let m = method.as_str().unwrap();
            if ["get", "post", "delete", "put", "patch"].contains(&m) {
                documented.insert((m.to_uppercase(), path.as_str().unwrap().to_owned()));
            }
        }
    }
    let served: BTreeSet<_> = p::ROUTES
        .iter()
        .map(|r| (r.method.to_owned(), r.path.to_owned()))
        .collect();
    assert_eq!(
        documented, served,
        "docs/pool-openapi.yaml against protocol::ROUTES"
    );
}

#[test]
fn the_openapi_file_lists_every_error_code_and_state() {
    let doc = openapi();
    let schemas = &doc["components"]["schemas"];
    let codes: BTreeSet<_> = schemas["ErrorBody"]["properties"]["error"]["enum"]
        .as_vec()
        .expect("ErrorBody.error enum")
        .iter()
        .map(|y| y.as_str().unwrap().to_owned())
        .collect();
    let all = [
        p::ErrorCode::StaleEpoch,
        p::ErrorCode::NotFound,
        p::ErrorCode::NotQuiesced,
        p::ErrorCode::CannotServe,
        p::ErrorCode::Invalid,
        p::ErrorCode::Busy,
        p::ErrorCode::DeviceTaken,
        p::ErrorCode::Unauthorized,
        p::ErrorCode::NotOwner,
        p::ErrorCode::Quiesced,
        p::ErrorCode::Internal,
        p::ErrorCode::MethodNotAllowed,
        p::ErrorCode::Unavailable,
    ];
    let ours: BTreeSet<_> = all.iter().map(|c| c.as_str().to_owned()).collect();
    assert_eq!(codes, ours);
    let states: BTreeSet<_> = schemas["SessionState"]["enum"]
        .as_vec()
        .expect("SessionState enum")
        .iter()
        .map(|y| y.as_str().unwrap().to_owned())
        .collect();
    let ours: BTreeSet<_> = [
        SessionState::Running,
        SessionState::Quiesced,
        SessionState::Released,
    ]
    .iter()
    .map(|s| s.as_str().to_owned())
    .collect();
    assert_eq!(states, ours);
}

// ---- the real binary ----

const BIN: &str = env!("CARGO_BIN_EXE_vfiod-pool");

/// A `vfiod-pool` process; killed (SIGKILL) when dropped.
struct PoolProcess {
    child: Child,
    url: url::Url,
}

impl Drop for PoolProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_pool(dir: &Path, listen: &str, extra: &[&str]) -> PoolProcess {
    let mut child = Command::new(BIN)
        .args(["--listen", listen, "--state-dir"])
        .arg(dir)
        .args(extra)
        .stdout(Stdio::piped())
        .env("VFIOD_LOG", "warn")
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("vfiod-pool: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    PoolProcess {
        url: url.parse().unwrap(),
        child,
    }
}

#[tokio::test]
async fn a_killed_pool_restarts_with_every_session_epoch_and_lease() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let proc1 = spawn_pool(
        &state,
        LOOPBACK,
        &["--quiesce-lease", "2", "--item-time-ms", "20"],
    );
    let c = client_for(proc1.url.clone());
    let a = c.create_session("dev0", "host-a", "vm1").await.unwrap();
    let b = c.create_session("dev1", "host-a", "vm2").await.unwrap();
    // a moves to host-b (epoch 2) and has work queued; b is quiesced when the pool dies.
    c.quiesce(&a.id, 1).await.unwrap();
    c.resume(&a.id, 1, "host-b").await.unwrap();
    c.submit_items(&a.id, "host-b", &items(1..=50))
        .await
        .unwrap();
    let qb = c.quiesce(&b.id, 1).await.unwrap();
    let before = c.sessions().await.unwrap();
    drop(proc1); // SIGKILL

    let proc2 = spawn_pool(
        &state,
        LOOPBACK,
        &["--quiesce-lease", "2", "--item-time-ms", "20"],
    );
    let c = client_for(proc2.url.clone());
    let after = c.sessions().await.unwrap();
    assert_eq!(after.len(), 2);
    for (x, y) in before.iter().zip(&after) {
        assert_eq!(
            (&x.id, x.epoch, &x.host, x.state),
            (&y.id, y.epoch, &y.host, y.state)
        );
    }
    let sb = c.session(&b.id).await.unwrap();
    assert_eq!(
        sb.quiesce_deadline, qb.quiesce_deadline,
        "the lease survives the restart"
    );
    // Fencing survived too.
    assert!(matches!(
        c.quiesce(&a.id, 1).await,
        Err(PoolError::StaleEpoch { current: 2 })
    ));
    // a's queued items run to the end; each result once.
    collect_results(&c, &a.id, "host-b", 50).await;
    // b's lease, started before the kill, expires after it: back on its last owner.
    eventually("b's lease expiry", || async {
        c.session(&b.id).await.unwrap().state == SessionState::Running
    })
    .await;
    let sb = c.session(&b.id).await.unwrap();
    assert_eq!((sb.epoch, sb.host.as_str()), (2, "host-a"));
    // No id is reused after the restart.
    let n = c.create_session("dev2", "host-a", "vm3").await.unwrap();
    assert_eq!(n.id, "s-3");
}

#[test]
fn plain_http_is_refused_on_a_non_loopback_address() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let out = Command::new(BIN)
        .args(["--listen", "0.0.0.0:0", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing plain HTTP on 0.0.0.0:0") && err.contains("--tls-cert"),
        "{err}"
    );
    assert!(!state.exists(), "a refused start creates nothing");
    // The library refuses the same, before binding.
    let cfg = PoolConfig::new("192.0.2.1:8443".parse().unwrap(), state.clone());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(service::start(cfg));
    assert!(matches!(r, Err(ServiceError::PlainOnNetwork { .. })));
    // And the client refuses plain http to a non-loopback pool.
    let e =
        PoolClient::new(&PoolEndpoint::new("http://192.0.2.1:8443".parse().unwrap())).unwrap_err();
    assert!(matches!(e, PoolError::Config(_)), "{e}");
}

// ---- TLS with client certificates ----

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

/// A CA, the pool's certificate for 127.0.0.1/localhost, a client the CA signed ("known") and
/// one a stranger CA signed ("unknown").
fn make_pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| std::fs::write(dir.path().join(name), text).unwrap();
    let ca = |cn: &str| {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert, Issuer::new(params, key))
    };
    let leaf = |names: Vec<String>, issuer: &Issuer<'_, KeyPair>| {
        let params = CertificateParams::new(names).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (ca_cert, ca_issuer) = ca("vfiod test pool CA");
    write("ca.pem", ca_cert.pem());
    let (server, server_key) = leaf(vec!["127.0.0.1".into(), "localhost".into()], &ca_issuer);
    write("server.pem", server);
    write("server.key", server_key);
    let (known, known_key) = leaf(vec!["host-a".into()], &ca_issuer);
    write("known.pem", known);
    write("known.key", known_key);
    let (_, stranger) = ca("some other CA");
    let (unknown, unknown_key) = leaf(vec!["host-x".into()], &stranger);
    write("unknown.pem", unknown);
    write("unknown.key", unknown_key);
    Pki { dir }
}

#[tokio::test]
async fn tls_with_client_certificates_refuses_an_unknown_client() {
    let pki = make_pki();
    let dir = tempfile::tempdir().unwrap();
    let pool = start(dir.path(), |c| {
        c.tls = Some(TlsFiles {
            cert: pki.path("server.pem"),
            key: pki.path("server.key"),
            client_ca: pki.path("ca.pem"),
        })
    })
    .await;
    let endpoint = |cert: Option<&str>| {
        let mut ep = PoolEndpoint::new(pool.url(true));
        ep.ca_file = Some(pki.path("ca.pem"));
        if let Some(name) = cert {
            ep.cert_file = Some(pki.path(&format!("{name}.pem")));
            ep.key_file = Some(pki.path(&format!("{name}.key")));
        }
        PoolClient::new(&ep).unwrap()
    };
    // The known client is served.
    let known = endpoint(Some("known"));
    assert_eq!(known.health().await.unwrap().status, "ok");
    let s = known.create_session("dev0", "host-a", "vm1").await.unwrap();
    // A client with a certificate from another CA, and one without any, are refused in the
    // handshake: no reply, nothing changes.
    for (who, c) in [
        ("unknown", endpoint(Some("unknown"))),
        ("anonymous", endpoint(None)),
    ] {
        let e = c.quiesce(&s.id, 1).await.unwrap_err();
        assert!(matches!(e, PoolError::Unreachable(_)), "{who}: {e}");
    }
    assert_eq!(
        known.session(&s.id).await.unwrap().state,
        SessionState::Running
    );
    // Plain HTTP to the TLS port gets nothing either.
    let plain = client_for(format!("http://{}", pool.addr()).parse().unwrap());
    assert!(plain.health().await.is_err());
    pool.stop().await;
}

/// `vfiod-pool drive` as the nested domain runs it (tests/vm pool_migration): a session leased,
/// every item streamed and received once, progress lines on stderr while it runs, the report as
/// JSON on stdout and exit 0; and a driver that finds the session's items numbered by another
/// exits non-zero with that reason.
#[test]
fn the_drive_command_reports_progress_and_a_clean_count() {
    let dir = tempfile::tempdir().unwrap();
    let pool = spawn_pool(
        &dir.path().join("state"),
        LOOPBACK,
        &["--item-time-ms", "1"],
    );
    let url = pool.url.as_str();
    let drive = |extra: &[&str]| {
        Command::new(BIN)
            .args(["drive", "--url", url, "--host", "host-a", "--json"])
            .args(extra)
            .env("VFIOD_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = drive(&["--items", "400", "--progress", "0.05"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "drive failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            &report["submitted"],
            &report["received"],
            &report["lost"],
            &report["duplicated"],
            &report["wrong"],
            &report["complete"]
        ),
        (
            &400.into(),
            &400.into(),
            &0.into(),
            &0.into(),
            &0.into(),
            &true.into()
        ),
        "{report}"
    );
    let progress: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("vfiod-pool drive: ") && l.ends_with(" on host-a"))
        .collect();
    assert!(
        !progress.is_empty(),
        "no progress line on stderr:\n{stderr}"
    );
    let session = report["session"].as_str().unwrap();

    // The same session again: its items are numbered already.
    let again = drive(&["--session", session, "--items", "10", "--give-up", "2"]);
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("another driver numbered"), "{err}");
    // A negative interval is refused before anything runs.
    let bad = drive(&["--items", "10", "--progress=-1"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--progress: -1 is not a number of seconds"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}
