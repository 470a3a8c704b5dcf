//! Pooled devices through vfiod (issue 11), against the real pool service (`vfiod-pool` on
//! loopback) and vfiod on simulated hosts, each on its own private bus: leasing and releasing
//! over D-Bus and `vfioctl pool`, the migration flow between two vfiod hosts driven as libvirt
//! would (the destination's `migrate begin` hook through `Manager.Hook` with the domain's XML;
//! the source's switchover and the destination's resume through the engine functions the
//! libvirt event handlers call), fencing of a stale source, and the hook failing closed when the
//! pool cannot be reached.

use crate::common;

use crate::common::{dict, eventually_async, vfioctl, Harness};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use vfiod::client::pool::PooledEntry;
use vfiod::host::libvirt::xml::{metadata_element_with, MetadataPooled};
use vfiod::pool::client::{PoolClient, PoolEndpoint};
use zbus::Variant;

const UUID: &str = "6ba7b810-9dad-11d1-80b4-00c04fd430c8";

/// `vfiod-pool` on a free loopback port, killed when dropped.
struct Pool {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Pool {
    fn start(extra: &[&str]) -> Pool {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(common::bins::vfiod_pool())
            .args(["--listen", "127.0.0.1:0", "--state-dir"])
            .arg(dir.path())
            .args(["--devices", "2"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("vfiod-pool starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("vfiod-pool: listening on ")
            .unwrap_or_else(|| panic!("vfiod-pool said {line:?}"))
            .trim_end_matches('/')
            .to_string();
        Pool {
            child,
            url,
            _dir: dir,
        }
    }

    fn client(&self) -> PoolClient {
        vfiod::pool::client::install_crypto_provider();
        PoolClient::new(&PoolEndpoint::new(self.url.parse().unwrap())).unwrap()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(host: &str, url: &str, quiesce_at: &str) -> String {
    format!(
        "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\nhost_name = \"{host}\"\n\
         [[pool]]\nname = \"gpus\"\nurl = \"{url}\"\nconnect_timeout_ms = 500\n\
         request_timeout_ms = 2000\nquiesce_at = \"{quiesce_at}\"\n"
    )
}

async fn lease(h: &Harness, device: &str) -> Result<PooledEntry, zbus::Error> {
    let owner = dict(&[
        ("vm_name", Variant::from("vm1")),
        ("vm_uuid", Variant::from(UUID)),
    ]);
    let d = h
        .manager()
        .await
        .lease_pooled("gpus", device, owner)
        .await?;
    Ok(PooledEntry::from_dict(&d))
}

async fn claims(h: &Harness, history: bool) -> Vec<PooledEntry> {
    let q = dict(&[("history", Variant::from(history))]);
    h.manager()
        .await
        .get_pooled_claims(q)
        .await
        .unwrap()
        .iter()
        .map(PooledEntry::from_dict)
        .collect()
}

/// The domain XML a hook gets: the VM with its pooled session in vfiod's metadata.
fn domain_xml(sessions: &[MetadataPooled]) -> String {
    format!(
        "<domain type='kvm'><name>vm1</name><uuid>{UUID}</uuid><memory>65536</memory>\
         <metadata>{}</metadata><devices></devices></domain>",
        metadata_element_with(&[], sessions)
    )
}

fn session_of(c: &PooledEntry, host: &str) -> MetadataPooled {
    MetadataPooled {
        pool: c.pool.clone(),
        session: c.session.clone(),
        device: c.device.clone(),
        epoch: c.epoch,
        host: host.into(),
    }
}

async fn hook(h: &Harness, op: &str, sub: &str, xml: &str) -> (i32, String, String) {
    h.manager()
        .await
        .hook("vm1", op, sub, "-", xml)
        .await
        .unwrap()
}

/// The pool calls of `h` refused for a stale epoch so far (`vfiod_pool_call_errors_total`).
async fn stale_epoch_refusals(h: &Harness) -> f64 {
    let text = h.manager().await.get_metrics().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with("vfiod_pool_call_errors_total{error=\"stale_epoch\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn engine(h: &Harness) -> Arc<vfiod::engine::Engine> {
    Arc::clone(h.engine())
}

/// The `pool` events of the history, (time, message).
fn pool_events(h: &Harness) -> Vec<(i64, String)> {
    h.store()
        .events(None, 0, 10_000)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == vfiod::model::event::EventKind::Pool)
        .map(|e| (e.time_ms, e.message))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_list_show_and_release() {
    let pool = Pool::start(&[]);
    let h = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let bus = h.bus.address().to_string();
    let status = |bus: &str| {
        let (ok, out) = vfioctl(bus, &["status"]);
        assert!(ok, "{out}");
        out
    };
    let before = status(&bus);
    assert!(
        before.contains("\npool gpus: no call since vfiod started\n"),
        "{before}"
    );

    let c = lease(&h, "dev0").await.unwrap();
    let leased = status(&bus);
    assert!(
        leased.contains("\npool gpus: reachable (answered "),
        "{leased}"
    );
    assert_eq!(
        (c.state.as_str(), c.epoch, c.pool.as_str()),
        ("leased", 1, "gpus")
    );
    assert_eq!((c.vm_name.as_str(), c.device.as_str()), ("vm1", "dev0"));
    // Its object, there when the call returns.
    let object = vfiod::client::pool::pooled_claim(&h.client, c.id)
        .await
        .unwrap();
    assert_eq!(object.session().await.unwrap(), c.session);
    assert_eq!(object.state().await.unwrap(), "leased");
    assert_eq!(object.epoch().await.unwrap(), 1);
    assert_eq!(object.pool().await.unwrap(), "gpus");
    // The pool sees this host's name and the VM.
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!(
        (s.host.as_str(), s.vm.as_str(), s.epoch),
        ("hosta", "vm1", 1)
    );

    // A device the pool already leased: NoDeviceAvailable with the pool's reason; a pool not
    // configured: InvalidArgument. Neither records anything.
    let (name, message) = common::refusal(lease(&h, "dev0").await, "lease a taken device");
    assert_eq!(
        name, "org.vfiod.Vfiod1.Error.NoDeviceAvailable",
        "{message}"
    );
    let owner = dict(&[("vm_name", Variant::from("vm1"))]);
    let r = h.manager().await.lease_pooled("tpus", "dev1", owner).await;
    let (name, message) = common::refusal(r, "an unknown pool");
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument");
    assert!(message.contains("no [[pool]] named \"tpus\""), "{message}");
    assert_eq!(claims(&h, true).await.len(), 1);

    // vfioctl pool list / show / devices / pools.
    let (ok, out) = vfioctl(&bus, &["pool", "list"]);
    assert!(ok, "{out}");
    assert!(
        out.contains(&c.session) && out.contains("leased") && out.contains("vm1"),
        "{out}"
    );
    let (ok, out) = vfioctl(&bus, &["pool", "show", &c.id.to_string()]);
    assert!(ok, "{out}");
    assert!(out.contains("leased to vm1 on hosta"), "{out}");
    let (ok, out) = vfioctl(&bus, &["pool", "devices", "gpus"]);
    assert!(ok, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("dev0") && l.contains(&c.session)),
        "{out}"
    );
    let (ok, out) = vfioctl(&bus, &["pool", "pools"]);
    assert!(
        ok && out.contains("hosta") && out.contains(&pool.url),
        "{out}"
    );
    let (ok, out) = vfioctl(&bus, &["events"]);
    assert!(
        ok && out.contains("pool") && out.contains("leased to vm1"),
        "{out}"
    );

    // Release: the pool frees the device, the claim is history.
    let (ok, out) = vfioctl(&bus, &["pool", "release", &c.id.to_string()]);
    assert!(ok && out.contains("released"), "{out}");
    assert!(claims(&h, false).await.is_empty());
    let gone = object.state().await.unwrap_err();
    assert!(gone.to_string().contains("UnknownObject"), "{gone}");
    let devices = pool.client().devices().await.unwrap();
    assert!(devices.iter().all(|d| d.session.is_none()), "{devices:?}");
    let (ok, out) = vfioctl(&bus, &["pool", "release", &c.id.to_string()]);
    assert!(!ok && out.contains("already ended"), "{out}");
    assert!(status(&bus).contains("\npool gpus: reachable ("));

    // The pool goes away: its next call fails, and status says so, with why.
    drop(pool);
    let (ok, out) = vfioctl(&bus, &["pool", "devices", "gpus"]);
    assert!(!ok, "{out}");
    let down = status(&bus);
    assert!(
        down.contains("\npool gpus: unreachable (") && down.contains("pool unreachable"),
        "{down}"
    );
    let (ok, out) = vfioctl(&bus, &["status", "--json"]);
    assert!(ok, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["pools"][0]["name"], "gpus", "{json}");
    assert!(
        json["pools"][0]["last_call_ms"].as_i64().unwrap() > 0,
        "{json}"
    );
    assert!(
        json["pools"][0]["last_call_error"]
            .as_str()
            .unwrap()
            .contains("unreachable"),
        "{json}"
    );
    assert!(json["fleet"].is_null(), "no [fleet]: {json}");
}

/// The whole flow between two vfiod hosts, as libvirt drives it: the destination's
/// `migrate begin` hook prepares the move, the source quiesces at its switchover, the
/// destination resumes, the source forgets at its `stopped` hook. Every step is an event with
/// its time; the pool ends with the session on the destination at epoch 2.
/// `org.vfiod.Vfiod1.Pools` has what grew on `Manager` (which keeps them as deprecated
/// aliases, answering alike), `Lease` returns the claim's object, and the claim is released
/// through its own object (`PooledClaim.Release`), as a PCI claim is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pools_interface_leases_and_the_claims_object_releases() {
    let pool = Pool::start(&[]);
    let h = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let pools = vfiod::client::pool::pools(&h.client).await.unwrap();
    let m = h.manager().await;
    assert_eq!(pools.host_name().await.unwrap(), "hosta");
    assert_eq!(m.host_name().await.unwrap(), "hosta");
    let listed = pools.list(dict(&[])).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(vfiod::dbus::wire::Entry(&listed[0]).str("name"), "gpus");
    assert_eq!(m.get_pools().await.unwrap(), listed);
    let devices = pools.get_devices("gpus", dict(&[])).await.unwrap();
    assert_eq!(m.get_pool_devices("gpus").await.unwrap(), devices);
    assert!(!devices.is_empty());
    // Options that are not known are refused, naming the key.
    let (name, message) = common::refusal(
        pools
            .get_devices("gpus", dict(&[("colour", Variant::from("red"))]))
            .await,
        "an unknown option",
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument");
    assert!(message.contains("colour"), "{message}");

    let owner = dict(&[("vm_name", Variant::from("vm1"))]);
    let path = pools.lease("gpus", "dev0", owner).await.unwrap();
    let id = vfiod::client::pool::id_of_path(path.as_str()).expect("a pooled claim's path");
    let object = vfiod::client::pool::pooled_claim(&h.client, id)
        .await
        .unwrap();
    assert_eq!(object.state().await.unwrap(), "leased");
    let q = dict(&[("history", Variant::from(false))]);
    let standing = pools.get_claims(q).await.unwrap();
    assert_eq!(
        m.get_pooled_claims(dict(&[("history", Variant::from(false))]))
            .await
            .unwrap(),
        standing
    );
    assert_eq!(standing.len(), 1);
    let c = PooledEntry::from_dict(&standing[0]);
    assert_eq!((c.id, c.device.as_str()), (id, "dev0"));

    let ended = PooledEntry::from_dict(&object.release().await.unwrap());
    assert_eq!((ended.id, ended.state.as_str()), (id, "released"));
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!(s.state.as_str(), "released", "the pool ended it: {s:?}");
    assert!(claims(&h, false).await.is_empty());
    // The object went with the claim.
    let gone = object.release().await;
    assert!(
        matches!(&gone, Err(zbus::Error::FDO(e)) if matches!(**e, zbus::fdo::Error::UnknownObject(_))),
        "{gone:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_follows_its_vm_from_one_host_to_another() {
    let pool = Pool::start(&[]);
    let a = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let b = Harness::start(&config("hostb", &pool.url, "switchover")).await;
    let c = lease(&a, "dev1").await.unwrap();
    let xml = domain_xml(&[session_of(&c, "hosta")]);

    // 1. Destination, migrate begin: prepare-move, recorded as moving; the pool knows.
    let (code, out, message) = hook(&b, "migrate", "begin", &xml).await;
    assert_eq!(code, 0, "{message}");
    assert!(out.is_empty(), "no hostdev to retarget: {out}");
    assert!(
        message.contains("pooled claims") && message.contains("moving here"),
        "{message}"
    );
    let incoming = claims(&b, false).await;
    assert_eq!(incoming.len(), 1);
    assert_eq!(
        (incoming[0].state.as_str(), incoming[0].peer_host.as_str()),
        ("moving", "hosta")
    );
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!(s.moving_to.as_deref(), Some("hostb"));
    // libvirt retrying the hook: nothing twice.
    let (code, _, message) = hook(&b, "migrate", "begin", &xml).await;
    assert_eq!(code, 0, "{message}");
    assert_eq!(claims(&b, false).await.len(), 1);

    // 2. Source, switchover (suspended for migration): quiesce.
    let done = engine(&a).quiesce_pooled("vm1", Some(UUID)).await;
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].error, None);
    assert_eq!(claims(&a, false).await[0].state, "quiesced");

    // 3. Destination, the VM runs: resume here with the epoch, the new epoch recorded.
    let done = engine(&b).resume_pooled("vm1", Some(UUID)).await;
    assert_eq!(done[0].error, None, "{done:?}");
    let now = claims(&b, false).await;
    assert_eq!((now[0].state.as_str(), now[0].epoch), ("leased", 2));
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hostb", 2));
    // B's object shows the new epoch; the session has landed (no longer incoming from A).
    let object = vfiod::client::pool::pooled_claim(&b.client, now[0].id)
        .await
        .unwrap();
    assert_eq!(object.epoch().await.unwrap(), 2);
    assert_eq!(object.peer_host().await.unwrap(), "");

    // 4. Source, stopped after the migration: forgotten, no pool call (the pool still says B).
    let (code, _, _) = hook(&a, "stopped", "end", &xml).await;
    assert_eq!(code, 0);
    eventually_async(Duration::from_secs(5), "the source forgets", || async {
        claims(&a, false).await.is_empty().then_some(())
    })
    .await;
    let ended = claims(&a, true).await;
    assert_eq!(ended[0].state, "forgotten", "{ended:?}");
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hostb", 2));

    // Every step with its time: the quiesce window is visible.
    let quiesced = pool_events(&a)
        .into_iter()
        .find(|(_, m)| m.contains("quiesced at the migration's switchover"))
        .expect("a quiesce event");
    let resumed = pool_events(&b)
        .into_iter()
        .find(|(_, m)| m.contains("resumed on hostb at epoch 2"))
        .expect("a resume event");
    assert!(resumed.0 >= quiesced.0, "{quiesced:?} {resumed:?}");
    assert!(pool_events(&b)
        .iter()
        .any(|(_, m)| m.contains("prepare-move at epoch 1")));

    // 5. And back, B -> A: B, the source now, forgets at its stopped hook; it must not take its
    // claim (which came in from A) for a failed incoming migration and resume it on A itself.
    let xml = domain_xml(&[session_of(&now[0], "hostb")]);
    let (code, _, message) = hook(&a, "migrate", "begin", &xml).await;
    assert_eq!(code, 0, "{message}");
    let done = engine(&b).quiesce_pooled("vm1", Some(UUID)).await;
    assert_eq!(done[0].error, None, "{done:?}");
    let done = engine(&a).resume_pooled("vm1", Some(UUID)).await;
    assert_eq!(done[0].error, None, "{done:?}");
    let (code, _, _) = hook(&b, "stopped", "end", &xml).await;
    assert_eq!(code, 0);
    eventually_async(Duration::from_secs(5), "hostb forgets", || async {
        claims(&b, false).await.is_empty().then_some(())
    })
    .await;
    let b_steps: Vec<String> = pool_events(&b).into_iter().map(|(_, m)| m).collect();
    assert!(
        b_steps
            .iter()
            .any(|m| m.contains("forgotten, no pool call"))
            && !b_steps.iter().any(|m| m.contains("resumed on its source")),
        "{b_steps:#?}"
    );
    let back = claims(&a, false).await;
    assert_eq!(
        (back.len(), back[0].state.as_str(), back[0].epoch),
        (1, "leased", 3)
    );
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hosta", 3));
}

/// A source fenced out (the destination took the session over) gets 409 stale epoch once,
/// records it, and never tries again; a migration that fails after the quiesce resumes on the
/// source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_migration_resumes_on_the_source_and_a_stale_source_is_fenced() {
    let pool = Pool::start(&[]);
    let a = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let b = Harness::start(&config("hostb", &pool.url, "switchover")).await;
    let c = lease(&a, "dev0").await.unwrap();

    // Failure after the quiesce: the source's domain runs again, the session resumes there.
    engine(&a).quiesce_pooled("vm1", Some(UUID)).await;
    let done = engine(&a).resume_pooled("vm1", Some(UUID)).await;
    assert_eq!(done[0].error, None, "{done:?}");
    let now = claims(&a, false).await;
    assert_eq!((now[0].state.as_str(), now[0].epoch), ("leased", 2));
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hosta", 2));

    // A migration to B that completes while A misses it (partitioned): A still thinks epoch 2.
    let xml = domain_xml(&[session_of(&now[0], "hosta")]);
    assert_eq!(hook(&b, "migrate", "begin", &xml).await.0, 0);
    assert_eq!(
        engine(&b).resume_pooled("vm1", Some(UUID)).await[0].error,
        None
    );
    assert_eq!(pool.client().session(&c.session).await.unwrap().epoch, 3);

    // A's switchover comes late: the pool refuses epoch 2, A records it fenced. No retry
    // loop: the pool refused one call of A's for its epoch (A's own count), where "under 2 s"
    // raced a loaded machine.
    let stale_before = stale_epoch_refusals(&a).await;
    let done = engine(&a).quiesce_pooled("vm1", Some(UUID)).await;
    assert!(
        done[0].error.as_deref().unwrap().contains("stale epoch"),
        "{done:?}"
    );
    assert_eq!(
        stale_epoch_refusals(&a).await,
        stale_before + 1.0,
        "one call refused for its epoch, no retry loop"
    );
    let fenced = claims(&a, false).await;
    assert_eq!(fenced[0].state, "error");
    assert!(
        fenced[0].reason.contains("fenced") && fenced[0].reason.contains("epoch 3"),
        "{fenced:?}"
    );
    // Nothing more is tried for it.
    assert!(engine(&a)
        .quiesce_pooled("vm1", Some(UUID))
        .await
        .is_empty());
    assert!(engine(&a).resume_pooled("vm1", Some(UUID)).await.is_empty());
    assert_eq!(
        pool_events(&a)
            .iter()
            .filter(|(_, m)| m.contains("stale epoch"))
            .count(),
        1
    );
    // The pool still has B's session; an operator's release of A's claim only ends it here.
    let bus = a.bus.address().to_string();
    let (ok, out) = vfioctl(&bus, &["pool", "release", &fenced[0].id.to_string()]);
    assert!(
        ok && out.contains("forgotten") && out.contains("fenced"),
        "{out}"
    );
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hostb", 3));
}

/// `quiesce_at = "begin"`: the destination quiesces at migrate begin, then resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conservative_mode_quiesces_at_migrate_begin() {
    let pool = Pool::start(&[]);
    let a = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let b = Harness::start(&config("hostb", &pool.url, "begin")).await;
    let c = lease(&a, "dev0").await.unwrap();
    let xml = domain_xml(&[session_of(&c, "hosta")]);
    let (code, _, message) = hook(&b, "migrate", "begin", &xml).await;
    assert_eq!(code, 0, "{message}");
    assert_eq!(claims(&b, false).await[0].state, "quiesced");
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!(s.state, vfiod::pool::protocol::SessionState::Quiesced);
    // The source's switchover quiesce is idempotent.
    assert_eq!(
        engine(&a).quiesce_pooled("vm1", Some(UUID)).await[0].error,
        None
    );
    assert_eq!(
        engine(&b).resume_pooled("vm1", Some(UUID)).await[0].error,
        None
    );
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hostb", 2));
}

/// A migration that fails after the destination quiesced (conservative mode): the
/// destination's `stopped` hook resumes the session on its source, and the source, whose
/// epoch the pool moved on, adopts the pool's epoch (the pool says the session is its own)
/// rather than being fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_incoming_migration_gives_the_session_back_to_its_source() {
    let pool = Pool::start(&[]);
    let a = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let b = Harness::start(&config("hostb", &pool.url, "begin")).await;
    let c = lease(&a, "dev0").await.unwrap();
    let xml = domain_xml(&[session_of(&c, "hosta")]);
    assert_eq!(hook(&b, "migrate", "begin", &xml).await.0, 0);
    assert_eq!(claims(&b, false).await[0].state, "quiesced");
    // The domain never ran on B: libvirt's stopped hook there.
    assert_eq!(hook(&b, "stopped", "end", &xml).await.0, 0);
    eventually_async(
        Duration::from_secs(5),
        "B gives the session back",
        || async { claims(&b, false).await.is_empty().then_some(()) },
    )
    .await;
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hosta", 2));
    assert_eq!(s.state, vfiod::pool::protocol::SessionState::Running);
    // A still holds epoch 1, and the domain's metadata says so: the next migration's
    // destination finds the pool still gives the session to A and moves it from epoch 2.
    let (code, _, message) = hook(&b, "migrate", "begin", &xml).await;
    assert_eq!(code, 0, "{message}");
    let incoming = claims(&b, false).await;
    assert_eq!(
        (incoming[0].state.as_str(), incoming[0].epoch),
        ("quiesced", 2)
    );
    // A's switchover adopts epoch 2 from the pool (already quiesced by B: nothing more).
    let done = engine(&a).quiesce_pooled("vm1", Some(UUID)).await;
    assert_eq!(done[0].error, None, "{done:?}");
    let now = claims(&a, false).await;
    assert_eq!((now[0].state.as_str(), now[0].epoch), ("quiesced", 2));
    assert!(pool_events(&a).iter().any(|(_, m)| m.contains("adopted")));
    assert_eq!(
        engine(&b).resume_pooled("vm1", Some(UUID)).await[0].error,
        None
    );
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hostb", 3));
}

/// The destination's hook fails closed, with one line, before any memory is copied: the pool
/// cannot be reached, the pool is not configured here, or the pool refuses the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_begin_fails_closed_with_one_line() {
    let pool = Pool::start(&["--hosts", "hosta,hostb"]);
    let a = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let c = lease(&a, "dev0").await.unwrap();
    let xml = domain_xml(&[session_of(&c, "hosta")]);

    // A port nobody listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let b = Harness::start(&config("hostb", &closed, "switchover")).await;
    // Refused for the cause (unreachable), the answer bounded by the pool's deadlines in the
    // daemon; "within 5 s" here raced a loaded machine.
    let (code, out, message) = hook(&b, "migrate", "begin", &xml).await;
    assert_eq!(code, 1, "{message}");
    assert!(out.is_empty());
    assert!(
        message
            .starts_with("vfiod: domain vm1 cannot come here: pool gpus: refused to move session")
            && message.contains("unreachable"),
        "{message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");
    assert!(claims(&b, true).await.is_empty(), "nothing recorded");

    // Not configured here.
    let mut other = config("hostb", &pool.url, "switchover");
    other = other.replace("name = \"gpus\"", "name = \"other\"");
    let b2 = Harness::start(&other).await;
    let (code, _, message) = hook(&b2, "migrate", "begin", &xml).await;
    assert_eq!(code, 1);
    assert!(
        message.contains("not configured on this host: gpus"),
        "{message}"
    );

    // The pool does not serve this host.
    let c2 = Harness::start(&config("hostc", &pool.url, "switchover")).await;
    let (code, _, message) = hook(&c2, "migrate", "begin", &xml).await;
    assert_eq!(code, 1);
    assert!(
        message.contains("cannot come here") && message.contains("hostc"),
        "{message}"
    );
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch, s.moving_to), ("hosta", 1, None));
}

/// libvirt's own events drive the flow (the test driver, in this process: its domain "test"
/// runs): a lease writes the session in the domain's metadata; a quiesced session (a migration
/// that failed after its switchover) is resumed here when libvirt reports the domain resumed,
/// and the new epoch is written back into the metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resumed_event_resumes_and_the_metadata_follows() {
    const TEST_UUID: &str = "6695eb01-f6a4-8304-79aa-97f2502e193f";
    let pool = Pool::start(&[]);
    // A real libvirtd serving the test driver: vfiod's libvirt client runs in its helper
    // process, and `test:///default` would be a driver of its own in each process (the test's
    // pause and resume would reach no event of the helper's).
    let libvirtd = crate::common::libvirtd::Libvirtd::start();
    let uri = libvirtd.uri();
    let text = config("hosta", &pool.url, "switchover")
        .replace("libvirt_uri = \"\"", &format!("libvirt_uri = \"{uri}\""));
    let a = Harness::start(&text).await;
    let owner = dict(&[
        ("vm_name", Variant::from("test")),
        ("vm_uuid", Variant::from(TEST_UUID)),
    ]);
    let c = PooledEntry::from_dict(
        &a.manager()
            .await
            .lease_pooled("gpus", "dev0", owner)
            .await
            .unwrap(),
    );
    let libvirt = engine(&a).core().libvirt().clone();
    let metadata = move || {
        let xml = libvirt
            .domain_xml("test", vfiod::host::libvirt::Definition::Live)
            .unwrap();
        vfiod::host::libvirt::xml::parse_pooled(&xml).unwrap()
    };
    let m = tokio::task::spawn_blocking(metadata.clone()).await.unwrap();
    assert_eq!(m, vec![session_of(&c, "hosta")]);

    // The switchover quiesces (the test driver cannot migrate: played by the engine function
    // its event handler calls), then the domain is paused and resumed through libvirt.
    assert_eq!(
        engine(&a).quiesce_pooled("test", Some(TEST_UUID)).await[0].error,
        None
    );
    tokio::task::spawn_blocking(move || {
        let conn = virt::connect::Connect::open(Some(&uri)).unwrap();
        let dom = conn.lookup_domain_by_name("test").unwrap();
        dom.suspend().unwrap();
        dom.resume().unwrap();
    })
    .await
    .unwrap();
    eventually_async(
        Duration::from_secs(10),
        "resumed through the event",
        || async {
            let now = claims(&a, false).await;
            (now[0].state == "leased" && now[0].epoch == 2).then_some(())
        },
    )
    .await;
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hosta", 2));
    eventually_async(Duration::from_secs(5), "the metadata has epoch 2", || {
        let metadata = metadata.clone();
        async move {
            let m = tokio::task::spawn_blocking(metadata).await.unwrap();
            (m.len() == 1 && m[0].epoch == 2).then_some(())
        }
    })
    .await;
}

/// LeasePooled and ReleasePooled ask `org.vfiod.vfiod1.claim` (verb, VM, kind `pooled`) of a
/// real polkitd: a user without it is refused and nothing reaches the pool; the operator
/// granted every action leases and releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn leasing_and_releasing_ask_the_claim_action() {
    use crate::common::polkit::{
        assert_root, uid_of, PolkitHarness, GRANTED_USER, MODE_USER, NOBODY,
    };
    assert_root();
    let pool = Pool::start(&[]);
    let p = PolkitHarness::start(&config("hosta", &pool.url, "switchover")).await;
    let asked = |user: &str, verb: &str| {
        format!("vfiod-test rule: org.vfiod.vfiod1.claim for {user} verb={verb} vm=vm1 kind=pooled")
    };
    let lease = ["pool", "lease", "gpus", "dev0", "--vm", "vm1"];
    for (uid, user) in [(NOBODY, "nobody"), (uid_of(MODE_USER), MODE_USER)] {
        let r = p.vfioctl(uid, &lease).await;
        assert!(!r.ok, "{user} leased: {}", r.stdout);
        assert!(
            r.stderr.contains("NotAuthorized") && r.stderr.contains("org.vfiod.vfiod1.claim"),
            "{user}: {}",
            r.stderr
        );
        assert!(
            p.polkitd
                .log()
                .lines()
                .any(|l| l.ends_with(&asked(user, "LeasePooled"))),
            "{}",
            p.polkitd.log()
        );
    }
    assert!(
        pool.client().sessions().await.unwrap().is_empty(),
        "the pool was called"
    );
    let r = p.vfioctl(uid_of(GRANTED_USER), &lease).await;
    assert!(r.ok, "{}", r.stderr);
    let c = claims(&p.h, false).await;
    assert!(
        c[0].requested_by
            .starts_with(&format!("uid {} ", uid_of(GRANTED_USER))),
        "{c:?}"
    );
    let r = p.vfioctl(NOBODY, &["pool", "release", "1"]).await;
    assert!(!r.ok && r.stderr.contains("NotAuthorized"), "{}", r.stderr);
    assert!(p
        .polkitd
        .log()
        .lines()
        .any(|l| l.ends_with(&asked("nobody", "ReleasePooled"))));
    assert_eq!(claims(&p.h, false).await.len(), 1);
    let r = p
        .vfioctl(uid_of(GRANTED_USER), &["pool", "release", "1"])
        .await;
    assert!(r.ok, "{}", r.stderr);
    assert!(claims(&p.h, false).await.is_empty());
}

/// The demo (`cargo run --release --example pool-demo`) as a newcomer runs it: every
/// step with its time, the pause window, and nothing lost or duplicated by the stand-in driver.
#[test]
fn the_demo_hands_a_session_over_and_loses_nothing() {
    let out = Command::new(common::bins::pool_demo()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in [
        "pooled claim 1: dev0 leased to vm1",
        "hostb  migrate begin hook: pooled claims 1 moving here",
        "hosta  switchover (suspended for migration): session quiesced",
        "hostb  resumed (the VM runs here): session at epoch 2",
        "hosta  stopped hook: the session is forgotten here",
        "quiesced at the migration's switchover",
        "resumed on hostb at epoch 2",
        "quiesce window (quiesce to resume):",
        "3000 items: 0 lost, 0 duplicated, 0 wrong",
    ] {
        assert!(stdout.contains(step), "{step:?} missing in:\n{stdout}");
    }
}

/// Events missed while vfiod was down: a quiesced session whose domain no longer runs here (it
/// went to another host meanwhile) is forgotten when vfiod connects to libvirt again; one
/// whose domain runs is left to its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_catches_up_with_a_domain_that_left() {
    let pool = Pool::start(&[]);
    let text = config("hosta", &pool.url, "switchover")
        .replace("libvirt_uri = \"\"", "libvirt_uri = \"test:///default\"");
    let mut a = Harness::start(&text).await;
    // "vm1" is no domain of this libvirt; "test" runs.
    let gone = lease(&a, "dev0").await.unwrap();
    let owner = dict(&[("vm_name", Variant::from("test"))]);
    a.manager()
        .await
        .lease_pooled("gpus", "dev1", owner)
        .await
        .unwrap();
    engine(&a).quiesce_pooled("vm1", Some(UUID)).await;
    engine(&a).quiesce_pooled("test", None).await;
    let states = |c: Vec<PooledEntry>| c.into_iter().map(|c| (c.id, c.state)).collect::<Vec<_>>();
    assert_eq!(
        states(claims(&a, false).await),
        [(1, "quiesced".to_string()), (2, "quiesced".to_string())]
    );
    a.stop_server().await;
    a.start_server().await;
    eventually_async(Duration::from_secs(10), "the reconcile", || async {
        (states(claims(&a, false).await) == [(2, "quiesced".to_string())]).then_some(())
    })
    .await;
    let ended = claims(&a, true).await;
    assert_eq!(ended[0].session, gone.session);
    assert_eq!(ended[0].state, "forgotten");
}

/// A TCP proxy on loopback to `url`'s host and port that holds each chunk of the pool's
/// answers back by `delay`: a pool slower than a hook's deadline. Its threads end with the
/// test process.
fn slow_proxy(url: &str, delay: Duration) -> String {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let target = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let here = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            let Ok(upstream) = TcpStream::connect(&target) else {
                continue;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream, hold: Option<Duration>| {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        if let Some(d) = hold {
                            std::thread::sleep(d);
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            };
            pipe(
                client.try_clone().unwrap(),
                upstream.try_clone().unwrap(),
                None,
            );
            pipe(upstream, client, Some(delay));
        }
    });
    here
}

/// Issue 33 (6) for `migrate`: a destination's `migrate begin` admitted in time whose pool
/// move ends after the hook's deadline (the pool answers 1.5 s late, the hook gave up at 1 s and
/// libvirt refused the migration) leaves no pool move behind here: the session it moved is
/// dropped as for an incoming domain that never ran here (it stays with its source), rather
/// than held "moving" for a domain that never came, which a later run would take as moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_answered_after_its_deadline_leaves_no_pool_move() {
    let pool = Pool::start(&[]);
    let a = Harness::start(&config("hosta", &pool.url, "switchover")).await;
    let slow = slow_proxy(&pool.url, Duration::from_millis(1500));
    let b = Harness::start(&config("hostb", &slow, "switchover")).await;
    let c = lease(&a, "dev0").await.unwrap();
    let xml = domain_xml(&[session_of(&c, "hosta")]);
    let now = vfiod::host::clock::monotonic_ms();
    let timing = dict(&[
        ("sent_ms", Variant::from(now)),
        ("deadline_ms", Variant::from(now + 1000)),
    ]);
    let (code, _, message) = b
        .manager()
        .await
        .hook_with_options("vm1", "migrate", "begin", "-", &xml, timing)
        .await
        .unwrap();
    assert_eq!(code, 1, "refused at its deadline: {message}");
    // The run goes on to its end (the pool's late answer) and records the move...
    eventually_async(
        Duration::from_secs(30),
        "the late run records its pool move",
        || async { (!claims(&b, true).await.is_empty()).then_some(()) },
    )
    .await;
    // ...which is undone, the migration being refused.
    eventually_async(
        Duration::from_secs(30),
        "the late run's pool move is undone",
        || async { claims(&b, false).await.is_empty().then_some(()) },
    )
    .await;
    let gone = claims(&b, true).await;
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert_eq!(gone[0].state, "forgotten", "{gone:?}");
    // The session stays with its source, running, at its epoch.
    let s = pool.client().session(&c.session).await.unwrap();
    assert_eq!((s.host.as_str(), s.epoch), ("hosta", 1));
    assert_eq!(s.state, vfiod::pool::protocol::SessionState::Running);
}
