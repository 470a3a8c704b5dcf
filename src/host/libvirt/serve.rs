//! The libvirt helper's side (`vfiod-libvirt`, started by the daemon's [`super::Libvirt`]): it
//! runs the worker ([`super::worker::LocalWorker`]) in this process, answers the daemon's
//! requests from standard input on standard output ([`super::wire`]), and forwards libvirt's
//! events there too. It ends when its standard input does (the daemon stopped it, or is gone).
//!
//! Each request waits for its answer on a thread of its own, so that a migration (minutes) or a
//! call libvirt is slow to answer does not hold the ones behind it longer than the worker does.

use super::wire::{Call, Line, Request, Value};
use super::worker::{self, LocalWorker};
use super::LibvirtError;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Serves the daemon until standard input ends. `uri`: what to connect to (none: nothing).
pub fn serve(root: PathBuf, uri: Option<String>) -> Result<(), LibvirtError> {
    let (events, mut event_rx) = tokio::sync::mpsc::unbounded_channel();
    let worker = LocalWorker::start(uri, root, Some(events))?;
    let out = Arc::new(Mutex::new(std::io::stdout()));
    {
        let out = Arc::clone(&out);
        std::thread::Builder::new()
            .name("libvirt-events".into())
            .spawn(move || {
                while let Some(event) = event_rx.blocking_recv() {
                    if !say(&out, &Line::Event(event)) {
                        break;
                    }
                }
            })
            .map_err(|e| LibvirtError::Spawn(e.to_string()))?;
    }
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let request: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("the daemon sent something unreadable: {e}");
                continue;
            }
        };
        if let Call::SetUri(uri) = request.call {
            worker.set_uri(uri);
            continue;
        }
        let (worker, out) = (worker.clone(), Arc::clone(&out));
        let spawned = std::thread::Builder::new()
            .name("libvirt-call".into())
            .spawn(move || {
                let id = request.id;
                let result = answer(&worker, request);
                say(&out, &Line::Answer { id, result });
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot answer a request: {e}");
        }
    }
    worker.stop();
    Ok(())
}

/// Writes one line; false when the daemon no longer reads.
fn say(out: &Mutex<std::io::Stdout>, line: &Line) -> bool {
    let Ok(mut text) = serde_json::to_vec(line) else {
        return true;
    };
    text.push(b'\n');
    let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
    out.write_all(&text).and_then(|()| out.flush()).is_ok()
}

fn answer(worker: &LocalWorker, request: Request) -> Result<Value, LibvirtError> {
    let worker = match request.wait_ms {
        Some(ms) => worker.with_timeout(Duration::from_millis(ms)),
        None => worker.clone(),
    };
    Ok(match request.call {
        Call::RunningDomains => Value::Running(worker.running_domains()?),
        Call::DomainXml { domain, which } => Value::Xml(worker.domain_xml(&domain, which)?),
        Call::Lookup { domain } => Value::Info(worker.lookup(&domain)?),
        Call::AllDomains => Value::All(worker.all_domains()?),
        Call::SetMetadata {
            domain,
            xml,
            affect,
        } => {
            worker.set_metadata(&domain, xml.as_deref(), affect)?;
            Value::Unit
        }
        Call::AttachDevice {
            domain,
            xml,
            affect,
        } => {
            worker.attach_device(&domain, &xml, affect)?;
            Value::Unit
        }
        Call::DetachDevice {
            domain,
            xml,
            affect,
        } => {
            worker.detach_device(&domain, &xml, affect)?;
            Value::Unit
        }
        Call::Migrate {
            source,
            domain,
            migration,
        } => {
            worker::migrate(&source, &domain, &migration)?;
            Value::Unit
        }
        Call::SetUri(_) => Value::Unit,
    })
}
