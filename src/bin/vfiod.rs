//! `vfiod`: the daemon. See `vfiod --help`.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use vfiod::config::{self, Settings};
use vfiod::dbus::{auth::Authorizer, BusTarget};
use vfiod::engine::ConfigSource;
use vfiod::error_chain;
use vfiod::host::sysfs::Sysfs;
use vfiod::host::uevent;
use vfiod::server::{Options, Server};
use vfiod::sim::bus::PrivateBus;
use vfiod::sim::kernel::{HostModel, SimKernel};

/// Manages PCI accelerators (GPUs, FPGAs, QAT, NVMe, SR-IOV NICs) for libvirt/QEMU VMs and
/// serves their inventory on D-Bus as org.vfiod.Vfiod1.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Main configuration file (default /etc/vfiod/vfiod.toml; missing = defaults, which
    /// manage nothing).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Drop-in directory read after the main file.
    #[arg(long, default_value = config::DEFAULT_DROPIN_DIR)]
    conf_dir: PathBuf,
    /// Bus to serve on: system, session, or a D-Bus address.
    #[arg(long, default_value = "system")]
    bus: BusTarget,
    /// Validate the configuration, print the settings in effect, and exit.
    #[arg(long)]
    check_config: bool,
    /// Run on a simulated host (no hardware is read or touched) on a private bus started for
    /// the purpose. Both are private to the user who runs it (and root): that user may use
    /// every method without polkit; no other user reaches the bus or reads the tree.
    #[arg(long)]
    simulate: bool,
    /// With --simulate: keep the simulated host here instead of a temporary directory; a later
    /// run with the same directory reopens it (its devices and vfiod's state survive). It must
    /// be the running user's own, and is made mode 0700.
    #[arg(long, requires = "simulate")]
    sim_root: Option<PathBuf>,
    /// With --simulate: serve this recording (`vfioctl record`'s tarball, or any tree or tarball
    /// with a sys/ directory at some depth) as the simulated host instead of the reference
    /// host. Read-only: every sysfs write fails as the kernel fails a write to a read-only
    /// attribute (EACCES). Without --config, nothing is selected.
    #[arg(
        long,
        requires = "simulate",
        conflicts_with = "sim_root",
        value_name = "FILE_OR_DIR"
    )]
    replay: Option<PathBuf>,
    /// With --replay: boot the recording in the simulated kernel instead, whose SR-IOV,
    /// binding and reset behaviour then applies (a split, a rebind), starting from the
    /// recorded state.
    #[arg(long, requires = "replay")]
    replay_writable: bool,
    /// With --simulate: run this command with VFIOD_BUS pointing at the simulation, then stop
    /// and exit with its status (e.g. `vfiod --simulate -- vfioctl list`).
    #[arg(last = true, requires = "simulate")]
    command: Vec<String>,
    /// Create the state database and exit, taking an existing but empty `vfiod.db` as a new
    /// store (the daemon refuses to start on one: it is a database that lost its content).
    #[arg(long, conflicts_with_all = ["simulate", "check_config"])]
    init_state: bool,
    /// Start although the state database lacks changes vfiod acknowledged (its write-ahead
    /// log was damaged or removed, or an older copy was restored), going on with what it
    /// holds. Without it vfiod refuses to start on such a database and says what is missing.
    /// The loss is logged and recorded as a `store` event.
    #[arg(long, conflicts_with_all = ["init_state", "check_config"])]
    accept_store_loss: bool,
    /// The pooled demo's old place: it is `cargo run --release --example pool-demo` now (it
    /// runs the reference pool service, which vfiod no longer links). Says so and exits 2.
    // Hidden, and only for one release: for someone who learnt the old command.
    #[arg(long, hide = true, exclusive = true)]
    demo_pool: bool,
    /// Print a man page (roff) on stdout and exit: vfiod.8 (this daemon, from these options)
    /// or vfiod.toml.5 (its configuration, from docs/config.md). What `make install` installs.
    // Hidden: for the install, not for a person reading the help (nor in the page itself).
    #[arg(long, hide = true, value_name = "PAGE", exclusive = true)]
    man: Option<ManPage>,
}

/// The pages `vfiod --man` prints.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ManPage {
    #[value(name = "vfiod.8")]
    Daemon,
    #[value(name = "vfiod.toml.5")]
    Config,
}

/// `vfiod --man PAGE`: the page on stdout.
fn print_man(page: ManPage) -> ExitCode {
    use vfiod::client::man;
    let text = match page {
        ManPage::Daemon => man::command_page(
            <Args as clap::CommandFactory>::command(),
            "8",
            &daemon_man_sections(),
        ),
        ManPage::Config => Ok(man::config_page(env!("CARGO_PKG_VERSION")).into_bytes()),
    };
    use std::io::Write;
    match text.and_then(|t| std::io::stdout().write_all(&t)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vfiod: {e}");
            ExitCode::FAILURE
        }
    }
}

/// vfiod(8)'s sections beyond its options: where it reads and keeps things.
fn daemon_man_sections() -> String {
    format!(
        ".SH FILES\n\
         .TP\n\\fB/etc/vfiod/vfiod.toml\\fR, \\fB{dropins}/*.toml\\fR\n\
         The configuration, see \\fBvfiod.toml\\fR(5).\n\
         .TP\n\\fB/var/lib/vfiod/vfiod.db\\fR\n\
         The state database (claims, tasks, history), under the configuration's state_dir; its \
         write\\-ahead log \\fBvfiod.db\\-wal\\fR is emptied into it at a clean stop.\n\
         .TP\n\\fB/var/lib/vfiod/vfiod.acknowledged\\fR\n\
         The last change vfiod acknowledged, written after each commit: a database found behind \
         it at start lost acknowledged changes, and vfiod refuses to start (see \
         \\fB\\-\\-accept\\-store\\-loss\\fR).\n\
         .SH ENVIRONMENT\n\
         .TP\n\\fBVFIOD_LOG\\fR\n\
         The log filter: a level (\\fBdebug\\fR), or levels per target (\\fBvfiod=debug,zbus=warn\\fR); default \\fBinfo\\fR.\n\
         .SH SIGNALS\n\
         .TP\n\\fBSIGHUP\\fR\n\
         Re-read the configuration, as \\fBvfioctl reload\\fR does.\n\
         .TP\n\\fBSIGTERM\\fR\n\
         Stop within seconds; a task cut short is reported as interrupted at the next start.\n",
        dropins = config::DEFAULT_DROPIN_DIR.replace('-', "\\-"),
    )
}

/// Called once the API is served; may start the `--simulate -- COMMAND` child.
type ReadyHook = Box<dyn FnOnce() -> Result<Option<tokio::process::Child>, String> + Send>;

/// At most this many malloc arenas: glibc gives each thread that allocates an arena of its own
/// (up to 8 per core), whose first heap stays resident although a daemon that mostly waits
/// allocates little; two keep the worker threads from contending and save about 2 MB of an
/// idle vfiod's memory (issue 20, measured with benches/idle-memory.sh).
const MALLOC_ARENAS: i32 = 2;

fn main() -> ExitCode {
    // SAFETY: mallopt only sets a parameter of glibc's allocator; it is called before any other
    // thread exists, and an unsupported parameter is ignored (it returns 0).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
    let args = Args::parse();
    if let Some(page) = args.man {
        return print_man(page);
    }
    if args.demo_pool {
        eprintln!(
            "vfiod: --demo-pool moved out of the daemon (which no longer links the pool \
             service): from a checkout, run `cargo run --release --example pool-demo`"
        );
        return ExitCode::from(2);
    }
    vfiod::init_logging("vfiod", "info");
    // Before any thread or descriptor: the limit is the process's.
    match vfiod::server::raise_fd_limit() {
        Ok((soft, hard)) => tracing::debug!("descriptor limit {soft} (hard {hard})"),
        Err(e) => tracing::warn!("cannot raise the descriptor limit: {e}"),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vfiod: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vfiod: {e}");
            ExitCode::FAILURE
        }
    };
    // A blocking worker may be stuck (a write a driver never completes): dropping the runtime
    // would wait for it forever, and SIGTERM must end vfiod within seconds. Its task is reported
    // as interrupted at the next start.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not when it is
/// first polled.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    // SIGHUP's default action ends the process: from the first moment, a SIGHUP (a reload by
    // systemd or an operator while vfiod starts) is caught instead. The server listens for it
    // from its own start on; one that comes before that is dropped (the configuration is being
    // read then anyway).
    let _early_hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    if args.simulate {
        return simulate(args).await;
    }
    let source = ConfigSource {
        main: args
            .config
            .clone()
            .unwrap_or_else(|| config::DEFAULT_CONFIG_PATH.into()),
        dropin_dir: Some(args.conf_dir.clone()),
        main_required: args.config.is_some(),
        pin_sysfs_root: None,
        pin_state_dir: None,
    };
    if args.check_config {
        return check_config(&source);
    }
    let settings = source.load().map_err(|e| error_chain(&e))?;
    if args.init_state {
        return init_state(&settings.state_dir);
    }
    let sysfs = Sysfs::host(&settings.sysfs_root);
    // Kernel events describe the real /sys; with another root they would name devices that
    // are not in the tree we read, so only polling applies there.
    let events = if settings.sysfs_root == std::path::Path::new("/") {
        match uevent::netlink_source() {
            Ok(rx) => Some(rx),
            Err(e) => {
                tracing::warn!("cannot listen to kernel uevents ({e}); relying on polling");
                None
            }
        }
    } else {
        None
    };
    serve(
        settings,
        Some(source),
        sysfs,
        events,
        args.bus,
        Authorizer::Polkit,
        false,
        None,
        args.accept_store_loss,
    )
    .await
}

/// `--accept-store-loss`: the store opened as it is, under the state lock, a loss it finds
/// logged and recorded, and its acknowledged mark started again; the daemon then starts on it.
fn accept_loss(dir: &std::path::Path) -> Result<(), String> {
    let _lock = vfiod::store::lock::StateDirLock::acquire(dir).map_err(|e| error_chain(&e))?;
    let (store, loss) =
        vfiod::store::Store::open_accepting_loss(dir).map_err(|e| error_chain(&e))?;
    match loss {
        // Store::open_accepting_loss logged it, with what is missing.
        Some(_) => tracing::warn!(
            "starting on {} with the loss accepted (--accept-store-loss)",
            store.path().display()
        ),
        None => tracing::info!(
            "--accept-store-loss: {} lacks nothing vfiod acknowledged; nothing to accept",
            store.path().display()
        ),
    }
    Ok(())
}

/// `--init-state`: the store created (or an empty file taken as a new one), under the state
/// lock, so that a running daemon's database is never touched.
fn init_state(dir: &std::path::Path) -> Result<ExitCode, String> {
    let _lock = vfiod::store::lock::StateDirLock::acquire(dir).map_err(|e| error_chain(&e))?;
    let store = vfiod::store::Store::init(dir).map_err(|e| error_chain(&e))?;
    let version = store.schema_version().map_err(|e| error_chain(&e))?;
    println!(
        "state database {} ready (schema version {version})",
        store.path().display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `--check-config`: the settings, or every error found in the files, one per line.
fn check_config(source: &ConfigSource) -> Result<ExitCode, String> {
    match source.check() {
        Ok(settings) => {
            print_settings(&settings);
            Ok(ExitCode::SUCCESS)
        }
        Err(errors) => Err(config_errors(&errors)),
    }
}

/// Errors as lines of vfiod's message (`main` puts `vfiod: ` before the first): one error alone
/// reads as the daemon's own start-up error does; several end with their count.
fn config_errors(errors: &[vfiod::config::ConfigError]) -> String {
    vfiod::config::error_lines(errors).join("\nvfiod: ")
}

/// A `[[select]]` rule's settings besides its selector, as `key=value` words after a colon;
/// nothing when it only selects (the scenario's mode and the kind from the class apply).
fn rule_settings(r: &vfiod::config::DeviceRule) -> String {
    let mut words = Vec::new();
    if let Some(k) = r.kind {
        words.push(format!("kind={}", k.as_str()));
    }
    if let Some(m) = r.mode {
        words.push(format!("mode={}", m.as_str()));
    }
    if let Some(n) = r.num_vfs {
        words.push(format!("num_vfs={n}"));
    }
    if let Some(d) = &r.vf_driver {
        words.push(format!("vf_driver={d}"));
    }
    if let Some(d) = &r.pf_driver {
        words.push(format!("pf_driver={d}"));
    }
    if words.is_empty() {
        String::new()
    } else {
        format!(": {}", words.join(" "))
    }
}

fn print_settings(s: &Settings) {
    println!(
        "configuration OK, read from: {}",
        s.sources
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("scenario = {}", s.scenario.as_str());
    println!("poll_interval = {}s", s.poll_interval.as_secs());
    println!("state_dir = {}", s.state_dir.display());
    println!("sysfs_root = {}", s.sysfs_root.display());
    println!("select: {} rule(s)", s.select.len());
    for (i, r) in s.select.iter().enumerate() {
        let origin = s
            .select_origins
            .get(i)
            .map(|o| format!(" ({})", o.entry))
            .unwrap_or_default();
        println!("  #{} {}{origin}{}", i + 1, r.selector, rule_settings(r));
    }
    for w in s.shadowed_rule_warnings() {
        eprintln!("warning: {w}");
    }
    // The host's functions, read as the inventory reads them (read-only).
    match vfiod::inventory::scan(&Sysfs::host(&s.sysfs_root), s, &Default::default()) {
        Ok(devices) => {
            let functions: Vec<_> = devices
                .iter()
                .map(|d| (d.address, d.vendor_id, d.device_id, d.class))
                .collect();
            for w in s.unmatched_rule_warnings(&functions) {
                eprintln!("warning: {w}");
            }
        }
        Err(e) => eprintln!(
            "warning: cannot read the host's PCI functions under {}: {}",
            s.sysfs_root.display(),
            error_chain(&e)
        ),
    }
    println!("protect: {} selector(s)", s.protect.len());
    for p in &s.protect {
        println!("  {p}");
    }
    println!("host_name = {}", s.host_name);
    println!("pool: {} pool(s)", s.pools.len());
    for p in &s.pools {
        println!(
            "  {} {} (quiesce at {})",
            p.name,
            p.url,
            p.quiesce_at.as_str()
        );
    }
    match &s.fleet {
        None => println!("fleet: off"),
        // Not reached from a file: without the fleet built in, `[fleet]` does not validate.
        #[cfg(not(feature = "fleet"))]
        Some(_) => println!("fleet: configured, but not built into this vfiod"),
        #[cfg(feature = "fleet")]
        Some(f) => {
            let interval = f.report_interval.unwrap_or(s.poll_interval);
            println!(
                "fleet: host {}, report every {}s, down after {} intervals, credentials {}",
                vfiod::fleet::host_name(f.host.as_deref()),
                interval.as_secs(),
                f.down_after,
                f.credentials_file.display()
            );
            // The file is checked now as the daemon will check it (mode, type, syntax).
            if let Err(e) = vfiod::fleet::credentials::read(&f.credentials_file) {
                eprintln!("warning: {}", error_chain(&e));
            }
        }
    }
    match &s.metrics.textfile {
        None => println!("metrics: no textfile (vfioctl metrics only)"),
        Some(path) => {
            println!("metrics: textfile {}", path.display());
            // A warning, as the daemon gives: node_exporter's directory may come later.
            if !path.parent().is_some_and(|d| d.is_dir()) {
                eprintln!(
                    "warning: metrics: the directory of {} does not exist: vfiod will log a \
                     warning and write the file once it does",
                    path.display()
                );
            }
        }
    }
    let h = &s.history;
    let age = |a: Option<std::time::Duration>| {
        a.map_or("no age limit".to_string(), |d| {
            format!("{} days", d.as_secs() / 86_400)
        })
    };
    let count = |c: Option<u64>| c.map_or("no count limit".to_string(), |n| format!("at most {n}"));
    println!(
        "history: events {}, {}; finished tasks {}, {}; pruned every {}s",
        age(h.events_max_age),
        count(h.events_max_count),
        age(h.tasks_max_age),
        count(h.tasks_max_count),
        h.prune_interval.as_secs()
    );
    // Warnings, not errors: the module may be installed after the configuration is written.
    for warning in vfiod::host::modules::driver_warnings(s, &s.sysfs_root) {
        eprintln!("warning: {warning}");
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    settings: Settings,
    source: Option<ConfigSource>,
    sysfs: Sysfs,
    events: Option<uevent::EventReceiver>,
    bus: BusTarget,
    authorizer: Authorizer,
    simulated: bool,
    on_ready: Option<ReadyHook>,
    accept_store_loss: bool,
) -> Result<ExitCode, String> {
    if accept_store_loss {
        accept_loss(&settings.state_dir)?;
    }
    // Handlers first: a SIGTERM during start-up (a reconcile waiting on a slow device) ends vfiod
    // too, instead of the default action killing it between two writes.
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let start = Server::start(Options {
        settings,
        source,
        sysfs,
        events,
        bus,
        authorizer,
        simulated,
    });
    let server = tokio::select! {
        started = start => started.map_err(|e| error_chain(&e))?,
        _ = &mut shutdown => {
            tracing::warn!("stopped during start-up");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let child = match on_ready {
        Some(f) => f(),
        None => Ok(None),
    };
    let code = match child {
        Ok(Some(mut c)) => c.wait().await.ok().and_then(|s| s.code()).unwrap_or(1),
        Ok(None) => tokio::select! {
            () = &mut shutdown => 0,
            // Reconnecting would need every object exported again and every subscription
            // remade; exiting non-zero has systemd (Restart=on-failure) start a whole new
            // daemon within seconds, which the state store makes safe.
            () = server.connection_lost() => {
                tracing::error!(
                    "the connection to the bus is lost; exiting so that vfiod is restarted"
                );
                1
            }
        },
        Err(e) => {
            eprintln!("vfiod: {e}");
            127
        }
    };
    server.stop().await;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

async fn simulate(args: Args) -> Result<ExitCode, String> {
    let tmp;
    let base = match &args.sim_root {
        Some(dir) => dir.clone(),
        None => {
            tmp = tempfile::Builder::new()
                .prefix("vfiod-sim.")
                .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .tempdir()
                .map_err(|e| e.to_string())?;
            tmp.path().to_path_buf()
        }
    };
    // The simulation's own: no other user reads its tree or reaches its bus (issue 33).
    if let Some(mode) = vfiod::sim::make_private_dir(&base).map_err(|e| error_chain(&e))? {
        tracing::warn!(
            "{} was mode {mode:04o}: made 0700, as a simulation's directory is its user's only",
            base.display()
        );
    }
    // One simulation per directory, taken before anything in it is touched: a second run
    // would re-render the kernel's files and start a bus under the running one's feet.
    let _sim_lock =
        vfiod::store::lock::StateDirLock::acquire(&base).map_err(|e| error_chain(&e))?;
    let root = base.join("root");
    if let Some(source) = &args.replay {
        return replay(&args, source, &base).await;
    }
    // With --sim-root the simulated host persists: a second run (after a stop, or a kill)
    // reopens the same kernel state, as a real host keeps its devices across a daemon restart.
    let kernel = if args.sim_root.is_some() {
        SimKernel::open_or_build(&root, &HostModel::reference()).map_err(|e| {
            format!(
                "cannot open or build the simulated host in {}: {e}",
                root.display()
            )
        })?
    } else {
        SimKernel::build(&root, &HostModel::reference())
            .map_err(|e| format!("cannot build the simulated host: {e}"))?
    };
    let events = Some(kernel.subscribe());
    let code = run_simulation(
        &args,
        &base,
        kernel.root(),
        kernel.sysfs(),
        events,
        include_str!("../../conf/simulate.toml"),
        "<built-in conf/simulate.toml>",
        Vec::new(),
    )
    .await;
    drop(kernel);
    code
}

/// `--simulate --replay`: the recording read-only as the sysfs root, or booted in the
/// simulated kernel with `--replay-writable` (see `vfiod::sim::replay`).
async fn replay(
    args: &Args,
    source: &std::path::Path,
    base: &std::path::Path,
) -> Result<ExitCode, String> {
    use vfiod::sim::replay::Replay;
    let recording = Replay::open(source, &base.join("replay")).map_err(|e| error_chain(&e))?;
    let mut banner = vec![format!(" Replaying:        {}", recording.describe())];
    let (kernel, sysfs, events) = if args.replay_writable {
        let (kernel, notes) = recording
            .build_writable(&base.join("root"))
            .map_err(|e| error_chain(&e))?;
        banner.push(" Writable: the simulated kernel's behaviour applies to it.".into());
        for n in notes {
            tracing::warn!("{n}");
            banner.push(format!(" {n}"));
        }
        let (sysfs, events) = (kernel.sysfs(), Some(kernel.subscribe()));
        (Some(kernel), sysfs, events)
    } else {
        banner.push(" Read-only: every sysfs write fails with EACCES.".into());
        (None, recording.sysfs(), None)
    };
    let root = sysfs.root().to_path_buf();
    let code = run_simulation(
        args,
        base,
        &root,
        sysfs,
        events,
        "",
        "<replay: default settings, nothing selected>",
        banner,
    )
    .await;
    drop(kernel);
    code
}

/// The simulation's settings, private bus and banner, then the daemon on `sysfs` (rooted at
/// `root`), and the `-- COMMAND` if any.
#[allow(clippy::too_many_arguments)]
async fn run_simulation(
    args: &Args,
    base: &std::path::Path,
    root: &std::path::Path,
    sysfs: Sysfs,
    events: Option<uevent::EventReceiver>,
    default_config: &str,
    default_config_name: &str,
    banner: Vec<String>,
) -> Result<ExitCode, String> {
    let (settings, source) = match &args.config {
        Some(path) => {
            let source = ConfigSource {
                main: path.clone(),
                dropin_dir: None,
                main_required: true,
                pin_sysfs_root: Some(root.to_path_buf()),
                pin_state_dir: Some(base.join("state")),
            };
            if args.check_config {
                return check_config(&source);
            }
            (source.load().map_err(|e| error_chain(&e))?, Some(source))
        }
        None => {
            let mut s =
                Settings::from_toml_str(default_config, std::path::Path::new(default_config_name))
                    .map_err(|e| error_chain(&e))?;
            s.sysfs_root = root.to_path_buf();
            s.state_dir = base.join("state");
            (s, None)
        }
    };
    if args.check_config {
        print_settings(&settings);
        return Ok(ExitCode::SUCCESS);
    }
    let (bus_guard, bus) = match args.bus.clone() {
        BusTarget::System => {
            let b = PrivateBus::start_private(&base.join("bus")).map_err(|e| error_chain(&e))?;
            let addr = b.address().to_string();
            (Some(b), BusTarget::Address(addr))
        }
        other => (None, other),
    };
    let address = match &bus {
        BusTarget::Address(a) => a.clone(),
        BusTarget::Session => "session".into(),
        BusTarget::System => unreachable!(),
    };
    let command = args.command.clone();
    let banner_addr = address.clone();
    let root_display = root.display().to_string();
    let uid = nix::unistd::geteuid();
    let on_ready: ReadyHook = Box::new(move || {
        eprintln!();
        eprintln!("=== vfiod SIMULATION ===================================================");
        eprintln!(" This is a simulated host: no real device is read or touched.");
        eprintln!(" Simulated sysfs:  {root_display}");
        for line in &banner {
            eprintln!("{line}");
        }
        eprintln!(" Private bus:      {banner_addr}");
        if uid.is_root() {
            eprintln!(" Private to root: no other user reaches this bus or tree.");
        } else {
            eprintln!(" Private to uid {uid} (and root): no other user reaches this bus or tree.");
        }
        eprintln!(" That user may use every method without polkit; AddFromPath and Hook are");
        eprintln!(" root's and that user's only, as in production.");
        eprintln!(" Point vfioctl at it:");
        eprintln!("   export VFIOD_BUS='{banner_addr}'");
        eprintln!("   vfioctl list");
        eprintln!("========================================================================");
        eprintln!();
        if command.is_empty() {
            return Ok(None);
        }
        let mut path = std::env::var_os("PATH").unwrap_or_default();
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|p| p.to_path_buf()))
        {
            let mut dirs = vec![dir];
            dirs.extend(std::env::split_paths(&path));
            path = std::env::join_paths(dirs).unwrap_or(path);
        }
        match tokio::process::Command::new(&command[0])
            .args(&command[1..])
            .env("VFIOD_BUS", &banner_addr)
            .env("PATH", path)
            .spawn()
        {
            Ok(c) => Ok(Some(c)),
            Err(e) => Err(format!("cannot run {:?}: {e}", command[0])),
        }
    });
    let code = serve(
        settings,
        source,
        sysfs,
        events,
        bus,
        Authorizer::SameUser,
        true,
        Some(on_ready),
        args.accept_store_loss,
    )
    .await;
    drop(bus_guard);
    code
}
