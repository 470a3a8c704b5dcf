//! The doctor's bus edge: whether vfiod answers on the bus vfioctl uses, and whether polkitd
//! is there. Reads only: it asks the bus daemon about names and reads two of vfiod's
//! properties; every call is bounded, so a stuck bus is an answer too.

use super::VfiodFacts;
use crate::client::{self, ClientError};
use crate::dbus::BusTarget;
use std::time::Duration;

/// How long one question to the bus may take.
const DEADLINE: Duration = Duration::from_secs(5);
/// polkit's name on the system bus.
const POLKIT: &str = "org.freedesktop.PolicyKit1";

/// The bus as an operator names it: "system bus", "bus at /run/x/bus.sock" (the socket of an
/// address, without its guid), "bus tcp:host=..." (another address, whole).
pub fn describe(bus: &BusTarget) -> String {
    match bus {
        BusTarget::System => "system bus".into(),
        BusTarget::Session => "session bus".into(),
        BusTarget::Address(a) => {
            let path = a
                .strip_prefix("unix:")
                .and_then(|rest| rest.split(',').find_map(|kv| kv.strip_prefix("path=")));
            match path {
                Some(p) => format!("bus at {p}"),
                None => format!("bus {a}"),
            }
        }
    }
}

/// vfiod on the bus, and whether polkitd is owned or activatable there (`None`: no bus).
pub async fn read(bus: &BusTarget) -> (VfiodFacts, Option<bool>) {
    let name = describe(bus);
    let no_bus = |error: String| {
        (
            VfiodFacts::NoBus {
                bus: name.clone(),
                error,
            },
            None,
        )
    };
    let conn = match tokio::time::timeout(DEADLINE, client::connect(bus)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return no_bus(chain_once(&e)),
        Err(_) => return no_bus(format!("no answer within {}s", DEADLINE.as_secs())),
    };
    let polkit = tokio::time::timeout(DEADLINE, polkit_on(&conn))
        .await
        .ok()
        .flatten();
    let vfiod = match tokio::time::timeout(DEADLINE, vfiod_on(&conn)).await {
        Ok(Ok((version, iommu))) => VfiodFacts::Answers {
            bus: name,
            version,
            iommu,
        },
        Ok(Err(ClientError::NotRunning)) => VfiodFacts::NotRunning { bus: name },
        Ok(Err(e)) => VfiodFacts::NoBus {
            bus: name,
            error: chain_once(&e),
        },
        Err(_) => VfiodFacts::NoBus {
            bus: name,
            error: format!("vfiod did not answer within {}s", DEADLINE.as_secs()),
        },
    };
    (vfiod, polkit)
}

/// An error and its causes on one line, a cause that repeats the one before it said once (zbus
/// repeats the I/O error it wraps).
fn chain_once(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !parts.iter().any(|p| p.ends_with(&text)) {
            parts.push(text);
        }
        cur = c.source();
    }
    parts.join(": ")
}

async fn vfiod_on(conn: &zbus::Connection) -> Result<(String, String), ClientError> {
    let dbus = zbus::fdo::DBusProxy::new(conn).await?;
    let name = zbus::names::BusName::try_from(crate::dbus::BUS_NAME).map_err(ClientError::Call)?;
    if !dbus.name_has_owner(name).await? {
        return Err(ClientError::NotRunning);
    }
    let m = client::manager(conn).await?;
    let version = m.version().await?;
    let iommu = m.iommu().await.unwrap_or_default();
    Ok((version, iommu))
}

async fn polkit_on(conn: &zbus::Connection) -> Option<bool> {
    let dbus = zbus::fdo::DBusProxy::new(conn).await.ok()?;
    let name = zbus::names::BusName::try_from(POLKIT).ok()?;
    if dbus.name_has_owner(name).await.ok()? {
        return Some(true);
    }
    let activatable = dbus.list_activatable_names().await.ok()?;
    Some(activatable.iter().any(|n| n.as_str() == POLKIT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bus_is_named_by_its_socket() {
        let table = [
            (BusTarget::System, "system bus"),
            (BusTarget::Session, "session bus"),
            (
                BusTarget::Address("unix:path=/tmp/b/bus.sock,guid=43".into()),
                "bus at /tmp/b/bus.sock",
            ),
            (
                BusTarget::Address("unix:guid=43,path=/run/x".into()),
                "bus at /run/x",
            ),
            (
                BusTarget::Address("unix:abstract=/tmp/dbus-x".into()),
                "bus unix:abstract=/tmp/dbus-x",
            ),
        ];
        for (bus, want) in table {
            assert_eq!(describe(&bus), want);
        }
    }
}
