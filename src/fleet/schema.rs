//! The fleet database's schema, versioned like the local store's: an ordered list of steps,
//! each applied once in its own transaction and recorded in `fleet.schema_versions`. Steps are
//! only ever appended. `vfioctl fleet migrate`, run with the schema owner's credentials, applies
//! them; a host's vfiod only checks that the schema is recent enough (its role may not change
//! the schema).
//!
//! Row-level security (step 1): a host's login role is a member of `vfiod_fleet_host` and is
//! mapped to its host name in `fleet.host_roles`; every policy for that group compares a row's
//! `host` with `fleet.my_host()`, so a host's credentials read and write only its own rows.
//! `vfiod_fleet_operator` (vfioctl fleet) reads everything and may only reserve. Marking other
//! hosts down is done by `fleet.sweep()`, a `SECURITY DEFINER` function that does exactly that
//! and nothing else.

/// One schema step.
pub struct Step {
    pub version: i32,
    pub description: &'static str,
    pub sql: &'static str,
}

/// The schema version this build needs.
pub const VERSION: i32 = 2;

pub const STEPS: &[Step] = &[
    Step {
        version: 1,
        description: "hosts, devices, reservations, events; row-level security per host",
        sql: r#"
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'vfiod_fleet_host') THEN
    CREATE ROLE vfiod_fleet_host NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'vfiod_fleet_operator') THEN
    CREATE ROLE vfiod_fleet_operator NOLOGIN;
  END IF;
END $$;
GRANT USAGE ON SCHEMA fleet TO vfiod_fleet_host, vfiod_fleet_operator;
GRANT SELECT ON fleet.schema_versions TO vfiod_fleet_host, vfiod_fleet_operator;

-- Which login role speaks for which host: written by the administrator (vfioctl fleet add-host).
CREATE TABLE fleet.host_roles (
  host text PRIMARY KEY,
  role name NOT NULL UNIQUE
);
GRANT SELECT ON fleet.host_roles TO vfiod_fleet_host, vfiod_fleet_operator;

CREATE FUNCTION fleet.my_host() RETURNS text LANGUAGE sql STABLE
  AS $f$ SELECT host FROM fleet.host_roles WHERE role = current_user $f$;

CREATE TABLE fleet.hosts (
  host text PRIMARY KEY,
  status text NOT NULL DEFAULT 'up' CHECK (status IN ('up', 'down')),
  interval_ms integer NOT NULL CHECK (interval_ms > 0),
  down_after integer NOT NULL CHECK (down_after >= 2),
  last_heartbeat timestamptz NOT NULL DEFAULT now(),
  last_change timestamptz NOT NULL DEFAULT now(),
  report_digest text NOT NULL DEFAULT '',
  version text NOT NULL DEFAULT ''
);

CREATE TABLE fleet.devices (
  host text NOT NULL REFERENCES fleet.hosts ON DELETE CASCADE,
  address text NOT NULL,
  vendor_id integer,
  device_id integer,
  class integer,
  kind text NOT NULL,
  role text NOT NULL,
  parent_pf text,
  iommu_group integer,
  numa_node integer,
  vendor_name text NOT NULL,
  device_name text NOT NULL,
  state text NOT NULL,
  state_reason text NOT NULL,
  managed boolean NOT NULL,
  pool text NOT NULL CHECK (pool IN ('offered', 'held', 'withdrawn')),
  pool_reason text NOT NULL,
  digest text NOT NULL,
  reservation_id bigint,
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (host, address)
);
-- What a fleet claim walks, in order.
CREATE INDEX devices_offered ON fleet.devices (host, address)
  WHERE pool = 'offered' AND reservation_id IS NULL;

CREATE TABLE fleet.reservations (
  id bigserial PRIMARY KEY,
  host text NOT NULL,
  address text NOT NULL,
  vm_name text NOT NULL,
  requested_by text NOT NULL,
  state text NOT NULL DEFAULT 'pending'
    CHECK (state IN ('pending', 'claimed', 'refused', 'released')),
  reason text NOT NULL DEFAULT '',
  local_claim_id bigint,
  created_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now()
);
-- No double booking, whatever a writer does: one live reservation per function.
CREATE UNIQUE INDEX reservations_live ON fleet.reservations (host, address)
  WHERE state IN ('pending', 'claimed');
CREATE INDEX reservations_pending ON fleet.reservations (host) WHERE state = 'pending';

CREATE TABLE fleet.events (
  id bigserial PRIMARY KEY,
  at timestamptz NOT NULL DEFAULT now(),
  host text NOT NULL,
  address text,
  kind text NOT NULL,
  message text NOT NULL
);
CREATE INDEX events_host ON fleet.events (host, id);

ALTER TABLE fleet.hosts ENABLE ROW LEVEL SECURITY;
ALTER TABLE fleet.devices ENABLE ROW LEVEL SECURITY;
ALTER TABLE fleet.reservations ENABLE ROW LEVEL SECURITY;
ALTER TABLE fleet.events ENABLE ROW LEVEL SECURITY;

CREATE POLICY own_host ON fleet.hosts TO vfiod_fleet_host
  USING (host = fleet.my_host()) WITH CHECK (host = fleet.my_host());
CREATE POLICY own_host ON fleet.devices TO vfiod_fleet_host
  USING (host = fleet.my_host()) WITH CHECK (host = fleet.my_host());
CREATE POLICY own_host ON fleet.reservations TO vfiod_fleet_host
  USING (host = fleet.my_host()) WITH CHECK (host = fleet.my_host());
CREATE POLICY own_host ON fleet.events TO vfiod_fleet_host
  USING (host = fleet.my_host()) WITH CHECK (host = fleet.my_host());
GRANT SELECT, INSERT, UPDATE ON fleet.hosts TO vfiod_fleet_host;
GRANT SELECT, INSERT, UPDATE, DELETE ON fleet.devices TO vfiod_fleet_host;
GRANT SELECT, UPDATE ON fleet.reservations TO vfiod_fleet_host;
GRANT SELECT, INSERT ON fleet.events TO vfiod_fleet_host;
GRANT USAGE ON SEQUENCE fleet.events_id_seq TO vfiod_fleet_host;

CREATE POLICY read_all ON fleet.hosts FOR SELECT TO vfiod_fleet_operator USING (true);
CREATE POLICY read_all ON fleet.devices FOR SELECT TO vfiod_fleet_operator USING (true);
CREATE POLICY reserve ON fleet.devices FOR UPDATE TO vfiod_fleet_operator
  USING (true) WITH CHECK (true);
CREATE POLICY all_reservations ON fleet.reservations TO vfiod_fleet_operator
  USING (true) WITH CHECK (true);
CREATE POLICY read_all ON fleet.events FOR SELECT TO vfiod_fleet_operator USING (true);
-- An operator records its reservations, nothing in a host's name.
CREATE POLICY record ON fleet.events FOR INSERT TO vfiod_fleet_operator
  WITH CHECK (kind = 'reserved');
GRANT SELECT ON fleet.hosts, fleet.devices, fleet.events TO vfiod_fleet_operator;
-- An operator reserves a function: that column only.
GRANT UPDATE (reservation_id) ON fleet.devices TO vfiod_fleet_operator;
GRANT SELECT, INSERT, UPDATE ON fleet.reservations TO vfiod_fleet_operator;
GRANT INSERT ON fleet.events TO vfiod_fleet_operator;
GRANT USAGE ON SEQUENCE fleet.reservations_id_seq, fleet.events_id_seq TO vfiod_fleet_operator;

-- Marks down every host silent for down_after of its intervals, with an event each; refuses
-- their pending reservations. Run inside every report and every fleet query, so no
-- separate conductor process is needed. Owned by the schema owner, which RLS does not bind.
CREATE FUNCTION fleet.sweep() RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
  SET search_path = fleet, pg_temp AS $f$
DECLARE
  h record;
  n integer := 0;
BEGIN
  FOR h IN UPDATE fleet.hosts SET status = 'down'
      WHERE status = 'up'
        AND last_heartbeat < now() - make_interval(secs => interval_ms::float8 * down_after / 1000)
      RETURNING host, last_heartbeat
  LOOP
    INSERT INTO fleet.events (host, kind, message)
      VALUES (h.host, 'host-down',
              format('host %s marked down: no heartbeat since %s', h.host, h.last_heartbeat));
    WITH refused AS (
      UPDATE fleet.reservations SET state = 'refused', updated_at = now(),
        reason = 'its host was marked down before it took the reservation'
      WHERE host = h.host AND state = 'pending' RETURNING id)
    UPDATE fleet.devices SET reservation_id = NULL
      WHERE host = h.host AND reservation_id IN (SELECT id FROM refused);
    n := n + 1;
  END LOOP;
  RETURN n;
END $f$;
REVOKE ALL ON FUNCTION fleet.sweep() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fleet.sweep() TO vfiod_fleet_host, vfiod_fleet_operator;
"#,
    },
    Step {
        version: 2,
        description:
            "the sweep skips hosts whose row is locked, so concurrent reports never deadlock",
        // Every report runs the sweep at its end while it holds its own host's row. After an
        // outage every host is stale: host a's sweep waited for b's row while b's waited for
        // a's, and PostgreSQL killed one as a deadlock (the fleet test saw it in CI). A locked
        // host row belongs to a report in progress, so that host is alive: skipping it is the
        // right answer, not only the safe one. Rows are taken in host order besides.
        sql: r#"
CREATE OR REPLACE FUNCTION fleet.sweep() RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
  SET search_path = fleet, pg_temp AS $f$
DECLARE
  h record;
  n integer := 0;
BEGIN
  FOR h IN UPDATE fleet.hosts SET status = 'down'
      WHERE host IN (SELECT s.host FROM fleet.hosts s
        WHERE s.status = 'up'
          AND s.last_heartbeat < now() - make_interval(secs => s.interval_ms::float8 * s.down_after / 1000)
        ORDER BY s.host FOR UPDATE SKIP LOCKED)
      RETURNING host, last_heartbeat
  LOOP
    INSERT INTO fleet.events (host, kind, message)
      VALUES (h.host, 'host-down',
              format('host %s marked down: no heartbeat since %s', h.host, h.last_heartbeat));
    WITH refused AS (
      UPDATE fleet.reservations SET state = 'refused', updated_at = now(),
        reason = 'its host was marked down before it took the reservation'
      WHERE host = h.host AND state = 'pending' RETURNING id)
    UPDATE fleet.devices SET reservation_id = NULL
      WHERE host = h.host AND reservation_id IN (SELECT id FROM refused);
    n := n + 1;
  END LOOP;
  RETURN n;
END $f$;
"#,
    },
];

/// The DDL that holds the versions themselves (idempotent; run before the steps).
pub const BOOTSTRAP: &str = "CREATE SCHEMA IF NOT EXISTS fleet; \
     CREATE TABLE IF NOT EXISTS fleet.schema_versions (\
       version integer PRIMARY KEY, description text NOT NULL, \
       applied_at timestamptz NOT NULL DEFAULT now())";

/// The steps still to apply on a database at `current`, in order.
pub fn pending(current: i32) -> impl Iterator<Item = &'static Step> {
    STEPS.iter().filter(move |s| s.version > current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_numbered_in_order_and_end_at_the_version() {
        for (i, s) in STEPS.iter().enumerate() {
            assert_eq!(s.version, i as i32 + 1);
        }
        assert_eq!(STEPS.last().map(|s| s.version), Some(VERSION));
        assert_eq!(pending(0).count(), STEPS.len());
        assert_eq!(pending(VERSION).count(), 0);
    }
}
