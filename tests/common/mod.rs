//! Shared harness for the integration tests: a simulated host, a real private dbus-daemon,
//! and vfiod started in-process exactly as the binary starts it.
#![allow(dead_code)]

use futures_util::StreamExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use vfiod::config::Settings;
use vfiod::dbus::{auth::Authorizer, BusTarget};
use vfiod::engine::ConfigSource;
use vfiod::server::{Options, Server};
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{HostModel, SimKernel};
use zbus::{MessageStream, OwnedVariant};

pub mod bins;
pub mod libvirtd;
pub mod polkit;
#[cfg(feature = "fleet")]
pub mod postgres;
pub mod proxies;
pub mod test_job;

pub const DEMO_CONFIG: &str = include_str!("../../conf/simulate.toml");

/// Selects the same devices as the demo, with targets equal to the reference host's boot state
/// (private scenario; the QAT, booted split onto c6xxvf, stays so): start-up reconciles nothing,
/// so tests of the inventory see the host as modelled.
pub const STEADY_CONFIG: &str = r#"
scenario = "private"
poll_interval = 10
[[select]]
class = "0x03"
[[select]]
id = "10de:1aef"
[[select]]
id = "8086:1572"
[[select]]
id = "8086:37c8"
kind = "crypto"
mode = "vf"
num_vfs = 16
vf_driver = "c6xxvf"
[[select]]
class = "0x12"
kind = "fpga"
[[select]]
id = "144d:a824"
[[select]]
class = "0x010802"
"#;

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub kernel: Arc<SimKernel>,
    pub bus: PrivateBus,
    pub server: Option<Server>,
    /// A client connection, as vfioctl would have.
    pub client: zbus::Connection,
    pub config_path: PathBuf,
}

impl Harness {
    /// Starts vfiod on the reference host with `config` (TOML, written to a file so that
    /// reloads re-read it). Polling is made slow unless the config says otherwise, so tests
    /// see what uevents and explicit calls do.
    pub async fn start(config: &str) -> Harness {
        Self::start_with(config, HostModel::reference()).await
    }

    pub async fn start_with(config: &str, model: HostModel) -> Harness {
        let dir = fast_tempdir();
        let kernel = SimKernel::build(&dir.path().join("root"), &model).expect("simulated host");
        let bus = PrivateBus::start(&dir.path().join("bus"), "").expect("private dbus-daemon");
        let mut h = Harness::assemble(dir, kernel, bus, config).await;
        h.start_server().await;
        h
    }

    /// A harness around a host and a bus that the caller started (vfiod not started yet):
    /// writes `config` where reloads read it and connects a client.
    pub async fn assemble(
        dir: tempfile::TempDir,
        kernel: Arc<SimKernel>,
        bus: PrivateBus,
        config: &str,
    ) -> Harness {
        let config_path = dir.path().join("vfiod.toml");
        std::fs::write(&config_path, config).expect("write config");
        Harness {
            client: zbus::connection::Builder::address(bus.address())
                .build()
                .await
                .expect("client connection"),
            dir,
            kernel,
            bus,
            server: None,
            config_path,
        }
    }

    pub fn source(&self) -> ConfigSource {
        ConfigSource {
            main: self.config_path.clone(),
            dropin_dir: None,
            main_required: true,
            pin_sysfs_root: Some(self.kernel.root().to_path_buf()),
            pin_state_dir: Some(self.dir.path().join("state")),
        }
    }

    pub async fn start_server(&mut self) {
        let source = self.source();
        let settings: Settings = source.load().expect("test config loads");
        let test_driver = settings
            .libvirt_uri
            .clone()
            .filter(|u| u.starts_with("test://") || u.starts_with("test+unix://"));
        let server = Server::start(Options {
            settings,
            source: Some(source),
            sysfs: self.kernel.sysfs(),
            events: Some(self.kernel.subscribe()),
            bus: BusTarget::Address(self.bus.address().to_string()),
            authorizer: Authorizer::SameUser,
            simulated: true,
        })
        .await
        .expect("vfiod starts");
        // A test libvirt (the test driver, in a file or served by the test's libvirtd: connected
        // at once) must have been reconciled with before the test acts: the start-up reconcile
        // would otherwise race the test's hook calls and undo what they recorded when the
        // test's domains and claims disagree on purpose, and the events of domains the test
        // defines before the worker registered for them would never come.
        if test_driver.is_some() {
            wait_for_libvirt(&server.engine).await;
        }
        self.server = Some(server);
    }

    pub async fn stop_server(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
    }

    pub fn bus_target(&self) -> BusTarget {
        BusTarget::Address(self.bus.address().to_string())
    }

    pub fn engine(&self) -> &Arc<vfiod::engine::Engine> {
        &self.server.as_ref().expect("server running").engine
    }

    pub fn store(&self) -> Arc<vfiod::store::Store> {
        Arc::clone(self.server.as_ref().expect("server running").engine.store())
    }

    pub async fn manager(&self) -> vfiod::client::ManagerProxy<'static> {
        vfiod::client::manager(&self.client)
            .await
            .expect("manager proxy")
    }

    /// A stream of signals matching `rule` on the client connection (subscribe before acting).
    pub async fn signals(&self, rule: &str) -> MessageStream {
        MessageStream::for_match_rule(rule, &self.client, None)
            .await
            .expect("match rule")
    }
}

/// The next message on `stream` for which `pick` returns Some, within `secs` seconds.
pub async fn wait_for<T>(
    stream: &mut MessageStream,
    secs: u64,
    mut pick: impl FnMut(&zbus::Message) -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next())
            .await
            .unwrap_or_else(|_| panic!("no matching signal within {secs} s"));
        let msg = next.expect("stream open").expect("message");
        if let Some(v) = pick(&msg) {
            return v;
        }
    }
}

pub type Props = HashMap<String, OwnedVariant>;

/// A temporary directory in memory (`/dev/shm`) unless `TMPDIR` says otherwise: the simulated
/// kernel renders thousands of small files and links (like sysfs, which lives in memory too),
/// ten times faster there than on a busy disk.
pub fn fast_tempdir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if std::env::var_os("TMPDIR").is_none() && shm.is_dir() {
        if let Ok(d) = tempfile::Builder::new()
            .prefix("vfiod-test.")
            .tempdir_in(shm)
        {
            return d;
        }
    }
    tempfile::Builder::new()
        .prefix("vfiod-test.")
        .tempdir()
        .expect("tempdir")
}

pub fn prop_str(p: &Props, k: &str) -> Option<String> {
    p.get(k)
        .and_then(|v| String::try_from(v.try_clone().ok()?).ok())
}

pub fn addr(s: &str) -> vfiod::model::pci::PciAddress {
    s.parse().expect("address")
}

/// The deadline for waiting on something that must happen: far past anything a loaded 2-core
/// machine takes, so it only ends a test that hangs. Tests never bound how long a thing takes
/// (timing claims live in `benches/`, as ratios); the rule and its guard: tests/library/timing.rs.
pub const HUNG: Duration = Duration::from_secs(60);

/// Polls `condition` until it returns `Some`, and returns that; fails the test with `what` if it
/// has not within `within`. The one way tests wait for something asynchronous (no fixed sleeps):
/// it returns as soon as the condition holds, and a regression fails with a message, not a hang.
pub async fn eventually<T>(
    within: Duration,
    what: &str,
    mut condition: impl FnMut() -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = condition() {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`eventually`] for a condition that needs to await (a D-Bus call).
pub async fn eventually_async<T, F, Fut>(within: Duration, what: &str, mut condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = condition().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`eventually`] for a test without an async runtime (child processes, threads): blocks the
/// thread between polls.
pub fn eventually_blocking<T>(
    within: Duration,
    what: &str,
    mut condition: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(v) = condition() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Set, to a test's name, only in the process [`helper_process`] starts: that test then acts as
/// the helper process its own run needs, instead of running its checks.
pub const HELPER_ENV: &str = "VFIOD_TEST_HELPER";

/// The name libtest knows the test `test` of module `module_path` (`module_path!()`) by, as
/// `--exact` wants it: the module's path without the crate's name, `jobs::a_job_...`.
pub fn test_name(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_krate, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}

/// Whether this process is the helper process of test `name` (started by [`helper_process`]).
pub fn is_helper(name: &str) -> bool {
    std::env::var_os(HELPER_ENV).is_some_and(|v| v == name)
}

/// This test binary again, running only test `name` (`--exact`, one thread) with [`HELPER_ENV`]
/// set to it, so that the test acts as its own helper process. A test that needs a process of
/// its own (to be killed, or alone with its threads) is its own helper: no ignored helper test
/// that passes doing nothing when run without the variable.
pub fn helper_process(name: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().expect("this test binary"));
    c.args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(HELPER_ENV, name);
    c
}

/// Runs test `name` as its own helper process ([`helper_process`]) to its end, and fails unless
/// it ran and passed there.
pub fn run_in_own_process(name: &str) {
    let out = helper_process(name)
        .output()
        .expect("run the helper process");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("test result: ok. 1 passed;"),
        "{name} in a process of its own ({}):\n{text}",
        out.status
    );
}

/// Runs the built `vfioctl` against `bus`: (success, stdout and stderr together).
pub fn vfioctl(bus: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args(args)
        .env("VFIOD_BUS", bus)
        .output()
        .expect("run vfioctl");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// [`STEADY_CONFIG`] with the GPU's IOMMU group (GPU and audio function) selected onto vfio-pci,
/// or not: toggling it moves the group back and forth.
pub fn gpu_group_config(vfio: bool) -> String {
    if !vfio {
        return STEADY_CONFIG.to_string();
    }
    let c = STEADY_CONFIG
        .replace(
            "class = \"0x03\"\n",
            "class = \"0x03\"\npf_driver = \"vfio-pci\"\n",
        )
        .replace(
            "id = \"10de:1aef\"\n",
            "id = \"10de:1aef\"\npf_driver = \"vfio-pci\"\n",
        );
    assert_ne!(c, STEADY_CONFIG);
    c
}

impl Harness {
    /// Replaces the configuration file in one step (a reload never reads half a file).
    pub fn replace_config(&self, text: &str) {
        let tmp = self.config_path.with_extension("toml.new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.config_path).unwrap();
    }
}

/// (error name, message) of a refused call; fails the test, saying `what`, if the call was
/// accepted or the error is not a D-Bus error reply.
pub fn refusal<T>(r: zbus::Result<T>, what: &str) -> (String, String) {
    match r {
        Err(zbus::Error::MethodError(name, message, _)) => {
            (name.to_string(), message.unwrap_or_default())
        }
        // zbus reports the org.freedesktop.DBus.Error.* names as its own enum.
        Err(zbus::Error::FDO(e)) => {
            use zbus::DBusError;
            (
                e.name().to_string(),
                e.description().unwrap_or_default().to_string(),
            )
        }
        Err(other) => panic!("{what}: not a D-Bus error reply: {other}"),
        Ok(_) => panic!("{what}: accepted, but must be refused"),
    }
}

/// An `a{sv}` dictionary (a query, requirements, an owner) from its pairs.
pub fn dict(pairs: &[(&str, zbus::Variant<'static>)]) -> vfiod::dbus::wire::Dict {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), OwnedVariant::try_from(v.clone()).unwrap()))
        .collect()
}

/// A new client connection to `address` (a private bus), as a separate client would have.
pub async fn connect(address: &str) -> zbus::Connection {
    zbus::connection::Builder::address(address)
        .build()
        .await
        .expect("client connection")
}

/// Waits until `address` is back in the pool after the clean its claim's end started (issue 23:
/// held out of the pool, `cleaning`, until the reset and the health check pass; then `usable`
/// and idle), and returns the clean's result as the device shows it (`LastResult`). The hold is
/// written with the claim's end, so a clean still to come is never mistaken for a done one.
pub async fn cleaned(h: &Harness, address: &str) -> String {
    let store = h.store();
    let client = &h.client;
    let a = addr(address);
    eventually_async(
        HUNG,
        &format!("{address} is cleaned and back in the pool"),
        || {
            let store = std::sync::Arc::clone(&store);
            async move {
                if store.clean_hold(a).ok()?.is_some() {
                    return None;
                }
                let d = vfiod::client::show_device(client, address).await.ok()?;
                (d.state == "usable" && d.task_state == "idle" && d.last_result.contains("clean"))
                    .then_some(d.last_result)
            }
        },
    )
    .await
}

/// Waits (at most 20 s) until the engine's run loop has handled the libvirt worker's
/// `Connected`: from then on the worker is registered for domain events, and the claims were
/// reconciled with libvirt's domains. An event of a domain defined before that is never seen
/// (libvirt does not replay events), so a test that waits for one must wait for this first.
pub async fn wait_for_libvirt(engine: &vfiod::engine::Engine) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let link = engine.libvirt_link();
        if link.as_ref().map(|l| l.word()) == Some("connected") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "vfiod did not connect to libvirt within 20 s: {link:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
