//! Remote pooled devices: `pool list|show|pools|devices|lease|release`.

use super::*;

/// The pool commands (`main` dispatches only those here).
pub(crate) async fn run(conn: &zbus::Connection, command: Command) -> Result<(), Failure> {
    match command {
        Command::Pool(command) => pool(conn, command).await?,
        _ => unreachable!("main dispatches only the pool commands here"),
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
pub(crate) enum PoolCommand {
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

pub(crate) async fn pool(conn: &zbus::Connection, command: PoolCommand) -> Result<(), Failure> {
    use vfiod::client::pool::{self, PoolDeviceEntry, PoolEntry, PooledEntry};
    let m = pool::pools(conn).await.map_err(describe)?;
    let call = |e: zbus::Error| describe(e.into());
    let claims = |all: bool| {
        let m = m.clone();
        async move {
            let q = client::query(vec![("history", Some(all.into()))]);
            Ok::<_, Failure>(
                m.get_claims(q)
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
                let page: Vec<client::EventEntry> = client::manager(conn)
                    .await
                    .map_err(describe)?
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
                .list(Default::default())
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
                .get_devices(&pool, Default::default())
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
            let path = m.lease(&pool, &device, owner).await.map_err(call)?;
            let id = pool::id_of_path(path.as_str());
            let c = claims(false)
                .await?
                .into_iter()
                .find(|c| Some(c.id) == id)
                .ok_or_else(|| Failure::from(format!("leased as {path}, and it ended since")))?;
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
            let object = pool::pooled_claim(conn, id).await.map_err(describe)?;
            let c = match object.release().await {
                Ok(d) => PooledEntry::from_dict(&d),
                // No object: no standing claim by that id. Say which: it ended, or never was.
                Err(zbus::Error::FDO(e)) if matches!(*e, zbus::fdo::Error::UnknownObject(_)) => {
                    let ended = claims(true).await?.into_iter().find(|c| c.id == id);
                    return Err(match ended {
                        Some(c) => Failure::named(
                            "org.vfiod.Vfiod1.Error.InvalidArgument",
                            format!("pooled claim {id} is {}: already ended", c.state),
                        ),
                        None => Failure::named(
                            "org.vfiod.Vfiod1.Error.NoSuchClaim",
                            format!("no pooled claim {id}"),
                        ),
                    });
                }
                Err(e) => return Err(call(e)),
            };
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
