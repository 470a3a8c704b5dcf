//! `task start|show|list|reset`, and following a task to its end (`--wait`) with progress.

use super::*;

/// The tasks commands (`main` dispatches only those here).
pub(crate) async fn run(conn: &zbus::Connection, command: Command) -> Result<(), Failure> {
    match command {
        Command::Task(TaskCommand::Start {
            address,
            kind,
            vfs,
            wait,
            json,
        }) => {
            let d = client::device(conn, &address).await.map_err(describe)?;
            let path = match kind.as_str() {
                "split" => d.set_mode("vf", client::mode_options(vfs)).await,
                "restore" => d.set_mode("pf", client::mode_options(None)).await,
                _ => d.apply().await,
            }
            .map_err(|e| describe(e.into()))?;
            start_and_follow(conn, path, wait, json).await?;
        }
        Command::Task(TaskCommand::Show { task, json }) if task.parse::<i64>().is_err() => {
            let d = client::show_device(conn, &task).await.map_err(describe)?;
            if json {
                let current = match &d.current_task {
                    Some(path) => {
                        let path = zbus::OwnedObjectPath::try_from(path.as_str())
                            .map_err(|e| e.to_string())?;
                        let t = client::task(conn, path).await.map_err(describe)?;
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
                        conn,
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
            let t = client::task(conn, path).await.map_err(describe)?;
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
            let d = client::device(conn, &address).await.map_err(describe)?;
            d.reset_task().await.map_err(|e| describe(e.into()))?;
            if json {
                let d = client::show_device(conn, &address)
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
            let m = client::manager(conn).await.map_err(describe)?;
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
        _ => unreachable!("main dispatches only the tasks commands here"),
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
pub(crate) enum TaskCommand {
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

pub(crate) async fn start_and_follow(
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
