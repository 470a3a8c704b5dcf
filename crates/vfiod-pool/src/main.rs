//! `vfiod-pool`: the reference pool service of the pool protocol (docs/pool-protocol.md), and
//! `vfiod-pool drive`, the stand-in user-mode driver. See `vfiod-pool --help`.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tracing_subscriber::filter::Targets;

use clap::{Args, Parser, Subcommand};
use vfiod_pool::driver::{self, DriverConfig};
use vfiod_pool::service::{self, ConnectionLimits, PoolConfig, TlsFiles};
use vfiod_pool_protocol::client::{PoolClient, PoolEndpoint};
use vfiod_pool_protocol::error_chain;

/// A device pool speaking pool protocol v1: leases pooled accelerators to VMs, quiesces and
/// resumes their work across a live migration, with epochs that fence a stale host off. Its
/// devices are stand-ins: a worker per session computes numbered work items.
#[derive(Parser, Debug)]
// Its own name, not the package's: `vfiod-pool --version` says `vfiod-pool 0.1.0`.
#[command(
    name = "vfiod-pool",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the stand-in user-mode driver: stream numbered items to a session, follow it when
    /// it moves, report lost and duplicated items and the longest pause. Exits 0 only when
    /// every result came, once and right.
    Drive(Box<DriveArgs>),
    /// Print the man page vfiod-pool(1) (roff) on stdout: what `make install` installs.
    // Hidden: for the install, not for a person reading the help.
    #[command(hide = true)]
    Man,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address to listen on (`127.0.0.1:PORT`; port 0 picks one). Plain HTTP on loopback
    /// only: any other address needs --tls-cert, --tls-key and --client-ca.
    #[arg(long, required = true)]
    listen: Option<SocketAddr>,
    /// Directory of the pool's own database (`pool.db`), created if missing.
    #[arg(long, required = true)]
    state_dir: Option<PathBuf>,
    /// Number of stand-in devices (`dev0`, `dev1`, ...).
    #[arg(long, default_value_t = 4)]
    devices: u32,
    /// PEM certificate chain of the pool (TLS).
    #[arg(long, requires_all = ["tls_key", "client_ca"])]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires_all = ["tls_cert", "client_ca"])]
    tls_key: Option<PathBuf>,
    /// PEM CA whose client certificates are accepted; clients without one are refused.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    client_ca: Option<PathBuf>,
    /// Seconds a quiesced session waits for its resume before the pool resumes it on its
    /// last owner (fractions allowed).
    #[arg(long, default_value_t = 60.0)]
    quiesce_lease: f64,
    /// The hosts this pool serves, comma-separated; prepare-move or resume to another is
    /// refused (`cannot_serve`). Default: any host.
    #[arg(long, value_delimiter = ',')]
    hosts: Option<Vec<String>>,
    /// Milliseconds the stand-in accelerator works on one item.
    #[arg(long, default_value_t = 1)]
    item_time_ms: u64,
    /// Connections served at once, all clients together (lowered to what the descriptor
    /// limit allows; more are refused with 503 `unavailable` on plain HTTP, closed on TLS).
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections served at once from one client address.
    #[arg(long, default_value_t = 64)]
    max_connections_per_client: usize,
    /// Seconds a connection has to send a request's headers (from its start, or the end of
    /// the previous reply: idle connections are closed after it too).
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds one request may take, its body included (then 503 `unavailable`).
    #[arg(long, default_value_t = 30.0)]
    request_timeout: f64,
}

#[derive(Args, Debug)]
struct DriveArgs {
    /// The pool's URL (`http://127.0.0.1:PORT` or `https://...`).
    #[arg(long)]
    url: url::Url,
    /// PEM CA of the pool's certificate.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// PEM client certificate.
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// PEM key of --cert.
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// The session to drive; without it, a session is leased first (--device, --vm).
    #[arg(long, conflicts_with_all = ["device", "vm"])]
    session: Option<String>,
    /// Device to lease when no --session is given.
    #[arg(long, default_value = "dev0")]
    device: String,
    /// VM name for the lease when no --session is given.
    #[arg(long, default_value = "vm")]
    vm: String,
    /// The host the driver runs on.
    #[arg(long)]
    host: String,
    /// Number of items to stream.
    #[arg(long, default_value_t = 10_000)]
    items: u64,
    /// Most items without a result at any time.
    #[arg(long, default_value_t = 64)]
    window: u64,
    /// Do not re-read the session when the pool refuses this host (wait instead).
    #[arg(long)]
    no_follow: bool,
    /// Seconds without progress before giving up (the missing items count as lost).
    #[arg(long, default_value_t = 30.0)]
    give_up: f64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Every this many seconds, one line of progress on stderr (where the driver is, what it
    /// sent and got back); 0: none.
    #[arg(long, default_value_t = 0.0)]
    progress: f64,
}

fn init_logging() {
    use tracing_subscriber::prelude::*;
    // Levels per target ("info", "vfiod_pool=debug"): tracing's Targets, not EnvFilter and its
    // regex engine. A value that does not parse is said once, and the default applies.
    let default = || "info".parse::<Targets>().expect("a level parses");
    let filter = match std::env::var("VFIOD_LOG") {
        Ok(v) => v.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!("vfiod-pool: VFIOD_LOG={v:?} is not a log filter ({e}); logging at info");
            default()
        }),
        Err(_) => default(),
    };
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_target(false),
        )
        .with(filter)
        .init();
}

fn seconds(what: &str, s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|_| format!("{what}: {s} is not a number of seconds"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Man) = cli.command {
        let page = vfiod_man::command_page(<Cli as clap::CommandFactory>::command(), "1", "");
        return match page.and_then(|p| std::io::stdout().write_all(&p)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("vfiod-pool: {e}");
                ExitCode::FAILURE
            }
        };
    }
    init_logging();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vfiod-pool: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Some(Command::Drive(args)) => rt.block_on(drive(*args)),
        None => rt.block_on(serve(cli.serve)),
        Some(Command::Man) => unreachable!("printed before the runtime starts"),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vfiod-pool: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(a: ServeArgs) -> Result<ExitCode, String> {
    let (Some(listen), Some(state_dir)) = (a.listen, a.state_dir) else {
        return Err("--listen and --state-dir are required".into());
    };
    let mut cfg = PoolConfig::new(listen, state_dir);
    cfg.devices = service::standin_devices(a.devices);
    cfg.quiesce_lease = seconds("--quiesce-lease", a.quiesce_lease)?;
    cfg.hosts = a.hosts;
    cfg.item_time = Duration::from_millis(a.item_time_ms);
    cfg.limits = ConnectionLimits {
        header_read_timeout: seconds("--header-timeout", a.header_timeout)?,
        request_timeout: seconds("--request-timeout", a.request_timeout)?,
        max_connections: a.max_connections,
        max_per_client: a.max_connections_per_client,
    };
    // Each connection is a descriptor: the hard limit, not the default soft 1024.
    match service::raise_nofile_limit() {
        Ok(n) => tracing::debug!(nofile = n, "descriptor limit"),
        Err(e) => tracing::warn!("cannot raise the descriptor limit: {e}"),
    }
    if let (Some(cert), Some(key), Some(client_ca)) = (a.tls_cert, a.tls_key, a.client_ca) {
        cfg.tls = Some(TlsFiles {
            cert,
            key,
            client_ca,
        });
    }
    let tls = cfg.tls.is_some();
    let pool = service::start(cfg).await.map_err(|e| error_chain(&e))?;
    // One line on stdout when the pool serves, for scripts and tests that start it on port 0.
    println!(
        "vfiod-pool: listening on {}",
        pool.url(tls).as_str().trim_end_matches('/')
    );
    let _ = std::io::stdout().flush();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("SIGTERM handler: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping");
    pool.stop().await;
    Ok(ExitCode::SUCCESS)
}

async fn drive(a: DriveArgs) -> Result<ExitCode, String> {
    // Bad numbers are refused before a session is leased.
    let every = seconds("--progress", a.progress)?;
    let give_up = seconds("--give-up", a.give_up)?;
    if a.items > service::core::MAX_SEQ {
        return Err(format!(
            "--items {}: items are numbered up to {} (2^63 - 1)",
            a.items,
            service::core::MAX_SEQ
        ));
    }
    let mut ep = PoolEndpoint::new(a.url);
    ep.ca_file = a.ca_file;
    ep.cert_file = a.cert;
    ep.key_file = a.key;
    let client = PoolClient::new(&ep).map_err(|e| error_chain(&e))?;
    let session = match a.session {
        Some(s) => s,
        None => {
            let s = client
                .create_session(&a.device, &a.host, &a.vm)
                .await
                .map_err(|e| error_chain(&e))?;
            eprintln!(
                "vfiod-pool drive: leased {} to {} on {}: session {} epoch {}",
                s.device, s.vm, s.host, s.id, s.epoch
            );
            s.id
        }
    };
    let mut cfg = DriverConfig::new(&session, &a.host, a.items);
    cfg.window = a.window.max(1);
    cfg.follow_session = !a.no_follow;
    cfg.give_up = give_up;
    let (d, handle) = driver::driver(client, cfg);
    let run = d.run();
    tokio::pin!(run);
    let result = if every.is_zero() {
        run.await
    } else {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                r = &mut run => break r,
                _ = tick.tick() => {
                    let p = handle.progress();
                    eprintln!(
                        "vfiod-pool drive: {} submitted, {} received, on {}",
                        p.submitted, p.received, p.host
                    );
                }
            }
        }
    };
    let report = result.map_err(|e| error_chain(&e))?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!("{report}");
    }
    Ok(
        if report.complete && report.lost == 0 && report.duplicated == 0 && report.wrong == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}
