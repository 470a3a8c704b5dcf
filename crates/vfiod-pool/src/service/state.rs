//! A session's state machine, pure: what a command does to a session record, decided without
//! I/O and tested as tables. The store persists what [`apply`] returns; the HTTP layer turns a
//! [`Refusal`] into the protocol's error body.
//!
//! ```text
//!   create ──> running ──quiesce(e)──> quiesced ──resume(e, host)──> running (epoch e+1, host)
//!                 ^                       │
//!                 └── lease expiry ───────┘  (epoch e+1, last owner, note says why)
//!   running | quiesced ──release(e)──> released (for good)
//! ```

use crate::protocol::{valid_name, CreateSession, ErrorCode, SessionState};

/// A session as the pool keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRecord {
    pub id: String,
    pub device: String,
    /// The current owner: the only host the data plane serves.
    pub host: String,
    pub vm: String,
    /// The fencing token; +1 at every change of owner (resume, lease expiry).
    pub epoch: u64,
    pub state: SessionState,
    /// The destination a prepare-move confirmed, until the next resume.
    pub moving_to: Option<String>,
    /// Unix time in milliseconds when the quiesce lease ends; set exactly while quiesced.
    pub quiesce_deadline_ms: Option<u64>,
    pub last_note: Option<String>,
    /// The epoch the resume that made the current epoch named: a retry of that same resume
    /// (its reply lost) is answered with the session as it is, not with `stale_epoch`.
    pub resumed_from: Option<u64>,
    /// The highest work item number accepted (the data plane ignores numbers at or below it).
    pub last_seq: u64,
}

/// The pool-wide rules a decision needs.
#[derive(Clone, Copy, Debug)]
pub struct Rules<'a> {
    /// Now, in Unix milliseconds.
    pub now_ms: u64,
    /// The quiesce lease.
    pub lease_ms: u64,
    /// The hosts the pool can serve; `None`: any host.
    pub hosts: Option<&'a [String]>,
}

/// A control-plane command on one session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    PrepareMove {
        epoch: u64,
        to_host: String,
    },
    Quiesce {
        epoch: u64,
    },
    Resume {
        epoch: u64,
        host: String,
    },
    Release {
        epoch: u64,
    },
    /// The lease clock ticked: a quiesced session past its deadline resumes on its last owner.
    ExpireLease,
}

/// What a command did. `Unchanged` is a success too (an idempotent repeat, a lease that has
/// not run out): the caller answers with the record as it is and writes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    Changed(SessionRecord),
    Unchanged,
}

/// Why a command was refused, as the protocol's error code.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
    /// Set on `stale_epoch` (and `not_owner`): the epoch the session is at.
    pub current_epoch: Option<u64>,
}

impl Refusal {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            message: message.into(),
            current_epoch: None,
        }
    }
}

fn stale(rec: &SessionRecord, epoch: u64) -> Refusal {
    Refusal {
        code: ErrorCode::StaleEpoch,
        message: format!("session {} is at epoch {}, not {epoch}", rec.id, rec.epoch),
        current_epoch: Some(rec.epoch),
    }
}

/// Whether the pool can serve `host` (a valid name, on the allow-list if there is one).
pub fn can_serve(rules: &Rules<'_>, host: &str) -> Result<(), Refusal> {
    if !valid_name(host) {
        return Err(Refusal::new(
            ErrorCode::Invalid,
            format!("{host:?} is not a host name"),
        ));
    }
    match rules.hosts {
        Some(list) if !list.iter().any(|h| h == host) => Err(Refusal::new(
            ErrorCode::CannotServe,
            format!(
                "this pool does not serve host {host} (it serves {})",
                list.join(", ")
            ),
        )),
        _ => Ok(()),
    }
}

/// A new session `id` for `req`: epoch 1, running. The caller checks that the device exists
/// and is free (that needs the store).
pub fn create(id: &str, req: &CreateSession, rules: &Rules<'_>) -> Result<SessionRecord, Refusal> {
    for (what, v) in [("device", &req.device), ("vm", &req.vm)] {
        if !valid_name(v) {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!("{v:?} is not a {what} name"),
            ));
        }
    }
    can_serve(rules, &req.host)?;
    Ok(SessionRecord {
        id: id.to_owned(),
        device: req.device.clone(),
        host: req.host.clone(),
        vm: req.vm.clone(),
        epoch: 1,
        state: SessionState::Running,
        moving_to: None,
        quiesce_deadline_ms: None,
        last_note: Some(format!("leased to {} on {}", req.vm, req.host)),
        resumed_from: None,
        last_seq: 0,
    })
}

/// What `cmd` does to `rec`.
pub fn apply(rec: &SessionRecord, cmd: &Command, rules: &Rules<'_>) -> Result<Transition, Refusal> {
    use SessionState::*;
    if rec.state == Released {
        return match cmd {
            Command::Release { epoch } if *epoch == rec.epoch => Ok(Transition::Unchanged),
            Command::ExpireLease => Ok(Transition::Unchanged),
            _ => Err(Refusal::new(
                ErrorCode::NotFound,
                format!("session {} was released", rec.id),
            )),
        };
    }
    match cmd {
        Command::ExpireLease => match (rec.state, rec.quiesce_deadline_ms) {
            (Quiesced, Some(deadline)) if deadline <= rules.now_ms => {
                let mut next = resumed(rec, rec.epoch, &rec.host);
                next.last_note = Some(format!(
                    "quiesce lease of {} expired at epoch {} without a resume: resumed on its \
                     last owner {}",
                    lease_words(rules.lease_ms),
                    rec.epoch,
                    rec.host
                ));
                Ok(Transition::Changed(next))
            }
            _ => Ok(Transition::Unchanged),
        },
        // A retry of the resume that made this epoch (same epoch named, same host): the
        // caller's wish holds already. Any other host with that epoch is fenced off below.
        Command::Resume { epoch, host }
            if rec.state == Running
                && rec.resumed_from == Some(*epoch)
                && rec.epoch == epoch + 1
                && rec.host == *host =>
        {
            Ok(Transition::Unchanged)
        }
        Command::PrepareMove { epoch, .. }
        | Command::Quiesce { epoch }
        | Command::Resume { epoch, .. }
        | Command::Release { epoch }
            if *epoch != rec.epoch =>
        {
            Err(stale(rec, *epoch))
        }
        Command::PrepareMove { to_host, .. } => {
            can_serve(rules, to_host)?;
            if rec.moving_to.as_deref() == Some(to_host) {
                return Ok(Transition::Unchanged);
            }
            let mut next = rec.clone();
            next.moving_to = Some(to_host.clone());
            next.last_note = Some(format!("prepared to move from {} to {to_host}", rec.host));
            Ok(Transition::Changed(next))
        }
        Command::Quiesce { .. } => match rec.state {
            // Idempotent: the lease is not extended by a repeat (a stuck caller cannot keep
            // the session quiesced for ever).
            Quiesced => Ok(Transition::Unchanged),
            _ => {
                let mut next = rec.clone();
                next.state = Quiesced;
                next.quiesce_deadline_ms = Some(rules.now_ms.saturating_add(rules.lease_ms));
                next.last_note = Some(format!("quiesced on {} at epoch {}", rec.host, rec.epoch));
                Ok(Transition::Changed(next))
            }
        },
        Command::Resume { epoch, host } => {
            if rec.state != Quiesced {
                return Err(Refusal::new(
                    ErrorCode::NotQuiesced,
                    format!(
                        "session {} is {}: resume only after a quiesce",
                        rec.id, rec.state
                    ),
                ));
            }
            can_serve(rules, host)?;
            let mut next = resumed(rec, *epoch, host);
            next.last_note = Some(if *host == rec.host {
                format!("resumed on {host} at epoch {}", next.epoch)
            } else {
                format!("moved from {} to {host} at epoch {}", rec.host, next.epoch)
            });
            Ok(Transition::Changed(next))
        }
        Command::Release { .. } => {
            let mut next = rec.clone();
            next.state = Released;
            next.moving_to = None;
            next.quiesce_deadline_ms = None;
            next.last_note = Some(format!("released by {} at epoch {}", rec.host, rec.epoch));
            Ok(Transition::Changed(next))
        }
    }
}

/// `rec` running on `host` at the next epoch, resumed from `from_epoch`.
fn resumed(rec: &SessionRecord, from_epoch: u64, host: &str) -> SessionRecord {
    let mut next = rec.clone();
    next.state = SessionState::Running;
    next.host = host.to_owned();
    next.epoch = rec.epoch + 1;
    next.moving_to = None;
    next.quiesce_deadline_ms = None;
    next.resumed_from = Some(from_epoch);
    next
}

fn lease_words(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

/// Whether `host` may use the data plane of `rec` now: only the current owner, only while
/// running (a quiesced session's work and results wait for whoever resumes it).
pub fn check_data_plane(rec: &SessionRecord, host: &str) -> Result<(), Refusal> {
    match rec.state {
        SessionState::Released => Err(Refusal::new(
            ErrorCode::NotFound,
            format!("session {} was released", rec.id),
        )),
        _ if rec.host != host => Err(Refusal {
            code: ErrorCode::NotOwner,
            message: format!(
                "session {} is served to {}, not to {host}",
                rec.id, rec.host
            ),
            current_epoch: Some(rec.epoch),
        }),
        SessionState::Quiesced => Err(Refusal {
            code: ErrorCode::Quiesced,
            message: format!(
                "session {} is quiesced: its work waits for the resume",
                rec.id
            ),
            current_epoch: Some(rec.epoch),
        }),
        SessionState::Running => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: u64 = 60_000;

    fn rules(now_ms: u64) -> Rules<'static> {
        Rules {
            now_ms,
            lease_ms: LEASE,
            hosts: None,
        }
    }

    fn running() -> SessionRecord {
        create(
            "s-1",
            &CreateSession {
                device: "dev0".into(),
                host: "a".into(),
                vm: "vm1".into(),
            },
            &rules(0),
        )
        .unwrap()
    }

    fn changed(t: Result<Transition, Refusal>) -> SessionRecord {
        match t {
            Ok(Transition::Changed(r)) => r,
            other => panic!("expected a change, got {other:?}"),
        }
    }

    fn refused(t: Result<Transition, Refusal>) -> Refusal {
        match t {
            Err(r) => r,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_new_session_runs_at_epoch_one() {
        let s = running();
        assert_eq!((s.epoch, s.state), (1, SessionState::Running));
        let bad = CreateSession {
            device: "a/b".into(),
            host: "a".into(),
            vm: "v".into(),
        };
        assert_eq!(
            create("s-2", &bad, &rules(0)).unwrap_err().code,
            ErrorCode::Invalid
        );
    }

    #[test]
    fn the_move_quiesce_resume_round() {
        let s = running();
        let s = changed(apply(
            &s,
            &Command::PrepareMove {
                epoch: 1,
                to_host: "b".into(),
            },
            &rules(0),
        ));
        assert_eq!(s.moving_to.as_deref(), Some("b"));
        assert_eq!(s.state, SessionState::Running, "prepare-move stops nothing");
        let q = changed(apply(&s, &Command::Quiesce { epoch: 1 }, &rules(1000)));
        assert_eq!((q.state, q.epoch), (SessionState::Quiesced, 1));
        assert_eq!(q.quiesce_deadline_ms, Some(1000 + LEASE));
        let r = changed(apply(
            &q,
            &Command::Resume {
                epoch: 1,
                host: "b".into(),
            },
            &rules(2000),
        ));
        assert_eq!(
            (r.state, r.epoch, r.host.as_str()),
            (SessionState::Running, 2, "b")
        );
        assert_eq!((r.moving_to.clone(), r.quiesce_deadline_ms), (None, None));
        assert!(r
            .last_note
            .as_deref()
            .unwrap()
            .contains("moved from a to b"));
    }

    #[test]
    fn quiesce_is_idempotent_and_does_not_extend_the_lease() {
        let q = changed(apply(&running(), &Command::Quiesce { epoch: 1 }, &rules(0)));
        assert_eq!(
            apply(&q, &Command::Quiesce { epoch: 1 }, &rules(5000)),
            Ok(Transition::Unchanged)
        );
    }

    #[test]
    fn every_mutation_with_another_epoch_is_stale() {
        let s = running();
        let q = changed(apply(&s, &Command::Quiesce { epoch: 1 }, &rules(0)));
        for (rec, cmd) in [
            (
                &s,
                Command::PrepareMove {
                    epoch: 0,
                    to_host: "b".into(),
                },
            ),
            (&s, Command::Quiesce { epoch: 2 }),
            (
                &q,
                Command::Resume {
                    epoch: 0,
                    host: "b".into(),
                },
            ),
            (&q, Command::Release { epoch: 2 }),
        ] {
            let r = refused(apply(rec, &cmd, &rules(0)));
            assert_eq!(
                (r.code, r.current_epoch),
                (ErrorCode::StaleEpoch, Some(1)),
                "{cmd:?}"
            );
        }
    }

    #[test]
    fn the_source_is_fenced_off_after_the_destination_resumed() {
        let q = changed(apply(&running(), &Command::Quiesce { epoch: 1 }, &rules(0)));
        let on_b = changed(apply(
            &q,
            &Command::Resume {
                epoch: 1,
                host: "b".into(),
            },
            &rules(0),
        ));
        // The slow source tries to take the session back, or to release it, with epoch 1.
        let r = refused(apply(
            &on_b,
            &Command::Resume {
                epoch: 1,
                host: "a".into(),
            },
            &rules(0),
        ));
        assert_eq!((r.code, r.current_epoch), (ErrorCode::StaleEpoch, Some(2)));
        let r = refused(apply(&on_b, &Command::Release { epoch: 1 }, &rules(0)));
        assert_eq!(r.code, ErrorCode::StaleEpoch);
        // The destination's own retry of its resume is answered as done.
        assert_eq!(
            apply(
                &on_b,
                &Command::Resume {
                    epoch: 1,
                    host: "b".into()
                },
                &rules(0)
            ),
            Ok(Transition::Unchanged)
        );
    }

    #[test]
    fn resume_only_after_quiesce() {
        let r = refused(apply(
            &running(),
            &Command::Resume {
                epoch: 1,
                host: "b".into(),
            },
            &rules(0),
        ));
        assert_eq!(r.code, ErrorCode::NotQuiesced);
    }

    #[test]
    fn the_lease_expiry_resumes_on_the_last_owner() {
        let q = changed(apply(&running(), &Command::Quiesce { epoch: 1 }, &rules(0)));
        assert_eq!(
            apply(&q, &Command::ExpireLease, &rules(LEASE - 1)),
            Ok(Transition::Unchanged)
        );
        let e = changed(apply(&q, &Command::ExpireLease, &rules(LEASE)));
        assert_eq!(
            (e.state, e.epoch, e.host.as_str()),
            (SessionState::Running, 2, "a")
        );
        assert!(
            e.last_note
                .as_deref()
                .unwrap()
                .contains("lease of 60 s expired"),
            "{e:?}"
        );
        // The destination's late resume is fenced; the source's own resume counts as done.
        let r = refused(apply(
            &e,
            &Command::Resume {
                epoch: 1,
                host: "b".into(),
            },
            &rules(0),
        ));
        assert_eq!(r.code, ErrorCode::StaleEpoch);
        assert_eq!(
            apply(
                &e,
                &Command::Resume {
                    epoch: 1,
                    host: "a".into()
                },
                &rules(0)
            ),
            Ok(Transition::Unchanged)
        );
        // A running session has no lease.
        assert_eq!(
            apply(&e, &Command::ExpireLease, &rules(u64::MAX)),
            Ok(Transition::Unchanged)
        );
    }

    #[test]
    fn release_is_final_and_idempotent() {
        let rel = changed(apply(&running(), &Command::Release { epoch: 1 }, &rules(0)));
        assert_eq!(rel.state, SessionState::Released);
        assert_eq!(
            apply(&rel, &Command::Release { epoch: 1 }, &rules(0)),
            Ok(Transition::Unchanged)
        );
        for cmd in [
            Command::Quiesce { epoch: 1 },
            Command::Resume {
                epoch: 1,
                host: "a".into(),
            },
            Command::Release { epoch: 7 },
        ] {
            assert_eq!(
                refused(apply(&rel, &cmd, &rules(0))).code,
                ErrorCode::NotFound,
                "{cmd:?}"
            );
        }
    }

    #[test]
    fn the_allow_list_refuses_a_host_early() {
        let hosts = ["a".to_owned(), "b".to_owned()];
        let rules = Rules {
            now_ms: 0,
            lease_ms: LEASE,
            hosts: Some(&hosts),
        };
        let r = refused(apply(
            &running(),
            &Command::PrepareMove {
                epoch: 1,
                to_host: "c".into(),
            },
            &rules,
        ));
        assert_eq!(r.code, ErrorCode::CannotServe);
        assert!(r.message.contains("does not serve host c"), "{}", r.message);
        assert!(apply(
            &running(),
            &Command::PrepareMove {
                epoch: 1,
                to_host: "b".into()
            },
            &rules
        )
        .is_ok());
    }

    #[test]
    fn the_data_plane_serves_the_running_owner_only() {
        let s = running();
        assert!(check_data_plane(&s, "a").is_ok());
        assert_eq!(
            check_data_plane(&s, "b").unwrap_err().code,
            ErrorCode::NotOwner
        );
        let q = changed(apply(&s, &Command::Quiesce { epoch: 1 }, &rules(0)));
        assert_eq!(
            check_data_plane(&q, "a").unwrap_err().code,
            ErrorCode::Quiesced
        );
        let b = changed(apply(
            &q,
            &Command::Resume {
                epoch: 1,
                host: "b".into(),
            },
            &rules(0),
        ));
        assert_eq!(
            check_data_plane(&b, "a").unwrap_err().code,
            ErrorCode::NotOwner
        );
        assert!(check_data_plane(&b, "b").is_ok());
    }
}
