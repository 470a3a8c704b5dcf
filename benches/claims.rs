//! Durable claims over D-Bus: 16 clients, each on its own connection to a private dbus-daemon,
//! against vfiod started in-process on the simulated host (the NIC split into 40 VFs) with its
//! real SQLite store (WAL, synchronous=FULL) in a directory on disk. In the same run and for the
//! same time, the same clients first make a no-op call (`org.freedesktop.DBus.Peer.Ping` on
//! vfiod's root object: a full round trip through the bus and vfiod's dispatch, nothing else),
//! then `Claim({role: vf})` + `Claim.Release()` pairs, then the no-op again (its two runs bracket
//! the claims, so drift on a shared machine shows). Each reply to Claim is checked against the
//! database file (the claim must be committed when the reply comes) and against a set of the
//! functions the clients hold; after the run, the store's history is replayed in commit order and
//! no function may ever be in two active claims.
//!
//! Run: `cargo bench --bench claims`. Target: >= 2,000 durable claims/s, 0 double-bookings.
//! `VFIOD_BENCH_SECS` sets each phase's length (default 3), `VFIOD_BENCH_CLIENTS` the number of
//! clients (default 16), `VFIOD_BENCH_STATE_DIR` where the state directory goes (default: the
//! target directory, on the disk the build uses; tmpfs would make every fsync free);
//! `VFIOD_BENCH_KEEP=1` keeps the state directory for a look at the database afterwards.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vfiod::client::claim::ClaimProxy;
use vfiod::client::ManagerProxy;
use vfiod::dbus::wire::Dict;
use vfiod::dbus::{auth::Authorizer, BusTarget, BUS_NAME, ROOT_PATH};
use vfiod::server::{Options, Server};
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{HostModel, SimKernel};
use zbus::proxy::CacheProperties;

/// The NIC split into 40 VFs on vfio-pci, its VFs selected with it (as
/// tests/simulated/claims.rs has it).
const CONFIG: &str = r#"
scenario = "public"
poll_interval = 3600
[[select]]
class = "0x0200"
mode = "vf"
num_vfs = 40
vf_driver = "vfio-pci"
"#;
const POOL: usize = 40;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn dict(pairs: &[(&str, &str)]) -> Dict {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                zbus::OwnedVariant::try_from(zbus::Variant::from(v.to_string())).unwrap(),
            )
        })
        .collect()
}

/// The file system a path is on, as `stat -f` names the common ones.
fn filesystem(path: &Path) -> String {
    match nix::sys::statfs::statfs(path) {
        Ok(s) => match s.filesystem_type() {
            nix::sys::statfs::TMPFS_MAGIC => "tmpfs (fsync is free: not a durable figure)".into(),
            nix::sys::statfs::EXT4_SUPER_MAGIC => "ext4".into(),
            nix::sys::statfs::XFS_SUPER_MAGIC => "xfs".into(),
            nix::sys::statfs::BTRFS_SUPER_MAGIC => "btrfs".into(),
            t => format!("file system type {:#x}", t.0),
        },
        Err(e) => format!("unknown file system ({e})"),
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// What one client did in one phase.
#[derive(Default)]
struct Tally {
    /// Completed operations: no-op calls, or claim + release pairs.
    done: u64,
    /// Claim + release latencies (claim phase only).
    latencies: Vec<Duration>,
    /// Claims whose functions another client's live claim held.
    doubles: u64,
    /// Claims checked against the database file and the shared set.
    checked: u64,
}

/// Who holds each function, as the clients know it: a function enters when its claim's reply
/// has come and leaves before the Release is sent, so an entry is always a live claim, and a
/// second holder is a double booking.
type Held = Arc<Mutex<HashMap<String, (usize, i64)>>>;

struct Client {
    index: usize,
    conn: zbus::Connection,
    peer: zbus::fdo::PeerProxy<'static>,
    claims: ManagerProxy<'static>,
    /// A read-only connection to vfiod's database file (WAL: it never blocks vfiod's writer).
    /// Only this client uses it; the mutex makes the client shareable between tasks.
    db: Mutex<rusqlite::Connection>,
}

impl Client {
    async fn connect(index: usize, address: &str, db: &Path) -> Client {
        let conn = zbus::connection::Builder::address(address)
            .build()
            .await
            .expect("client connection");
        let peer = zbus::fdo::PeerProxy::builder(&conn)
            .destination(BUS_NAME)
            .path(ROOT_PATH)
            .cache_properties(CacheProperties::No)
            .build()
            .await
            .unwrap();
        let claims = ManagerProxy::builder(&conn)
            .cache_properties(CacheProperties::No)
            .build()
            .await
            .unwrap();
        let db = rusqlite::Connection::open_with_flags(
            db,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .expect("open the database read-only");
        let db = Mutex::new(db);
        Client {
            index,
            conn,
            peer,
            claims,
            db,
        }
    }

    async fn noop(&self, until: Instant) -> Tally {
        let mut t = Tally::default();
        while Instant::now() < until {
            self.peer.ping().await.expect("Ping");
            t.done += 1;
        }
        t
    }

    /// The functions claim `id` holds, as committed in the database file.
    fn committed_functions(&self, id: i64) -> Vec<String> {
        let db = self.db.lock().unwrap();
        let mut stmt = db
            .prepare_cached(
                "SELECT address FROM claim_functions WHERE claim_id = ?1 AND active = 1 \
                 ORDER BY rowid",
            )
            .unwrap();
        stmt.query_map([id], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    async fn claim_release(&self, until: Instant, held: &Held) -> Tally {
        let req = dict(&[("role", "vf")]);
        let owner = dict(&[("vm_name", &format!("bench-{}", self.index))]);
        let mut t = Tally::default();
        while Instant::now() < until {
            let start = Instant::now();
            let path = self
                .claims
                .claim(req.clone(), owner.clone())
                .await
                .expect("Claim");
            let id: i64 = path
                .as_str()
                .rsplit('/')
                .next()
                .and_then(|n| n.parse().ok())
                .expect("a claim path ends in its id");
            // Replied, so committed: the row must be in the file already.
            let functions = self.committed_functions(id);
            assert!(
                !functions.is_empty(),
                "claim {id} was replied before it was committed"
            );
            {
                let mut held = held.lock().unwrap();
                for f in &functions {
                    if let Some((other, other_id)) = held.insert(f.clone(), (self.index, id)) {
                        eprintln!(
                            "double booking: {f} in claim {id} (client {}) and claim {other_id} \
                             (client {other})",
                            self.index
                        );
                        t.doubles += 1;
                    }
                }
            }
            t.checked += 1;
            {
                let mut held = held.lock().unwrap();
                for f in &functions {
                    if held.get(f) == Some(&(self.index, id)) {
                        held.remove(f);
                    }
                }
            }
            ClaimProxy::builder(&self.conn)
                .path(path)
                .cache_properties(CacheProperties::No)
                .build()
                .await
                .unwrap()
                .release()
                .await
                .expect("Release");
            t.latencies.push(start.elapsed());
            t.done += 1;
        }
        t
    }
}

/// Runs one phase on every client at once; returns the merged tally and the time it took (from
/// the start until the last client's last operation ended).
fn phase<F, Fut>(rt: &tokio::runtime::Runtime, clients: &Arc<Vec<Client>>, run: F) -> (Tally, f64)
where
    F: Fn(Arc<Vec<Client>>, usize) -> Fut,
    Fut: std::future::Future<Output = Tally> + Send + 'static,
{
    let start = Instant::now();
    let tallies: Vec<Tally> = rt.block_on(async {
        let handles: Vec<_> = (0..clients.len())
            .map(|i| tokio::spawn(run(Arc::clone(clients), i)))
            .collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.expect("client task"));
        }
        out
    });
    let took = start.elapsed().as_secs_f64();
    let mut all = Tally::default();
    for t in tallies {
        all.done += t.done;
        all.doubles += t.doubles;
        all.checked += t.checked;
        all.latencies.extend(t.latencies);
    }
    all.latencies.sort();
    (all, took)
}

/// Replays the claim history in commit order (event ids): (claims replayed, functions that were
/// ever in two active claims at once, claims still active).
fn replay_history(db: &Path) -> (usize, usize, usize) {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let mut functions: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    let mut stmt = conn
        .prepare("SELECT claim_id, address FROM claim_functions ORDER BY rowid")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
        .unwrap();
    for row in rows {
        let (id, a) = row.unwrap();
        functions.entry(id).or_default().push(a);
    }
    // "claim N on ADDRESS...: claimed by ..." / "claim N on ADDRESS: released by ...".
    let mut stmt = conn
        .prepare("SELECT message FROM events WHERE kind = 'claim' ORDER BY id")
        .unwrap();
    let messages: Vec<String> = stmt
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    let mut holder: HashMap<&str, i64> = HashMap::new();
    let (mut claimed, mut doubles) = (0, 0);
    for m in &messages {
        let id: i64 = m
            .strip_prefix("claim ")
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a claim event that names no claim: {m:?}"));
        let held = functions
            .get(&id)
            .unwrap_or_else(|| panic!("claim {id} holds no functions"));
        if m.contains(": claimed by ") {
            claimed += 1;
            for f in held {
                if let Some(other) = holder.insert(f, id) {
                    eprintln!("history: {f} in claim {id} while claim {other} held it");
                    doubles += 1;
                }
            }
        } else if m.contains(": released by ") {
            for f in held {
                if holder.get(f.as_str()) == Some(&id) {
                    holder.remove(f.as_str());
                }
            }
        }
    }
    let active: std::collections::BTreeSet<i64> = holder.values().copied().collect();
    (claimed, doubles, active.len())
}

fn main() {
    let secs: f64 = env_or("VFIOD_BENCH_SECS", 3.0);
    let n_clients: usize = env_or("VFIOD_BENCH_CLIENTS", 16);
    assert!(
        (1..=POOL).contains(&n_clients),
        "VFIOD_BENCH_CLIENTS must be 1..={POOL}: each client holds one VF at a time"
    );
    let span = Duration::from_secs_f64(secs);

    // The simulated kernel and the bus in memory (as the tests have them); the state on disk.
    let dir = tempfile::Builder::new()
        .prefix("vfiod-bench.")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let state_parent = std::env::var_os("VFIOD_BENCH_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&state_parent).unwrap();
    let state = tempfile::Builder::new()
        .prefix("vfiod-bench-state.")
        .tempdir_in(&state_parent)
        .unwrap();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let bus = PrivateBus::start(&dir.path().join("bus"), "").expect("private dbus-daemon");
    let mut settings =
        vfiod::config::Settings::from_toml_str(CONFIG, Path::new("bench.toml")).unwrap();
    settings.sysfs_root = kernel.root().to_path_buf();
    settings.state_dir = state.path().to_path_buf();
    let db = state.path().join(vfiod::store::DB_FILE_NAME);

    // vfiod on a runtime of its own, built as the binary builds it; the clients on another.
    let daemon_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let clients_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .unwrap();
    let server = daemon_rt
        .block_on(Server::start(Options {
            settings,
            source: None,
            sysfs: kernel.sysfs(),
            events: Some(kernel.subscribe()),
            bus: BusTarget::Address(bus.address().to_string()),
            authorizer: Authorizer::SameUser,
            simulated: true,
        }))
        .expect("vfiod starts");

    let clients: Arc<Vec<Client>> = Arc::new(clients_rt.block_on(async {
        let mut v = Vec::new();
        for i in 0..n_clients {
            v.push(Client::connect(i, bus.address(), &db).await);
        }
        // Start-up split the NIC before vfiod took its name; its 40 VFs are claimable.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let found = v[0]
                .claims
                .find_devices(dict(&[("role", "vf")]))
                .await
                .unwrap();
            if found.len() == POOL {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "only {} claimable VFs",
                found.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        v
    }));

    let held: Held = Arc::new(Mutex::new(HashMap::new()));
    let noop = |clients: Arc<Vec<Client>>, i: usize| async move {
        clients[i].noop(Instant::now() + span).await
    };
    let claims = {
        let held = Arc::clone(&held);
        move |clients: Arc<Vec<Client>>, i: usize| {
            let held = Arc::clone(&held);
            async move { clients[i].claim_release(Instant::now() + span, &held).await }
        }
    };
    // Warm both paths (connections, prepared statements, the WAL file) before measuring.
    let warm = Duration::from_millis(300);
    clients_rt.block_on(async {
        clients[0].noop(Instant::now() + warm).await;
        clients[0].claim_release(Instant::now() + warm, &held).await;
    });

    let (a1, ta1) = phase(&clients_rt, &clients, noop);
    let (b, tb) = phase(&clients_rt, &clients, claims);
    let (a2, ta2) = phase(&clients_rt, &clients, noop);

    let store = Arc::clone(server.engine.store());
    let active = store
        .active_claim_records()
        .expect("read the active claims");
    daemon_rt.block_on(server.stop());
    let (replayed, history_doubles, history_active) = replay_history(&db);

    let (r1, r2) = (a1.done as f64 / ta1, a2.done as f64 / ta2);
    let noop_rate = (r1 + r2) / 2.0;
    let pairs = b.done as f64 / tb;
    let doubles = b.doubles + history_doubles as u64;
    println!(
        "{n_clients} clients (own D-Bus connections), private dbus-daemon, pool of {POOL} VFs, \
         {secs} s per phase; state on {}",
        filesystem(state.path())
    );
    println!(
        "no-op call (Peer.Ping)        : {:>9.0} calls/s (before {:.0}, after {:.0})",
        noop_rate, r1, r2
    );
    println!(
        "claim + release pairs         : {:>9.0} pairs/s = durable claims/s ({:.0} calls/s; \
         pair p50 {:.2} ms, p99 {:.2} ms)",
        pairs,
        2.0 * pairs,
        quantile(&b.latencies, 0.5).as_secs_f64() * 1e3,
        quantile(&b.latencies, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "ratio calls/s claim/no-op     : {:>9.3}",
        2.0 * pairs / noop_rate
    );
    println!(
        "double-bookings               : {:>9} (clients checked {} claims against the file and \
         each other; store history replayed {} claims, {} active after the run, store says {})",
        doubles,
        b.checked,
        replayed,
        history_active,
        active.len()
    );
    println!("target                        : >= 2,000 durable claims/s, 0 double-bookings");
    if std::env::var_os("VFIOD_BENCH_KEEP").is_some() {
        println!("state kept in {}", state.keep().display());
    }
    assert_eq!(doubles, 0, "double bookings");
    assert_eq!(active.len(), 0, "claims left active after the run");
    assert_eq!(history_active, 0, "the history ends with claims active");
    drop(bus);
}
