//! The fleet database's queries: the host's report transaction (with the conductor's
//! comparison), reservations as a host sees them, and the operator's queries and reservation.
//! Everything here is one statement or one transaction on a `tokio_postgres` client; the
//! decisions are the pure functions of `super::conductor`.

use super::conductor::{self, Judged, StoredRow};
use super::record::{Record, Report};
use super::schema;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_postgres::{Client, GenericClient};

/// Where fleet reservations are announced; the payload is the host's name.
pub const RESERVE_CHANNEL: &str = "fleet_reserve";

/// A host's own settings, written with each report.
#[derive(Clone, Debug)]
pub struct HostMeta {
    pub host: String,
    pub interval_ms: i32,
    pub down_after: i32,
    pub version: String,
}

/// What one report did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportOutcome {
    /// Only the heartbeat was written (the report equals the last one).
    pub heartbeat_only: bool,
    pub inserted: usize,
    pub updated: usize,
    pub deleted: usize,
    pub events: usize,
}

fn record_digest(r: &Record) -> String {
    let bytes = serde_json::to_vec(r).unwrap_or_default();
    Sha256::digest(&bytes)
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Applies the versions the database lacks, each in its own transaction under an advisory
/// lock (two migrators never apply a step twice). Returns the versions applied.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, tokio_postgres::Error> {
    client.batch_execute(schema::BOOTSTRAP).await?;
    let mut applied = Vec::new();
    for step in schema::STEPS {
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock(7011813)", &[])
            .await?;
        let done: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM fleet.schema_versions WHERE version = $1)",
                &[&step.version],
            )
            .await?
            .get(0);
        if done {
            continue;
        }
        tx.batch_execute(step.sql).await?;
        tx.execute(
            "INSERT INTO fleet.schema_versions (version, description) VALUES ($1, $2)",
            &[&step.version, &step.description],
        )
        .await?;
        tx.commit().await?;
        applied.push(step.version);
    }
    Ok(applied)
}

/// The highest schema version applied (0: none).
pub async fn schema_version(client: &impl GenericClient) -> Result<i32, tokio_postgres::Error> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('fleet.schema_versions') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !exists {
        return Ok(0);
    }
    Ok(client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM fleet.schema_versions",
            &[],
        )
        .await?
        .get(0))
}

/// Maps a login role to a host (administrator; the role must exist).
pub async fn add_host(
    client: &Client,
    host: &str,
    role: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO fleet.host_roles (host, role) VALUES ($1, $2) \
             ON CONFLICT (host) DO UPDATE SET role = EXCLUDED.role",
            &[&host, &role],
        )
        .await?;
    // A role name cannot be a bind parameter: quoted as an identifier by the server itself.
    let quoted: String = client
        .query_one("SELECT quote_ident($1)", &[&role])
        .await?
        .get(0);
    client
        .batch_execute(&format!("GRANT vfiod_fleet_host TO {quoted}"))
        .await
}

const UPSERT: &str = "INSERT INTO fleet.devices (host, address, vendor_id, device_id, class, \
     kind, role, parent_pf, iommu_group, numa_node, vendor_name, device_name, state, \
     state_reason, managed, pool, pool_reason, digest, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, now()) \
     ON CONFLICT (host, address) DO UPDATE SET vendor_id = EXCLUDED.vendor_id, \
     device_id = EXCLUDED.device_id, class = EXCLUDED.class, kind = EXCLUDED.kind, \
     role = EXCLUDED.role, parent_pf = EXCLUDED.parent_pf, iommu_group = EXCLUDED.iommu_group, \
     numa_node = EXCLUDED.numa_node, vendor_name = EXCLUDED.vendor_name, \
     device_name = EXCLUDED.device_name, state = EXCLUDED.state, \
     state_reason = EXCLUDED.state_reason, managed = EXCLUDED.managed, pool = EXCLUDED.pool, \
     pool_reason = EXCLUDED.pool_reason, digest = EXCLUDED.digest, updated_at = now()";

/// One report, in one transaction: the heartbeat, then (when the report differs from the last)
/// the conductor's comparison of the records with the host's rows, its writes and events, the
/// reservations whose local claim is gone, and the sweep of silent hosts.
pub async fn report(
    client: &mut Client,
    meta: &HostMeta,
    report: &Report,
) -> Result<ReportOutcome, tokio_postgres::Error> {
    let digest = report.digest();
    let host = meta.host.as_str();
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "SELECT status, report_digest FROM fleet.hosts WHERE host = $1 FOR UPDATE",
            &[&host],
        )
        .await?;
    let mut events: Vec<(Option<String>, &str, String)> = Vec::new();
    let same = match &row {
        None => {
            tx.execute(
                "INSERT INTO fleet.hosts (host, interval_ms, down_after, version) \
                 VALUES ($1, $2, $3, $4)",
                &[&host, &meta.interval_ms, &meta.down_after, &meta.version],
            )
            .await?;
            events.push((None, "host-up", format!("host {host} joined the fleet")));
            false
        }
        Some(r) => {
            let status: String = r.get(0);
            let stored: String = r.get(1);
            tx.execute(
                "UPDATE fleet.hosts SET last_heartbeat = now(), status = 'up', \
                 interval_ms = $2, down_after = $3, version = $4 WHERE host = $1",
                &[&host, &meta.interval_ms, &meta.down_after, &meta.version],
            )
            .await?;
            if status == "down" {
                events.push((None, "host-up", format!("host {host} reports again")));
            }
            stored == digest
        }
    };
    let mut out = ReportOutcome {
        heartbeat_only: same,
        ..ReportOutcome::default()
    };
    if !same {
        let stored: Vec<StoredRow> = tx
            .query(
                "SELECT address, digest, pool, reservation_id FROM fleet.devices \
                 WHERE host = $1 FOR UPDATE",
                &[&host],
            )
            .await?
            .iter()
            .map(|r| StoredRow {
                address: r.get(0),
                digest: r.get(1),
                pool: r.get(2),
                reservation_id: r.get(3),
            })
            .collect();
        let judged: Vec<Judged<'_>> = report
            .records
            .iter()
            .map(|r| Judged {
                record: r,
                digest: record_digest(r),
                verdict: conductor::verdict(r),
            })
            .collect();
        let changes = conductor::compare(&stored, &judged);
        let upsert = tx.prepare(UPSERT).await?;
        // Pipelined: the statements go out together, one round trip for the lot.
        let writes = changes
            .insert
            .iter()
            .chain(&changes.update)
            .map(|&i| upsert_one(&tx, &upsert, host, &judged[i]));
        futures_util::future::try_join_all(writes).await?;
        if !changes.delete.is_empty() {
            let gone: Vec<&str> = changes.delete.iter().map(|(a, _)| a.as_str()).collect();
            tx.execute(
                "DELETE FROM fleet.devices WHERE host = $1 AND address = ANY($2)",
                &[&host, &gone],
            )
            .await?;
            tx.execute(
                "UPDATE fleet.reservations SET state = 'refused', updated_at = now(), \
                 reason = 'its host no longer reports the device' \
                 WHERE host = $1 AND address = ANY($2) AND state = 'pending'",
                &[&host, &gone],
            )
            .await?;
        }
        for e in &changes.events {
            events.push((Some(e.address.clone()), e.kind, e.message.clone()));
        }
        // A fleet reservation lives as long as its local claim.
        let live: Vec<i64> = report.claims.iter().map(|c| c.0).collect();
        let released = tx
            .execute(
                "UPDATE fleet.reservations SET state = 'released', updated_at = now(), \
                 reason = 'the local claim was released' \
                 WHERE host = $1 AND state = 'claimed' AND NOT (local_claim_id = ANY($2))",
                &[&host, &live],
            )
            .await?;
        if released > 0 {
            events.push((
                None,
                "reservations-released",
                format!("{released} reservation(s) ended with their local claims"),
            ));
        }
        tx.execute(
            "UPDATE fleet.devices d SET reservation_id = NULL WHERE d.host = $1 \
             AND d.reservation_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM fleet.reservations r \
             WHERE r.id = d.reservation_id AND r.state IN ('pending', 'claimed'))",
            &[&host],
        )
        .await?;
        tx.execute(
            "UPDATE fleet.hosts SET report_digest = $2, last_change = now() WHERE host = $1",
            &[&host, &digest],
        )
        .await?;
        out.inserted = changes.insert.len();
        out.updated = changes.update.len();
        out.deleted = changes.delete.len();
    }
    if !events.is_empty() {
        let addresses: Vec<Option<String>> = events.iter().map(|e| e.0.clone()).collect();
        let kinds: Vec<&str> = events.iter().map(|e| e.1).collect();
        let messages: Vec<&str> = events.iter().map(|e| e.2.as_str()).collect();
        tx.execute(
            "INSERT INTO fleet.events (host, address, kind, message) \
             SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[])",
            &[&host, &addresses, &kinds, &messages],
        )
        .await?;
        out.events = events.len();
    }
    tx.query_one("SELECT fleet.sweep()", &[]).await?;
    tx.commit().await?;
    Ok(out)
}

async fn upsert_one(
    tx: &tokio_postgres::Transaction<'_>,
    stmt: &tokio_postgres::Statement,
    host: &str,
    j: &Judged<'_>,
) -> Result<u64, tokio_postgres::Error> {
    let r = j.record;
    let i = |v: Option<u16>| v.map(i32::from);
    tx.execute(
        stmt,
        &[
            &host,
            &r.address.to_string(),
            &i(r.vendor_id),
            &i(r.device_id),
            &r.class.map(|c| c as i32),
            &r.kind,
            &r.role,
            &r.parent_pf.map(|p| p.to_string()),
            &r.iommu_group.map(|g| g as i32),
            &r.numa_node,
            &r.vendor_name,
            &r.device_name,
            &r.state,
            &r.state_reason,
            &r.managed,
            &j.verdict.as_str(),
            &j.verdict.reason(),
            &j.digest,
        ],
    )
    .await
}

/// A reservation, as both sides see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reservation {
    pub id: i64,
    pub host: String,
    pub address: String,
    pub vm_name: String,
    pub requested_by: String,
    pub state: String,
    pub reason: String,
    pub local_claim_id: Option<i64>,
}

const RESERVATION: &str = "SELECT id, host, address, vm_name, requested_by, state, reason, \
     local_claim_id FROM fleet.reservations";

fn reservation(r: &tokio_postgres::Row) -> Reservation {
    Reservation {
        id: r.get(0),
        host: r.get(1),
        address: r.get(2),
        vm_name: r.get(3),
        requested_by: r.get(4),
        state: r.get(5),
        reason: r.get(6),
        local_claim_id: r.get(7),
    }
}

/// The host's reservations waiting for it, oldest first.
pub async fn pending_reservations(
    client: &Client,
    host: &str,
) -> Result<Vec<Reservation>, tokio_postgres::Error> {
    Ok(client
        .query(
            &format!("{RESERVATION} WHERE host = $1 AND state = 'pending' ORDER BY id"),
            &[&host],
        )
        .await?
        .iter()
        .map(reservation)
        .collect())
}

/// The host took reservation `id` as local claim `claim_id`. `false`: it was no longer pending
/// (refused meanwhile: the caller gives the local claim back).
pub async fn reservation_claimed(
    client: &mut Client,
    host: &str,
    id: i64,
    claim_id: i64,
) -> Result<bool, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let n = tx
        .execute(
            "UPDATE fleet.reservations SET state = 'claimed', local_claim_id = $3, \
             updated_at = now() WHERE id = $1 AND host = $2 AND state = 'pending'",
            &[&id, &host, &claim_id],
        )
        .await?;
    if n == 1 {
        tx.execute(
            "INSERT INTO fleet.events (host, address, kind, message) \
             SELECT host, address, 'reservation-claimed', \
             format('reservation %s for %s is local claim %s', id, vm_name, $2::bigint) \
             FROM fleet.reservations WHERE id = $1",
            &[&id, &claim_id],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(n == 1)
}

/// The host refuses reservation `id`: it is released with `reason` and its function is free
/// in the fleet again.
pub async fn reservation_refused(
    client: &mut Client,
    host: &str,
    id: i64,
    reason: &str,
) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let n = tx
        .execute(
            "UPDATE fleet.reservations SET state = 'refused', reason = $3, updated_at = now() \
             WHERE id = $1 AND host = $2 AND state = 'pending'",
            &[&id, &host, &reason],
        )
        .await?;
    tx.execute(
        "UPDATE fleet.devices SET reservation_id = NULL WHERE host = $1 AND reservation_id = $2",
        &[&host, &id],
    )
    .await?;
    if n == 1 {
        tx.execute(
            "INSERT INTO fleet.events (host, address, kind, message) \
             SELECT host, address, 'reservation-refused', \
             format('reservation %s for %s refused: %s', id, vm_name, $2::text) \
             FROM fleet.reservations WHERE id = $1",
            &[&id, &reason],
        )
        .await?;
    }
    tx.commit().await
}

// ----- the operator's side -------------------------------------------------------------

/// What `vfioctl fleet list|find|claim` filter on (like FindDevices), all optional.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub host: Option<String>,
    pub kind: Option<String>,
    pub vendor_id: Option<u16>,
    pub device_id: Option<u16>,
    pub role: Option<String>,
    pub numa_node: Option<i32>,
    pub address: Option<String>,
    pub parent: Option<String>,
}

/// The filter's SQL condition on `d`, its parameters from `$first` on.
const FILTER_SQL: &str = "($1::text IS NULL OR d.host = $1) \
     AND ($2::text IS NULL OR d.kind = $2) \
     AND ($3::integer IS NULL OR d.vendor_id = $3) \
     AND ($4::integer IS NULL OR d.device_id = $4) \
     AND ($5::text IS NULL OR d.role = $5) \
     AND ($6::integer IS NULL OR d.numa_node = $6) \
     AND ($7::text IS NULL OR d.address = $7) \
     AND ($8::text IS NULL OR d.parent_pf = $8)";

/// Whether a host is alive: heard from within down_after of its intervals.
const ALIVE_SQL: &str = "h.status = 'up' AND h.last_heartbeat >= \
     now() - make_interval(secs => h.interval_ms::float8 * h.down_after / 1000)";

impl Filter {
    fn params(&self) -> [Box<dyn tokio_postgres::types::ToSql + Sync + Send>; 8] {
        [
            Box::new(self.host.clone()),
            Box::new(self.kind.clone()),
            Box::new(self.vendor_id.map(i32::from)),
            Box::new(self.device_id.map(i32::from)),
            Box::new(self.role.clone()),
            Box::new(self.numa_node),
            Box::new(self.address.clone()),
            Box::new(self.parent.clone()),
        ]
    }
}

fn refs(
    p: &[Box<dyn tokio_postgres::types::ToSql + Sync + Send>],
) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
    p.iter()
        .map(|b| b.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect()
}

/// One host as `vfioctl fleet hosts` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct HostRow {
    pub host: String,
    /// `up` or `down`.
    pub status: String,
    /// Seconds since its last heartbeat.
    pub silent_seconds: f64,
    pub interval_ms: i32,
    pub down_after: i32,
    pub devices: i64,
    pub offered: i64,
    pub version: String,
}

/// Every host, after a sweep.
pub async fn hosts(client: &Client) -> Result<Vec<HostRow>, tokio_postgres::Error> {
    client.query_one("SELECT fleet.sweep()", &[]).await?;
    let sql = format!(
        "SELECT h.host, CASE WHEN {ALIVE_SQL} THEN 'up' ELSE 'down' END, \
         extract(epoch FROM now() - h.last_heartbeat)::float8, h.interval_ms, h.down_after, \
         (SELECT count(*) FROM fleet.devices d WHERE d.host = h.host), \
         (SELECT count(*) FROM fleet.devices d WHERE d.host = h.host AND d.pool = 'offered' \
            AND d.reservation_id IS NULL), h.version \
         FROM fleet.hosts h ORDER BY h.host"
    );
    Ok(client
        .query(&sql, &[])
        .await?
        .iter()
        .map(|r| HostRow {
            host: r.get(0),
            status: r.get(1),
            silent_seconds: r.get(2),
            interval_ms: r.get(3),
            down_after: r.get(4),
            devices: r.get(5),
            offered: r.get(6),
            version: r.get(7),
        })
        .collect())
}

/// One device as `vfioctl fleet list|find` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceRow {
    pub host: String,
    pub address: String,
    pub kind: String,
    pub role: String,
    pub vendor_id: Option<i32>,
    pub device_id: Option<i32>,
    pub numa_node: Option<i32>,
    pub iommu_group: Option<i32>,
    pub parent_pf: Option<String>,
    pub state: String,
    /// `offered`, `held` or `withdrawn` as its host last reported; `reserved` when a fleet
    /// reservation holds it; `host-down` when its host is down.
    pub pool: String,
    pub reason: String,
}

async fn device_rows(
    client: &Client,
    filter: &Filter,
    offered_only: bool,
) -> Result<Vec<DeviceRow>, tokio_postgres::Error> {
    client.query_one("SELECT fleet.sweep()", &[]).await?;
    let only = if offered_only {
        format!(" AND d.pool = 'offered' AND d.reservation_id IS NULL AND {ALIVE_SQL}")
    } else {
        String::new()
    };
    let sql = format!(
        "SELECT d.host, d.address, d.kind, d.role, d.vendor_id, d.device_id, d.numa_node, \
         d.iommu_group, d.parent_pf, d.state, \
         CASE WHEN NOT ({ALIVE_SQL}) THEN 'host-down' \
              WHEN d.reservation_id IS NOT NULL THEN 'reserved' ELSE d.pool END, \
         CASE WHEN NOT ({ALIVE_SQL}) THEN 'its host is down' \
              WHEN d.reservation_id IS NOT NULL THEN 'fleet reservation ' || d.reservation_id \
              ELSE d.pool_reason END \
         FROM fleet.devices d JOIN fleet.hosts h ON h.host = d.host \
         WHERE {FILTER_SQL}{only} ORDER BY d.host, d.address"
    );
    let p = filter.params();
    Ok(client
        .query(&sql, &refs(&p))
        .await?
        .iter()
        .map(|r| DeviceRow {
            host: r.get(0),
            address: r.get(1),
            kind: r.get(2),
            role: r.get(3),
            vendor_id: r.get(4),
            device_id: r.get(5),
            numa_node: r.get(6),
            iommu_group: r.get(7),
            parent_pf: r.get(8),
            state: r.get(9),
            pool: r.get(10),
            reason: r.get(11),
        })
        .collect())
}

/// Every device the fleet knows that matches.
pub async fn list(
    client: &Client,
    filter: &Filter,
) -> Result<Vec<DeviceRow>, tokio_postgres::Error> {
    device_rows(client, filter, false).await
}

/// The devices a fleet claim could get now.
pub async fn find(
    client: &Client,
    filter: &Filter,
) -> Result<Vec<DeviceRow>, tokio_postgres::Error> {
    device_rows(client, filter, true).await
}

/// Reserves one offered function that matches, on a live host, for `vm`: the row is locked
/// with `FOR UPDATE SKIP LOCKED`, so concurrent reservations take different rows (or none)
/// without waiting on each other; the reservation and the function's mark are committed
/// together and the host is notified. `None`: nothing free matches.
pub async fn reserve(
    client: &mut Client,
    filter: &Filter,
    vm: &str,
    requested_by: &str,
) -> Result<Option<Reservation>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    // Spread without a sort of every candidate: start at a host chosen by the VM's name (so
    // concurrent requests start on different hosts), walk the offered rows in index order
    // (host, address) from there, and wrap around once. The sweep first, in the same round trip.
    let start: Option<String> = tx
        .query_one(
            "SELECT fleet.sweep(), (SELECT host FROM fleet.hosts \
             ORDER BY hashtext(host || '/' || $1) LIMIT 1)",
            &[&vm],
        )
        .await?
        .get(1);
    let Some(start) = start else {
        return Ok(None);
    };
    let pick = |range: &str| {
        format!(
            "SELECT d.host, d.address FROM fleet.devices d JOIN fleet.hosts h ON h.host = d.host \
             WHERE d.pool = 'offered' AND d.reservation_id IS NULL AND d.host {range} $9 \
             AND {ALIVE_SQL} AND {FILTER_SQL} \
             ORDER BY d.host, d.address LIMIT 1 FOR UPDATE OF d SKIP LOCKED"
        )
    };
    let p = filter.params();
    let mut params = refs(&p);
    params.push(&start);
    let row = match tx.query_opt(&pick(">="), &params).await? {
        Some(row) => row,
        None => match tx.query_opt(&pick("<"), &params).await? {
            Some(row) => row,
            None => return Ok(None),
        },
    };
    let (host, address): (String, String) = (row.get(0), row.get(1));
    // The reservation, the function's mark, the event and the notification: one statement.
    let r = tx
        .query_one(
            "WITH r AS (INSERT INTO fleet.reservations (host, address, vm_name, requested_by) \
               VALUES ($1, $2, $3, $4) RETURNING *), \
             d AS (UPDATE fleet.devices SET reservation_id = (SELECT id FROM r) \
               WHERE host = $1 AND address = $2), \
             e AS (INSERT INTO fleet.events (host, address, kind, message) \
               SELECT $1, $2, 'reserved', format('reservation %s for %s by %s', id, $3, $4) \
               FROM r) \
             SELECT id, host, address, vm_name, requested_by, state, reason, local_claim_id, \
               pg_notify($5, $1) FROM r",
            &[&host, &address, &vm, &requested_by, &RESERVE_CHANNEL],
        )
        .await?;
    let res = reservation(&r);
    tx.commit().await?;
    Ok(Some(res))
}

/// Reservation `id` as it is now.
pub async fn reservation_by_id(
    client: &Client,
    id: i64,
) -> Result<Option<Reservation>, tokio_postgres::Error> {
    Ok(client
        .query_opt(&format!("{RESERVATION} WHERE id = $1"), &[&id])
        .await?
        .as_ref()
        .map(reservation))
}

/// The requester gives up on a pending reservation (its wait ran out): it is refused, so that a
/// host that takes it late gives its local claim back.
pub async fn withdraw(
    client: &mut Client,
    id: i64,
    reason: &str,
) -> Result<bool, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let n = tx
        .execute(
            "UPDATE fleet.reservations SET state = 'refused', reason = $2, updated_at = now() \
             WHERE id = $1 AND state = 'pending'",
            &[&id, &reason],
        )
        .await?;
    tx.execute(
        "UPDATE fleet.devices SET reservation_id = NULL WHERE reservation_id = $1",
        &[&id],
    )
    .await?;
    tx.commit().await?;
    Ok(n == 1)
}

/// One fleet event as `vfioctl fleet events` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct EventRow {
    pub id: i64,
    /// UTC, ISO 8601 with milliseconds.
    pub at: String,
    pub host: String,
    pub address: Option<String>,
    pub kind: String,
    pub message: String,
}

/// The newest `limit` events (of one host), oldest first.
pub async fn events(
    client: &Client,
    host: Option<&str>,
    limit: i64,
) -> Result<Vec<EventRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT * FROM (SELECT id, \
             to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), host, address, kind, \
             message FROM fleet.events WHERE ($1::text IS NULL OR host = $1) \
             ORDER BY id DESC LIMIT $2) newest ORDER BY id",
            &[&host, &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| EventRow {
            id: r.get(0),
            at: r.get(1),
            host: r.get(2),
            address: r.get(3),
            kind: r.get(4),
            message: r.get(5),
        })
        .collect())
}
