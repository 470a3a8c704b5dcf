//! Cleaning between tenants (issue 23): how long a released device takes to be back in the
//! pool, against the reset it needs. vfiod runs in-process on the simulated host (the NIC split
//! into 8 VFs on vfio-pci) with its real SQLite store on disk; a client on a private
//! dbus-daemon claims a VF, releases it, and polls `FindDevices` for it until it is claimable
//! again: the release's commit, the hold, the cleaner's wake-up, the clean task (admitted,
//! prepared, guarded, the reset, the health check, the outcome recorded), the task's end and
//! the pass after it. Every reset of the simulated kernel is made to take `VFIOD_BENCH_RESET_MS`
//! (default 100 ms, about what a function-level reset takes on hardware); the reference, in the
//! same run, is the bare reset: one write of `1` to the VF's `reset` through the same sysfs
//! backend, with the same delay.
//!
//! Run: `cargo bench --bench clean`. Prints the per-round figures' median and 95th percentile,
//! vfiod's own time (release to claimable, minus the bare reset) and the ratio; target: vfiod's
//! own time at most 50 ms at the median (exit status 1 otherwise). `VFIOD_BENCH_ROUNDS` sets the
//! rounds (default 30).

use std::path::Path;
use std::time::{Duration, Instant};
use vfiod::client::claim::ClaimProxy;
use vfiod::client::ManagerProxy;
use vfiod::dbus::wire::Dict;
use vfiod::dbus::{auth::Authorizer, BusTarget};
use vfiod::model::pci::PciAddress;
use vfiod::server::{Options, Server};
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{FaultAction, FaultTarget, HostModel, SimKernel};

const CONFIG: &str = r#"
scenario = "public"
poll_interval = 3600
libvirt_uri = ""
[[select]]
class = "0x0200"
mode = "vf"
num_vfs = 8
vf_driver = "vfio-pci"
"#;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn dict(key: &str, value: &str) -> Dict {
    Dict::from([(
        key.to_string(),
        zbus::OwnedVariant::try_from(zbus::Variant::from(value.to_string())).unwrap(),
    )])
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let rounds: usize = env_or("VFIOD_BENCH_ROUNDS", 30);
    let reset = Duration::from_millis(env_or("VFIOD_BENCH_RESET_MS", 100));
    let dir = tempfile::tempdir().unwrap();
    // On the disk the build uses: every commit is a real fsync.
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let bus = PrivateBus::start(&dir.path().join("bus"), "").expect("private dbus-daemon");
    let mut settings =
        vfiod::config::Settings::from_toml_str(CONFIG, Path::new("bench.toml")).unwrap();
    settings.sysfs_root = kernel.root().to_path_buf();
    settings.state_dir = state.path().to_path_buf();

    let daemon_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
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
    let vf: PciAddress = server
        .engine
        .store()
        .devices()
        .unwrap()
        .into_iter()
        .find(|d| d.parent_pf.is_some() && d.driver.as_deref() == Some("vfio-pci"))
        .expect("a VF on vfio-pci")
        .address;
    let slow_resets = || {
        kernel.inject(
            FaultTarget::DeviceAttr(vf, "reset".into()),
            FaultAction::Delay(reset),
            None,
        )
    };
    slow_resets();

    let (cleaned, bare) = client_rt.block_on(async {
        let conn = zbus::connection::Builder::address(bus.address())
            .build()
            .await
            .unwrap();
        let manager = ManagerProxy::builder(&conn)
            .cache_properties(zbus::proxy::CacheProperties::No)
            .build()
            .await
            .unwrap();
        let find = dict("address", &vf.to_string());
        let owner = dict("vm_name", "bench");
        let mut cleaned = Vec::with_capacity(rounds);
        let mut bare = Vec::with_capacity(rounds);
        for round in 0..rounds + 1 {
            let path = manager
                .claim(find.clone(), owner.clone())
                .await
                .expect("claim");
            let claim = ClaimProxy::builder(&conn).path(path).build().await.unwrap();
            let released = Instant::now();
            claim.release().await.expect("release");
            loop {
                if !manager.find_devices(find.clone()).await.unwrap().is_empty() {
                    break;
                }
                assert!(
                    released.elapsed() < Duration::from_secs(30),
                    "not back in the pool"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let took = released.elapsed();
            // The reference: the bare reset write, through the same backend, same delay.
            let sysfs = kernel.sysfs();
            let t = Instant::now();
            sysfs
                .write(&sysfs.device_attr(vf, "reset"), "1")
                .expect("a bare reset");
            let reset_took = t.elapsed();
            // The first round warms the caches: not counted.
            if round > 0 {
                cleaned.push(took);
                bare.push(reset_took);
            }
        }
        (cleaned, bare)
    });
    let health = server.engine.store().reset_health(vf).unwrap().unwrap();
    assert_eq!(health.cleans as usize, rounds + 1, "every round cleaned");
    daemon_rt.block_on(server.stop());

    let (mut cleaned, mut bare) = (cleaned, bare);
    cleaned.sort();
    bare.sort();
    let own: Vec<f64> = {
        let mut v: Vec<f64> = cleaned
            .iter()
            .zip(&bare)
            .map(|(c, b)| ms(*c) - ms(*b))
            .collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    };
    let own_p50 = own[own.len() / 2];
    let own_p95 = own[((own.len() - 1) as f64 * 0.95).round() as usize];
    println!(
        "clean: {rounds} rounds, each reset made to take {} ms (VF {vf})",
        reset.as_millis()
    );
    println!(
        "  release -> back in the pool: median {:.1} ms, p95 {:.1} ms",
        ms(quantile(&cleaned, 0.5)),
        ms(quantile(&cleaned, 0.95))
    );
    println!(
        "  the bare reset write (reference): median {:.1} ms, p95 {:.1} ms",
        ms(quantile(&bare, 0.5)),
        ms(quantile(&bare, 0.95))
    );
    println!(
        "  vfiod's own time (release to pool minus the reset): median {own_p50:.1} ms, p95 {own_p95:.1} ms; ratio to the bare reset {:.2}x",
        ms(quantile(&cleaned, 0.5)) / ms(quantile(&bare, 0.5))
    );
    if own_p50 > 50.0 {
        eprintln!("vfiod's own time {own_p50:.1} ms is over the 50 ms target");
        std::process::exit(1);
    }
}
