//! The HTTP face of the pool: the routes of [`crate::protocol::ROUTES`] on axum, each a
//! thin translation to [`Core`]; refusals become the protocol's error body with its status,
//! axum's own too (an unknown path, a method a path does not serve, a path that is not UTF-8,
//! a body or query that does not parse, a request past its deadline).

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, MethodRouter};
use axum::{Json, Router};

use super::core::{Core, CoreError};
use super::state::{Command, Refusal};
use super::Service;
use crate::protocol::{self as p, ErrorBody, ErrorCode};

/// An error reply.
struct ApiError(CoreError);

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> ApiError {
        ApiError(e)
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        ApiError(CoreError::Refused(r))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (code, body) = match self.0 {
            CoreError::Refused(r) => (
                r.code,
                ErrorBody {
                    current_epoch: r.current_epoch,
                    ..ErrorBody::new(r.code, r.message)
                },
            ),
            CoreError::Store(e) => {
                let chain = crate::error_chain(&e);
                tracing::error!("{chain}");
                (
                    ErrorCode::Internal,
                    ErrorBody::new(ErrorCode::Internal, chain),
                )
            }
        };
        let status =
            StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(body)).into_response()
    }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

fn invalid(what: impl std::fmt::Display) -> ApiError {
    Refusal::new(ErrorCode::Invalid, what.to_string()).into()
}

/// The body, or `invalid` with serde's reason.
fn body<T>(b: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    b.map(|Json(v)| v).map_err(|e| invalid(e.body_text()))
}

/// The session id of the path, or `invalid` (a percent-encoded path that is not UTF-8).
fn path_id(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    p.map(|Path(id)| id)
        .map_err(|e| invalid(format!("the path's session id: {}", e.body_text())))
}

/// The `405` of a path served with other methods, naming them.
fn method_not_allowed(path: &'static str) -> ApiError {
    let methods: Vec<&str> = p::ROUTES
        .iter()
        .filter(|r| r.path == path)
        .map(|r| r.method)
        .collect();
    Refusal::new(
        ErrorCode::MethodNotAllowed,
        format!("{path} is served with {} only", methods.join(", ")),
    )
    .into()
}

/// Answers `unavailable` when the request is not answered within the service's request
/// timeout (a body that trickles in, a store that hangs): the connection is freed.
async fn deadline(State(s): State<Arc<Service>>, req: Request, next: Next) -> Response {
    let limit = s.request_timeout;
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(reply) => reply,
        Err(_) => ApiError::from(Refusal::new(
            ErrorCode::Unavailable,
            format!(
                "the request was not answered within {} s",
                limit.as_secs_f64()
            ),
        ))
        .into_response(),
    }
}

/// The router of protocol v1 on `service`: built from [`p::ROUTES`], so it serves exactly the
/// routes the protocol (and the OpenAPI file, which a test compares) defines.
pub fn router(service: Arc<Service>) -> Router {
    let mut by_path: Vec<(&'static str, MethodRouter<Arc<Service>>)> = Vec::new();
    for r in p::ROUTES {
        let h = handler(*r);
        match by_path.iter_mut().find(|(path, _)| *path == r.path) {
            Some((_, m)) => *m = std::mem::take(m).merge(h),
            None => by_path.push((r.path, h)),
        }
    }
    let mut router = Router::new();
    for (path, m) in by_path {
        router = router.route(
            path,
            m.fallback(move || async move { method_not_allowed(path) }),
        );
    }
    router
        .fallback(|| async {
            ApiError::from(Refusal::new(
                ErrorCode::NotFound,
                "no such path in pool protocol v1",
            ))
        })
        .layer(axum::middleware::from_fn_with_state(
            service.clone(),
            deadline,
        ))
        .with_state(service)
}

/// The handler of one protocol route.
fn handler(r: p::Route) -> MethodRouter<Arc<Service>> {
    use p::*;
    match r {
        ROUTE_HEALTH => get(health),
        ROUTE_DEVICES => get(devices),
        ROUTE_SESSIONS_LIST => get(sessions),
        ROUTE_SESSION_CREATE => post(create),
        ROUTE_SESSION_GET => get(session),
        ROUTE_SESSION_RELEASE => delete(release),
        ROUTE_PREPARE_MOVE => post(prepare_move),
        ROUTE_QUIESCE => post(quiesce),
        ROUTE_RESUME => post(resume),
        ROUTE_ITEMS => post(items),
        ROUTE_RESULTS => post(results),
        // A route added to the protocol without a handler: caught by the unit test below
        // (and every integration test) before it could ship.
        other => panic!(
            "pool protocol route {} {} has no handler",
            other.method, other.path
        ),
    }
}

fn core(s: &Service) -> &Core {
    &s.core
}

async fn health() -> Json<p::Health> {
    Json(p::Health {
        status: "ok".into(),
        protocol: 1,
        server: format!("vfiod-pool {}", env!("CARGO_PKG_VERSION")),
    })
}

async fn devices(State(s): State<Arc<Service>>) -> ApiResult<Vec<p::PoolDevice>> {
    Ok(Json(core(&s).devices()?))
}

async fn sessions(State(s): State<Arc<Service>>) -> ApiResult<Vec<p::Session>> {
    Ok(Json(core(&s).sessions()?))
}

async fn create(
    State(s): State<Arc<Service>>,
    b: Result<Json<p::CreateSession>, JsonRejection>,
) -> Result<(StatusCode, Json<p::Session>), ApiError> {
    let req = body(b)?;
    let session = core(&s).create(&req)?;
    tracing::info!(
        session = session.id,
        device = req.device,
        host = req.host,
        vm = req.vm,
        "created"
    );
    s.start_worker(&session.id);
    Ok((StatusCode::CREATED, Json(session)))
}

async fn session(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult<p::Session> {
    let id = path_id(id)?;
    Ok(Json(core(&s).session(&id)?))
}

async fn release(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<p::ReleaseQuery>, QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let id = path_id(id)?;
    let Query(q) = q.map_err(|e| invalid(format!("{} (DELETE needs ?epoch=N)", e.body_text())))?;
    core(&s).change(&id, &Command::Release { epoch: q.epoch })?;
    Ok(StatusCode::NO_CONTENT)
}

async fn prepare_move(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
    b: Result<Json<p::PrepareMove>, JsonRejection>,
) -> ApiResult<p::Session> {
    let id = path_id(id)?;
    let req = body(b)?;
    Ok(Json(core(&s).change(
        &id,
        &Command::PrepareMove {
            epoch: req.epoch,
            to_host: req.to_host,
        },
    )?))
}

async fn quiesce(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
    b: Result<Json<p::Quiesce>, JsonRejection>,
) -> ApiResult<p::Quiesced> {
    let id = path_id(id)?;
    let req = body(b)?;
    Ok(Json(core(&s).quiesce(&id, req.epoch).await?))
}

async fn resume(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
    b: Result<Json<p::Resume>, JsonRejection>,
) -> ApiResult<p::Session> {
    let id = path_id(id)?;
    let req = body(b)?;
    Ok(Json(core(&s).change(
        &id,
        &Command::Resume {
            epoch: req.epoch,
            host: req.host,
        },
    )?))
}

async fn items(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
    b: Result<Json<p::SubmitItems>, JsonRejection>,
) -> ApiResult<p::Submitted> {
    let id = path_id(id)?;
    let req = body(b)?;
    Ok(Json(core(&s).submit(&id, &req.host, &req.items)?))
}

async fn results(
    State(s): State<Arc<Service>>,
    id: Result<Path<String>, PathRejection>,
    b: Result<Json<p::FetchResults>, JsonRejection>,
) -> ApiResult<p::Results> {
    let id = path_id(id)?;
    let req = body(b)?;
    Ok(Json(core(&s).fetch(&id, &req.host, req.ack, req.max)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_protocol_route_has_a_handler() {
        for r in p::ROUTES {
            let _ = handler(*r);
        }
    }
}
