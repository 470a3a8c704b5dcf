//! `vfioctl`: the command-line client of vfiod. See `vfioctl --help`.

use clap::{Parser, Subcommand};

#[cfg(feature = "fleet")]
#[path = "vfioctl/fleet.rs"]
mod fleet;
use std::process::ExitCode;
use vfiod::client::exit::Failure;
use vfiod::client::{self, claims, ClientError};
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
        /// unprotected, config, aer, task, claim, image, pool.
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

#[derive(Subcommand, Debug)]
enum PoolCommand {
    /// The pooled claims of this host (standing ones; --all for the ended ones too).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// One pooled claim and its history (every step with its time).
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
    /// The configured pools, and the host name they know this host as.
    Pools {
        #[arg(long)]
        json: bool,
    },
    /// The devices pool POOL offers, and the session holding each.
    Devices {
        pool: String,
        #[arg(long)]
        json: bool,
    },
    /// Lease device DEVICE of pool POOL to a VM (needs authorization).
    Lease {
        pool: String,
        device: String,
        /// The libvirt domain's name.
        #[arg(long)]
        vm: Option<String>,
        /// The libvirt domain's UUID.
        #[arg(long)]
        vm_uuid: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Give pooled claim ID back to its pool (needs authorization).
    Release {
        id: i64,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum FpgaCommand {
    /// Write catalog image IMAGE into the FPGA at DEVICE, as a task (needs authorization).
    Program {
        #[arg(value_parser = spelling)]
        device: String,
        image: String,
        /// Show progress until the task ends; exit non-zero if it fails.
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check what the FPGA at DEVICE runs against IMAGE, as a task (needs authorization).
    Verify {
        #[arg(value_parser = spelling)]
        device: String,
        image: String,
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ImageCommand {
    /// Add an image (needs authorization). vfioctl opens FILE as you and passes the open file
    /// to vfiod; with --from-path (root only) vfiod opens FILE itself; with --url vfiod
    /// downloads it (progress on a terminal) and the command returns once it is kept.
    Add {
        /// The image's name in the catalog (1-64 of A-Z a-z 0-9 . _ -).
        name: String,
        /// The image file ("-": standard input).
        #[arg(required_unless_present = "url", conflicts_with = "url")]
        file: Option<String>,
        /// Have vfiod download the image from this https URL (plain http only to a loopback
        /// host unless its [images] allow_http).
        #[arg(long, conflicts_with = "from_path")]
        url: Option<String>,
        /// The SHA-256 the content must have (64 hex digits).
        #[arg(long)]
        sha256: String,
        /// gbs, xclbin or opaque (default: as its header says).
        #[arg(long)]
        format: Option<String>,
        /// The interface id of the static region it fits (for an opaque image).
        #[arg(long)]
        interface_id: Option<String>,
        /// The AFU id it provides (for an opaque image).
        #[arg(long)]
        afu_id: Option<String>,
        /// vfiod opens FILE (an absolute path on this host) instead: root only.
        #[arg(long)]
        from_path: bool,
        #[arg(long)]
        json: bool,
    },
    /// Every image.
    List {
        #[arg(long)]
        json: bool,
    },
    /// One image by name (or id).
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Keep an image but refuse it for program and verify (needs authorization).
    Deactivate {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Undo deactivate (needs authorization).
    Activate {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove an image and its file (needs authorization).
    Remove {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop the download of image NAME under way (`image add --url` in another terminal; needs
    /// authorization): nothing is kept.
    Cancel {
        name: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum HookCommand {
    /// The qemu driver's hook: DOMAIN OPERATION SUB-OPERATION EXTRA, the XML on stdin.
    Qemu {
        domain: String,
        operation: String,
        sub_operation: String,
        /// libvirt passes "-" when it has nothing to say; absent is accepted too.
        #[arg(default_value = "-")]
        extra: String,
    },
}

/// What a claim asks for; every option is optional and all must match.
#[derive(clap::Args, Debug)]
pub(crate) struct Requirements {
    /// Device kind: gpu, fpga, crypto, nvme, nic, other.
    #[arg(long)]
    pub(crate) kind: Option<vfiod::model::device::Kind>,
    /// Vendor:device id, as lspci -n prints it ("8086:154c", or "8086:*").
    #[arg(long)]
    pub(crate) id: Option<String>,
    /// Only VFs.
    #[arg(long, conflicts_with = "pf")]
    pub(crate) vf: bool,
    /// Only SR-IOV PFs (whole).
    #[arg(long)]
    pub(crate) pf: bool,
    /// Only devices on this NUMA node.
    #[arg(long)]
    pub(crate) numa: Option<i32>,
    /// Exactly this device (DDDD:BB:SS.F).
    #[arg(long, value_parser = spelling)]
    pub(crate) address: Option<String>,
    /// Only VFs of this PF.
    #[arg(long, value_parser = spelling)]
    pub(crate) parent: Option<String>,
}

impl Requirements {
    fn dict(&self) -> vfiod::dbus::wire::Dict {
        let role = if self.vf {
            Some("vf")
        } else if self.pf {
            Some("pf")
        } else {
            None
        };
        client::query(vec![
            ("kind", self.kind.map(|k| k.as_str().into())),
            ("id", self.id.clone().map(zbus::Variant::from)),
            ("role", role.map(zbus::Variant::from)),
            ("numa_node", self.numa.map(zbus::Variant::from)),
            ("address", self.address.clone().map(zbus::Variant::from)),
            ("parent", self.parent.clone().map(zbus::Variant::from)),
        ])
    }
}

#[derive(Subcommand, Debug)]
enum TaskCommand {
    /// Start a task: split (vf mode), restore (pf mode), or apply (the policy's mode).
    Start {
        #[arg(value_parser = spelling)]
        address: String,
        #[arg(value_parser = ["split", "restore", "apply"])]
        kind: String,
        #[arg(long)]
        vfs: Option<u32>,
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// A task's current state, by id; or, given a device's address, the task that holds the
    /// device now, else its last result.
    Show {
        #[arg(value_parser = spelling)]
        task: String,
        #[arg(long)]
        json: bool,
    },
    /// Clear a device's task left in error (after looking at the device).
    Reset {
        #[arg(value_parser = spelling)]
        address: String,
        #[arg(long)]
        json: bool,
    },
    /// Task history, newest first.
    List {
        #[arg(value_parser = spelling)]
        address: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
}

async fn start_and_follow(
    conn: &zbus::Connection,
    path: zbus::OwnedObjectPath,
    wait: bool,
    json: bool,
) -> Result<(), Failure> {
    let t = client::task(conn, path.clone()).await.map_err(describe)?;
    let id = t.id().await.map_err(|e| describe(e.into()))?;
    let kind = t.kind().await.map_err(|e| describe(e.into()))?;
    if !wait {
        if json {
            print_json(&client::task_view(&t).await.map_err(describe)?)?;
        } else {
            println!("task {id} ({kind}) started: {}", path.as_str());
        }
        return Ok(());
    }
    if !json {
        println!("task {id} ({kind}) started: {}", path.as_str());
    }
    let bar = client::progress::TaskProgress::new(&format!("task {id} {kind}"));
    let waited = client::wait_task(&t, |pct, step| bar.update(pct, step)).await;
    bar.finish();
    let (state, result) = waited.map_err(describe)?;
    if json {
        print_json(&client::task_view(&t).await.map_err(describe)?)?;
    } else {
        println!("task {id} {kind}: {state}: {result}");
    }
    if state == "success" {
        Ok(())
    } else {
        Err(format!("task {id} failed").into())
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

/// A call on a claim, described; one whose object is gone says so plainly.
fn gone_claim(claim: &str, e: ClientError) -> Failure {
    match e {
        ClientError::Call(z) if unknown_object(&z) => Failure::named(
            "org.vfiod.Vfiod1.Error.NoSuchClaim",
            format!(
                "no active claim {claim} (a released claim's object is gone; vfioctl claims \
                 lists the active ones)"
            ),
        ),
        other => describe(other),
    }
}

/// Whether the bus says the object called is not there (a task or claim that is gone).
fn unknown_object(e: &zbus::Error) -> bool {
    match e {
        zbus::Error::MethodError(name, _, _) => {
            name.as_str() == "org.freedesktop.DBus.Error.UnknownObject"
        }
        zbus::Error::FDO(f) => matches!(**f, zbus::fdo::Error::UnknownObject(_)),
        _ => false,
    }
}

/// What `--json` prints for a claim that has ended (its object is gone): its number and path.
fn ended_claim(path: &zbus::OwnedObjectPath) -> serde_json::Value {
    let id = path
        .as_str()
        .rsplit('/')
        .next()
        .and_then(|n| n.parse::<u64>().ok());
    serde_json::json!({ "id": id, "path": path.as_str(), "state": "released" })
}

/// A note for the person at a terminal, where a script's reader of stdout would get words it
/// does not want: on stderr, and only when stderr is a terminal.
fn note(text: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprintln!("{text}");
    }
}

/// `vfioctl plan --config PATH [ADDRESS]`: the files read and checked here (every error
/// named, without asking vfiod), then planned by vfiod against its host now.
async fn preview(
    conn: &zbus::Connection,
    path: &std::path::Path,
    address: Option<&str>,
) -> Result<Vec<client::PlanEntry>, Failure> {
    use vfiod::config::Settings;
    let files = Settings::read_files(path).map_err(|e| Failure::from(vfiod::error_chain(&e)))?;
    if let Err(errors) = Settings::from_files(files.clone()) {
        let mut lines: Vec<String> = errors.iter().map(|e| vfiod::error_chain(e)).collect();
        if lines.len() > 1 {
            lines.push(format!("{} errors in the configuration", errors.len()));
        }
        return Err(Failure::named(
            "org.vfiod.Vfiod1.Error.InvalidConfig",
            lines.join("\n"),
        ));
    }
    let plans = client::preview_plans(conn, &files)
        .await
        .map_err(describe)?;
    Ok(match address {
        None => plans,
        // Only the PFs it selects have a plan; another function is left alone by it.
        Some(a) => vec![plans
            .into_iter()
            .find(|p| p.address == a)
            .unwrap_or_else(|| client::PlanEntry {
                address: a.to_string(),
                decision: "leave".into(),
                reason: "not selected by that configuration (or a VF, which follows its PF)".into(),
                program: "nothing".into(),
                steps: Vec::new(),
                json: serde_json::json!({
                    "address": a,
                    "decision": "leave",
                    "reason": "not selected by that configuration",
                })
                .to_string(),
            })],
    })
}

/// `vfioctl plan`'s output: one line per device and its writes, or the plans as JSON.
fn print_plans(plans: Vec<client::PlanEntry>, json: bool, config: &str) -> Result<(), Failure> {
    if json {
        let v: Vec<serde_json::Value> = plans
            .iter()
            .map(|p| serde_json::from_str(&p.json).unwrap_or(serde_json::Value::Null))
            .collect();
        print_json(&v)?;
    } else if plans.is_empty() {
        println!("no device is selected by {config}: nothing to plan");
    } else {
        for p in plans {
            let what = match p.decision.as_str() {
                "target" if p.program == "nothing" => {
                    "in its target mode: nothing to do".to_string()
                }
                "target" => p.program.clone(),
                "refuse" => "refused".to_string(),
                _ => "left alone".to_string(),
            };
            println!("{}: {what} ({})", p.address, p.reason);
            for s in &p.steps {
                println!("    {s}");
            }
        }
    }
    Ok(())
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

/// `vfioctl hook qemu`: never fails for its own reasons where libvirt would suffer from it;
/// see `vfiod::client::hook`.
async fn hook(target: BusTarget, command: HookCommand) -> ExitCode {
    let HookCommand::Qemu {
        domain,
        operation,
        sub_operation,
        extra,
    } = command;
    let args = client::hook::HookArgs {
        domain,
        operation,
        sub_operation,
        extra,
    };
    ExitCode::from(client::hook::process(&target, &args).await)
}

async fn run(args: Args) -> Result<(), Failure> {
    let target = bus(&args)?;
    let conn = client::connect(&target).await.map_err(describe)?;
    match args.command {
        Command::List { json, kind } => {
            let mut devices = client::list_devices(&conn).await.map_err(describe)?;
            if let Some(k) = kind {
                devices.retain(|d| d.kind == k.as_str());
            }
            if json {
                print_json(&devices)?;
            } else {
                print!("{}", client::render_table(&devices));
            }
        }
        Command::Show { address, json } => {
            let d = client::show_device(&conn, &address)
                .await
                .map_err(describe)?;
            if json {
                print_json(&d)?;
            } else {
                print!("{}", client::render_details(&d));
            }
        }
        Command::Status { json } => {
            let s = client::status::read(&conn).await.map_err(describe)?;
            if json {
                print_json(&s)?;
            } else {
                print!("{}", client::status::render(&s, format_time));
            }
        }
        Command::Events {
            address,
            kind,
            limit,
            since,
            before,
            follow,
            json,
        } => {
            let m = client::manager(&conn).await.map_err(describe)?;
            // Subscribed before the first read, so nothing recorded in between is missed.
            let signals = if follow {
                Some(
                    client::events::EventFollower::subscribe(&m)
                        .await
                        .map_err(|e| describe(e.into()))?,
                )
            } else {
                None
            };
            let q = |since: Option<i64>, limit: u32| {
                client::query(vec![
                    ("address", address.clone().map(zbus::Variant::from)),
                    ("kind", kind.clone().map(zbus::Variant::from)),
                    ("limit", Some(limit.into())),
                    ("since", since.map(zbus::Variant::from)),
                    ("before", before.map(zbus::Variant::from)),
                ])
            };
            let events: Vec<client::EventEntry> = m
                .get_events(q(since, limit))
                .await
                .map_err(|e| describe(e.into()))?
                .iter()
                .map(client::EventEntry::from_dict)
                .collect();
            let Some(mut signals) = signals else {
                if json {
                    print_json(&events)?;
                } else {
                    print!("{}", events_table(&events));
                }
                return Ok(());
            };
            // Following: a line per entry as it comes (NDJSON with --json), columns of fixed
            // width, since a table cannot be sized before its rows are known.
            let print = |e: &client::EventEntry| -> Result<(), String> {
                if json {
                    println!("{}", serde_json::to_string(e).map_err(|e| e.to_string())?);
                } else {
                    println!("{}", event_line(e));
                }
                Ok(())
            };
            if !json && client::table::legend() {
                println!("{}", event_line_header());
            }
            let mut last = since.unwrap_or(0);
            for e in &events {
                print(e)?;
                last = last.max(e.id);
            }
            // A signal only wakes: the entries are read back with the same filter, from the
            // last one printed, so a signal the bus dropped or one that arrives out of turn
            // loses nothing and prints nothing twice.
            while let Some(newest) = signals.next().await.map_err(|e| describe(e.into()))? {
                if newest <= last {
                    continue;
                }
                loop {
                    let batch: Vec<client::EventEntry> = m
                        .get_events(q(Some(last), 10_000))
                        .await
                        .map_err(|e| describe(e.into()))?
                        .iter()
                        .map(client::EventEntry::from_dict)
                        .collect();
                    for e in &batch {
                        print(e)?;
                        last = last.max(e.id);
                    }
                    if batch.len() < 10_000 {
                        break;
                    }
                }
                // Entries filtered out still move the mark: they need not be asked for again.
                last = last.max(newest);
            }
            return Err(Failure::from(
                "vfiod left the bus: no more events to follow".to_string(),
            ));
        }
        Command::Plan {
            address,
            config: Some(path),
            json,
        } => {
            let plans = preview(&conn, &path, address.as_deref()).await?;
            print_plans(
                plans,
                json,
                &format!("the configuration in {}", path.display()),
            )?;
        }
        Command::Plan {
            address,
            config: None,
            json,
        } => {
            let m = client::manager(&conn).await.map_err(describe)?;
            let plans: Vec<client::PlanEntry> = match &address {
                Some(a) => vec![m.get_plan(a).await.map_err(|e| describe(e.into()))?],
                None => m.get_plans().await.map_err(|e| describe(e.into()))?,
            }
            .iter()
            .map(client::PlanEntry::from_dict)
            .collect();
            print_plans(plans, json, "the configuration")?;
        }
        Command::Mode {
            address,
            mode,
            vfs,
            wait,
            json,
        } => {
            let d = client::device(&conn, &address).await.map_err(describe)?;
            let path = d
                .set_mode(&mode, vfs.unwrap_or(0))
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(&conn, path, wait, json).await?;
        }
        Command::Task(TaskCommand::Start {
            address,
            kind,
            vfs,
            wait,
            json,
        }) => {
            let d = client::device(&conn, &address).await.map_err(describe)?;
            let path = match kind.as_str() {
                "split" => d.set_mode("vf", vfs.unwrap_or(0)).await,
                "restore" => d.set_mode("pf", 0).await,
                _ => d.apply().await,
            }
            .map_err(|e| describe(e.into()))?;
            start_and_follow(&conn, path, wait, json).await?;
        }
        Command::Task(TaskCommand::Show { task, json }) if task.parse::<i64>().is_err() => {
            let d = client::show_device(&conn, &task).await.map_err(describe)?;
            if json {
                let current = match &d.current_task {
                    Some(path) => {
                        let path = zbus::OwnedObjectPath::try_from(path.as_str())
                            .map_err(|e| e.to_string())?;
                        let t = client::task(&conn, path).await.map_err(describe)?;
                        Some(client::task_view(&t).await.map_err(describe)?)
                    }
                    None => None,
                };
                print_json(&serde_json::json!({
                    "address": d.address,
                    "task_state": d.task_state,
                    "task": current,
                    "last_result": d.last_result,
                }))?;
                return Ok(());
            }
            match &d.current_task {
                Some(path) => {
                    let t = client::task(
                        &conn,
                        zbus::OwnedObjectPath::try_from(path.as_str())
                            .map_err(|e| e.to_string())?,
                    )
                    .await
                    .map_err(describe)?;
                    let get = async {
                        Ok::<_, zbus::Error>((
                            t.id().await?,
                            t.kind().await?,
                            t.step().await?,
                            t.percent().await?,
                        ))
                    };
                    let (id, kind, step, pct) = get.await.map_err(|e| describe(e.into()))?;
                    println!("{}: task {id} {kind}: {} ({pct}%)", d.address, d.task_state);
                    if !step.is_empty() {
                        println!("step:   {step}");
                    }
                }
                None => println!("{}: {}", d.address, d.task_state),
            }
            if !d.last_result.is_empty() {
                println!("last:   {}", d.last_result);
            }
        }
        Command::Task(TaskCommand::Show { task, json }) => {
            let id: i64 = task.parse().map_err(|e| format!("{task}: {e}"))?;
            let path =
                zbus::OwnedObjectPath::try_from(format!("{}/task/{id}", vfiod::dbus::ROOT_PATH))
                    .map_err(|e| e.to_string())?;
            let t = client::task(&conn, path).await.map_err(describe)?;
            let view = client::task_view(&t).await.map_err(|e| match e {
                ClientError::Call(e) if unknown_object(&e) => Failure::named(
                    "org.freedesktop.DBus.Error.UnknownObject",
                    format!(
                        "no task {id} on the bus (vfioctl task list shows the history; a \
                             task's object stays while a device shows it, and for the newest \
                             others)"
                    ),
                ),
                other => describe(other),
            })?;
            if json {
                print_json(&view)?;
                return Ok(());
            }
            let client::TaskView {
                kind,
                address: dev,
                state,
                step,
                percent: pct,
                result,
                ..
            } = view;
            println!("task {id}: {kind} on {dev}: {state} ({pct}%)");
            if !step.is_empty() {
                println!("step:   {step}");
            }
            if !result.is_empty() {
                println!("result: {result}");
            }
        }
        Command::Task(TaskCommand::Reset { address, json }) => {
            let d = client::device(&conn, &address).await.map_err(describe)?;
            d.reset_task().await.map_err(|e| describe(e.into()))?;
            if json {
                let d = client::show_device(&conn, &address)
                    .await
                    .map_err(describe)?;
                print_json(&serde_json::json!({
                    "address": d.address,
                    "task_state": d.task_state,
                    "last_result": d.last_result,
                }))?;
            } else {
                println!("{address}: task reset; the device is idle");
            }
        }
        Command::Task(TaskCommand::List {
            address,
            limit,
            json,
        }) => {
            let m = client::manager(&conn).await.map_err(describe)?;
            let q = client::query(vec![
                ("address", address.map(zbus::Variant::from)),
                ("limit", Some(limit.into())),
            ]);
            let tasks: Vec<client::TaskEntry> = m
                .get_tasks(q)
                .await
                .map_err(|e| describe(e.into()))?
                .iter()
                .map(client::TaskEntry::from_dict)
                .collect();
            if json {
                print_json(&tasks)?;
            } else {
                let rows = tasks.iter().map(|t| {
                    vec![
                        t.id.to_string(),
                        format_time(t.created_ms),
                        t.address.clone(),
                        t.kind.clone(),
                        t.state.clone(),
                        format!("{}%", t.percent),
                        t.result.clone(),
                    ]
                });
                print!(
                    "{}",
                    client::table::render(
                        &["TASK", "CREATED", "DEVICE", "KIND", "STATE", "DONE", "RESULT"],
                        rows
                    )
                );
            }
        }
        Command::Claim {
            want,
            vm,
            uuid,
            lease,
            persistent,
            json,
        } => {
            let owner = client::query(vec![
                ("vm_name", vm.map(zbus::Variant::from)),
                ("vm_uuid", uuid.map(zbus::Variant::from)),
                ("lease_seconds", Some(lease.into())),
                ("persistent", Some(persistent.into())),
            ]);
            let m = claims::claims_proxy(&conn).await.map_err(describe)?;
            let path = m
                .claim(want.dict(), owner)
                .await
                .map_err(|e| describe(e.into()))?;
            let c = claims::claim_view(&conn, path.as_str())
                .await
                .map_err(describe)?;
            if json {
                print_json(&c)?;
            } else {
                println!(
                    "claim {}: {} for {} ({})",
                    c.id,
                    c.functions.join(" + "),
                    c.vm,
                    c.path
                );
            }
        }
        Command::Find { want, json } => {
            let m = claims::claims_proxy(&conn).await.map_err(describe)?;
            let found: Vec<String> = m
                .find_devices(want.dict())
                .await
                .map_err(|e| describe(e.into()))?
                .iter()
                .map(|path| {
                    let name = path.as_str().rsplit('/').next().unwrap_or_default();
                    vfiod::model::pci::PciAddress::from_nodedev_name(name)
                        .map_or_else(|_| path.as_str().to_string(), |a| a.to_string())
                })
                .collect();
            if json {
                print_json(&found)?;
            } else {
                for a in &found {
                    println!("{a}");
                }
            }
            if found.is_empty() {
                // `$(vfioctl find ...)` gets nothing, the status says why; with --json the
                // error object too, as for every failure.
                let none = Failure::named(
                    "org.vfiod.Vfiod1.Error.NoDeviceAvailable",
                    "no device available that matches",
                );
                if json {
                    return Err(none);
                }
                note(&none.message);
                return Err(none.quiet());
            }
        }
        Command::Claims { json } => {
            let list = claims::list_claims(&conn).await.map_err(describe)?;
            if json {
                print_json(&list)?;
            } else if list.is_empty() {
                note("no claims");
            } else {
                print!("{}", claims::render_claims(&list, format_time));
            }
        }
        Command::Attach {
            claim,
            domain,
            live,
            config,
            wait,
            json,
        } => {
            let path = claims::claim_path(&claim)?;
            let mut flags = Vec::new();
            if live {
                flags.push("live");
            }
            if config {
                flags.push("config");
            }
            let what = claims::Change::Attach {
                domain: &domain,
                flags: &flags,
            };
            let done = claims::change(&conn, path.clone(), what, wait)
                .await
                .map_err(|e| gone_claim(&claim, e))?;
            if json {
                // The claim as it is now: attached, or still attaching without --wait.
                let c = claims::claim_view(&conn, path.as_str())
                    .await
                    .map_err(|e| gone_claim(&claim, e))?;
                return print_json(&c).map_err(Failure::from);
            }
            match done {
                claims::Progress::Done => {
                    let c = claims::claim_view(&conn, path.as_str())
                        .await
                        .map_err(describe)?;
                    let at = if c.guest_address.is_empty() {
                        String::new()
                    } else {
                        format!(" at guest address {}", c.guest_address)
                    };
                    println!(
                        "claim {claim}: {} attached to {domain}{at}",
                        c.functions.join(" + ")
                    );
                }
                claims::Progress::Started(state) => println!(
                    "claim {claim} is {state} to {domain} (vfioctl claims shows when it is \
                     attached; --wait waits)"
                ),
            }
        }
        Command::Detach { claim, wait, json } => {
            let path = claims::claim_path(&claim)?;
            let done = claims::change(&conn, path.clone(), claims::Change::Detach, wait)
                .await
                .map_err(|e| gone_claim(&claim, e))?;
            if json {
                return match done {
                    // Its object is gone with it.
                    claims::Progress::Done => print_json(&ended_claim(&path)),
                    claims::Progress::Started(_) => print_json(
                        &claims::claim_view(&conn, path.as_str())
                            .await
                            .map_err(|e| gone_claim(&claim, e))?,
                    ),
                }
                .map_err(Failure::from);
            }
            match done {
                claims::Progress::Done => {
                    println!("claim {claim} detached; its devices are back in the pool")
                }
                claims::Progress::Started(state) => println!(
                    "claim {claim} is {state}: the guest must let go of the device (vfioctl \
                     claims shows when the claim is gone; --wait waits)"
                ),
            }
        }
        Command::Release { claim, json } => {
            let path = claims::claim_path(&claim)?;
            claims::release(&conn, path.clone())
                .await
                .map_err(|e| gone_claim(&claim, e))?;
            if json {
                print_json(&ended_claim(&path))?;
            } else {
                println!("claim {claim} released");
            }
        }
        Command::Migrate {
            domain,
            destination,
            migrate_uri,
            offline,
            wait,
            json,
        } => {
            let m = client::manager(&conn).await.map_err(describe)?;
            let options = client::query(vec![
                ("live", Some((!offline).into())),
                ("migrate_uri", migrate_uri.map(zbus::Variant::from)),
            ]);
            let path = m
                .migrate(&domain, &destination, options)
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(&conn, path, wait, json).await?;
        }
        Command::Image(command) => image(&conn, command).await?,
        Command::Pool(command) => pool(&conn, command).await?,
        Command::Fpga(FpgaCommand::Program {
            device,
            image,
            wait,
            json,
        }) => {
            let d = client::device(&conn, &device).await.map_err(describe)?;
            let path = d.program(&image).await.map_err(|e| describe(e.into()))?;
            start_and_follow(&conn, path, wait, json).await?;
        }
        Command::Fpga(FpgaCommand::Verify {
            device,
            image,
            wait,
            json,
        }) => {
            let d = client::device(&conn, &device).await.map_err(describe)?;
            let path = d.verify(&image).await.map_err(|e| describe(e.into()))?;
            start_and_follow(&conn, path, wait, json).await?;
        }
        Command::Hook(_) => unreachable!("vfioctl hook is run before connecting"),
        Command::Completions { .. } | Command::Man => {
            unreachable!("completions and man are printed before connecting")
        }
        #[cfg(feature = "fleet")]
        Command::Fleet(_) => unreachable!("vfioctl fleet is run before connecting"),
        Command::Metrics => print!("{}", client::metrics::text(&conn).await.map_err(describe)?),
        Command::Reload { json } => {
            let m = client::manager(&conn).await.map_err(describe)?;
            m.reload().await.map_err(|e| describe(e.into()))?;
            if json {
                let sources = m.config_sources().await.map_err(|e| describe(e.into()))?;
                print_json(&serde_json::json!({ "config_sources": sources }))?;
            } else {
                println!("configuration reloaded");
            }
        }
        Command::Rescan { json } => {
            let m = client::manager(&conn).await.map_err(describe)?;
            m.rescan().await.map_err(|e| describe(e.into()))?;
            if json {
                let count = |r: zbus::Result<u32>| r.map_err(|e| describe(e.into()));
                print_json(&serde_json::json!({
                    "devices": count(m.device_count().await)?,
                    "usable": count(m.usable_count().await)?,
                    "protected": count(m.protected_count().await)?,
                    "broken": count(m.broken_count().await)?,
                }))?;
            } else {
                println!("rescan done");
            }
        }
    }
    Ok(())
}

/// `Images.AddFromUrl`, showing the download's progress on a terminal while the call runs;
/// Ctrl-C cancels the download.
async fn add_from_url(
    proxy: &vfiod::client::images::ImagesProxy<'static>,
    name: &str,
    url: &str,
    sha256: &str,
    options: vfiod::dbus::wire::Dict,
) -> zbus::Result<vfiod::dbus::wire::Dict> {
    use std::io::IsTerminal;
    use vfiod::dbus::wire::Entry;
    let call = proxy.add_from_url(name, url, sha256, options);
    tokio::pin!(call);
    let terminal = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
    let bar = vfiod::client::progress::DownloadProgress::new(name);
    let mut interrupted = false;
    // One registration for the whole call: a Ctrl-C between two turns of the loop is kept.
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| zbus::Error::Failure(format!("cannot catch Ctrl-C: {e}")))?;
    let result = loop {
        tokio::select! {
            r = &mut call => break r,
            // Ctrl-C stops the download in vfiod too (nothing is kept), then the call's
            // Cancelled error ends the command.
            _ = sigint.recv(), if !interrupted => {
                interrupted = true;
                if let Err(e) = proxy.cancel_download(name).await {
                    bar.finish();
                    eprintln!("cannot cancel the download: {e}");
                }
            }
            _ = tick.tick(), if terminal => {
                let Ok(all) = proxy.downloads().await else { continue };
                let Some(d) = all.iter().find(|d| Entry(d).str("name") == name) else {
                    continue;
                };
                let get = |k: &str| d.get(k).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                bar.update(get("received"), get("total"));
            }
        }
    };
    bar.finish();
    result
}

async fn image(conn: &zbus::Connection, command: ImageCommand) -> Result<(), Failure> {
    use vfiod::client::images::{self, ImageEntry};
    let proxy = images::images(conn).await.map_err(describe)?;
    let call = |e: zbus::Error| describe(e.into());
    match command {
        ImageCommand::Add {
            name,
            file,
            sha256,
            format,
            interface_id,
            afu_id,
            from_path,
            url,
            json,
        } => {
            let options = client::query(vec![
                ("format", format.map(zbus::Variant::from)),
                ("interface_id", interface_id.map(zbus::Variant::from)),
                ("afu_id", afu_id.map(zbus::Variant::from)),
            ]);
            let file = file.unwrap_or_default();
            let added = if let Some(url) = url {
                add_from_url(&proxy, &name, &url, &sha256, options)
                    .await
                    .map_err(call)?
            } else if from_path {
                let path = std::path::absolute(&file).map_err(|e| format!("{file}: {e}"))?;
                proxy
                    .add_from_path(&name, &path.to_string_lossy(), &sha256, options)
                    .await
                    .map_err(call)?
            } else {
                use std::os::fd::AsFd;
                let opened;
                let fd = if file == "-" {
                    std::io::stdin().as_fd().try_clone_to_owned()
                } else {
                    opened = std::fs::File::open(&file).map_err(|e| format!("{file}: {e}"))?;
                    opened.as_fd().try_clone_to_owned()
                }
                .map_err(|e| format!("{file}: {e}"))?;
                proxy
                    .add(&name, zbus::Fd::from(&fd), &sha256, options)
                    .await
                    .map_err(call)?
            };
            let entry = ImageEntry::from_dict(&added);
            if json {
                print_json(&entry)?;
            } else {
                println!(
                    "image {} {}: {}, {} bytes, interface {}",
                    entry.name,
                    if entry.source_url.is_empty() {
                        "added".to_string()
                    } else {
                        format!("downloaded from {}", entry.source_url)
                    },
                    entry.format,
                    entry.size,
                    if entry.interface_id.is_empty() {
                        "-"
                    } else {
                        &entry.interface_id
                    }
                );
            }
        }
        ImageCommand::List { json } => {
            let all: Vec<ImageEntry> = proxy
                .list()
                .await
                .map_err(call)?
                .iter()
                .map(ImageEntry::from_dict)
                .collect();
            if json {
                print_json(&all)?;
            } else {
                print!("{}", images::render_table(&all));
            }
        }
        ImageCommand::Show { name, json } => {
            let entry = ImageEntry::from_dict(&proxy.get(&name).await.map_err(call)?);
            if json {
                print_json(&entry)?;
            } else {
                print!("{}", images::render_details(&entry));
            }
        }
        ImageCommand::Deactivate { name, json } => {
            proxy.deactivate(&name).await.map_err(call)?;
            if json {
                print_json(&ImageEntry::from_dict(
                    &proxy.get(&name).await.map_err(call)?,
                ))?;
            } else {
                println!("image {name} deactivated");
            }
        }
        ImageCommand::Activate { name, json } => {
            proxy.activate(&name).await.map_err(call)?;
            if json {
                print_json(&ImageEntry::from_dict(
                    &proxy.get(&name).await.map_err(call)?,
                ))?;
            } else {
                println!("image {name} activated");
            }
        }
        ImageCommand::Remove { name, json } => {
            proxy.remove(&name).await.map_err(call)?;
            if json {
                print_json(&serde_json::json!({ "name": name, "state": "removed" }))?;
            } else {
                println!("image {name} removed");
            }
        }
        ImageCommand::Cancel { name, json } => {
            proxy.cancel_download(&name).await.map_err(call)?;
            if json {
                print_json(&serde_json::json!({ "name": name, "state": "cancelled" }))?;
            } else {
                println!("download of image {name} cancelled");
            }
        }
    }
    Ok(())
}

async fn pool(conn: &zbus::Connection, command: PoolCommand) -> Result<(), Failure> {
    use vfiod::client::pool::{self, PoolDeviceEntry, PoolEntry, PooledEntry};
    let m = client::manager(conn).await.map_err(describe)?;
    let call = |e: zbus::Error| describe(e.into());
    let claims = |all: bool| {
        let m = m.clone();
        async move {
            let q = client::query(vec![("history", Some(all.into()))]);
            Ok::<_, Failure>(
                m.get_pooled_claims(q)
                    .await
                    .map_err(call)?
                    .iter()
                    .map(PooledEntry::from_dict)
                    .collect::<Vec<_>>(),
            )
        }
    };
    match command {
        PoolCommand::List { all, json } => {
            let all = claims(all).await?;
            if json {
                print_json(&all)?;
            } else {
                print!("{}", pool::render_table(&all));
            }
        }
        PoolCommand::Show { id, json } => {
            let c = claims(true)
                .await?
                .into_iter()
                .find(|c| c.id == id)
                .ok_or_else(|| {
                    Failure::named(
                        "org.vfiod.Vfiod1.Error.NoSuchClaim",
                        format!("no pooled claim {id}"),
                    )
                })?;
            // Its steps: the history entries of kind pool that name it.
            let prefix = format!("pooled claim {id} ");
            let mut events = Vec::new();
            let mut since = 0i64;
            loop {
                let q = client::query(vec![
                    ("since", Some(since.into())),
                    ("limit", Some(10_000u32.into())),
                ]);
                let page: Vec<client::EventEntry> = m
                    .get_events(q)
                    .await
                    .map_err(call)?
                    .iter()
                    .map(client::EventEntry::from_dict)
                    .collect();
                let Some(last) = page.last() else { break };
                since = last.id;
                events.extend(
                    page.into_iter()
                        .filter(|e| e.kind == "pool" && e.message.starts_with(&prefix)),
                );
            }
            if json {
                print_json(&serde_json::json!({ "claim": c, "events": events }))?;
            } else {
                print!("{}", pool::render_details(&c));
                println!("  history:");
                for e in &events {
                    let step = e
                        .message
                        .split_once("): ")
                        .map_or(e.message.as_str(), |(_, rest)| rest);
                    println!("    {}  {step}", format_time_ms(e.time_ms));
                }
            }
        }
        PoolCommand::Pools { json } => {
            let pools: Vec<PoolEntry> = m
                .get_pools()
                .await
                .map_err(call)?
                .iter()
                .map(PoolEntry::from_dict)
                .collect();
            let host = m.host_name().await.map_err(call)?;
            if json {
                print_json(&serde_json::json!({ "host_name": host, "pools": pools }))?;
            } else {
                println!("this host is {host} to its pools");
                for p in &pools {
                    println!(
                        "{:<12} {}  quiesce at {}, deadlines {} + {} ms",
                        p.name, p.url, p.quiesce_at, p.connect_timeout_ms, p.request_timeout_ms
                    );
                }
            }
        }
        PoolCommand::Devices { pool, json } => {
            let devices: Vec<PoolDeviceEntry> = m
                .get_pool_devices(&pool)
                .await
                .map_err(call)?
                .iter()
                .map(PoolDeviceEntry::from_dict)
                .collect();
            if json {
                print_json(&devices)?;
            } else {
                let rows = devices.iter().map(|d| {
                    vec![
                        d.id.clone(),
                        d.kind.clone(),
                        d.model.clone(),
                        if d.session.is_empty() {
                            "-".into()
                        } else {
                            d.session.clone()
                        },
                    ]
                });
                print!(
                    "{}",
                    client::table::render(&["DEVICE", "KIND", "MODEL", "SESSION"], rows)
                );
            }
        }
        PoolCommand::Lease {
            pool,
            device,
            vm,
            vm_uuid,
            json,
        } => {
            let owner = client::query(vec![
                ("vm_name", vm.map(zbus::Variant::from)),
                ("vm_uuid", vm_uuid.map(zbus::Variant::from)),
            ]);
            let c =
                PooledEntry::from_dict(&m.lease_pooled(&pool, &device, owner).await.map_err(call)?);
            if json {
                print_json(&c)?;
            } else {
                println!(
                    "pooled claim {}: device {} of pool {} leased to {} (session {}, epoch {})",
                    c.id,
                    c.device,
                    c.pool,
                    if c.vm_name.is_empty() {
                        &c.vm_uuid
                    } else {
                        &c.vm_name
                    },
                    c.session,
                    c.epoch
                );
            }
        }
        PoolCommand::Release { id, json } => {
            let c = PooledEntry::from_dict(&m.release_pooled(id).await.map_err(call)?);
            if json {
                return print_json(&c).map_err(Failure::from);
            }
            println!(
                "pooled claim {id} {}{}",
                c.state,
                if c.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", c.reason)
                }
            );
        }
    }
    Ok(())
}

/// A time from Unix milliseconds, UTC, in RFC 3339 with milliseconds (a migration's quiesce
/// window is tens of them): `2026-12-02T05:18:40.123Z`.
/// `vfioctl events`' table. Milliseconds: a migration's quiesce window is tens of them.
fn events_table(events: &[client::EventEntry]) -> String {
    let rows = events.iter().map(|e| {
        vec![
            e.id.to_string(),
            format_time_ms(e.time_ms),
            e.kind.clone(),
            e.message.clone(),
        ]
    });
    client::table::render(&["ID", "TIME", "KIND", "MESSAGE"], rows)
}

/// One entry of `vfioctl events --follow`: the table's columns at fixed widths (an id of up
/// to 7 digits, the time's 24 characters, the longest kind's 11), since rows come one at a time.
fn event_line(e: &client::EventEntry) -> String {
    format!(
        "{:<7}  {:<24}  {:<11}  {}",
        e.id,
        format_time_ms(e.time_ms),
        e.kind,
        e.message
    )
}

fn event_line_header() -> String {
    format!("{:<7}  {:<24}  {:<11}  {}", "ID", "TIME", "KIND", "MESSAGE")
}

fn format_time_ms(ms: i64) -> String {
    humantime::format_rfc3339_millis(system_time(ms)).to_string()
}

/// The same to the second: `2026-12-02T05:18:40Z`.
fn format_time(ms: i64) -> String {
    humantime::format_rfc3339_seconds(system_time(ms)).to_string()
}

fn system_time(ms: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
