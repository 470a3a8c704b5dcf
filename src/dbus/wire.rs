//! The shapes of list replies and queries: `a{sv}` dictionaries, one definition for the service
//! and its clients (`crate::client`). A new field is a new key: old clients ignore it, and no
//! signature changes.

use super::error::{quote, Error};
use crate::mode::planner::DevicePlan;
use crate::model::pci::PciAddress;
use crate::store::{Event, TaskRecord};
use std::collections::HashMap;
use zbus::OwnedVariant;

/// One `a{sv}` dictionary.
pub type Dict = HashMap<String, OwnedVariant>;

use super::variant as v;

/// `Manager.GetEvents` entry.
pub fn event(e: &Event) -> Dict {
    Dict::from([
        ("id".into(), v(e.id)),
        ("time".into(), v(e.time_ms)),
        (
            "address".into(),
            v(e.address.map(|a| a.to_string()).unwrap_or_default()),
        ),
        ("kind".into(), v(e.kind.as_str())),
        ("message".into(), v(e.message.as_str())),
    ])
}

/// `Manager.Libvirt`: the connection to the configured URI; empty when none is configured.
pub fn libvirt_link(link: Option<&crate::engine::libvirt_link::Link>) -> Dict {
    use crate::engine::libvirt_link::LinkState;
    let Some(l) = link else {
        return Dict::new();
    };
    let mut d = Dict::from([
        ("uri".into(), v(l.uri.as_str())),
        ("state".into(), v(l.word())),
        ("since_ms".into(), v(l.since_ms)),
    ]);
    if let LinkState::Disconnected { reason } = &l.state {
        d.insert("reason".into(), v(reason.as_str()));
    }
    d
}

/// Unix milliseconds; 0 for a time before 1970 (a clock set far back).
fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `Manager.Fleet`: empty when the fleet is off; else `report_interval_s` u and
/// `last_report_ms` t (0: none since vfiod started).
pub fn fleet(settings: &crate::config::Settings, last: Option<std::time::SystemTime>) -> Dict {
    let Some(f) = &settings.fleet else {
        return Dict::new();
    };
    let interval = f.report_interval.unwrap_or(settings.poll_interval);
    Dict::from([
        ("report_interval_s".into(), v(interval.as_secs() as u32)),
        ("last_report_ms".into(), v(last.map_or(0, unix_ms))),
    ])
}

/// `Device.ResetHealth`: only what is known (D-Bus has no null).
pub fn reset_health(h: &crate::model::clean::ResetHealth) -> Dict {
    let mut d = Dict::from([
        ("failures_in_row".into(), v(h.failures_in_row)),
        ("cleans".into(), v(h.cleans)),
    ]);
    let text = [("method", &h.method), ("failure", &h.failure)];
    for (key, value) in text {
        if let Some(value) = value {
            d.insert(key.into(), v(value.as_str()));
        }
    }
    let times = [
        ("duration_ms", h.duration_ms),
        ("ok_ms", h.ok_ms),
        ("failure_ms", h.failure_ms),
    ];
    for (key, value) in times {
        if let Some(value) = value {
            d.insert(key.into(), v(value));
        }
    }
    d
}

/// `Manager.GetTasks` entry.
pub fn task(t: &TaskRecord) -> Dict {
    Dict::from([
        ("id".into(), v(t.id)),
        ("kind".into(), v(t.kind.as_str())),
        ("device".into(), v(t.address.to_string())),
        ("state".into(), v(t.state.as_str())),
        ("step".into(), v(t.step.as_str())),
        ("percent".into(), v(t.percent)),
        ("result".into(), v(t.message.as_str())),
        ("parameters".into(), v(task_parameters(t))),
        ("requested_by".into(), v(t.requested_by.as_str())),
        ("created".into(), v(t.created_ms)),
        ("started".into(), v(t.started_ms.unwrap_or(0))),
        ("finished".into(), v(t.finished_ms.unwrap_or(0))),
        ("reset_by".into(), v(t.reset_by.clone().unwrap_or_default())),
    ])
}

/// A task's parameters (recorded as JSON text) as an `a{sv}`: `Task.Parameters` and the
/// `parameters` of a `GetTasks` entry.
pub fn task_parameters(t: &TaskRecord) -> Dict {
    json_dict(&serde_json::from_str(&t.params).unwrap_or_default())
}

/// `Manager.GetPlan` reply and `GetPlans` entry.
pub fn plan(p: &DevicePlan) -> Dict {
    use crate::mode::policy::Decision;
    let decision = match &p.decision {
        Decision::Leave { .. } => "leave",
        Decision::Target { .. } => "target",
        Decision::Refuse { .. } => "refuse",
        Decision::Wait { .. } => "wait",
    };
    let program = serde_json::to_value(&p.program)
        .ok()
        .and_then(|v| {
            v.get("program")
                .and_then(|x| x.as_str())
                .map(str::to_string)
        })
        .unwrap_or_default();
    let steps: Vec<String> = p
        .plan
        .as_ref()
        .map(|pl| pl.steps.iter().map(|s| s.to_string()).collect())
        .unwrap_or_default();
    Dict::from([
        ("address".into(), v(p.address.to_string())),
        ("decision".into(), v(decision)),
        ("reason".into(), v(p.decision.reason())),
        ("program".into(), v(program)),
        ("steps".into(), v(steps)),
        (
            "plan".into(),
            v(json_dict(&serde_json::to_value(p).unwrap_or_default())),
        ),
    ])
}

/// A query dictionary whose keys were checked against those the method knows.
pub struct Query(Dict);

impl Query {
    pub fn new(dict: Dict, known: &[&str]) -> Result<Query, Error> {
        if let Some(bad) = dict.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(Error::InvalidArgument(format!(
                "unknown query key {} (known: {})",
                quote(bad),
                known.join(", ")
            )));
        }
        Ok(Query(dict))
    }

    fn get<T: TryFrom<OwnedVariant>>(&self, key: &str, kind: &str) -> Result<Option<T>, Error> {
        let Some(value) = self.0.get(key) else {
            return Ok(None);
        };
        let wrong = || {
            Error::InvalidArgument(format!(
                "query key {key} must be {kind}, not of type {}",
                value.value_signature()
            ))
        };
        let owned = value.try_clone().map_err(|_| wrong())?;
        T::try_from(owned).map(Some).map_err(|_| wrong())
    }

    pub fn str(&self, key: &str) -> Result<Option<String>, Error> {
        self.get::<String>(key, "a string (s)")
    }

    pub fn i64(&self, key: &str) -> Result<Option<i64>, Error> {
        self.get::<i64>(key, "a 64-bit integer (x)")
    }

    pub fn u64(&self, key: &str) -> Result<Option<u64>, Error> {
        self.get::<u64>(key, "an unsigned 64-bit integer (t)")
    }

    pub fn u32(&self, key: &str) -> Result<Option<u32>, Error> {
        self.get::<u32>(key, "an unsigned 32-bit integer (u)")
    }

    pub fn i32(&self, key: &str) -> Result<Option<i32>, Error> {
        self.get::<i32>(key, "a 32-bit integer (i)")
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, Error> {
        self.get::<bool>(key, "a boolean (b)")
    }

    /// A short string key (an address, a word, an id) parsed with `parse`; an error names the
    /// key, and a value too long to be any of these is refused without being echoed.
    pub fn parsed<T>(
        &self,
        key: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, Error> {
        const LONGEST: usize = 64;
        match self.str(key)? {
            None => Ok(None),
            Some(text) if text.len() > LONGEST => Err(Error::InvalidArgument(format!(
                "key {key}: {} is not a valid value",
                quote(&text)
            ))),
            Some(text) => parse(&text)
                .map(Some)
                .map_err(|e| Error::InvalidArgument(format!("key {key}: {e}"))),
        }
    }
}

/// The keys `Manager.FindDevices` and `Manager.Claim` take as requirements.
pub const REQUIREMENT_KEYS: &[&str] = &["address", "kind", "id", "role", "numa_node", "parent"];
/// The keys `Manager.Claim` takes as its owner.
pub const OWNER_KEYS: &[&str] = &["vm_name", "vm_uuid", "lease_seconds", "persistent"];

/// Claim requirements from their `a{sv}` dictionary (all keys optional).
pub fn requirements(dict: Dict) -> Result<crate::claim::Requirements, Error> {
    use crate::claim::Requirements;
    let q = Query::new(dict, REQUIREMENT_KEYS)?;
    let address = |t: &str| t.parse::<PciAddress>().map_err(|e| e.to_string());
    Ok(Requirements {
        address: q.parsed("address", address)?,
        kind: q.parsed("kind", |t| t.parse())?,
        id: q.parsed("id", Requirements::parse_id)?,
        role: q.parsed("role", |t| t.parse())?,
        numa_node: q.i32("numa_node")?,
        parent: q.parsed("parent", address)?,
    })
}

/// A claim's owner from its `a{sv}` dictionary; `default_lease` when it gives no lease_seconds.
pub fn owner(dict: Dict, default_lease: u32) -> Result<crate::claim::Owner, Error> {
    let q = Query::new(dict, OWNER_KEYS)?;
    crate::claim::Owner::new(
        q.str("vm_name")?.as_deref(),
        q.str("vm_uuid")?.as_deref(),
        q.u32("lease_seconds")?.unwrap_or(default_lease),
        q.bool("persistent")?.unwrap_or(false),
    )
    .map_err(|e| Error::InvalidArgument(format!("owner: {e}")))
}

/// `Manager.GetPools` entry.
/// `Manager.GetPools` entry; `last` is its last call since vfiod started: `last_call_ms` t
/// (0: none yet) and `last_call_error` s ("" when the pool answered, a refusal included).
pub fn pool(
    p: &crate::config::PoolSettings,
    last: Option<&crate::metrics::registry::PoolCall>,
) -> Dict {
    Dict::from([
        ("last_call_ms".into(), v(last.map_or(0, |c| unix_ms(c.at)))),
        (
            "last_call_error".into(),
            v(last.and_then(|c| c.error.as_deref()).unwrap_or("")),
        ),
        ("name".into(), v(p.name.as_str())),
        ("url".into(), v(p.url.as_str())),
        ("quiesce_at".into(), v(p.quiesce_at.as_str())),
        (
            "connect_timeout_ms".into(),
            v(p.connect_timeout.as_millis() as u32),
        ),
        (
            "request_timeout_ms".into(),
            v(p.request_timeout.as_millis() as u32),
        ),
    ])
}

/// `Manager.GetPoolDevices` entry.
pub fn pool_device(d: &crate::pool::client::PoolDevice) -> Dict {
    Dict::from([
        ("id".into(), v(d.id.as_str())),
        ("kind".into(), v(d.kind.as_str())),
        ("model".into(), v(d.model.as_str())),
        ("session".into(), v(d.session.clone().unwrap_or_default())),
    ])
}

/// `Manager.GetPooledClaims` entry.
pub fn pooled(c: &crate::model::pool::PooledClaim) -> Dict {
    Dict::from([
        ("id".into(), v(c.id)),
        ("pool".into(), v(c.pool.as_str())),
        ("session".into(), v(c.session.as_str())),
        ("device".into(), v(c.device.as_str())),
        ("epoch".into(), v(c.epoch)),
        ("state".into(), v(c.state.as_str())),
        ("reason".into(), v(c.reason.as_str())),
        ("vm_name".into(), v(c.vm_name.clone().unwrap_or_default())),
        ("vm_uuid".into(), v(c.vm_uuid.clone().unwrap_or_default())),
        (
            "peer_host".into(),
            v(c.peer_host.clone().unwrap_or_default()),
        ),
        ("requested_by".into(), v(c.requested_by.as_str())),
        ("created".into(), v(c.created_ms)),
        ("updated".into(), v(c.updated_ms)),
    ])
}

/// Reads back what [`event`], [`task`] and [`plan`] write (the client side).
pub struct Entry<'a>(pub &'a Dict);

impl Entry<'_> {
    fn get<T: TryFrom<OwnedVariant>>(&self, key: &str) -> Option<T> {
        self.0
            .get(key)
            .and_then(|v| v.try_clone().ok())
            .and_then(|v| T::try_from(v).ok())
    }

    pub fn str(&self, key: &str) -> String {
        self.get::<String>(key).unwrap_or_default()
    }

    /// A value that was JSON in the daemon ([`from_json`]), as JSON again; null when absent.
    pub fn json(&self, key: &str) -> serde_json::Value {
        self.0
            .get(key)
            .map(|x| to_json(x))
            .unwrap_or(serde_json::Value::Null)
    }

    pub fn i64(&self, key: &str) -> i64 {
        self.get::<i64>(key).unwrap_or_default()
    }

    pub fn u64(&self, key: &str) -> u64 {
        self.get::<u64>(key).unwrap_or_default()
    }

    pub fn u32(&self, key: &str) -> u32 {
        self.get::<u32>(key).unwrap_or_default()
    }

    pub fn u8(&self, key: &str) -> u8 {
        self.get::<u8>(key).unwrap_or_default()
    }

    pub fn strings(&self, key: &str) -> Vec<String> {
        self.get::<Vec<String>>(key).unwrap_or_default()
    }

    pub fn address(&self, key: &str) -> Option<PciAddress> {
        self.str(key).parse().ok()
    }
}

/// A JSON value as D-Bus values, so that no reply carries JSON inside a string: an object is an
/// `a{sv}` (a member that is null is left out: D-Bus has no null), an array `av`, a string `s`, a
/// whole number `x` (`t` above `i64::MAX`), another number `d`, a boolean `b`, and a null that is
/// not a member `s` "" . [`to_json`] reads it back.
pub fn from_json(j: &serde_json::Value) -> OwnedVariant {
    use serde_json::Value as J;
    match j {
        J::Null => v(""),
        J::Bool(b) => v(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => v(i),
            (None, Some(u)) => v(u),
            _ => v(n.as_f64().unwrap_or(0.0)),
        },
        J::String(s) => v(s.as_str()),
        J::Array(a) => v(a.iter().map(from_json).collect::<Vec<OwnedVariant>>()),
        J::Object(_) => v(json_dict(j)),
    }
}

/// A JSON object as an `a{sv}` ([`from_json`]); anything else as an empty one.
pub fn json_dict(j: &serde_json::Value) -> Dict {
    j.as_object()
        .map(|m| {
            m.iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k.clone(), from_json(x)))
                .collect()
        })
        .unwrap_or_default()
}

/// A D-Bus value as JSON: what [`from_json`] made, back (the nulls it left out stay out), and
/// any other value by its kind (an object path as a string, a structure as an array).
pub fn to_json(x: &zbus::Variant<'_>) -> serde_json::Value {
    use serde_json::Value as J;
    use zbus::Variant as V;
    match x {
        V::U8(n) => J::from(*n),
        V::Bool(b) => J::from(*b),
        V::I16(n) => J::from(*n),
        V::U16(n) => J::from(*n),
        V::I32(n) => J::from(*n),
        V::U32(n) => J::from(*n),
        V::I64(n) => J::from(*n),
        V::U64(n) => J::from(*n),
        V::F64(n) => J::from(*n),
        V::Str(s) => J::from(s.as_str()),
        V::Signature(s) => J::from(s.to_string()),
        V::ObjectPath(p) => J::from(p.as_str()),
        V::Variant(inner) => to_json(inner),
        V::Array(a) => J::Array(a.inner().iter().map(to_json).collect()),
        V::Dict(d) => J::Object(
            d.iter()
                .map(|(k, x)| {
                    let key = match k {
                        V::Str(s) => s.as_str().to_string(),
                        other => to_json(other).to_string(),
                    };
                    (key, to_json(x))
                })
                .collect(),
        ),
        V::Structure(s) => J::Array(s.fields().iter().map(to_json).collect()),
        #[cfg(unix)]
        V::Fd(_) => J::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::{from_json, json_dict, to_json};
    use serde_json::json;

    #[test]
    fn json_goes_over_dbus_without_strings_and_comes_back() {
        // (JSON, its D-Bus signature, what comes back)
        let table = [
            (json!(true), "b", json!(true)),
            (json!(-3), "x", json!(-3)),
            (json!(u64::MAX), "t", json!(u64::MAX)),
            (json!(1.5), "d", json!(1.5)),
            (json!("vf"), "s", json!("vf")),
            (json!([1, "a"]), "av", json!([1, "a"])),
            (
                json!({"mode": "vf", "num_vfs": 4}),
                "a{sv}",
                json!({"mode": "vf", "num_vfs": 4}),
            ),
            // D-Bus has no null: a null member is left out, a null alone is "".
            (
                json!({"driver": null, "mode": "pf"}),
                "a{sv}",
                json!({"mode": "pf"}),
            ),
            (json!(null), "s", json!("")),
            (
                json!({"plan": {"steps": [{"write": "sriov_numvfs"}]}}),
                "a{sv}",
                json!({"plan": {"steps": [{"write": "sriov_numvfs"}]}}),
            ),
        ];
        for (j, signature, back) in table {
            let v = from_json(&j);
            assert_eq!(v.value_signature().to_string(), signature, "{j}");
            assert_eq!(to_json(&v), back, "{j}");
        }
        assert!(
            json_dict(&json!([1])).is_empty(),
            "not an object: an empty a{{sv}}"
        );
    }
}
