//! The pool's accept loop, plain HTTP and TLS alike, under bounds that keep it answering when
//! clients misbehave (issue 24): a connection must send its request headers within
//! [`ConnectionLimits::header_read_timeout`] (from the connect, the handshake or the end of the
//! previous reply, so an idle keep-alive connection is closed too), a request must be answered
//! within [`ConnectionLimits::request_timeout`], and connections are counted in total and per
//! client address. A connection over a count is refused at once: on plain HTTP with a `503`
//! and the protocol's error body (at most [`MAX_REFUSING`] at a time, each for at most a
//! second), on TLS by closing it (a handshake is the costly part).
//! [`raise_nofile_limit`] gives the process the descriptors the counts assume.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::protocol::{ErrorBody, ErrorCode};

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Refused plain-HTTP connections being answered at once (beyond, a refused connection is
/// closed without its 503): a flood of refusals cannot become a flood of tasks.
pub const MAX_REFUSING: usize = 64;
/// How long a refused connection may take to read its `503`.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a stopping pool lets requests in progress finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Descriptors kept free of connections: the store (database, WAL, shared memory, lock), the
/// listener, logging, and a margin.
pub const RESERVED_FDS: u64 = 64;

/// Bounds on the clients of one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Time a connection has to send a request's headers, counted from the connect (after the
    /// TLS handshake) and from the end of each reply: a partial header and an idle keep-alive
    /// connection are both closed after it.
    pub header_read_timeout: Duration,
    /// Time a request may take from its headers to its reply (its body read included).
    pub request_timeout: Duration,
    /// Connections at once, all clients together (lowered at start to what the descriptor
    /// limit allows).
    pub max_connections: usize,
    /// Connections at once from one client address.
    pub max_per_client: usize,
}

impl Default for ConnectionLimits {
    /// 10 s for headers, 30 s per request, 1024 connections, 64 per client address: a pool
    /// serves a few dozen hosts, each with a client and a driver or two per session.
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_per_client: 64,
        }
    }
}

impl ConnectionLimits {
    /// Refuses zero bounds: a limit of 0 serves nobody, a zero timeout closes every connection.
    pub fn check(&self) -> Result<(), String> {
        if self.header_read_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err("connection timeouts must be longer than 0".into());
        }
        if self.max_connections == 0 || self.max_per_client == 0 {
            return Err("connection limits must be at least 1".into());
        }
        Ok(())
    }
}

/// Whether a new connection is served, given the connections open now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Serve,
    /// All clients together hold `max_connections`.
    Full,
    /// This client address holds `max_per_client`.
    ClientFull,
}

/// The decision for a new connection when `total` are open, `of_client` of them from its
/// address. Pure.
pub fn admission(limits: &ConnectionLimits, total: usize, of_client: usize) -> Admission {
    if total >= limits.max_connections {
        Admission::Full
    } else if of_client >= limits.max_per_client {
        Admission::ClientFull
    } else {
        Admission::Serve
    }
}

/// The connections open now, in total and per client address.
#[derive(Default)]
struct Counts {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// A counted connection: counted out when dropped (the connection's task ends, however).
struct Slot {
    counts: Arc<Mutex<Counts>>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        c.total -= 1;
        if let Some(n) = c.per_client.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_client.remove(&self.ip);
            }
        }
    }
}

fn take_slot(
    counts: &Arc<Mutex<Counts>>,
    limits: &ConnectionLimits,
    ip: IpAddr,
) -> Result<Slot, Admission> {
    let mut c = counts.lock().unwrap_or_else(PoisonError::into_inner);
    let of_client = c.per_client.get(&ip).copied().unwrap_or(0);
    match admission(limits, c.total, of_client) {
        Admission::Serve => {
            c.total += 1;
            *c.per_client.entry(ip).or_default() += 1;
            Ok(Slot {
                counts: counts.clone(),
                ip,
            })
        }
        refused => Err(refused),
    }
}

/// The `503` a refused plain-HTTP connection gets, in the protocol's error body.
fn refusal_reply(why: Admission, limits: &ConnectionLimits) -> Vec<u8> {
    let message = match why {
        Admission::ClientFull => format!(
            "this client address has {} connections open, the most the pool serves from one \
             address; retry when one closes",
            limits.max_per_client
        ),
        _ => format!(
            "the pool serves {} connections at once and has that many; retry shortly",
            limits.max_connections
        ),
    };
    let body =
        serde_json::to_string(&ErrorBody::new(ErrorCode::Unavailable, message)).unwrap_or_default();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `app` on `listener` until `stop` turns true (or its sender is dropped), with TLS
/// when `acceptor` is given; then lets each connection finish the request it is answering
/// (idle ones close at once) for up to [`SHUTDOWN_GRACE`], and drops what is left.
pub(super) async fn serve(
    listener: TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    app: axum::Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) {
    let counts = Arc::new(Mutex::new(Counts::default()));
    let refusing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => match take_slot(&counts, &limits, peer.ip()) {
                    Ok(slot) => {
                        let acceptor = acceptor.clone();
                        let app = app.clone();
                        let limits = limits.clone();
                        let stop = stop.clone();
                        conns.spawn(async move {
                            let _slot = slot;
                            connection(tcp, peer, acceptor, app, &limits, stop).await;
                        });
                    }
                    Err(why) => {
                        tracing::warn!(%peer, ?why, "connection refused: over the connection limit");
                        if acceptor.is_none() && refusing.load(Ordering::Relaxed) < MAX_REFUSING {
                            refusing.fetch_add(1, Ordering::Relaxed);
                            let refusing = refusing.clone();
                            let reply = refusal_reply(why, &limits);
                            conns.spawn(async move {
                                let _ = tokio::time::timeout(REFUSAL_TIMEOUT, refuse(tcp, &reply)).await;
                                refusing.fetch_sub(1, Ordering::Relaxed);
                            });
                        }
                    }
                },
                Err(e) => {
                    // EMFILE and the like: the descriptors come back as connections close.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    break;
                }
            }
        }
    }
    let grace = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    });
    if grace.await.is_err() {
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

/// Sends `reply` and closes `tcp` cleanly: its write side first, then what the client sent is
/// read and dropped until it closes too. Closing with its request unread would make the kernel
/// reset the connection, and the client could lose the reply.
async fn refuse(mut tcp: TcpStream, reply: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if tcp.write_all(reply).await.is_err() || tcp.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 4096];
    while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// One connection: the TLS handshake if any, then HTTP/1.1 by hyper under the header-read
/// timeout.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    app: axum::Router,
    limits: &ConnectionLimits,
    stop: watch::Receiver<bool>,
) {
    let Some(acceptor) = acceptor else {
        return http(tcp, peer, app, limits, stop).await;
    };
    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp));
    let mut stopping = stop.clone();
    let tls = tokio::select! {
        tls = handshake => tls,
        () = stopped(&mut stopping) => return,
    };
    match tls {
        Ok(Ok(tls)) => http(tls, peer, app, limits, stop).await,
        Ok(Err(e)) => tracing::warn!(%peer, "TLS handshake refused: {e}"),
        Err(_) => tracing::warn!(%peer, "TLS handshake timed out"),
    }
}

/// Returns when `stop` turns true or its sender is dropped (its guard never lives across
/// another await).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// HTTP/1.1 on `io` until the client closes, a timeout closes it, or the pool stops: then the
/// reply in progress is finished and the connection closed.
async fn http<I>(
    io: I,
    peer: SocketAddr,
    app: axum::Router,
    limits: &ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = TowerToHyperService::new(app);
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = stopped(&mut stop) => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, "connection: {e}");
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (each connection is a descriptor; the
/// default soft limit of 1024 is what 1,100 idle connections used up) and returns the soft
/// limit now in force.
pub fn raise_nofile_limit() -> Result<u64, nix::Error> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(getrlimit(Resource::RLIMIT_NOFILE)?.0)
}

/// `limits` with `max_connections` lowered to what `nofile` descriptors allow after
/// [`RESERVED_FDS`] and the refusals being answered ([`MAX_REFUSING`]). Pure.
pub fn fit_to_descriptors(mut limits: ConnectionLimits, nofile: u64) -> ConnectionLimits {
    let room = nofile
        .saturating_sub(RESERVED_FDS + MAX_REFUSING as u64)
        .max(1);
    limits.max_connections = limits
        .max_connections
        .min(usize::try_from(room).unwrap_or(usize::MAX));
    limits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_is_served() {
        let limits = ConnectionLimits {
            max_connections: 10,
            max_per_client: 3,
            ..ConnectionLimits::default()
        };
        // (open in total, open from this client, decision)
        let cases = [
            (0, 0, Admission::Serve),
            (9, 2, Admission::Serve),
            (9, 3, Admission::ClientFull),
            (10, 0, Admission::Full),
            (10, 3, Admission::Full),
            (5, 5, Admission::ClientFull),
        ];
        for (total, of_client, want) in cases {
            assert_eq!(
                admission(&limits, total, of_client),
                want,
                "{total} {of_client}"
            );
        }
    }

    #[test]
    fn slots_are_counted_back_when_dropped() {
        let limits = ConnectionLimits {
            max_connections: 3,
            max_per_client: 2,
            ..ConnectionLimits::default()
        };
        let counts = Arc::new(Mutex::new(Counts::default()));
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let a1 = take_slot(&counts, &limits, a).unwrap();
        let _a2 = take_slot(&counts, &limits, a).unwrap();
        assert_eq!(
            take_slot(&counts, &limits, a).err(),
            Some(Admission::ClientFull)
        );
        let _b1 = take_slot(&counts, &limits, b).unwrap();
        assert_eq!(take_slot(&counts, &limits, b).err(), Some(Admission::Full));
        drop(a1);
        let _b2 = take_slot(&counts, &limits, b).unwrap();
        drop(_b1);
        drop(_b2);
        assert!(!counts.lock().unwrap().per_client.contains_key(&b));
    }

    #[test]
    fn connections_fit_the_descriptors() {
        let l = ConnectionLimits::default();
        assert_eq!(fit_to_descriptors(l.clone(), 1 << 20).max_connections, 1024);
        assert_eq!(fit_to_descriptors(l.clone(), 1024).max_connections, 896);
        assert_eq!(fit_to_descriptors(l.clone(), 10).max_connections, 1);
        assert!(ConnectionLimits {
            max_per_client: 0,
            ..l.clone()
        }
        .check()
        .is_err());
        assert!(ConnectionLimits {
            header_read_timeout: Duration::ZERO,
            ..l
        }
        .check()
        .is_err());
    }

    #[test]
    fn the_refusal_is_the_protocols_error_body() {
        let reply = refusal_reply(Admission::ClientFull, &ConnectionLimits::default());
        let text = String::from_utf8(reply).unwrap();
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let body: ErrorBody = serde_json::from_str(body).unwrap();
        assert_eq!(body.error, "unavailable");
        assert!(body.message.contains("64 connections"), "{}", body.message);
    }
}
