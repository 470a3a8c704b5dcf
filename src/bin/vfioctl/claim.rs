//! Claims of PCI devices for VMs: `find`, `claim`, `claims`, `attach`, `detach`, `release`,
//! `migrate`.

use super::*;

/// The claims commands (`main` dispatches only those here).
pub(crate) async fn run(conn: &zbus::Connection, command: Command) -> Result<(), Failure> {
    match command {
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
            let m = client::claim::claims_proxy(conn).await.map_err(describe)?;
            let path = m
                .claim(want.dict(), owner)
                .await
                .map_err(|e| describe(e.into()))?;
            let c = client::claim::claim_view(conn, path.as_str())
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
            let m = client::claim::claims_proxy(conn).await.map_err(describe)?;
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
            let list = client::claim::list_claims(conn).await.map_err(describe)?;
            if json {
                print_json(&list)?;
            } else if list.is_empty() {
                note("no claims");
            } else {
                print!("{}", client::claim::render_claims(&list, format_time));
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
            let path = client::claim::claim_path(&claim)?;
            let mut flags = Vec::new();
            if live {
                flags.push("live");
            }
            if config {
                flags.push("config");
            }
            let what = client::claim::Change::Attach {
                domain: &domain,
                flags: &flags,
            };
            let done = client::claim::change(conn, path.clone(), what, wait)
                .await
                .map_err(|e| gone_claim(&claim, e))?;
            if json {
                // The claim as it is now: attached, or still attaching without --wait.
                let c = client::claim::claim_view(conn, path.as_str())
                    .await
                    .map_err(|e| gone_claim(&claim, e))?;
                return print_json(&c).map_err(Failure::from);
            }
            match done {
                client::claim::Progress::Done => {
                    let c = client::claim::claim_view(conn, path.as_str())
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
                client::claim::Progress::Started(state) => println!(
                    "claim {claim} is {state} to {domain} (vfioctl claims shows when it is \
                     attached; --wait waits)"
                ),
            }
        }
        Command::Detach { claim, wait, json } => {
            let path = client::claim::claim_path(&claim)?;
            let done =
                client::claim::change(conn, path.clone(), client::claim::Change::Detach, wait)
                    .await
                    .map_err(|e| gone_claim(&claim, e))?;
            if json {
                return match done {
                    // Its object is gone with it.
                    client::claim::Progress::Done => print_json(&ended_claim(&path)),
                    client::claim::Progress::Started(_) => print_json(
                        &client::claim::claim_view(conn, path.as_str())
                            .await
                            .map_err(|e| gone_claim(&claim, e))?,
                    ),
                }
                .map_err(Failure::from);
            }
            match done {
                client::claim::Progress::Done => println!(
                    "claim {claim} detached; its devices return to the pool once cleaned \
                     (vfioctl show: state cleaning, then usable)"
                ),
                client::claim::Progress::Started(state) => println!(
                    "claim {claim} is {state}: the guest must let go of the device (vfioctl \
                     claims shows when the claim is gone; --wait waits)"
                ),
            }
        }
        Command::Release { claim, json } => {
            let path = client::claim::claim_path(&claim)?;
            client::claim::release(conn, path.clone())
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
            let m = client::manager(conn).await.map_err(describe)?;
            let options = client::query(vec![
                ("live", Some((!offline).into())),
                ("migrate_uri", migrate_uri.map(zbus::Variant::from)),
            ]);
            let path = m
                .migrate(&domain, &destination, options)
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(conn, path, wait, json).await?;
        }
        _ => unreachable!("main dispatches only the claims commands here"),
    }
    Ok(())
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

/// A call on a claim, described; one whose object is gone says so plainly.
pub(crate) fn gone_claim(claim: &str, e: ClientError) -> Failure {
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
pub(crate) fn unknown_object(e: &zbus::Error) -> bool {
    match e {
        zbus::Error::MethodError(name, _, _) => {
            name.as_str() == "org.freedesktop.DBus.Error.UnknownObject"
        }
        zbus::Error::FDO(f) => matches!(**f, zbus::fdo::Error::UnknownObject(_)),
        _ => false,
    }
}

/// What `--json` prints for a claim that has ended (its object is gone): its number and path.
pub(crate) fn ended_claim(path: &zbus::OwnedObjectPath) -> serde_json::Value {
    let id = path
        .as_str()
        .rsplit('/')
        .next()
        .and_then(|n| n.parse::<u64>().ok());
    serde_json::json!({ "id": id, "path": path.as_str(), "state": "released" })
}
