//! `vfioctl fleet ...`: the fleet's database, read and reserved from directly (not through a
//! local vfiod), with the credentials file of the daemon's configuration or `--credentials`.

use clap::{Args as ClapArgs, Subcommand};
use std::path::PathBuf;
use std::time::Duration;
use vfiod::fleet::{credentials, db};

#[derive(ClapArgs, Debug)]
pub struct FleetArgs {
    /// The vfiod configuration whose `[fleet] credentials_file` is used (default
    /// /etc/vfiod/vfiod.toml and its drop-ins).
    #[arg(long)]
    fleet_config: Option<PathBuf>,
    /// A credentials file to use instead (a libpq connection string, mode 0600).
    #[arg(long, conflicts_with = "fleet_config")]
    credentials: Option<PathBuf>,
    /// With --credentials: CA certificates (PEM) for the database's TLS certificate, beside
    /// the system's (with --fleet-config: its `[fleet] ca_file`).
    #[arg(long, requires = "credentials")]
    ca_file: Option<PathBuf>,
    #[command(subcommand)]
    command: FleetCommand,
}

/// Filters like FindDevices' (the same options as `vfioctl find`), plus the host.
#[derive(ClapArgs, Debug)]
pub struct FleetFilter {
    /// Only this host.
    #[arg(long)]
    host: Option<String>,
    #[command(flatten)]
    requirements: super::Requirements,
}

#[derive(Subcommand, Debug)]
enum FleetCommand {
    /// Every host of the fleet: up or down, when last heard, its devices.
    Hosts {
        #[arg(long)]
        json: bool,
    },
    /// Every device the fleet knows that matches, with its place in the pool.
    List {
        #[command(flatten)]
        filter: FleetFilter,
        #[arg(long)]
        json: bool,
    },
    /// The devices a fleet claim could get now (offered, unreserved, on a live host).
    Find {
        #[command(flatten)]
        filter: FleetFilter,
        #[arg(long)]
        json: bool,
    },
    /// Reserves a matching device on some host for a VM and waits until that host's vfiod has
    /// made it a local claim (or refused it, with the reason).
    Claim {
        #[command(flatten)]
        filter: FleetFilter,
        /// The VM's libvirt domain name.
        #[arg(long)]
        vm: String,
        /// How long to wait for the host, in seconds.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        #[arg(long)]
        json: bool,
    },
    /// The fleet's history: hosts joining and going down, devices added, withdrawn, restored
    /// and removed, reservations made, taken and refused. The newest entries, oldest first.
    Events {
        /// Only this host's events.
        #[arg(long)]
        host: Option<String>,
        /// How many entries (1..=10000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=10000))]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Applies the schema migrations (with the schema owner's credentials).
    Migrate,
    /// Lets a database login role report for a host (administrator).
    AddHost { host: String, role: String },
}

fn filter(filter: &FleetFilter) -> Result<db::Filter, String> {
    let f = &filter.requirements;
    let (vendor_id, device_id) = match &f.id {
        Some(id) => {
            let (v, d) = vfiod::claim::Requirements::parse_id(id)?;
            (Some(v), d)
        }
        None => (None, None),
    };
    let address = |a: &Option<String>| -> Result<Option<String>, String> {
        a.as_deref()
            .map(|a| {
                a.parse::<vfiod::model::pci::PciAddress>()
                    .map(|a| a.to_string())
                    .map_err(|e| e.to_string())
            })
            .transpose()
    };
    Ok(db::Filter {
        host: filter.host.clone(),
        kind: f.kind.map(|k| k.as_str().to_string()),
        vendor_id,
        device_id,
        role: if f.vf {
            Some("vf".into())
        } else if f.pf {
            Some("pf".into())
        } else {
            None
        },
        numa_node: f.numa,
        address: address(&f.address)?,
        parent: address(&f.parent)?,
    })
}

/// The credentials file and the CA file to use.
fn credentials_path(args: &FleetArgs) -> Result<(PathBuf, Option<PathBuf>), String> {
    if let Some(p) = &args.credentials {
        return Ok((p.clone(), args.ca_file.clone()));
    }
    let (main, dropins, required) = match &args.fleet_config {
        Some(p) => (p.clone(), None, true),
        None => (
            PathBuf::from(vfiod::config::DEFAULT_CONFIG_PATH),
            Some(PathBuf::from(vfiod::config::DEFAULT_DROPIN_DIR)),
            false,
        ),
    };
    let settings = vfiod::config::Settings::load(&main, dropins.as_deref(), required)
        .map_err(|e| vfiod::error_chain(&e))?;
    settings
        .fleet
        .map(|f| (f.credentials_file, f.ca_file))
        .ok_or_else(|| {
            format!(
                "{} has no [fleet] section (give --credentials FILE)",
                main.display()
            )
        })
}

fn db_error(e: tokio_postgres::Error) -> String {
    format!("fleet database: {}", vfiod::error_chain(&e))
}

pub async fn run(args: FleetArgs) -> Result<(), String> {
    let (path, ca_file) = credentials_path(&args)?;
    let config = credentials::read(&path).map_err(|e| vfiod::error_chain(&e))?;
    let vfiod::fleet::tls::Connection {
        mut client, driver, ..
    } = vfiod::fleet::tls::connect(&config, ca_file.as_deref())
        .await
        .map_err(|e| vfiod::error_chain(&e))?;
    let result = command(&mut client, args.command).await;
    // The driver ends once the client is gone (it tells the server goodbye).
    drop(client);
    driver.join().await;
    result
}

async fn command(client: &mut tokio_postgres::Client, command: FleetCommand) -> Result<(), String> {
    match command {
        FleetCommand::Hosts { json } => {
            let hosts = db::hosts(client).await.map_err(db_error)?;
            if json {
                return super::print_json(&hosts);
            }
            let rows = hosts.iter().map(|h| {
                vec![
                    h.host.clone(),
                    h.status.to_string(),
                    format!("{:.1}s", h.silent_seconds),
                    format!("{:.1}s", f64::from(h.interval_ms) / 1000.0),
                    h.devices.to_string(),
                    h.offered.to_string(),
                ]
            });
            print!(
                "{}",
                vfiod::client::table::render(
                    &["HOST", "STATE", "SILENT", "INTERVAL", "DEVICES", "OFFERED"],
                    rows
                )
            );
        }
        FleetCommand::List { filter: f, json } => {
            let rows = db::list(client, &filter(&f)?).await.map_err(db_error)?;
            print_devices(&rows, json)?;
        }
        FleetCommand::Find { filter: f, json } => {
            let rows = db::find(client, &filter(&f)?).await.map_err(db_error)?;
            print_devices(&rows, json)?;
        }
        FleetCommand::Claim {
            filter: f,
            vm,
            timeout,
            json,
        } => {
            vfiod::claim::Owner::new(Some(&vm), None, 0, false)?;
            let who = requester();
            let Some(r) = db::reserve(client, &filter(&f)?, &vm, &who)
                .await
                .map_err(db_error)?
            else {
                return Err("no free device in the fleet matches".into());
            };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
            let done = loop {
                let now = db::reservation_by_id(client, r.id)
                    .await
                    .map_err(db_error)?
                    .ok_or("the reservation vanished")?;
                if now.state != "pending" {
                    break now;
                }
                if tokio::time::Instant::now() >= deadline {
                    db::withdraw(client, r.id, "its requester stopped waiting for the host")
                        .await
                        .map_err(db_error)?;
                    return Err(format!(
                        "host {} did not take reservation {} within {timeout} s: withdrawn",
                        r.host, r.id
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            if json {
                super::print_json(&done)?;
            }
            match done.state.as_str() {
                "claimed" => {
                    if !json {
                        println!(
                            "reservation {}: {} on {} for {} is local claim {}",
                            done.id,
                            done.address,
                            done.host,
                            done.vm_name,
                            done.local_claim_id.unwrap_or_default()
                        );
                    }
                }
                _ => {
                    return Err(format!(
                        "reservation {} of {} on {} {}: {}",
                        done.id, done.address, done.host, done.state, done.reason
                    ))
                }
            }
        }
        FleetCommand::Events { host, limit, json } => {
            let rows = db::events(client, host.as_deref(), limit)
                .await
                .map_err(db_error)?;
            if json {
                return super::print_json(&rows);
            }
            let rows = rows.iter().map(|e| {
                vec![
                    e.id.to_string(),
                    e.at.to_string(),
                    e.host.clone(),
                    e.address.clone().unwrap_or_else(|| "-".into()),
                    e.kind.to_string(),
                    e.message.clone(),
                ]
            });
            print!(
                "{}",
                vfiod::client::table::render(
                    &["ID", "TIME", "HOST", "ADDRESS", "KIND", "MESSAGE"],
                    rows
                )
            );
        }
        FleetCommand::Migrate => {
            let applied = db::migrate(client).await.map_err(db_error)?;
            if applied.is_empty() {
                println!(
                    "the fleet schema is up to date (version {})",
                    vfiod::fleet::schema::VERSION
                );
            } else {
                println!("applied fleet schema version(s) {applied:?}");
            }
        }
        FleetCommand::AddHost { host, role } => {
            vfiod::config::check_host_name(&host)?;
            db::add_host(client, &host, &role).await.map_err(db_error)?;
            println!("role {role} reports for host {host}");
        }
    }
    Ok(())
}

/// Who asks, for the reservation's record: the local user name.
fn requester() -> String {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|u| u.name)
        .unwrap_or_else(|| format!("uid {}", nix::unistd::getuid()))
}

fn print_devices(rows: &[db::DeviceRow], json: bool) -> Result<(), String> {
    if json {
        return super::print_json(&rows);
    }
    let rows = rows.iter().map(|d| {
        let id = match (d.vendor_id, d.device_id) {
            (Some(v), Some(dv)) => format!("{v:04x}:{dv:04x}"),
            _ => "?".into(),
        };
        vec![
            d.host.clone(),
            d.address.to_string(),
            d.kind.to_string(),
            d.role.to_string(),
            id,
            d.numa_node.map_or("-".into(), |n| n.to_string()),
            d.pool.to_string(),
            d.reason.to_string(),
        ]
    });
    print!(
        "{}",
        vfiod::client::table::render(
            &["HOST", "ADDRESS", "KIND", "ROLE", "ID", "NUMA", "POOL", "REASON"],
            rows
        )
    );
    Ok(())
}
