//! The fleet database under a fleet's load, on this machine: generated reports of N hosts x 100
//! functions every 10 s (no daemons: the reports are built as a host builds them and sent with
//! the host's own transaction, `fleet::db::report`, each host on its own connection and role,
//! row-level security included), then fleet claims with 16 concurrent clients.
//!
//! `cargo bench --bench fleet` (VFIOD_BENCH_HOSTS="50,200", VFIOD_BENCH_SECS=30 per size).
//! PostgreSQL runs durably (fsync, synchronous commit) in a directory on disk (TMPDIR, else
//! /var/tmp). Printed per size: report transaction p50/p99 (heartbeats and changed reports
//! apart), the database's CPU (all its processes, from /proc) as a share of the machine, fleet
//! claims per second, and the same run's reference: a one-row update transaction's p50/p99 and
//! rate, so that figures from different machines compare as ratios.

#[path = "../tests/common/postgres.rs"]
#[allow(dead_code)]
mod postgres;

use postgres::Postgres;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vfiod::claim::Snapshot;
use vfiod::fleet::db::{self, HostMeta};
use vfiod::fleet::record::Report;
use vfiod::model::device::{Device, Kind, Mode, Role, State};
use vfiod::model::pci::ClassCode;

const FUNCTIONS: usize = 100;
const INTERVAL: Duration = Duration::from_secs(10);
const CLAIM_CLIENTS: usize = 16;
/// The share of reports that carry a change (a device breaking or recovering, a claim).
const CHANGED_SHARE: f64 = 0.1;

fn main() {
    let sizes: Vec<usize> = std::env::var("VFIOD_BENCH_HOSTS")
        .unwrap_or_else(|_| "50,200".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let secs: u64 = std::env::var("VFIOD_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "fleet benchmark: {FUNCTIONS} functions per host, a report every {INTERVAL:?} per host, \
         {:.0}% of reports changed, {secs} s per size, {cores} cores",
        CHANGED_SHARE * 100.0
    );
    for n in sizes {
        rt.block_on(run(n, Duration::from_secs(secs), cores));
    }
}

fn disk_tempdir() -> tempfile::TempDir {
    let base = std::env::var_os("TMPDIR").unwrap_or_else(|| "/var/tmp".into());
    tempfile::Builder::new()
        .prefix("vfiod-bench-pg.")
        .tempdir_in(base)
        .expect("tempdir on disk")
}

/// CPU seconds (user + system) of the postmaster and every process under it, the exited ones
/// included (the postmaster's `cutime`/`cstime` count those it has waited for).
fn database_cpu(postmaster: i32) -> f64 {
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // After the command's closing parenthesis: state ppid ... utime(14) stime(15).
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ppid: i32 = f.get(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        if pid == postmaster || ppid == postmaster {
            // utime, stime
            total += field(11) + field(12);
        }
        if pid == postmaster {
            // cutime, cstime
            total += field(13) + field(14);
        }
    }
    total as f64 / tick
}

fn device(i: usize, host: usize) -> Device {
    // 4 SR-IOV PFs (24, 24, 24 and 20 VFs) and 4 GPUs: 100 functions.
    let pf = i / 25;
    let index = i % 25;
    let (role, device_id, parent) = match (i >= 100 - 4, index) {
        (true, _) => (Role::Function, 0x20b5, None),
        (false, 0) => (Role::Pf, 0x1572, None),
        (false, _) => (
            Role::Vf,
            0x154c,
            Some(format!("0000:{:02x}:00.0", 0x10 + pf).parse().unwrap()),
        ),
    };
    let address = match role {
        Role::Function => format!("0000:{:02x}:00.0", 0xa0 + (i - 96)),
        Role::Pf => format!("0000:{:02x}:00.0", 0x10 + pf),
        Role::Vf => format!("0000:{:02x}:{:02x}.{}", 0x10 + pf, 2 + index / 8, index % 8),
    };
    Device {
        address: address.parse().unwrap(),
        vendor_id: 0x8086,
        device_id,
        subsystem_vendor_id: 0x8086,
        subsystem_device_id: 1,
        revision: 2,
        class: ClassCode(if role == Role::Function {
            0x030200
        } else {
            0x020000
        }),
        vendor_name: "Intel Corporation".into(),
        device_name: format!("function {i} of host {host}"),
        kind: if role == Role::Function {
            Kind::Gpu
        } else {
            Kind::Nic
        },
        driver: Some("vfio-pci".into()),
        driver_override: Some("vfio-pci".into()),
        numa_node: Some((pf % 2) as i32),
        iommu_group: Some(100 + i as u32),
        role,
        separable: role == Role::Pf,
        mode: if role == Role::Pf { Mode::Vf } else { Mode::Pf },
        total_vfs: if role == Role::Pf { 24 } else { 0 },
        num_vfs: if role == Role::Pf { 24 } else { 0 },
        parent_pf: parent,
        managed: true,
        state: State::Usable,
        state_reason: String::new(),
    }
}

fn report(host: usize, broken: Option<usize>) -> Report {
    let mut devices: Vec<Device> = (0..FUNCTIONS).map(|i| device(i, host)).collect();
    if let Some(b) = broken {
        devices[b].state = State::Broken;
        devices[b].state_reason = "config space reads all-ones".into();
    }
    Report::build(
        &Snapshot {
            devices,
            ..Snapshot::default()
        },
        &[],
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

async fn run(hosts: usize, duration: Duration, cores: usize) {
    let pg = Postgres::start_in(disk_tempdir(), true);
    let postmaster = pg.pid().expect("postmaster pid");
    let su0 = pg.superuser("postgres").await;
    su0.batch_execute("CREATE DATABASE fleet").await.unwrap();
    let mut su = pg.superuser("fleet").await;
    db::migrate(&mut su).await.unwrap();
    for h in 0..hosts {
        su.batch_execute(&format!("CREATE ROLE bench_host_{h} LOGIN PASSWORD 'pw'"))
            .await
            .unwrap();
        db::add_host(&su, &format!("host-{h:03}"), &format!("bench_host_{h}"))
            .await
            .unwrap();
    }
    su.batch_execute(
        "CREATE ROLE bench_ops LOGIN PASSWORD 'pw'; GRANT vfiod_fleet_operator TO bench_ops; \
         CREATE TABLE public.reference (id int PRIMARY KEY, n bigint); \
         INSERT INTO public.reference SELECT g, 0 FROM generate_series(1, 16) g; \
         GRANT SELECT, UPDATE ON public.reference TO bench_ops",
    )
    .await
    .unwrap();

    // Each host: its connection, its report.
    let mut clients = Vec::new();
    for h in 0..hosts {
        let c = pg.client(&format!("bench_host_{h}"), "pw", "fleet").await;
        clients.push(c);
    }
    let meta = |h: usize| HostMeta {
        host: format!("host-{h:03}"),
        interval_ms: INTERVAL.as_millis() as i32,
        down_after: 3,
        version: "bench".into(),
    };
    // First reports: every row inserted.
    let mut first = Vec::new();
    for (h, c) in clients.iter_mut().enumerate() {
        let t = Instant::now();
        db::report(c, &meta(h), &report(h, None)).await.unwrap();
        first.push(t.elapsed());
    }
    first.sort();

    // Steady state: every host every INTERVAL, staggered evenly; a tenth of the reports carry
    // a change (one function breaks, or recovers).
    let cpu0 = database_cpu(postmaster);
    let wall0 = Instant::now();
    let mut tasks = Vec::new();
    for (h, mut c) in clients.into_iter().enumerate() {
        let offset = INTERVAL.mul_f64(h as f64 / hosts as f64);
        tasks.push(tokio::spawn(async move {
            let mut heartbeats = Vec::new();
            let mut changed = Vec::new();
            let start = tokio::time::Instant::now() + offset;
            let mut broken = None;
            let mut k = 0u64;
            let end = tokio::time::Instant::now() + duration;
            let mut next = start;
            while next < end {
                tokio::time::sleep_until(next).await;
                k += 1;
                // Deterministic spread of changes over hosts and turns.
                let change =
                    ((h as u64 * 7919 + k * 104_729) % 1000) as f64 / 1000.0 < CHANGED_SHARE;
                if change {
                    broken = match broken {
                        None => Some((h + k as usize) % FUNCTIONS),
                        Some(_) => None,
                    };
                }
                let r = report(h, broken);
                let t = Instant::now();
                let out = db::report(&mut c, &meta(h), &r).await.unwrap();
                let took = t.elapsed();
                if out.heartbeat_only {
                    heartbeats.push(took);
                } else {
                    changed.push(took);
                }
                next += INTERVAL;
            }
            (heartbeats, changed)
        }));
    }
    let mut heartbeats = Vec::new();
    let mut changed = Vec::new();
    for t in tasks {
        let (h, c) = t.await.unwrap();
        heartbeats.extend(h);
        changed.extend(c);
    }
    let wall = wall0.elapsed().as_secs_f64();
    let cpu = database_cpu(postmaster) - cpu0;
    heartbeats.sort();
    changed.sort();
    let mut all: Vec<Duration> = heartbeats.iter().chain(&changed).copied().collect();
    all.sort();

    // Fleet claims: 16 clients reserving VFs as fast as they can. This is the database's part
    // of a fleet claim; the host's local claim is SQLite work (benches/claims.rs).
    let ops: Vec<_> =
        futures_join((0..CLAIM_CLIENTS).map(|_| pg.client("bench_ops", "pw", "fleet"))).await;
    let claim_secs = Duration::from_secs(10);
    let counter = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let t0 = Instant::now();
    let mut runs = Vec::new();
    for (i, mut c) in ops.into_iter().enumerate() {
        let counter = Arc::clone(&counter);
        runs.push(tokio::spawn(async move {
            let filter = db::Filter {
                role: Some("vf".into()),
                ..Default::default()
            };
            let mut lat = Vec::new();
            let mut n = 0;
            while t0.elapsed() < claim_secs {
                let t = Instant::now();
                let r = db::reserve(&mut c, &filter, &format!("vm-{i}-{n}"), "bench")
                    .await
                    .unwrap();
                lat.push(t.elapsed());
                n += 1;
                if r.is_none() {
                    break;
                }
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            (c, lat)
        }));
    }
    let mut claim_lat = Vec::new();
    let mut ops_back = Vec::new();
    for r in runs {
        let (c, l) = r.await.unwrap();
        claim_lat.extend(l);
        ops_back.push(c);
    }
    let claim_wall = t0.elapsed().as_secs_f64();
    let claims = counter.load(std::sync::atomic::Ordering::Relaxed);
    claim_lat.sort();

    // The reference: a one-row update transaction, 16 clients, same server, same run.
    let t0 = Instant::now();
    let mut runs = Vec::new();
    let ref_secs = Duration::from_secs(5);
    for (i, mut c) in ops_back.into_iter().enumerate() {
        runs.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let id = (i % 16) as i32 + 1;
            while t0.elapsed() < ref_secs {
                let t = Instant::now();
                let tx = c.transaction().await.unwrap();
                tx.execute(
                    "UPDATE public.reference SET n = n + 1 WHERE id = $1",
                    &[&id],
                )
                .await
                .unwrap();
                tx.commit().await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut ref_lat = Vec::new();
    for r in runs {
        ref_lat.extend(r.await.unwrap());
    }
    let ref_rate = ref_lat.len() as f64 / t0.elapsed().as_secs_f64();
    ref_lat.sort();
    let ref_p50 = percentile(&ref_lat, 0.5);

    println!("\n== {hosts} hosts x {FUNCTIONS} functions ==");
    println!(
        "first report (100 rows inserted): p50 {} p99 {}",
        ms(percentile(&first, 0.5)),
        ms(percentile(&first, 0.99))
    );
    println!(
        "steady reports: {} in {wall:.1} s ({:.1}/s): all p50 {} p99 {}; heartbeats ({}) p50 {} p99 {}; changed ({}) p50 {} p99 {}",
        all.len(),
        all.len() as f64 / wall,
        ms(percentile(&all, 0.5)),
        ms(percentile(&all, 0.99)),
        heartbeats.len(),
        ms(percentile(&heartbeats, 0.5)),
        ms(percentile(&heartbeats, 0.99)),
        changed.len(),
        ms(percentile(&changed, 0.5)),
        ms(percentile(&changed, 0.99)),
    );
    println!(
        "database CPU: {cpu:.2} s in {wall:.1} s = {:.1}% of one core, {:.1}% of the machine ({cores} cores)",
        100.0 * cpu / wall,
        100.0 * cpu / wall / cores as f64
    );
    println!(
        "fleet claims (reservations), {CLAIM_CLIENTS} clients: {claims} in {claim_wall:.1} s = {:.0}/s, p50 {} p99 {}",
        claims as f64 / claim_wall,
        ms(percentile(&claim_lat, 0.5)),
        ms(percentile(&claim_lat, 0.99))
    );
    println!(
        "reference (one-row update transaction, {CLAIM_CLIENTS} clients): {ref_rate:.0}/s, p50 {} p99 {}",
        ms(ref_p50),
        ms(percentile(&ref_lat, 0.99))
    );
    println!(
        "ratios to the reference: report p50 {:.1}x, heartbeat p50 {:.1}x, changed report p50 {:.1}x, claim p50 {:.1}x, claim rate {:.2}x",
        percentile(&all, 0.5).as_secs_f64() / ref_p50.as_secs_f64(),
        percentile(&heartbeats, 0.5).as_secs_f64() / ref_p50.as_secs_f64(),
        percentile(&changed, 0.5).as_secs_f64() / ref_p50.as_secs_f64(),
        percentile(&claim_lat, 0.5).as_secs_f64() / ref_p50.as_secs_f64(),
        (claims as f64 / claim_wall) / ref_rate
    );
    drop(su0);
    drop(su);
    drop(pg);
}

async fn futures_join<F, T>(futures: impl Iterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T>,
{
    let mut out = Vec::new();
    for f in futures {
        out.push(f.await);
    }
    out
}
