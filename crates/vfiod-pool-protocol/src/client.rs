//! The HTTP client of the pool protocol: one [`PoolClient`] per `[[pool]]`, async on tokio,
//! `reqwest` with rustls (ring provider). HTTPS with the pool's CA and a client certificate
//! between hosts; plain `http://` only to a loopback address, so a control call that fences a
//! migration never crosses a network in clear text. Every pool refusal comes back as a typed
//! [`PoolError`] (the fencing one carries the pool's current epoch).
//!
//! Every reply body is read in chunks against a cap ([`MAX_REPLY_SIZE`], [`MAX_ERROR_REPLY_SIZE`]
//! for refusals) and refused with [`PoolError::TooLarge`] past it: a broken or hostile pool
//! must not make the host daemon buffer a body of its choosing (issue 24).

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use url::{Host, Url};

use super::protocol::{self as p, ErrorBody, ErrorCode};
pub use super::protocol::{
    PoolDevice, Quiesced, Results, Session, SessionState, Submitted, WorkItem, WorkResult,
};

/// The largest success reply read from a pool. The biggest protocol reply is
/// `GET /v1/sessions` (about 200 bytes per session): 16 MiB is some 80,000 sessions.
pub const MAX_REPLY_SIZE: usize = 16 << 20;
/// The largest error reply read from a pool: an [`ErrorBody`] is a code and one message, and
/// only its first 200 characters are quoted back.
pub const MAX_ERROR_REPLY_SIZE: usize = 64 << 10;

/// How long an idle connection to a pool is kept for the next call.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a pool is and how to reach it (from a `[[pool]]` section, or a test).
#[derive(Clone, Debug)]
pub struct PoolEndpoint {
    /// `https://pool.example:8443` (or `http://127.0.0.1:PORT` on loopback). A path in the URL
    /// is a prefix before `/v1/...`.
    pub url: Url,
    /// PEM file of the CA(s) that sign the pool's server certificate. Without it, the system's
    /// trust store decides.
    pub ca_file: Option<PathBuf>,
    /// PEM file of this host's client certificate (chain), for mutual TLS.
    pub cert_file: Option<PathBuf>,
    /// PEM file of the private key of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// Bound on TCP connect plus TLS handshake.
    pub connect_timeout: Duration,
    /// Bound on a whole request, reply included.
    pub request_timeout: Duration,
}

impl PoolEndpoint {
    /// An endpoint at `url` without TLS files, with 3 s to connect and 10 s per request.
    pub fn new(url: Url) -> PoolEndpoint {
        PoolEndpoint {
            url,
            ca_file: None,
            cert_file: None,
            key_file: None,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a pool call failed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The epoch named is not the session's: someone else (the destination, the lease expiry)
    /// has moved it on. Fencing: never retry with `current` blindly.
    #[error("stale epoch: the pool's session is at epoch {current}")]
    StaleEpoch { current: u64 },
    #[error("the pool has no such session")]
    NotFound,
    #[error("the session is not quiesced")]
    NotQuiesced,
    /// Any other refusal (4xx) with the pool's code and message (`cannot_serve`,
    /// `device_taken`, `invalid`, `not_owner`, `quiesced`, ...).
    #[error("the pool refused ({code}): {message}")]
    Refused { code: String, message: String },
    /// No answer: connect failure, timeout, TLS handshake refused.
    #[error("pool unreachable: {0}")]
    Unreachable(String),
    /// An answer that is not the protocol: 5xx, a body that does not parse.
    #[error("pool protocol error: {0}")]
    Protocol(String),
    /// The endpoint cannot be used as given (URL, TLS files).
    #[error("pool endpoint: {0}")]
    Config(String),
    /// A reply body over the cap (announced in `Content-Length` or grown past it while read):
    /// refused, and the connection dropped without reading the rest.
    #[error("pool reply too large: {what} is over {limit} bytes{}", .announced.map(|n| format!(" (the pool announced {n})")).unwrap_or_default())]
    TooLarge {
        what: String,
        limit: usize,
        announced: Option<u64>,
    },
}

impl PoolError {
    /// The protocol code of a refusal (`stale_epoch`, `not_found`, `not_quiesced` or the code
    /// of `Refused`), `None` when the pool did not answer with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            PoolError::StaleEpoch { .. } => Some(ErrorCode::StaleEpoch.as_str()),
            PoolError::NotFound => Some(ErrorCode::NotFound.as_str()),
            PoolError::NotQuiesced => Some(ErrorCode::NotQuiesced.as_str()),
            PoolError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }

    /// [`Self::code`] as the protocol's typed code; `None` also for a code this version does not
    /// know.
    pub fn error_code(&self) -> Option<ErrorCode> {
        self.code().and_then(ErrorCode::parse)
    }
}

/// A client of one pool.
#[derive(Clone, Debug)]
pub struct PoolClient {
    http: reqwest::Client,
    /// The URL without a trailing slash; paths (`/v1/...`) are appended.
    base: String,
    /// The cap on a success reply's body ([`MAX_REPLY_SIZE`] unless a test says otherwise).
    max_reply: usize,
}

/// Whether `url`'s host is a loopback address (`127.0.0.0/8`, `::1`, `localhost`).
pub fn is_loopback(url: &Url) -> bool {
    match url.host() {
        Some(Host::Ipv4(ip)) => ip.is_loopback(),
        Some(Host::Ipv6(ip)) => ip.is_loopback(),
        Some(Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        None => false,
    }
}

/// Installs rustls' ring provider as the process default, once. reqwest (built without a
/// provider of its own, to avoid aws-lc-rs) takes the process default; a provider another part
/// of the process installed first stays.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn read_file(what: &str, path: &Path) -> Result<Vec<u8>, PoolError> {
    std::fs::read(path)
        .map_err(|e| PoolError::Config(format!("cannot read the {what} {}: {e}", path.display())))
}

impl PoolClient {
    /// A client for `ep`. Refuses a URL that is neither `https://` nor `http://` to a loopback
    /// host, a certificate without its key (or the reverse), and unreadable or unparsable PEM.
    pub fn new(ep: &PoolEndpoint) -> Result<PoolClient, PoolError> {
        match ep.url.scheme() {
            "https" => {}
            "http" if is_loopback(&ep.url) => {}
            "http" => {
                return Err(PoolError::Config(format!(
                    "{}: plain http is allowed to a loopback address only; use https:// with \
                     the pool's CA and a client certificate",
                    ep.url
                )))
            }
            other => {
                return Err(PoolError::Config(format!(
                    "{}: unsupported scheme {other:?} (http or https)",
                    ep.url
                )))
            }
        }
        if ep.url.host().is_none() {
            return Err(PoolError::Config(format!(
                "{}: the URL names no host",
                ep.url
            )));
        }
        install_crypto_provider();
        let mut b = reqwest::Client::builder()
            .connect_timeout(ep.connect_timeout)
            .timeout(ep.request_timeout)
            // vfiod-pool closes a connection idle for its header timeout (10 s by default):
            // drop ours first, so a call never races the pool's close on a reused connection.
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            // A pool is addressed directly: an HTTP(S)_PROXY meant for the internet must not
            // carry fencing calls.
            .no_proxy()
            .tls_backend_rustls();
        if let Some(ca) = &ep.ca_file {
            let pem = read_file("CA file", ca)?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                PoolError::Config(format!(
                    "CA file {}: {}",
                    ca.display(),
                    crate::error_chain(&e)
                ))
            })?;
            if certs.is_empty() {
                return Err(PoolError::Config(format!(
                    "CA file {} holds no certificate",
                    ca.display()
                )));
            }
            // The pool's own CA only: a certificate some public CA issued for the pool's name
            // is not the pool.
            b = b.tls_certs_only(certs);
        }
        match (&ep.cert_file, &ep.key_file) {
            (Some(cert), Some(key)) => {
                let mut pem = read_file("client certificate", cert)?;
                pem.push(b'\n');
                pem.extend(read_file("client key", key)?);
                let id = reqwest::Identity::from_pem(&pem).map_err(|e| {
                    PoolError::Config(format!(
                        "client certificate {} with key {}: {}",
                        cert.display(),
                        key.display(),
                        crate::error_chain(&e)
                    ))
                })?;
                b = b.identity(id);
            }
            (None, None) => {}
            _ => {
                return Err(PoolError::Config(
                    "a client certificate needs its key file and the reverse".into(),
                ))
            }
        }
        let http = b
            .build()
            .map_err(|e| PoolError::Config(format!("TLS set-up: {}", crate::error_chain(&e))))?;
        let base = ep.url.as_str().trim_end_matches('/').to_owned();
        Ok(PoolClient {
            http,
            base,
            max_reply: MAX_REPLY_SIZE,
        })
    }

    /// The same client with another cap on success replies (the cap on error replies stays
    /// [`MAX_ERROR_REPLY_SIZE`]).
    pub fn with_max_reply(mut self, limit: usize) -> PoolClient {
        self.max_reply = limit;
        self
    }

    /// The pool's URL (without a trailing slash).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// `GET /v1/health`.
    pub async fn health(&self) -> Result<p::Health, PoolError> {
        self.call(Method::GET, p::PATH_HEALTH, None::<&()>).await
    }

    /// `GET /v1/devices`: the pooled devices and which session holds each.
    pub async fn devices(&self) -> Result<Vec<PoolDevice>, PoolError> {
        self.call(Method::GET, p::PATH_DEVICES, None::<&()>).await
    }

    /// `GET /v1/sessions`: every session the pool keeps (released ones included).
    pub async fn sessions(&self) -> Result<Vec<Session>, PoolError> {
        self.call(Method::GET, p::PATH_SESSIONS, None::<&()>).await
    }

    /// `POST /v1/sessions`: lease `device` to `vm` on `host`; epoch 1, running.
    pub async fn create_session(
        &self,
        device: &str,
        host: &str,
        vm: &str,
    ) -> Result<Session, PoolError> {
        let body = p::CreateSession {
            device: device.into(),
            host: host.into(),
            vm: vm.into(),
        };
        self.call(Method::POST, p::PATH_SESSIONS, Some(&body)).await
    }

    /// `GET /v1/sessions/{id}`.
    pub async fn session(&self, id: &str) -> Result<Session, PoolError> {
        check_id(id)?;
        self.call(Method::GET, &p::session_path(id), None::<&()>)
            .await
    }

    /// `POST /v1/sessions/{id}/prepare-move`: fail early if the pool cannot serve `to_host`.
    pub async fn prepare_move(
        &self,
        id: &str,
        epoch: u64,
        to_host: &str,
    ) -> Result<Session, PoolError> {
        check_id(id)?;
        let body = p::PrepareMove {
            epoch,
            to_host: to_host.into(),
        };
        self.call(Method::POST, &p::prepare_move_path(id), Some(&body))
            .await
    }

    /// `POST /v1/sessions/{id}/quiesce`: stop the work at a clean point. Idempotent.
    pub async fn quiesce(&self, id: &str, epoch: u64) -> Result<Quiesced, PoolError> {
        check_id(id)?;
        self.call(
            Method::POST,
            &p::quiesce_path(id),
            Some(&p::Quiesce { epoch }),
        )
        .await
    }

    /// `POST /v1/sessions/{id}/resume`: re-target to `host`, restart the work; the reply
    /// carries the new epoch (`epoch + 1`).
    pub async fn resume(&self, id: &str, epoch: u64, host: &str) -> Result<Session, PoolError> {
        check_id(id)?;
        let body = p::Resume {
            epoch,
            host: host.into(),
        };
        self.call(Method::POST, &p::resume_path(id), Some(&body))
            .await
    }

    /// `DELETE /v1/sessions/{id}?epoch=N`: give the device back. Idempotent.
    pub async fn release(&self, id: &str, epoch: u64) -> Result<(), PoolError> {
        check_id(id)?;
        let path = format!("{}?epoch={epoch}", p::session_path(id));
        let resp = self.send(Method::DELETE, &path, None::<&()>).await?;
        check_status(resp).await.map(drop)
    }

    /// Data plane of the stand-in accelerator: submit items as the driver on `host`.
    pub async fn submit_items(
        &self,
        id: &str,
        host: &str,
        items: &[WorkItem],
    ) -> Result<Submitted, PoolError> {
        check_id(id)?;
        let body = p::SubmitItems {
            host: host.into(),
            items: items.to_vec(),
        };
        self.call(Method::POST, &p::items_path(id), Some(&body))
            .await
    }

    /// Data plane of the stand-in accelerator: acknowledge every result `<= ack` and fetch
    /// the next ones as the driver on `host`.
    pub async fn fetch_results(
        &self,
        id: &str,
        host: &str,
        ack: u64,
        max: Option<u64>,
    ) -> Result<Results, PoolError> {
        check_id(id)?;
        let body = p::FetchResults {
            host: host.into(),
            ack,
            max,
        };
        self.call(Method::POST, &p::results_path(id), Some(&body))
            .await
    }

    async fn send<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<reqwest::Response, PoolError> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method, &url);
        if let Some(b) = body {
            req = req.json(b);
        }
        req.send()
            .await
            .map_err(|e| PoolError::Unreachable(format!("{url}: {}", crate::error_chain(&e))))
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, PoolError> {
        let resp = self.send(method, path, body).await?;
        let resp = check_status(resp).await?;
        let what = format!("the reply to {path}");
        let bytes = read_capped(resp, self.max_reply, &what).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| PoolError::Protocol(format!("{path}: unexpected reply body: {e}")))
    }
}

fn check_id(id: &str) -> Result<(), PoolError> {
    if p::valid_name(id) {
        Ok(())
    } else {
        Err(PoolError::Refused {
            code: ErrorCode::Invalid.as_str().into(),
            message: format!("{id:?} is not a session id"),
        })
    }
}

/// A success reply as it is; an error reply as the [`PoolError`] its body names.
async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, PoolError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let what = format!("the HTTP {status} reply");
    Err(reply_error(
        status,
        read_capped(resp, MAX_ERROR_REPLY_SIZE, &what).await,
    ))
}

/// The error an error reply stands for, from its status and its body as read.
///
/// A body that broke off is the transport's failure (`Unreachable`, which callers retry), never
/// a refusal: a 409 alone does not say whether the session is quiesced, moved or fenced, and
/// reading it as a final refusal made the stand-in driver give up when a live migration cut its
/// connection in the middle of a `quiesced` reply (stop 31's CI).
fn reply_error(status: StatusCode, body: Result<Vec<u8>, PoolError>) -> PoolError {
    match body {
        Ok(bytes) => error_from_reply(status, &String::from_utf8_lossy(&bytes)),
        Err(e) => e,
    }
}

/// The body of `resp`, read chunk by chunk and refused once it passes `limit` bytes (or when
/// `Content-Length` announces more): never more than `limit` plus one chunk in memory.
/// Dropping the response on refusal closes the connection, so the rest is never read.
async fn read_capped(
    mut resp: reqwest::Response,
    limit: usize,
    what: &str,
) -> Result<Vec<u8>, PoolError> {
    let announced = resp.content_length();
    let too_large = || PoolError::TooLarge {
        what: what.to_owned(),
        limit,
        announced,
    };
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // An announced length is only a hint for the first allocation; the cap decides.
    let mut body = Vec::with_capacity(announced.map_or(0, |n| n as usize).min(limit));
    loop {
        let chunk = resp.chunk().await.map_err(|e| {
            PoolError::Unreachable(format!("reading {what}: {}", crate::error_chain(&e)))
        })?;
        let Some(chunk) = chunk else {
            return Ok(body);
        };
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
}

/// The [`PoolError`] of an error reply with `status` and body `text`.
fn error_from_reply(status: StatusCode, text: &str) -> PoolError {
    let body: Option<ErrorBody> = serde_json::from_str(text).ok();
    if status.is_server_error() || !status.is_client_error() {
        let what = body.map(|b| format!("{}: {}", b.error, b.message));
        return PoolError::Protocol(format!(
            "HTTP {status}: {}",
            what.unwrap_or_else(|| text.chars().take(200).collect())
        ));
    }
    let Some(body) = body else {
        return PoolError::Refused {
            code: format!("http_{}", status.as_u16()),
            message: text.chars().take(200).collect(),
        };
    };
    match body.error.as_str() {
        "stale_epoch" => match body.current_epoch {
            Some(current) => PoolError::StaleEpoch { current },
            None => PoolError::Protocol("stale_epoch without current_epoch".into()),
        },
        "not_found" => PoolError::NotFound,
        "not_quiesced" => PoolError::NotQuiesced,
        _ => PoolError::Refused {
            code: body.error,
            message: body.message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(url: &str) -> PoolEndpoint {
        PoolEndpoint::new(Url::parse(url).unwrap())
    }

    #[test]
    fn plain_http_only_to_loopback() {
        assert!(PoolClient::new(&ep("http://127.0.0.1:9000")).is_ok());
        assert!(PoolClient::new(&ep("http://[::1]:9000")).is_ok());
        assert!(PoolClient::new(&ep("http://localhost:9000/")).is_ok());
        for bad in [
            "http://10.0.0.5:9000",
            "http://pool.example:9000",
            "ftp://127.0.0.1/",
        ] {
            let e = PoolClient::new(&ep(bad)).unwrap_err();
            assert!(matches!(e, PoolError::Config(_)), "{bad}: {e}");
        }
        let e = PoolClient::new(&ep("http://10.0.0.5:9000")).unwrap_err();
        assert!(e.to_string().contains("loopback"), "{e}");
        assert!(PoolClient::new(&ep("https://pool.example:8443")).is_ok());
    }

    #[test]
    fn tls_files_are_checked_when_the_client_is_made() {
        let mut e = ep("https://pool.example:8443");
        e.cert_file = Some("/nonexistent/cert.pem".into());
        assert!(
            matches!(PoolClient::new(&e), Err(PoolError::Config(_))),
            "cert without key"
        );
        e.key_file = Some("/nonexistent/key.pem".into());
        let err = PoolClient::new(&e).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/cert.pem"), "{err}");
        let mut e = ep("https://pool.example:8443");
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("ca.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        e.ca_file = Some(empty);
        assert!(matches!(PoolClient::new(&e), Err(PoolError::Config(_))));
    }

    #[test]
    fn a_reply_whose_body_broke_off_is_unreachable_not_refused() {
        let cut = || {
            Err(PoolError::Unreachable(
                "reading the HTTP 409 reply: connection reset".into(),
            ))
        };
        for status in [
            StatusCode::CONFLICT,
            StatusCode::NOT_FOUND,
            StatusCode::SERVICE_UNAVAILABLE,
        ] {
            let e = reply_error(status, cut());
            assert!(matches!(e, PoolError::Unreachable(_)), "{status}: {e:?}");
        }
        let e = reply_error(
            StatusCode::CONFLICT,
            Ok(br#"{"error":"quiesced","message":"m"}"#.to_vec()),
        );
        assert!(
            matches!(e, PoolError::Refused { ref code, .. } if code == "quiesced"),
            "{e:?}"
        );
    }

    #[test]
    fn error_replies_become_typed_errors() {
        let e = error_from_reply(
            StatusCode::CONFLICT,
            r#"{"error":"stale_epoch","message":"m","current_epoch":4}"#,
        );
        assert!(matches!(e, PoolError::StaleEpoch { current: 4 }));
        let e = error_from_reply(
            StatusCode::NOT_FOUND,
            r#"{"error":"not_found","message":"m"}"#,
        );
        assert!(matches!(e, PoolError::NotFound));
        let e = error_from_reply(
            StatusCode::CONFLICT,
            r#"{"error":"not_quiesced","message":"m"}"#,
        );
        assert!(matches!(e, PoolError::NotQuiesced));
        let e = error_from_reply(
            StatusCode::UNPROCESSABLE_ENTITY,
            r#"{"error":"cannot_serve","message":"host c is not served"}"#,
        );
        assert_eq!(e.code(), Some("cannot_serve"));
        assert!(e.to_string().contains("host c is not served"));
        let e = error_from_reply(StatusCode::INTERNAL_SERVER_ERROR, "boom");
        assert!(matches!(e, PoolError::Protocol(_)));
        let e = error_from_reply(StatusCode::BAD_REQUEST, "not json");
        assert_eq!(e.code(), Some("http_400"));
    }
}
