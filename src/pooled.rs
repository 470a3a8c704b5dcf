//! Pooled devices through a live migration, decided: what vfiod does for each libvirt hook and
//! domain event, given the domain's pooled claims on this host (and, at the destination's
//! `migrate begin`, the sessions the domain's metadata carries). Pure; `engine::pooled` reads
//! the records, calls these functions and carries out their answer (the pool calls, the store,
//! the metadata).
//!
//! | where        | hook / event                              | pooled claim here | action                                   |
//! |--------------|-------------------------------------------|-------------------|------------------------------------------|
//! | destination  | `migrate begin` hook                      | none              | prepare-move (quiesce too with `quiesce_at = "begin"`), record `moving`; a failure fails the hook |
//! | source       | suspended, detail *migrated*              | leased            | quiesce (idempotent)                     |
//! | destination  | resumed (the VM runs here)                | moving, quiesced  | quiesce if needed, resume on this host, record the new epoch |
//! | source       | resumed (the migration failed)            | quiesced          | resume on this host                      |
//! | source       | stopped (detail *migrated*), `stopped`/`release` hooks | quiesced, leased after a migration | forget (no pool call) |
//! | destination  | stopped (the migration failed here)       | moving            | forget; resume on the source if this host quiesced it |
//!
//! A step the pool refuses with a stale epoch ends in `error` ("fenced"): another host owns the
//! session, and this one never retries.

use crate::config::QuiesceAt;
use crate::host::libvirt::xml::MetadataPooled;
use crate::model::pooled::{PooledClaim, PooledState};

/// libvirt's `VIR_DOMAIN_EVENT_SUSPENDED_MIGRATED`: paused for the final phase of an outgoing
/// live migration.
pub const SUSPENDED_MIGRATED: i32 = 1;
/// libvirt's `VIR_DOMAIN_EVENT_STOPPED_MIGRATED`: gone to another host.
pub const STOPPED_MIGRATED: i32 = 3;

/// What happened to a domain, as the pooled flow distinguishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DomainStep {
    /// The source paused the VM for a migration's switchover.
    SuspendedForMigration,
    /// The VM runs (again): on the destination after a migration, or on the source after one
    /// failed, or after any pause.
    Resumed,
    /// The domain stopped; `migrated`: libvirt said it went to another host (the event's
    /// detail). The `stopped`/`release` hooks do not say, so they pass `false`.
    Stopped { migrated: bool },
}

impl DomainStep {
    /// The step a libvirt lifecycle event is, if the flow cares.
    pub fn of_event(kind: &crate::host::libvirt::DomainEventKind, detail: i32) -> Option<Self> {
        use crate::host::libvirt::DomainEventKind as K;
        match kind {
            K::Suspended if detail == SUSPENDED_MIGRATED => Some(DomainStep::SuspendedForMigration),
            K::Resumed => Some(DomainStep::Resumed),
            K::Stopped => Some(DomainStep::Stopped {
                migrated: detail == STOPPED_MIGRATED,
            }),
            _ => None,
        }
    }
}

/// What to do with one pooled claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `quiesce(epoch)`, then record `quiesced`.
    Quiesce { id: i64 },
    /// `quiesce(epoch)` unless recorded quiesced (idempotent either way), then
    /// `resume(epoch, this host)`: record the new epoch, `leased`, and write the metadata.
    ResumeHere { id: i64 },
    /// `resume(epoch, host)` for a migration that failed after this host (its destination)
    /// quiesced the session; then forget it here.
    ResumeOn { id: i64, host: String },
    /// Record `forgotten` with this reason; no pool call.
    Forget { id: i64, why: &'static str },
}

/// What `step` of the domain means for its standing pooled claims `claims` (already those of
/// the domain). Pure.
pub fn on_step(step: DomainStep, claims: &[PooledClaim]) -> Vec<Action> {
    claims
        .iter()
        .filter_map(|c| {
            let id = c.id;
            match (step, c.state) {
                (DomainStep::SuspendedForMigration, PooledState::Leased) => {
                    Some(Action::Quiesce { id })
                }
                (DomainStep::Resumed, PooledState::Moving | PooledState::Quiesced) => {
                    Some(Action::ResumeHere { id })
                }
                // The VM went away with its session: the destination owns it now.
                (DomainStep::Stopped { .. }, PooledState::Quiesced) if c.peer_host.is_none() => {
                    Some(Action::Forget {
                        id,
                        why: "the domain stopped here after its session was quiesced for a \
                              migration: the destination resumes it",
                    })
                }
                (DomainStep::Stopped { migrated: true }, PooledState::Leased) => {
                    Some(Action::Forget {
                        id,
                        why: "the domain migrated to another host, which takes the session over",
                    })
                }
                // A destination whose incoming migration failed.
                (DomainStep::Stopped { .. }, PooledState::Quiesced) => Some(Action::ResumeOn {
                    id,
                    host: c.peer_host.clone().unwrap_or_default(),
                }),
                (DomainStep::Stopped { .. }, PooledState::Moving) => Some(Action::Forget {
                    id,
                    why: "the incoming migration did not complete here: the session stays \
                          with its source",
                }),
                _ => None,
            }
        })
        .collect()
}

/// One session the destination's `migrate begin` moves here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incoming {
    pub session: MetadataPooled,
    /// Quiesce at once (`quiesce_at = "begin"`), not at the switchover.
    pub quiesce: bool,
    /// Already recorded here (libvirt retrying the hook): its claim id.
    pub existing: Option<i64>,
}

/// The destination's `migrate begin`: what to ask of each pool for the sessions the domain's
/// metadata carries, or the one line that refuses the migration (a pool this host does not
/// know). `quiesce_at(pool)`: the `[[pool]]` setting, `None` when not configured. Pure.
pub fn migrate_begin(
    domain: &str,
    sessions: &[MetadataPooled],
    quiesce_at: impl Fn(&str) -> Option<QuiesceAt>,
    here: &[PooledClaim],
) -> Result<Vec<Incoming>, String> {
    let mut out = Vec::new();
    let mut missing = Vec::new();
    for s in sessions {
        let Some(at) = quiesce_at(&s.pool) else {
            missing.push(format!("{} (session {})", s.pool, s.session));
            continue;
        };
        let existing = here
            .iter()
            .find(|c| c.pool == s.pool && c.session == s.session && c.state.holds())
            .map(|c| c.id);
        out.push(Incoming {
            session: s.clone(),
            quiesce: at == QuiesceAt::Begin,
            existing,
        });
    }
    if !missing.is_empty() {
        return Err(format!(
            "vfiod: domain {domain} cannot come here: its pooled devices' pools are not \
             configured on this host: {}",
            missing.join(", ")
        ));
    }
    Ok(out)
}

/// The sessions to write in a domain's metadata: its standing pooled claims, with this host.
pub fn metadata_of(claims: &[PooledClaim], host: &str) -> Vec<MetadataPooled> {
    claims
        .iter()
        .filter(|c| matches!(c.state, PooledState::Leased | PooledState::Quiesced))
        .map(|c| MetadataPooled {
            pool: c.pool.clone(),
            session: c.session.clone(),
            device: c.device.clone(),
            epoch: c.epoch,
            host: host.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(id: i64, state: PooledState, peer: Option<&str>) -> PooledClaim {
        PooledClaim {
            id,
            pool: "gpus".into(),
            session: format!("s-{id}"),
            device: "gpu-0".into(),
            epoch: 1,
            state,
            reason: String::new(),
            vm_name: Some("vm1".into()),
            vm_uuid: None,
            peer_host: peer.map(str::to_string),
            requested_by: "test".into(),
            created_ms: 0,
            updated_ms: 0,
        }
    }

    #[test]
    fn what_each_step_does_to_each_state() {
        use PooledState::*;
        let source = |s| claim(1, s, None);
        let destination = |s| claim(1, s, Some("hosta"));
        let stopped = DomainStep::Stopped { migrated: false };
        let migrated = DomainStep::Stopped { migrated: true };
        let kind = |a: Vec<Action>| -> &'static str {
            match a.as_slice() {
                [] => "-",
                [Action::Quiesce { .. }] => "quiesce",
                [Action::ResumeHere { .. }] => "resume here",
                [Action::ResumeOn { host, .. }] if host == "hosta" => "resume on hosta",
                [Action::Forget { .. }] => "forget",
                other => panic!("{other:?}"),
            }
        };
        for (step, c, wanted) in [
            // Source: switchover quiesces a running session, once.
            (DomainStep::SuspendedForMigration, source(Leased), "quiesce"),
            (DomainStep::SuspendedForMigration, source(Quiesced), "-"),
            (DomainStep::SuspendedForMigration, source(Error), "-"),
            // Source: the migration failed after the quiesce, the VM runs here again.
            (DomainStep::Resumed, source(Quiesced), "resume here"),
            // A plain unpause of a running session: nothing.
            (DomainStep::Resumed, source(Leased), "-"),
            // Source: gone with the VM.
            (migrated, source(Leased), "forget"),
            (migrated, source(Quiesced), "forget"),
            (stopped, source(Quiesced), "forget"),
            // A plain shutdown keeps the lease (an operator releases it).
            (stopped, source(Leased), "-"),
            (stopped, source(Error), "-"),
            // Destination: the VM runs here.
            (DomainStep::Resumed, destination(Moving), "resume here"),
            (DomainStep::Resumed, destination(Quiesced), "resume here"),
            // Destination: the incoming migration failed.
            (stopped, destination(Moving), "forget"),
            (stopped, destination(Quiesced), "resume on hosta"),
            (DomainStep::SuspendedForMigration, destination(Moving), "-"),
        ] {
            let got = kind(on_step(step, std::slice::from_ref(&c)));
            assert_eq!(
                got, wanted,
                "{step:?} with {:?} (peer {:?})",
                c.state, c.peer_host
            );
        }
    }

    #[test]
    fn libvirt_events_as_steps() {
        use crate::host::libvirt::DomainEventKind as K;
        assert_eq!(
            DomainStep::of_event(&K::Suspended, 1),
            Some(DomainStep::SuspendedForMigration)
        );
        assert_eq!(
            DomainStep::of_event(&K::Suspended, 0),
            None,
            "a user's pause"
        );
        assert_eq!(
            DomainStep::of_event(&K::Resumed, 1),
            Some(DomainStep::Resumed)
        );
        assert_eq!(
            DomainStep::of_event(&K::Stopped, 3),
            Some(DomainStep::Stopped { migrated: true })
        );
        assert_eq!(
            DomainStep::of_event(&K::Stopped, 0),
            Some(DomainStep::Stopped { migrated: false })
        );
        assert_eq!(DomainStep::of_event(&K::Started, 1), None);
    }

    #[test]
    fn migrate_begin_needs_every_pool_and_knows_a_retry() {
        let s = |pool: &str, session: &str| MetadataPooled {
            pool: pool.into(),
            session: session.into(),
            device: "gpu-0".into(),
            epoch: 4,
            host: "hosta".into(),
        };
        let at = |p: &str| match p {
            "gpus" => Some(QuiesceAt::Switchover),
            "fpgas" => Some(QuiesceAt::Begin),
            _ => None,
        };
        let mut here = claim(9, PooledState::Moving, Some("hosta"));
        here.session = "s-2".into();
        let got = migrate_begin("vm1", &[s("gpus", "s-1"), s("fpgas", "s-2")], at, &[]).unwrap();
        assert_eq!(
            got.iter()
                .map(|i| (i.quiesce, i.existing))
                .collect::<Vec<_>>(),
            [(false, None), (true, None)]
        );
        let got = migrate_begin("vm1", &[s("gpus", "s-2")], at, &[here]).unwrap();
        assert_eq!(got[0].existing, Some(9));
        let e = migrate_begin("vm1", &[s("gpus", "s-1"), s("tpus", "s-3")], at, &[]).unwrap_err();
        assert_eq!(
            e,
            "vfiod: domain vm1 cannot come here: its pooled devices' pools are not configured \
             on this host: tpus (session s-3)"
        );
        assert!(migrate_begin("vm1", &[], at, &[]).unwrap().is_empty());
    }

    #[test]
    fn metadata_carries_the_sessions_this_host_holds() {
        let mut q = claim(2, PooledState::Quiesced, None);
        q.epoch = 5;
        let m = metadata_of(
            &[
                claim(1, PooledState::Leased, None),
                q,
                claim(3, PooledState::Error, None),
                claim(4, PooledState::Moving, Some("hosta")),
            ],
            "hostb",
        );
        assert_eq!(
            m.iter()
                .map(|p| (p.session.as_str(), p.epoch, p.host.as_str()))
                .collect::<Vec<_>>(),
            [("s-1", 1, "hostb"), ("s-2", 5, "hostb")]
        );
    }
}
