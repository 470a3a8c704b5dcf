//! Pooled devices through a live migration, decided: what vfiod does for each libvirt hook and
//! domain event, given the domain's pooled claims on this host (and, at the destination's
//! `migrate begin`, the sessions the domain's metadata carries). Pure; `engine::pool` reads
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
//!
//! The rules of carrying each action out are here too, one function each, so that
//! `engine::pool` only makes the calls and records what these answer:
//!
//! | question                                             | answered by                            |
//! |------------------------------------------------------|----------------------------------------|
//! | which calls resume a session here, in which order (the optimistic resume) | [`resume_order`] |
//! | after a refusal: call again, ask who owns the session, or give up | [`after_refusal`] |
//! | adopt the pool's newer epoch, or fence               | [`adoption`], then [`after_adoption`]  |
//! | does a refusal end the claim in `error`              | [`refusal_ends`]                       |
//! | may a claim be released; does a refused release end it | [`unreleasable`], [`release_refused`] |
//! | `migrate begin`: does the metadata's host still own a session the pool calls stale | [`ask_owner_after_move`], [`owned_by`] |
//! | start-up: which claims missed a step while vfiod was down | [`mid_migration`], [`missed_step`] |
//!
//! The module is the one home of the pool concept in the daemon: the pool control protocol and
//! its client are re-exported here from the `vfiod-pool-protocol` crate
//! (crates/vfiod-pool-protocol), so that the daemon's code says `crate::pool::protocol` and
//! `crate::pool::client`. The reference pool service and its stand-in driver are the
//! `vfiod-pool` crate (crates/vfiod-pool): not linked into vfiod.

pub use vfiod_pool_protocol::{client, protocol};

use crate::config::QuiesceAt;
use crate::host::libvirt::xml::MetadataPooled;
use crate::model::pool::{PooledClaim, PooledState};
use crate::pool::client::PoolError;
use crate::pool::protocol::{Session, SessionState};
use std::time::Duration;

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

/// The words of a fencing, in the claim's reason and its events: the pool's session moved on to
/// epoch `current` under another host, and this host never retries.
pub fn fenced(current: u64) -> String {
    format!(
        "fenced: the pool's session is at epoch {current}, another host owns it; this host \
         does not retry"
    )
}

/// How many times a resume the pool could not answer is tried, and how long apart: the VM
/// already runs there, and its accelerator work waits for this call.
pub const RESUME_ATTEMPTS: u32 = 5;
pub const RESUME_RETRY: Duration = Duration::from_millis(300);

/// One pool call of [`Action::ResumeHere`], in the order [`resume_order`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResumeCall {
    /// One `resume(epoch, this host)`, optimistic: the source most likely quiesced at its
    /// switchover, so one round trip inside the pause window, not two. Its success ends the
    /// order (recorded leased); any failure goes on to the next call, unrecorded.
    TryResume,
    /// `quiesce(epoch)`: the source has not quiesced (yet: its event and this host's race, or
    /// its vfiod is down); a quiesce is idempotent, and the VM is paused there by now. Its
    /// failure ends the order; its success leaves the claim quiesced.
    Quiesce,
    /// `resume(epoch, this host)`, retried as [`after_refusal`] says; its answer ends the order.
    Resume,
}

/// The calls that resume a claim in `state` on this host, in order. Pure.
pub fn resume_order(state: PooledState) -> &'static [ResumeCall] {
    use ResumeCall::*;
    match state {
        PooledState::Moving => &[TryResume, Quiesce, Resume],
        PooledState::Quiesced => &[Resume],
        // Not a state `on_step` resumes; as a moving claim whose first resume failed.
        _ => &[Quiesce, Resume],
    }
}

/// A call of the flow the pool may refuse, as the rules after a refusal tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Quiesce,
    /// `resume(epoch, host)`; `here`: the host is this one (not a failed migration's source).
    Resume {
        here: bool,
    },
}

/// What comes after the pool refused a call (or did not answer it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Retry {
    /// The pool could not be reached (`why`, for the event): wait `after`, call again.
    Again { after: Duration, why: String },
    /// A stale epoch: read the pool's session, whose owner may still be this host
    /// ([`adoption`], then [`after_adoption`]).
    AskOwner,
    /// The refusal stands; [`refusal_ends`] says whether it ends the claim.
    GiveUp,
}

/// What to do when attempt `attempt` (the first is 1) of `call` failed with `refusal` (`None`:
/// not an answer of the pool, a pool this host does not know for one). A quiesce looks at the
/// owner once and is never repeated for an unreachable pool (the source's switchover cannot
/// wait); a resume is tried [`RESUME_ATTEMPTS`] times in all. Pure.
pub fn after_refusal(call: Call, refusal: Option<&PoolError>, attempt: u32) -> Retry {
    match (call, refusal) {
        (Call::Quiesce, Some(PoolError::StaleEpoch { .. })) if attempt == 1 => Retry::AskOwner,
        (Call::Resume { .. }, Some(PoolError::Unreachable(why))) if attempt < RESUME_ATTEMPTS => {
            Retry::Again {
                after: RESUME_RETRY,
                why: why.clone(),
            }
        }
        (Call::Resume { .. }, Some(PoolError::StaleEpoch { .. })) if attempt < RESUME_ATTEMPTS => {
            Retry::AskOwner
        }
        _ => Retry::GiveUp,
    }
}

/// A claim this host holds at `epoch`, after a stale-epoch refusal, against the pool's session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// The pool still gives the session to this host, at a newer epoch (its quiesce lease
    /// expired and it resumed here, or a failed migration's destination gave it back): record
    /// `state` at `epoch`.
    Adopt { state: PooledState, epoch: u64 },
    /// Another host owns it, its epoch is not newer, it is released, or the pool cannot say
    /// (`None`): fenced.
    Fence,
}

/// Adopt or fence: who owns the session, by the pool's session `pool` (`None` when it could
/// not be read), for a claim at `epoch` on host `me`. Pure.
pub fn adoption(epoch: u64, me: &str, pool: Option<&Session>) -> Adoption {
    let Some(s) = pool else {
        return Adoption::Fence;
    };
    if s.host != me || s.epoch <= epoch {
        return Adoption::Fence;
    }
    let state = match s.state {
        SessionState::Running => PooledState::Leased,
        SessionState::Quiesced => PooledState::Quiesced,
        SessionState::Released => return Adoption::Fence,
    };
    Adoption::Adopt {
        state,
        epoch: s.epoch,
    }
}

/// What a refused call does once the owner has been looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterAdoption {
    /// The adopted claim is what the call wanted: done.
    Done,
    /// Call again, at the adopted epoch.
    Again,
    /// The refusal stands, recorded as a fencing.
    Fence,
}

/// After [`Retry::AskOwner`]: `adopted` is the state the claim was adopted in, `None` when
/// fenced. A quiesce of a session adopted quiesced is done, of one adopted running is called
/// again; a resume here is done when the pool already runs it here (a lease expiry on its last
/// owner). Anything else is a fencing. Pure.
pub fn after_adoption(call: Call, adopted: Option<PooledState>) -> AfterAdoption {
    match (call, adopted) {
        (Call::Quiesce, Some(PooledState::Quiesced)) => AfterAdoption::Done,
        (Call::Quiesce, Some(PooledState::Leased)) => AfterAdoption::Again,
        (Call::Resume { here: true }, Some(PooledState::Leased)) => AfterAdoption::Done,
        _ => AfterAdoption::Fence,
    }
}

/// Whether the pool's refusal of a flow call on `session` ends the claim: `Some(reason)`, the
/// claim goes to `error` for good (a stale epoch: fenced; a session the pool no longer has).
/// `None`: an event only, the claim as it was (it may be tried again). Pure.
pub fn refusal_ends(refusal: Option<&PoolError>, session: &str) -> Option<String> {
    match refusal {
        Some(PoolError::StaleEpoch { current }) => Some(fenced(*current)),
        Some(PoolError::NotFound) => Some(format!("the pool has no session {session}")),
        _ => None,
    }
}

/// Why a pooled claim in `state` cannot be released here, if it cannot. Pure.
pub fn unreleasable(state: PooledState) -> Option<&'static str> {
    if state.ended() {
        Some("already ended")
    } else if state == PooledState::Moving {
        Some("a migration is bringing it here; it is released where the VM runs")
    } else {
        None
    }
}

/// A release the pool refused that ends the claim here all the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForgetAnyway {
    /// The claim's reason.
    pub reason: String,
    /// What the event adds after "released by ...: ".
    pub event: String,
}

/// A refused release: a pool that has no such session any more, or that fenced this host out,
/// ends the claim here all the same (`forgotten`); anything else (an unreachable pool, `None`:
/// no pool's answer) leaves it as it is, to try again. Pure.
pub fn release_refused(refusal: Option<&PoolError>) -> Option<ForgetAnyway> {
    match refusal {
        Some(PoolError::NotFound) => Some(ForgetAnyway {
            reason: "the pool has no such session any more".into(),
            event: "the pool no longer has the session".into(),
        }),
        Some(PoolError::StaleEpoch { current }) => Some(ForgetAnyway {
            reason: fenced(*current),
            event: fenced(*current),
        }),
        _ => None,
    }
}

/// After the pool refused to prepare-move `s` here (`refusal`): the pool's epoch when the
/// refusal is a stale epoch and the metadata names a host, so that the pool's session is worth
/// reading ([`owned_by`]); `None`: the refusal stands. Pure.
pub fn ask_owner_after_move(s: &MetadataPooled, refusal: Option<&PoolError>) -> Option<u64> {
    match refusal {
        Some(PoolError::StaleEpoch { current }) if !s.host.is_empty() => Some(*current),
        _ => None,
    }
}

/// Whether the pool (`pool`: its session, `None` when it could not be read) gives session `s`
/// to the host the metadata names, at epoch `current`. The metadata's epoch is old, but the
/// pool may still give the session to that host (its quiesce lease expired there, or an earlier
/// failed migration gave it back, each a new epoch): then that host is still the owner this
/// migration moves it from, and prepare-move is tried once more at `current`. Pure.
pub fn owned_by(s: &MetadataPooled, current: u64, pool: Option<&Session>) -> bool {
    matches!(pool, Some(p) if !s.host.is_empty()
        && p.host == s.host
        && p.epoch == current
        && p.state != SessionState::Released)
}

/// What libvirt says of a pooled claim's domain when vfiod starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DomainSeen {
    Running,
    /// Defined, not running.
    Inactive,
    /// libvirt has no such domain.
    Missing,
    /// libvirt cannot say (not reachable, another error).
    Unknown,
}

/// Whether a claim in `state` may have missed a step while vfiod was down: one in the middle of
/// a migration (moving or quiesced). Only those are looked up in libvirt at start-up. Pure.
pub fn mid_migration(state: PooledState) -> bool {
    matches!(state, PooledState::Moving | PooledState::Quiesced)
}

/// The step a claim in the middle of a migration takes at start-up, by what libvirt says of its
/// domain: one that does not run here any more stopped while vfiod was down. A domain that runs
/// is left alone (its events come, and a paused one cannot be told from a running one here),
/// and nothing is decided on a guess when libvirt cannot say. Pure.
pub fn missed_step(seen: DomainSeen) -> Option<DomainStep> {
    match seen {
        DomainSeen::Inactive | DomainSeen::Missing => Some(DomainStep::Stopped { migrated: false }),
        DomainSeen::Running | DomainSeen::Unknown => None,
    }
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

    fn pool_session(host: &str, epoch: u64, state: SessionState) -> Session {
        Session {
            id: "s-1".into(),
            device: "gpu-0".into(),
            host: host.into(),
            vm: "vm1".into(),
            epoch,
            state,
            in_flight: 0,
            undelivered: 0,
            moving_to: None,
            quiesce_deadline: None,
            last_note: None,
        }
    }

    #[test]
    fn the_order_of_a_resume_here() {
        use PooledState::*;
        use ResumeCall::*;
        for (state, wanted) in [
            // The optimistic resume: one round trip inside the pause window, then the safe way.
            (Moving, &[TryResume, Quiesce, Resume][..]),
            (Quiesced, &[Resume]),
            (Leased, &[Quiesce, Resume]),
        ] {
            assert_eq!(resume_order(state), wanted, "{state:?}");
        }
    }

    #[test]
    fn retry_or_give_up_after_a_refusal() {
        let stale = PoolError::StaleEpoch { current: 3 };
        let down = PoolError::Unreachable("connection refused".into());
        let refused = PoolError::Refused {
            code: "device_taken".into(),
            message: "no".into(),
        };
        let again = Retry::Again {
            after: RESUME_RETRY,
            why: "connection refused".into(),
        };
        let here = Call::Resume { here: true };
        let source = Call::Resume { here: false };
        for (call, refusal, attempt, wanted) in [
            // A resume waits for an unreachable pool, RESUME_ATTEMPTS calls in all.
            (here, Some(&down), 1, again.clone()),
            (here, Some(&down), RESUME_ATTEMPTS - 1, again.clone()),
            (here, Some(&down), RESUME_ATTEMPTS, Retry::GiveUp),
            (source, Some(&down), 2, again),
            // A stale epoch asks who owns the session, while attempts remain.
            (here, Some(&stale), 1, Retry::AskOwner),
            (source, Some(&stale), 1, Retry::AskOwner),
            (here, Some(&stale), RESUME_ATTEMPTS, Retry::GiveUp),
            // Other refusals stand.
            (here, Some(&PoolError::NotFound), 1, Retry::GiveUp),
            (here, Some(&refused), 1, Retry::GiveUp),
            (here, None, 1, Retry::GiveUp),
            // A quiesce asks the owner once, and never waits for an unreachable pool.
            (Call::Quiesce, Some(&stale), 1, Retry::AskOwner),
            (Call::Quiesce, Some(&stale), 2, Retry::GiveUp),
            (Call::Quiesce, Some(&down), 1, Retry::GiveUp),
            (Call::Quiesce, Some(&PoolError::NotFound), 1, Retry::GiveUp),
            (Call::Quiesce, None, 1, Retry::GiveUp),
        ] {
            assert_eq!(
                after_refusal(call, refusal, attempt),
                wanted,
                "{call:?} refused with {refusal:?} at attempt {attempt}"
            );
        }
    }

    #[test]
    fn adopt_or_fence() {
        use SessionState::*;
        let adopt = |state, epoch| Adoption::Adopt { state, epoch };
        // The claim here is at epoch 2, on hostb.
        for (pool, wanted) in [
            // Still this host's, moved on (a lease expiry resumed it here): adopted as it is.
            (
                Some(pool_session("hostb", 3, Running)),
                adopt(PooledState::Leased, 3),
            ),
            (
                Some(pool_session("hostb", 4, Quiesced)),
                adopt(PooledState::Quiesced, 4),
            ),
            // Another host's: fenced, whatever the epoch.
            (Some(pool_session("hosta", 3, Running)), Adoption::Fence),
            (Some(pool_session("hosta", 1, Quiesced)), Adoption::Fence),
            // Not newer than the claim's: the refusal was not about a move on.
            (Some(pool_session("hostb", 2, Running)), Adoption::Fence),
            (Some(pool_session("hostb", 1, Running)), Adoption::Fence),
            (Some(pool_session("hostb", 3, Released)), Adoption::Fence),
            // The pool cannot say: nothing is adopted on a guess.
            (None, Adoption::Fence),
        ] {
            assert_eq!(adoption(2, "hostb", pool.as_ref()), wanted, "{pool:?}");
        }
    }

    #[test]
    fn what_a_refused_call_does_after_the_owner_is_known() {
        use PooledState::*;
        let here = Call::Resume { here: true };
        let source = Call::Resume { here: false };
        for (call, adopted, wanted) in [
            (Call::Quiesce, Some(Quiesced), AfterAdoption::Done),
            (Call::Quiesce, Some(Leased), AfterAdoption::Again),
            (Call::Quiesce, None, AfterAdoption::Fence),
            (here, Some(Leased), AfterAdoption::Done),
            (here, Some(Quiesced), AfterAdoption::Fence),
            (here, None, AfterAdoption::Fence),
            // Resuming on a failed migration's source, the pool runs it here: not the source's.
            (source, Some(Leased), AfterAdoption::Fence),
            (source, None, AfterAdoption::Fence),
        ] {
            assert_eq!(
                after_adoption(call, adopted),
                wanted,
                "{call:?} adopted as {adopted:?}"
            );
        }
    }

    #[test]
    fn which_refusals_end_a_claim() {
        let refused = PoolError::Refused {
            code: "invalid".into(),
            message: "no".into(),
        };
        for (refusal, wanted) in [
            (
                Some(PoolError::StaleEpoch { current: 7 }),
                Some(fenced(7).as_str()),
            ),
            (
                Some(PoolError::NotFound),
                Some("the pool has no session s-1"),
            ),
            (Some(PoolError::Unreachable("timeout".into())), None),
            (Some(PoolError::NotQuiesced), None),
            (Some(refused), None),
            (None, None),
        ] {
            assert_eq!(
                refusal_ends(refusal.as_ref(), "s-1").as_deref(),
                wanted,
                "{refusal:?}"
            );
        }
    }

    #[test]
    fn what_a_release_ends() {
        use PooledState::*;
        for (state, wanted) in [
            (Leased, None),
            (Quiesced, None),
            (Error, None),
            (
                Moving,
                Some("a migration is bringing it here; it is released where the VM runs"),
            ),
            (Released, Some("already ended")),
            (Forgotten, Some("already ended")),
        ] {
            assert_eq!(unreleasable(state), wanted, "{state:?}");
        }
        let forget = |reason: &str, event: &str| {
            Some(ForgetAnyway {
                reason: reason.into(),
                event: event.into(),
            })
        };
        for (refusal, wanted) in [
            (
                Some(PoolError::NotFound),
                forget(
                    "the pool has no such session any more",
                    "the pool no longer has the session",
                ),
            ),
            (
                Some(PoolError::StaleEpoch { current: 4 }),
                forget(&fenced(4), &fenced(4)),
            ),
            (Some(PoolError::Unreachable("timeout".into())), None),
            (Some(PoolError::Protocol("500".into())), None),
            (None, None),
        ] {
            assert_eq!(release_refused(refusal.as_ref()), wanted, "{refusal:?}");
        }
    }

    #[test]
    fn who_owns_a_session_a_migration_moves_here() {
        use SessionState::*;
        let named = |host: &str| MetadataPooled {
            pool: "gpus".into(),
            session: "s-1".into(),
            device: "gpu-0".into(),
            epoch: 2,
            host: host.into(),
        };
        let stale = PoolError::StaleEpoch { current: 3 };
        for (s, refusal, wanted) in [
            (named("hosta"), Some(&stale), Some(3)),
            // No host named: no owner to ask about.
            (named(""), Some(&stale), None),
            (named("hosta"), Some(&PoolError::NotFound), None),
            (
                named("hosta"),
                Some(&PoolError::Unreachable("x".into())),
                None,
            ),
            (named("hosta"), None, None),
        ] {
            assert_eq!(
                ask_owner_after_move(&s, refusal),
                wanted,
                "{refusal:?}, host {:?}",
                s.host
            );
        }
        // The pool's epoch is 3.
        for (s, pool, wanted) in [
            (
                named("hosta"),
                Some(pool_session("hosta", 3, Running)),
                true,
            ),
            (
                named("hosta"),
                Some(pool_session("hosta", 3, Quiesced)),
                true,
            ),
            (
                named("hosta"),
                Some(pool_session("hosta", 3, Released)),
                false,
            ),
            (
                named("hosta"),
                Some(pool_session("hostc", 3, Running)),
                false,
            ),
            (
                named("hosta"),
                Some(pool_session("hosta", 4, Running)),
                false,
            ),
            (named("hosta"), None, false),
            (named(""), Some(pool_session("", 3, Running)), false),
        ] {
            assert_eq!(
                owned_by(&s, 3, pool.as_ref()),
                wanted,
                "named {:?}, pool {pool:?}",
                s.host
            );
        }
    }

    #[test]
    fn what_start_up_catches_up_with() {
        use PooledState::*;
        for (state, wanted) in [
            (Moving, true),
            (Quiesced, true),
            (Leased, false),
            (Error, false),
            (Released, false),
            (Forgotten, false),
        ] {
            assert_eq!(mid_migration(state), wanted, "{state:?}");
        }
        let stopped = Some(DomainStep::Stopped { migrated: false });
        for (seen, wanted) in [
            (DomainSeen::Inactive, stopped),
            (DomainSeen::Missing, stopped),
            (DomainSeen::Running, None),
            (DomainSeen::Unknown, None),
        ] {
            assert_eq!(missed_step(seen), wanted, "{seen:?}");
        }
    }
}
