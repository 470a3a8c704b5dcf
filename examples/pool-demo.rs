//! The pooled demo (issue 11), `cargo run --release --example pool-demo`: a pooled device's
//! session handed over from one host to another by the same code libvirt's hooks and events
//! run, on one machine, with nothing to install: the reference pool service on loopback, two
//! vfiod daemons on simulated hosts ("hosta" and "hostb", each on a private bus), and the
//! stand-in user-mode driver streaming numbered items to the session throughout. It prints each
//! step with its time, the pause window, and what the driver lost or got twice.
//!
//! The steps are those of a live migration with `quiesce_at = "switchover"`: hostb's
//! `migrate begin` hook (through `Manager.Hook`, with the domain XML carrying the session in
//! vfiod's metadata), hosta's switchover ([`Engine::quiesce_pooled`], what libvirt's
//! suspended-for-migration event runs), hostb's resume ([`Engine::resume_pooled`], what the
//! resumed event runs), hosta's `stopped` hook. Only libvirt itself is played.
//!
//! An example of the vfiod package, with the pool crate as a dev-dependency: it needs both
//! ends, and the daemon's binary must not link the pool service (it was `vfiod --demo-pool`).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vfiod::config::Settings;
use vfiod::dbus::{auth::Authorizer, BusTarget};
use vfiod::engine::{ConfigSource, Engine};
use vfiod::host::libvirt::xml::{metadata_element_with, MetadataPooled};
use vfiod::pool::client::{PoolClient, PoolEndpoint};
use vfiod::server::{Options, Server};
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{HostModel, SimKernel};
use vfiod_pool::driver::{self, DriverConfig};
use vfiod_pool::service::{self, PoolConfig};

const UUID: &str = "0c1d2e3f-4a5b-4c6d-8e9f-a0b1c2d3e4f5";
const ITEMS: u64 = 3_000;

/// One simulated host with vfiod running on it.
struct Host {
    name: &'static str,
    server: Server,
    client: zbus::Connection,
    _bus: PrivateBus,
    _kernel: Arc<SimKernel>,
}

impl Host {
    async fn start(dir: &Path, name: &'static str, pool_url: &str) -> Result<Host, String> {
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let kernel = SimKernel::build(&dir.join("root"), &HostModel::reference())
            .map_err(|e| format!("simulated host: {e}"))?;
        let bus = PrivateBus::start(&dir.join("bus"), "").map_err(|e| format!("bus: {e}"))?;
        let config = dir.join("vfiod.toml");
        std::fs::write(
            &config,
            format!(
                "poll_interval = 3600\nlibvirt_uri = \"\"\nhost_name = \"{name}\"\n\
                 [[pool]]\nname = \"demo\"\nurl = \"{pool_url}\"\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let source = ConfigSource {
            main: config,
            dropin_dir: None,
            main_required: true,
            pin_sysfs_root: Some(kernel.root().to_path_buf()),
            pin_state_dir: Some(dir.join("state")),
        };
        let settings: Settings = source.load().map_err(|e| vfiod::error_chain(&e))?;
        let server = Server::start(Options {
            settings,
            source: Some(source),
            sysfs: kernel.sysfs(),
            events: Some(kernel.subscribe()),
            bus: BusTarget::Address(bus.address().to_string()),
            authorizer: Authorizer::SameUser,
            simulated: true,
        })
        .await
        .map_err(|e| vfiod::error_chain(&e))?;
        let client = zbus::connection::Builder::address(bus.address())
            .build()
            .await
            .map_err(|e| e.to_string())?;
        Ok(Host {
            name,
            server,
            client,
            _bus: bus,
            _kernel: kernel,
        })
    }

    fn engine(&self) -> &Arc<Engine> {
        &self.server.engine
    }

    async fn manager(&self) -> Result<vfiod::client::ManagerProxy<'static>, String> {
        vfiod::client::manager(&self.client)
            .await
            .map_err(|e| vfiod::error_chain(&e))
    }
}

/// Prints a step with the time since the demo began.
struct Clock(Instant);

impl Clock {
    fn say(&self, who: &str, what: &str) {
        println!(
            "{:>9.3} ms  {who:<6} {what}",
            self.0.elapsed().as_secs_f64() * 1000.0
        );
    }
}

/// Runs the demo; the error says what failed.
async fn pool_migration() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let clock = Clock(Instant::now());
    let pool = service::start(PoolConfig::new(
        "127.0.0.1:0".parse().expect("an address"),
        dir.path().join("pool"),
    ))
    .await
    .map_err(|e| vfiod::error_chain(&e))?;
    let url = pool.url(false).to_string();
    let url = url.trim_end_matches('/').to_string();
    clock.say("pool", &format!("vfiod-pool serves {url}"));
    let a = Host::start(dir.path(), "hosta", &url).await?;
    let b = Host::start(dir.path(), "hostb", &url).await?;
    clock.say("", "vfiod runs on simulated hosts hosta and hostb");

    // Lease a pooled device to the VM on hosta, over D-Bus.
    let owner = vfiod::client::query(vec![
        ("vm_name", Some("vm1".into())),
        ("vm_uuid", Some(UUID.into())),
    ]);
    let leased = a
        .manager()
        .await?
        .lease_pooled("demo", "dev0", owner)
        .await
        .map_err(|e| e.to_string())?;
    let c = vfiod::client::pool::PooledEntry::from_dict(&leased);
    clock.say(
        a.name,
        &format!(
            "pooled claim {}: dev0 leased to vm1, session {} at epoch {}",
            c.id, c.session, c.epoch
        ),
    );

    // The driver inside the VM streams items to its session from the host it runs on.
    vfiod::pool::client::install_crypto_provider();
    let endpoint = PoolEndpoint::new(url.parse().map_err(|e| format!("{url}: {e}"))?);
    let client = PoolClient::new(&endpoint).map_err(|e| e.to_string())?;
    let mut cfg = DriverConfig::new(&c.session, a.name, ITEMS);
    cfg.follow_session = false;
    let (drv, handle) = driver::driver(client, cfg);
    let running = tokio::spawn(drv.run());
    handle.wait_received(ITEMS / 4).await;
    clock.say(
        "driver",
        &format!("{} results so far", handle.progress().received),
    );

    // 1. hostb, migrate begin: the pool confirms it can serve hostb.
    let xml = format!(
        "<domain type='kvm'><name>vm1</name><uuid>{UUID}</uuid><metadata>{}</metadata>\
         <devices/></domain>",
        metadata_element_with(
            &[],
            &[MetadataPooled {
                pool: c.pool.clone(),
                session: c.session.clone(),
                device: c.device.clone(),
                epoch: c.epoch,
                host: a.name.into(),
            }]
        )
    );
    let (code, _, message) = b
        .manager()
        .await?
        .hook("vm1", "migrate", "begin", "-", &xml)
        .await
        .map_err(|e| e.to_string())?;
    if code != 0 {
        return Err(format!("hostb's migrate hook refused: {message}"));
    }
    clock.say(b.name, &format!("migrate begin hook: {message}"));
    tokio::time::sleep(Duration::from_millis(200)).await;

    // 2. hosta, switchover: quiesce.
    let quiesce_at = Instant::now();
    let q = a.engine().quiesce_pooled("vm1", Some(UUID)).await;
    step_result(&q)?;
    clock.say(
        a.name,
        "switchover (suspended for migration): session quiesced",
    );
    // The VM's own downtime: its memory's last pages cross over.
    tokio::time::sleep(Duration::from_millis(30)).await;

    // 3. hostb, the VM runs there: resume with the epoch; the driver runs there now.
    handle.move_to(b.name);
    let r = b.engine().resume_pooled("vm1", Some(UUID)).await;
    step_result(&r)?;
    let window = quiesce_at.elapsed();
    let epoch = r[0].after.as_ref().map_or(0, |c| c.epoch);
    clock.say(
        b.name,
        &format!("resumed (the VM runs here): session at epoch {epoch}"),
    );

    // 4. hosta, stopped after the migration: forgotten, no pool call.
    let (_, _, _) = a
        .manager()
        .await?
        .hook("vm1", "stopped", "end", "-", &xml)
        .await
        .map_err(|e| e.to_string())?;
    clock.say(a.name, "stopped hook: the session is forgotten here");

    let report = running
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| vfiod::error_chain(&e))?;
    clock.say("driver", "done");
    println!();
    println!("the pooled claim's history on both hosts (vfioctl events, kind pool), by time:");
    let mut steps = Vec::new();
    for host in [&a, &b] {
        let events = host
            .engine()
            .store()
            .events(None, 0, 1000)
            .map_err(|e| vfiod::error_chain(&e))?;
        steps.extend(
            events
                .into_iter()
                .filter(|e| e.kind == vfiod::model::event::EventKind::Pool)
                .map(|e| (e.time_ms, host.name, e.message)),
        );
    }
    steps.sort_by_key(|(t, _, _)| *t);
    let first = steps.first().map_or(0, |(t, _, _)| *t);
    for (t, host, message) in &steps {
        let step = message
            .split_once("): ")
            .map_or(message.as_str(), |(_, s)| s);
        println!("  +{:>6} ms  {host}  {step}", t - first);
    }
    println!();
    println!(
        "quiesce window (quiesce to resume): {:.1} ms; the driver's longest pause: {:.1} ms",
        window.as_secs_f64() * 1000.0,
        report.longest_gap.as_secs_f64() * 1000.0
    );
    println!(
        "{} items: {} lost, {} duplicated, {} wrong",
        report.submitted, report.lost, report.duplicated, report.wrong
    );
    a.server.stop().await;
    b.server.stop().await;
    pool.stop().await;
    if report.lost + report.duplicated + report.wrong > 0 || !report.complete {
        return Err("the driver saw items lost, duplicated or wrong".into());
    }
    Ok(())
}

fn step_result(done: &[vfiod::engine::PooledOutcome]) -> Result<(), String> {
    match done.first() {
        None => Err("no pooled claim took the step".into()),
        Some(o) => match &o.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        },
    }
}

fn main() -> ExitCode {
    // The demo prints its own steps; the daemons' log would drown them (VFIOD_LOG overrides).
    vfiod::log_to_stderr("warn");
    // Two daemons and a pool in one process: the descriptor limit as vfiod raises it.
    if let Err(e) = vfiod::server::raise_fd_limit() {
        tracing::warn!("cannot raise the descriptor limit: {e}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pool-demo: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(pool_migration()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pool-demo: {e}");
            ExitCode::FAILURE
        }
    };
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}
