//! `vfioctl`: the command-line client of vfiod. See `vfioctl --help`.
//!
//! This file holds the command line (`Args`, `Command`), `main` (what runs before a bus
//! connection: completions, man page, the hook, the fleet) and the dispatch to one module per
//! command family: `devices`, `events`, `tasks`, `claims`, `images`, `pool`, `hook`, `fleet`,
//! `record`.
//! What a command prints is rendered in `vfiod::client` (tables through comfy-table).

use clap::{Parser, Subcommand};

mod backup;
mod claim;
mod device;
mod doctor;
mod event;
#[cfg(feature = "fleet")]
mod fleet;
mod hook;
mod image;
mod pool;
mod record;
mod task;

use claim::unknown_object;
use claim::Requirements;
use event::{format_time, format_time_ms};
use hook::{hook, HookCommand};
use image::{FpgaCommand, ImageCommand};
use pool::PoolCommand;
use std::process::ExitCode;
use task::{start_and_follow, TaskCommand};
use vfiod::client::exit::Failure;
use vfiod::client::{self, ClientError};
use vfiod::dbus::BusTarget;

/// Inspect and control vfiod, the PCI accelerator manager.
#[derive(Parser, Debug)]
// The name, not the package's (`vfiod`): `vfioctl --version` says `vfioctl 0.1.0`.
#[command(name = "vfioctl", version)]
struct Args {
    /// Bus where vfiod runs: system, session, or a D-Bus address. Default: $VFIOD_BUS, else
    /// the system bus.
    #[arg(long, global = true)]
    bus: Option<BusTarget>,
    /// Print tables without their header row.
    #[arg(long, global = true)]
    no_legend: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List every PCI function vfiod knows.
    List {
        /// Print JSON (an array of objects) instead of a table.
        #[arg(long)]
        json: bool,
        /// Only devices of this kind (gpu, fpga, crypto, nvme, nic, other).
        #[arg(long)]
        kind: Option<vfiod::model::device::Kind>,
    },
    /// Show one device in detail.
    Show {
        /// PCI address, DDDD:BB:SS.F (or BB:SS.F, or pci_DDDD_BB_SS_F).
        #[arg(value_parser = spelling)]
        address: String,
        #[arg(long)]
        json: bool,
    },
    /// Daemon version, scenario and counts.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Inventory history (devices appearing, disappearing, breaking, config reloads, tasks):
    /// the newest entries, oldest first.
    Events {
        /// Only events of this device.
        #[arg(value_parser = spelling)]
        address: Option<String>,
        /// Only events of this kind: added, removed, changed, broken, recovered, protected,
        /// unprotected, config, aer, task, claim, image, pool, clean, store.
        #[arg(long)]
        kind: Option<String>,
        /// How many entries (1..=10000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// The entries after this event id (follow the history from there).
        #[arg(long, conflicts_with = "before")]
        since: Option<i64>,
        /// The newest entries before this event id (page back: pass the first id shown).
        #[arg(long)]
        before: Option<i64>,
        /// After the entries, keep printing new ones as the daemon records them, until
        /// interrupted or the daemon stops (exit 1). With --json, one object per line.
        #[arg(long, short = 'f', conflicts_with = "before")]
        follow: bool,
        #[arg(long)]
        json: bool,
    },
    /// What the mode policy decides for each selected device (or one), and the exact sysfs
    /// writes it would make. A dry run: nothing is changed.
    Plan {
        #[arg(value_parser = spelling)]
        address: Option<String>,
        /// Plan with this configuration instead of the running one, before it is installed: a
        /// file (the whole configuration) or a directory laid out as /etc/vfiod (vfiod.toml,
        /// conf.d/*.toml). Read here, as you; every error in it is named.
        #[arg(long, value_name = "DIR_OR_FILE")]
        config: Option<std::path::PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Put a device in PF mode (whole) or VF mode (split) as a task (needs authorization).
    Mode {
        #[arg(value_parser = spelling)]
        address: String,
        #[arg(value_parser = ["pf", "vf"])]
        mode: String,
        /// VFs for vf mode (default: the configuration's num_vfs, else all).
        #[arg(long)]
        vfs: Option<u32>,
        /// Show progress until the task ends; exit non-zero if it fails.
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Clean a device between tenants as at the end of a claim, as a task (needs
    /// authorization): reset, health check, the configured [[clean]] command. It is out of the
    /// pool until that succeeds; a failure quarantines it until `vfioctl task reset`.
    Clean {
        #[arg(value_parser = spelling)]
        address: String,
        /// Show progress until the task ends; exit non-zero if it fails.
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Tasks: start one, show one, reset a device's failed task, list history.
    #[command(subcommand)]
    Task(TaskCommand),
    /// The fleet's accelerator database (PostgreSQL): hosts, devices, fleet claims. Talks to
    /// the database, not to a local vfiod.
    #[cfg(feature = "fleet")]
    Fleet(fleet::FleetArgs),
    /// Claim the best device that matches for a VM (needs authorization): recorded durably,
    /// with the device's whole IOMMU group. Prints the claim.
    Claim {
        #[command(flatten)]
        want: Requirements,
        /// The VM's libvirt domain name.
        #[arg(long, required_unless_present = "uuid")]
        vm: Option<String>,
        /// The VM's UUID.
        #[arg(long)]
        uuid: Option<String>,
        /// Release the claim if it is not attached within this many seconds (0: no lease).
        #[arg(long, default_value_t = 0)]
        lease: u32,
        /// Keep the claim when the domain is undefined.
        #[arg(long)]
        persistent: bool,
        /// Print the claim as JSON (as `vfioctl claims --json` shows each).
        #[arg(long)]
        json: bool,
    },
    /// The devices a claim with these requirements could get now, best first.
    /// Exits with the no-device code (6) when none does.
    Find {
        #[command(flatten)]
        want: Requirements,
        /// Print JSON (an array of addresses) instead of one address per line.
        #[arg(long)]
        json: bool,
    },
    /// Active claims.
    Claims {
        #[arg(long)]
        json: bool,
    },
    /// Attach a claim's devices to its VM's libvirt domain as hostdevs (needs authorization).
    /// Without --wait, returns once the attach has started.
    Attach {
        /// The claim's number (as `vfioctl claims` shows) or object path.
        claim: String,
        /// The libvirt domain (name or UUID): the VM the claim is for.
        domain: String,
        /// Into the running domain (default when it runs).
        #[arg(long)]
        live: bool,
        /// Into the domain's configuration, for its next starts (default when it is defined).
        #[arg(long)]
        config: bool,
        /// Wait until libvirt has the device; exit non-zero with libvirt's message if it fails
        /// (a failed attach releases the claim).
        #[arg(long)]
        wait: bool,
        /// Print the claim as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Take a claim's devices out of their domain (needs authorization); the claim ends when the
    /// guest has let go. Without --wait, returns once the detach has started.
    Detach {
        /// The claim's number or object path.
        claim: String,
        /// Wait until the guest has let go (at most the daemon's [claims] detach_timeout); exit
        /// non-zero if it did not (the claim then stays).
        #[arg(long)]
        wait: bool,
        /// Print the claim as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Give a claim up: its devices return to the pool (needs authorization).
    Release {
        /// The claim's number (as `vfioctl claims` shows) or object path.
        claim: String,
        #[arg(long)]
        json: bool,
    },
    /// Live-migrate a running VM with the devices vfiod manages for it to another host (needs
    /// authorization): devices whose driver cannot migrate are detached first and the
    /// destination's vfiod attaches equivalent ones; if the migration fails they come back
    /// here. Runs as a task on the VM's first device.
    Migrate {
        /// The libvirt domain (name or UUID).
        domain: String,
        /// The destination's libvirt URI, e.g. qemu+ssh://hostb/system.
        destination: String,
        /// Where the memory goes when not the destination's default address (tcp://10.0.0.2).
        #[arg(long)]
        migrate_uri: Option<String>,
        /// Pause the VM while its memory is copied (default: live).
        #[arg(long)]
        offline: bool,
        /// Show progress until the task ends; exit non-zero if it fails.
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// libvirt's hook: what `/etc/libvirt/hooks/qemu.d/vfiod` runs, with libvirt's arguments and
    /// the domain XML on stdin. Exits with the hook's verdict within `[hooks]` deadlines, also
    /// when vfiod does not answer. Reads the daemon's configuration ($VFIOD_CONFIG, else
    /// /etc/vfiod) for the deadlines.
    // Internal: for libvirt, not for a person reading the help.
    #[command(subcommand, hide = true)]
    Hook(HookCommand),
    /// FPGA tasks: program an image into a card, verify what it runs.
    #[command(subcommand)]
    Fpga(FpgaCommand),
    /// The FPGA image catalog: add, list, show, deactivate, activate, remove.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Pooled devices: the remote pools, their devices, and the sessions leased to VMs here.
    #[command(subcommand)]
    Pool(PoolCommand),
    /// Record what vfiod reads of this host into a tarball for a bug report (no daemon needed).
    ///
    /// The PCI functions' sysfs attributes and links, the first 256 bytes of their config
    /// space, IOMMU groups, DFL regions, the mounted block devices and the interfaces that are
    /// up, with a manifest. It leaves out BARs and ROMs, other processes and the host name (the
    /// manifest lists all it leaves out). `vfiod --simulate --replay FILE` serves it back. Run as
    /// root to read every attribute.
    Record {
        /// Where to write the tarball ("-": standard output). Default:
        /// vfiod-recording-<UTC time>.tar.gz in the current directory.
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: Option<std::path::PathBuf>,
        /// Replace FILE if it exists.
        #[arg(long)]
        force: bool,
        /// Put the host's name in the manifest (left out by default).
        #[arg(long)]
        with_hostname: bool,
        /// Record the host under this root instead of / (a simulated host's tree, a copy).
        #[arg(long, value_name = "DIR", default_value = "/")]
        root: std::path::PathBuf,
    },
    /// Copy the state database into FILE while vfiod runs (SQLite's online backup): one
    /// consistent moment, a single file readable by its owner only (no daemon needed).
    ///
    /// vfioctl reads <state_dir>/vfiod.db itself, read-only, with your rights (root on a real
    /// host). To restore: stop vfiod, remove vfiod.db-wal and vfiod.db-shm, put FILE in place
    /// as vfiod.db, start; a copy older than what vfiod acknowledged is refused, naming what it
    /// lacks, until `vfiod --accept-store-loss`.
    Backup {
        /// Where to write the copy (replaced whole by a rename, never half-written).
        #[arg(value_name = "FILE")]
        file: std::path::PathBuf,
        /// Replace FILE if it exists.
        #[arg(long)]
        force: bool,
        /// The state directory. Default: state_dir of the configuration ($VFIOD_CONFIG, else
        /// /etc/vfiod/vfiod.toml and conf.d).
        #[arg(long, value_name = "DIR")]
        state_dir: Option<std::path::PathBuf>,
        /// Print what the copy holds as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check whether this host can pass devices through; reads only, needs no daemon.
    ///
    /// The checks: the IOMMU (groups, DMAR/AMD-Vi units, interrupt remapping), the VFIO
    /// modules, the configuration, each selected device's IOMMU group and the ACS above it,
    /// vfiod on the bus, libvirtd and its hook, polkitd. Each prints its verdict (ok, warn,
    /// fail), what it read, and the fix. Exits 0 when every check is ok, 8 when the worst is a
    /// warning, 9 when one fails. Run as root to read ACS.
    Doctor {
        /// The configuration to check: a file, or a directory laid out as /etc/vfiod.
        /// Default: $VFIOD_CONFIG, else /etc/vfiod.
        #[arg(long, value_name = "DIR_OR_FILE")]
        config: Option<std::path::PathBuf>,
        /// Read the host under this root, not the configuration's sysfs_root (a simulated
        /// host's tree).
        #[arg(long, value_name = "DIR")]
        root: Option<std::path::PathBuf>,
        /// Print the report as JSON: {root, verdict, checks: [{name, verdict, evidence,
        /// fix}]}.
        #[arg(long)]
        json: bool,
    },
    /// Print a completion script for SHELL (bash, zsh, fish, elvish, powershell) on stdout, e.g.
    /// `vfioctl completions bash > /etc/bash_completion.d/vfioctl`.
    Completions {
        #[arg(value_parser = clap::value_parser!(clap_complete::Shell))]
        shell: clap_complete::Shell,
    },
    /// Print the man page vfioctl(1) (roff) on stdout: what `make install` installs.
    #[command(hide = true)]
    Man,
    /// Print the daemon's metrics in the Prometheus text format (what `[metrics] textfile`
    /// holds), e.g. for `promtool check metrics`.
    Metrics,
    /// Re-read the configuration (needs authorization).
    Reload {
        #[arg(long)]
        json: bool,
    },
    /// Rescan the PCI devices now (needs authorization).
    Rescan {
        #[arg(long)]
        json: bool,
    },
}

impl Command {
    /// Whether the command was asked for JSON: then its failure is JSON on stderr too.
    fn json(&self) -> bool {
        match self {
            Command::List { json, .. }
            | Command::Show { json, .. }
            | Command::Status { json }
            | Command::Events { json, .. }
            | Command::Plan { json, .. }
            | Command::Claims { json }
            | Command::Claim { json, .. }
            | Command::Mode { json, .. }
            | Command::Clean { json, .. }
            | Command::Attach { json, .. }
            | Command::Detach { json, .. }
            | Command::Release { json, .. }
            | Command::Migrate { json, .. }
            | Command::Task(
                TaskCommand::Start { json, .. }
                | TaskCommand::Show { json, .. }
                | TaskCommand::List { json, .. }
                | TaskCommand::Reset { json, .. },
            )
            | Command::Reload { json }
            | Command::Rescan { json }
            | Command::Fpga(FpgaCommand::Program { json, .. } | FpgaCommand::Verify { json, .. })
            | Command::Find { json, .. } => *json,
            Command::Image(
                ImageCommand::Add { json, .. }
                | ImageCommand::List { json }
                | ImageCommand::Show { json, .. }
                | ImageCommand::Deactivate { json, .. }
                | ImageCommand::Activate { json, .. }
                | ImageCommand::Remove { json, .. }
                | ImageCommand::Cancel { json, .. },
            ) => *json,
            Command::Pool(
                PoolCommand::List { json, .. }
                | PoolCommand::Show { json, .. }
                | PoolCommand::Pools { json }
                | PoolCommand::Devices { json, .. }
                | PoolCommand::Lease { json, .. }
                | PoolCommand::Release { json, .. },
            ) => *json,
            _ => false,
        }
    }
}

/// clap's parser for an address argument: both spellings (see [`client::address_spelling`]).
fn spelling(text: &str) -> Result<String, std::convert::Infallible> {
    Ok(client::address_spelling(text))
}

fn bus(args: &Args) -> Result<BusTarget, String> {
    if let Some(b) = &args.bus {
        return Ok(b.clone());
    }
    match std::env::var("VFIOD_BUS") {
        Ok(v) if !v.is_empty() => v.parse().map_err(|e| format!("VFIOD_BUS: {e}")),
        _ => Ok(BusTarget::System),
    }
}

fn describe(e: ClientError) -> Failure {
    Failure::from(e)
}

/// A note for the person at a terminal, where a script's reader of stdout would get words it
/// does not want: on stderr, and only when stderr is a terminal.
fn note(text: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprintln!("{text}");
    }
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of our output goes away
    // (`vfioctl list --json | head`) instead of panicking on EPIPE. Rust ignores SIGPIPE by
    // default; put back the default action.
    // SAFETY: set once, first thing, before any other thread exists.
    unsafe {
        let _ = nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        );
    }
    let args = Args::parse();
    client::table::set_legend(!args.no_legend);
    // Generated from the definitions above; no daemon needed.
    match &args.command {
        Command::Completions { shell } => {
            let mut cmd = <Args as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut cmd, "vfioctl", &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        Command::Man => {
            use vfiod::client::man;
            let page = man::command_page(
                <Args as clap::CommandFactory>::command(),
                "1",
                &man::exit_status_section(),
            );
            use std::io::Write;
            return match page.and_then(|p| std::io::stdout().write_all(&p)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("vfioctl: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    if let Command::Record { .. } = &args.command {
        let Command::Record {
            output,
            force,
            with_hostname,
            root,
        } = args.command
        else {
            unreachable!("matched above")
        };
        return record::run(&root, output, force, with_hostname);
    }
    if let Command::Backup {
        file,
        force,
        state_dir,
        json,
    } = &args.command
    {
        return backup::run(file, *force, state_dir.clone(), *json);
    }
    if let Command::Hook(_) = &args.command {
        let target = match bus(&args) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("vfiod: {e}");
                BusTarget::System
            }
        };
        let Command::Hook(command) = args.command else {
            unreachable!("matched above")
        };
        return hook(target, command).await;
    }
    if let Command::Doctor { .. } = &args.command {
        let target = match bus(&args) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("vfioctl: {e}");
                return ExitCode::from(client::exit::USAGE);
            }
        };
        let Command::Doctor { config, root, json } = args.command else {
            unreachable!("matched above")
        };
        let options = vfiod::doctor::run::Options { config, root };
        return doctor::doctor(target, options, json).await;
    }
    #[cfg(feature = "fleet")]
    if let Command::Fleet(_) = &args.command {
        let Command::Fleet(f) = args.command else {
            unreachable!("matched above")
        };
        return match fleet::run(f).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("vfioctl: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let json = args.command.json();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.quiet {
                // Already said (or deliberately not: an empty `find` in a pipe).
            } else if json {
                eprintln!("{}", e.json());
            } else {
                eprintln!("vfioctl: {}", e.text());
            }
            ExitCode::from(e.code())
        }
    }
}

async fn run(args: Args) -> Result<(), Failure> {
    let target = bus(&args)?;
    let conn = client::connect(&target).await.map_err(describe)?;
    match args.command {
        command @ (Command::List { .. }
        | Command::Metrics
        | Command::Mode { .. }
        | Command::Clean { .. }
        | Command::Plan { .. }
        | Command::Reload { .. }
        | Command::Rescan { .. }
        | Command::Show { .. }
        | Command::Status { .. }) => device::run(&conn, command).await?,
        command @ Command::Events { .. } => event::run(&conn, command).await?,
        command @ Command::Task(_) => task::run(&conn, command).await?,
        command @ (Command::Attach { .. }
        | Command::Claim { .. }
        | Command::Claims { .. }
        | Command::Detach { .. }
        | Command::Find { .. }
        | Command::Migrate { .. }
        | Command::Release { .. }) => claim::run(&conn, command).await?,
        command @ (Command::Fpga(_) | Command::Image(_)) => image::run(&conn, command).await?,
        command @ Command::Pool(_) => pool::run(&conn, command).await?,
        Command::Hook(_) => unreachable!("vfioctl hook is run before connecting"),
        Command::Completions { .. } | Command::Man => {
            unreachable!("completions and man are printed before connecting")
        }
        Command::Record { .. } => unreachable!("vfioctl record is run before connecting"),
        Command::Backup { .. } => unreachable!("vfioctl backup is run before connecting"),
        Command::Doctor { .. } => unreachable!("vfioctl doctor is run before connecting"),
        #[cfg(feature = "fleet")]
        Command::Fleet(_) => unreachable!("vfioctl fleet is run before connecting"),
    }
    Ok(())
}
