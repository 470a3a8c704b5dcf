//! The pool control protocol, version 1 (docs/pool-protocol.md, docs/pool-openapi.yaml): the
//! request and response bodies, the session states, the error body and its codes, and the paths.
//! Plain serde types and pure functions, no I/O: the client (vfiod's side), the reference pool
//! service and the tests share them, so the two ends cannot drift apart.

use serde::{Deserialize, Serialize};

/// The version prefix of every path. A breaking change of the protocol gets `/v2`.
pub const API_PREFIX: &str = "/v1";
/// `GET`: the pool is up ([`Health`]).
pub const PATH_HEALTH: &str = "/v1/health";
/// `GET`: the pooled devices ([`PoolDevice`] list).
pub const PATH_DEVICES: &str = "/v1/devices";
/// `POST` ([`CreateSession`] -> 201 [`Session`]), `GET` (list of [`Session`]).
pub const PATH_SESSIONS: &str = "/v1/sessions";

/// One route the protocol defines: a method and a path template in OpenAPI's (and axum's)
/// `{id}` syntax. The server mounts exactly these and a test checks that the OpenAPI file
/// documents exactly these, so the documentation cannot miss a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
}

pub const ROUTE_HEALTH: Route = Route {
    method: "GET",
    path: PATH_HEALTH,
};
pub const ROUTE_DEVICES: Route = Route {
    method: "GET",
    path: PATH_DEVICES,
};
pub const ROUTE_SESSIONS_LIST: Route = Route {
    method: "GET",
    path: PATH_SESSIONS,
};
pub const ROUTE_SESSION_CREATE: Route = Route {
    method: "POST",
    path: PATH_SESSIONS,
};
pub const ROUTE_SESSION_GET: Route = Route {
    method: "GET",
    path: "/v1/sessions/{id}",
};
pub const ROUTE_SESSION_RELEASE: Route = Route {
    method: "DELETE",
    path: "/v1/sessions/{id}",
};
pub const ROUTE_PREPARE_MOVE: Route = Route {
    method: "POST",
    path: "/v1/sessions/{id}/prepare-move",
};
pub const ROUTE_QUIESCE: Route = Route {
    method: "POST",
    path: "/v1/sessions/{id}/quiesce",
};
pub const ROUTE_RESUME: Route = Route {
    method: "POST",
    path: "/v1/sessions/{id}/resume",
};
/// Data plane of the stand-in accelerator: submit numbered work items.
pub const ROUTE_ITEMS: Route = Route {
    method: "POST",
    path: "/v1/sessions/{id}/items",
};
/// Data plane of the stand-in accelerator: acknowledge and fetch results.
pub const ROUTE_RESULTS: Route = Route {
    method: "POST",
    path: "/v1/sessions/{id}/results",
};

/// Every route of protocol version 1.
pub const ROUTES: &[Route] = &[
    ROUTE_HEALTH,
    ROUTE_DEVICES,
    ROUTE_SESSIONS_LIST,
    ROUTE_SESSION_CREATE,
    ROUTE_SESSION_GET,
    ROUTE_SESSION_RELEASE,
    ROUTE_PREPARE_MOVE,
    ROUTE_QUIESCE,
    ROUTE_RESUME,
    ROUTE_ITEMS,
    ROUTE_RESULTS,
];

/// `/v1/sessions/{id}`.
pub fn session_path(id: &str) -> String {
    format!("{PATH_SESSIONS}/{id}")
}

/// `/v1/sessions/{id}/prepare-move`.
pub fn prepare_move_path(id: &str) -> String {
    format!("{PATH_SESSIONS}/{id}/prepare-move")
}

/// `/v1/sessions/{id}/quiesce`.
pub fn quiesce_path(id: &str) -> String {
    format!("{PATH_SESSIONS}/{id}/quiesce")
}

/// `/v1/sessions/{id}/resume`.
pub fn resume_path(id: &str) -> String {
    format!("{PATH_SESSIONS}/{id}/resume")
}

/// `/v1/sessions/{id}/items`.
pub fn items_path(id: &str) -> String {
    format!("{PATH_SESSIONS}/{id}/items")
}

/// `/v1/sessions/{id}/results`.
pub fn results_path(id: &str) -> String {
    format!("{PATH_SESSIONS}/{id}/results")
}

/// Whether `s` can be a session id, a device id, a host or a VM name on the wire: 1 to 128
/// characters of `[A-Za-z0-9._:-]`. Ids go into URL paths, so neither end has to escape them,
/// and a name with a slash or a space is refused as `invalid` before it reaches any state.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// A session's state. A session is created `running`; `quiesced` between a quiesce and the
/// resume (or the lease expiry) that ends it; `released` after a DELETE, for good.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// The device works for the session's host; the data plane serves that host only.
    Running,
    /// Work is stopped at a clean point: every item is either completed (its result kept for
    /// delivery) or still queued. The quiesce lease runs.
    Quiesced,
    /// The device is free again; the session's queued work and undelivered results are gone.
    Released,
}

impl SessionState {
    /// The wire name: `running`, `quiesced`, `released`.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Running => "running",
            SessionState::Quiesced => "quiesced",
            SessionState::Released => "released",
        }
    }

    /// The state from its wire name.
    pub fn parse(s: &str) -> Option<SessionState> {
        match s {
            "running" => Some(SessionState::Running),
            "quiesced" => Some(SessionState::Quiesced),
            "released" => Some(SessionState::Released),
            _ => None,
        }
    }
}

impl std::fmt::Display for SessionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `POST /v1/sessions`: lease `device` to `vm` running on `host`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateSession {
    pub device: String,
    pub host: String,
    pub vm: String,
}

/// `POST /v1/sessions/{id}/prepare-move`: the destination asks whether the pool can serve
/// `to_host`; nothing stops.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepareMove {
    pub epoch: u64,
    pub to_host: String,
}

/// `POST /v1/sessions/{id}/quiesce`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quiesce {
    pub epoch: u64,
}

/// `POST /v1/sessions/{id}/resume`: re-target the session to `host` and restart its work.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    pub epoch: u64,
    pub host: String,
}

/// The query of `DELETE /v1/sessions/{id}?epoch=N`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseQuery {
    pub epoch: u64,
}

/// A session as the pool reports it (`GET /v1/sessions/{id}` and the replies of the
/// mutating calls).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub id: String,
    pub device: String,
    /// The session's current owner: the only host the data plane serves.
    pub host: String,
    pub vm: String,
    /// The fencing token: every mutating call names the epoch it expects. Starts at 1, +1 at
    /// every resume (by a caller or by the lease expiry).
    pub epoch: u64,
    pub state: SessionState,
    /// Work items accepted and not yet processed.
    #[serde(default)]
    pub in_flight: u64,
    /// Results completed and not yet acknowledged by the owner (they go to whichever host
    /// owns the session when they are fetched).
    #[serde(default)]
    pub undelivered: u64,
    /// The destination a `prepare-move` confirmed, until the resume.
    #[serde(default)]
    pub moving_to: Option<String>,
    /// When a quiesced session's lease ends (RFC 3339, UTC), if quiesced.
    #[serde(default)]
    pub quiesce_deadline: Option<String>,
    /// Why the session last changed owner or state, in words ("quiesce lease of 60 s expired
    /// without a resume: resumed on its last owner host-a").
    #[serde(default)]
    pub last_note: Option<String>,
}

/// The reply of a quiesce.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quiesced {
    /// The same epoch the caller named: a quiesce does not change the owner.
    pub epoch: u64,
    /// Always [`SessionState::Quiesced`].
    pub state: SessionState,
    /// Work items still queued: they run after the resume.
    pub in_flight: u64,
    /// Results kept for delivery to the host that resumes the session.
    #[serde(default)]
    pub undelivered: u64,
    /// When the quiesce lease ends (RFC 3339, UTC).
    #[serde(default)]
    pub quiesce_deadline: Option<String>,
}

/// A pooled device (`GET /v1/devices`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDevice {
    pub id: String,
    /// `gpu`, `fpga`, ...
    pub kind: String,
    pub model: String,
    /// The session holding the device, if one does.
    #[serde(default)]
    pub session: Option<String>,
}

/// `GET /v1/health`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// `ok`.
    pub status: String,
    /// Protocol version: `1`.
    pub protocol: u32,
    /// The implementation, e.g. `vfiod-pool 0.1.0`.
    pub server: String,
}

/// One numbered work item of the stand-in accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkItem {
    /// The driver's sequence number, 1, 2, 3, ...: items of a session are numbered in order.
    pub seq: u64,
    pub payload: u64,
}

/// `POST /v1/sessions/{id}/items`: the driver on `host` submits items.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitItems {
    pub host: String,
    pub items: Vec<WorkItem>,
}

/// The reply of a submission.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submitted {
    /// Items newly queued.
    pub accepted: u64,
    /// Items ignored because their number was already accepted (a retried submission).
    pub repeated: u64,
    /// The highest item number the session has accepted.
    pub last_seq: u64,
    pub epoch: u64,
}

/// `POST /v1/sessions/{id}/results`: the driver on `host` acknowledges every result up to
/// `ack` (it holds them all) and asks for the rest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchResults {
    pub host: String,
    /// Every result numbered `<= ack` reached the driver: the pool may forget them.
    pub ack: u64,
    /// At most this many results in the reply (the pool may cap it further).
    #[serde(default)]
    pub max: Option<u64>,
}

/// One result of the stand-in accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkResult {
    pub seq: u64,
    /// [`work_value`] of the item's number and payload.
    pub value: u64,
}

/// The reply of a fetch: results not yet acknowledged, oldest first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Results {
    pub epoch: u64,
    pub results: Vec<WorkResult>,
    /// Items still queued.
    pub in_flight: u64,
}

/// What the stand-in accelerator computes for an item: a deterministic function of its number
/// and payload, so the driver can tell a right result from a wrong one (splitmix64's finaliser).
pub fn work_value(seq: u64, payload: u64) -> u64 {
    let mut z = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ payload;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The error codes of the protocol, each with its HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 409: the epoch named is not the session's; the body carries `current_epoch`.
    StaleEpoch,
    /// 404: no such session (or device), or the session was released.
    NotFound,
    /// 409: resume of a session that is not quiesced.
    NotQuiesced,
    /// 422: the pool cannot serve the host named (prepare-move, resume, create).
    CannotServe,
    /// 400: a malformed body, query or name.
    Invalid,
    /// 409: the session is busy with another change; retry.
    Busy,
    /// 409: the device already has a session.
    DeviceTaken,
    /// 401: no or an unknown client certificate (when the pool checks it above TLS).
    Unauthorized,
    /// 409: data plane: the host named is not the session's current owner.
    NotOwner,
    /// 409: data plane: the session is quiesced; its work and results wait for the resume.
    Quiesced,
    /// 500: the pool failed (its store); the body says how.
    Internal,
    /// 405: the path exists, the method is not one of its routes.
    MethodNotAllowed,
    /// 503: the pool is at a bound (connections in total or from one address, a request's
    /// deadline); retry later.
    Unavailable,
}

impl ErrorCode {
    /// Every code, in the order above.
    pub const ALL: [ErrorCode; 13] = [
        ErrorCode::StaleEpoch,
        ErrorCode::NotFound,
        ErrorCode::NotQuiesced,
        ErrorCode::CannotServe,
        ErrorCode::Invalid,
        ErrorCode::Busy,
        ErrorCode::DeviceTaken,
        ErrorCode::Unauthorized,
        ErrorCode::NotOwner,
        ErrorCode::Quiesced,
        ErrorCode::Internal,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Unavailable,
    ];

    /// The code of a wire name; `None` for a name this version does not know (a newer pool's:
    /// a client treats it as a refusal it cannot act on).
    pub fn parse(s: &str) -> Option<ErrorCode> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The HTTP status a reply with this code carries.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::StaleEpoch
            | ErrorCode::NotQuiesced
            | ErrorCode::Busy
            | ErrorCode::DeviceTaken
            | ErrorCode::NotOwner
            | ErrorCode::Quiesced => 409,
            ErrorCode::NotFound => 404,
            ErrorCode::CannotServe => 422,
            ErrorCode::Invalid => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Internal => 500,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Unavailable => 503,
        }
    }

    /// The wire name (`stale_epoch`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::StaleEpoch => "stale_epoch",
            ErrorCode::NotFound => "not_found",
            ErrorCode::NotQuiesced => "not_quiesced",
            ErrorCode::CannotServe => "cannot_serve",
            ErrorCode::Invalid => "invalid",
            ErrorCode::Busy => "busy",
            ErrorCode::DeviceTaken => "device_taken",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::NotOwner => "not_owner",
            ErrorCode::Quiesced => "quiesced",
            ErrorCode::Internal => "internal",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Unavailable => "unavailable",
        }
    }
}

/// The body of every error reply: `{"error": "<code>", "message": "...", "current_epoch": N}`.
/// `error` is kept as a string so that a client reads codes a newer pool adds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default)]
    pub message: String,
    /// The session's epoch, on `stale_epoch` (and `not_owner`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_epoch: Option<u64>,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            error: code.as_str().to_owned(),
            message: message.into(),
            current_epoch: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_state_is_snake_case_on_the_wire() {
        for s in [
            SessionState::Running,
            SessionState::Quiesced,
            SessionState::Released,
        ] {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
            assert_eq!(SessionState::parse(s.as_str()), Some(s));
        }
        assert_eq!(SessionState::parse("paused"), None);
    }

    #[test]
    fn error_codes_have_their_statuses_and_names() {
        let stale = ErrorBody {
            current_epoch: Some(7),
            ..ErrorBody::new(ErrorCode::StaleEpoch, "epoch 6 is stale")
        };
        let json = serde_json::to_value(&stale).unwrap();
        assert_eq!(json["error"], "stale_epoch");
        assert_eq!(json["current_epoch"], 7);
        assert_eq!(ErrorCode::StaleEpoch.status(), 409);
        assert_eq!(ErrorCode::NotFound.status(), 404);
        assert_eq!(ErrorCode::CannotServe.status(), 422);
        assert_eq!(ErrorCode::Invalid.status(), 400);
        // The serde name and as_str agree for every code.
        for c in [
            ErrorCode::StaleEpoch,
            ErrorCode::NotFound,
            ErrorCode::NotQuiesced,
            ErrorCode::CannotServe,
            ErrorCode::Invalid,
            ErrorCode::Busy,
            ErrorCode::DeviceTaken,
            ErrorCode::Unauthorized,
            ErrorCode::NotOwner,
            ErrorCode::Quiesced,
            ErrorCode::Internal,
            ErrorCode::MethodNotAllowed,
            ErrorCode::Unavailable,
        ] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
    }

    #[test]
    fn a_session_without_optional_fields_parses() {
        let s: Session = serde_json::from_str(
            r#"{"id":"s-1","device":"dev0","host":"a","vm":"vm1","epoch":1,"state":"running"}"#,
        )
        .unwrap();
        assert_eq!(s.epoch, 1);
        assert_eq!(s.moving_to, None);
        assert_eq!(s.in_flight, 0);
    }

    #[test]
    fn names_that_would_need_escaping_are_invalid() {
        assert!(valid_name("s-17"));
        assert!(valid_name("host-a.example.org"));
        assert!(!valid_name(""));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("a b"));
        assert!(!valid_name(&"x".repeat(129)));
    }

    #[test]
    fn paths_fill_the_route_templates() {
        assert_eq!(
            session_path("s-1"),
            ROUTE_SESSION_GET.path.replace("{id}", "s-1")
        );
        assert_eq!(
            quiesce_path("s-1"),
            ROUTE_QUIESCE.path.replace("{id}", "s-1")
        );
        assert_eq!(resume_path("s-1"), ROUTE_RESUME.path.replace("{id}", "s-1"));
        assert_eq!(
            prepare_move_path("s-1"),
            ROUTE_PREPARE_MOVE.path.replace("{id}", "s-1")
        );
        assert_eq!(items_path("s-1"), ROUTE_ITEMS.path.replace("{id}", "s-1"));
        assert_eq!(
            results_path("s-1"),
            ROUTE_RESULTS.path.replace("{id}", "s-1")
        );
        assert!(ROUTES.iter().all(|r| r.path.starts_with(API_PREFIX)));
    }

    #[test]
    fn work_values_depend_on_number_and_payload() {
        assert_ne!(work_value(1, 0), work_value(2, 0));
        assert_ne!(work_value(1, 0), work_value(1, 1));
        assert_eq!(work_value(5, 9), work_value(5, 9));
    }
}

#[cfg(test)]
mod error_code_tests {
    use super::ErrorCode;

    #[test]
    fn every_code_parses_back_from_its_wire_name_and_serde_agrees() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        assert_eq!(ErrorCode::parse("no_such_code"), None);
    }
}
