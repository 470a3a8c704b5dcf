//! The devices: `list`, `show`, `status`, `plan` (of the running configuration, or of one
//! not installed yet: `--config`), `mode`, `metrics`, `reload`, `rescan`.

use super::*;

/// The devices commands (`main` dispatches only those here).
pub(crate) async fn run(conn: &zbus::Connection, command: Command) -> Result<(), Failure> {
    match command {
        Command::List { json, kind } => {
            let mut devices = client::list_devices(conn).await.map_err(describe)?;
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
            let d = client::show_device(conn, &address)
                .await
                .map_err(describe)?;
            if json {
                print_json(&d)?;
            } else {
                print!("{}", client::render_details(&d));
            }
        }
        Command::Status { json } => {
            let s = client::status::read(conn).await.map_err(describe)?;
            if json {
                print_json(&s)?;
            } else {
                print!("{}", client::status::render(&s, format_time));
            }
        }
        Command::Plan {
            address,
            config: Some(path),
            json,
        } => {
            let plans = preview(conn, &path, address.as_deref()).await?;
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
            let m = client::manager(conn).await.map_err(describe)?;
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
            let d = client::device(conn, &address).await.map_err(describe)?;
            let path = d
                .set_mode(&mode, client::mode_options(vfs))
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(conn, path, wait, json).await?;
        }
        Command::Clean {
            address,
            wait,
            json,
        } => {
            let d = client::device(conn, &address).await.map_err(describe)?;
            let path = d
                .clean(Default::default())
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(conn, path, wait, json).await?;
        }
        Command::Metrics => print!("{}", client::metrics::text(conn).await.map_err(describe)?),
        Command::Reload { json } => {
            let m = client::manager(conn).await.map_err(describe)?;
            m.reload().await.map_err(|e| describe(e.into()))?;
            if json {
                let sources = m.config_sources().await.map_err(|e| describe(e.into()))?;
                print_json(&serde_json::json!({ "config_sources": sources }))?;
            } else {
                println!("configuration reloaded");
            }
        }
        Command::Rescan { json } => {
            let m = client::manager(conn).await.map_err(describe)?;
            m.rescan().await.map_err(|e| describe(e.into()))?;
            if json {
                let count = |r: zbus::Result<u32>| r.map_err(|e| describe(e.into()));
                print_json(&serde_json::json!({
                    "devices": count(m.device_count().await)?,
                    "usable": count(m.usable_count().await)?,
                    "protected": count(m.protected_count().await)?,
                    "broken": count(m.broken_count().await)?,
                    "cleaning": count(m.cleaning_count().await)?,
                }))?;
            } else {
                println!("rescan done");
            }
        }
        _ => unreachable!("main dispatches only the devices commands here"),
    }
    Ok(())
}

/// `vfioctl plan --config PATH [ADDRESS]`: the files read and checked here (every error
/// named, without asking vfiod), then planned by vfiod against its host now.
pub(crate) async fn preview(
    conn: &zbus::Connection,
    path: &std::path::Path,
    address: Option<&str>,
) -> Result<Vec<client::PlanEntry>, Failure> {
    use vfiod::config::Settings;
    let files = Settings::read_files(path).map_err(|e| Failure::from(vfiod::error_chain(&e)))?;
    if let Err(errors) = Settings::from_files(files.clone()) {
        let lines = vfiod::config::error_lines(&errors);
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
                }),
            })],
    })
}

/// `vfioctl plan`'s output: one line per device and its writes, or the plans as JSON.
pub(crate) fn print_plans(
    plans: Vec<client::PlanEntry>,
    json: bool,
    config: &str,
) -> Result<(), Failure> {
    if json {
        let v: Vec<serde_json::Value> = plans.iter().map(|p| p.json.clone()).collect();
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
                "wait" => "waiting".to_string(),
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
