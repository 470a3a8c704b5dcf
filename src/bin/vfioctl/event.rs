//! `events` (the history, and `--follow` from the daemon's signals), and the times tables show.

use super::*;

/// `vfioctl events` (`main` dispatches only it here).
pub(crate) async fn run(conn: &zbus::Connection, command: Command) -> Result<(), Failure> {
    let Command::Events {
        address,
        kind,
        limit,
        since,
        before,
        follow,
        json,
    } = command
    else {
        unreachable!("main dispatches only the events command here")
    };
    {
        let m = client::manager(conn).await.map_err(describe)?;
        // Subscribed before the first read, so nothing recorded in between is missed.
        let signals = if follow {
            Some(
                client::event::EventFollower::subscribe(&m)
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
                    // Gone between its last signal and this read: the same end as below.
                    .map_err(|e| match client::ClientError::from(e) {
                        client::ClientError::NotRunning => left_the_bus(),
                        other => describe(other),
                    })?
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
        Err(left_the_bus())
    }
}

/// How following ends when vfiod goes: its name left the bus, or a read found no owner.
fn left_the_bus() -> Failure {
    Failure::from("vfiod left the bus: no more events to follow".to_string())
}

/// `vfioctl events`' table. Milliseconds: a migration's quiesce window is tens of them.
pub(crate) fn events_table(events: &[client::EventEntry]) -> String {
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
pub(crate) fn event_line(e: &client::EventEntry) -> String {
    format!(
        "{:<7}  {:<24}  {:<11}  {}",
        e.id,
        format_time_ms(e.time_ms),
        e.kind,
        e.message
    )
}

pub(crate) fn event_line_header() -> String {
    format!("{:<7}  {:<24}  {:<11}  {}", "ID", "TIME", "KIND", "MESSAGE")
}

/// A time from Unix milliseconds, UTC, in RFC 3339 with milliseconds (a migration's quiesce
/// window is tens of them): `2026-12-02T05:18:40.123Z`.
pub(crate) fn format_time_ms(ms: i64) -> String {
    humantime::format_rfc3339_millis(system_time(ms)).to_string()
}

/// The same to the second: `2026-12-02T05:18:40Z`.
pub(crate) fn format_time(ms: i64) -> String {
    humantime::format_rfc3339_seconds(system_time(ms)).to_string()
}

pub(crate) fn system_time(ms: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
