//! The pool client against hostile pools (issue 24 item 4): real HTTP servers on loopback that
//! answer with a huge announced body, an endless chunked body, or a huge error body. Each reply
//! must be refused with `PoolError::TooLarge` after at most the cap (plus what the socket
//! buffers) was sent, never buffered whole.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::common;

use vfiod::pool::client::{PoolClient, PoolEndpoint, PoolError, MAX_ERROR_REPLY_SIZE};

/// How the fake pool answers.
#[derive(Clone, Copy)]
enum Reply {
    /// `200` with `Content-Length: 1 TB`, then bytes for as long as the client reads.
    AnnouncedHuge,
    /// `200`, chunked, chunks of `[` forever (the start of a JSON array that never ends).
    Endless,
    /// `409` with an endless chunked body.
    EndlessError,
    /// `200` with a valid body of exactly `n` bytes (a JSON array padded with spaces).
    Exactly(usize),
}

/// A one-connection-at-a-time HTTP server on loopback; `sent` counts the body bytes it
/// managed to write before the client hung up, `served` the connections it is done with.
struct FakePool {
    url: url::Url,
    sent: Arc<AtomicU64>,
    served: Arc<AtomicU64>,
    _thread: JoinHandle<()>,
}

fn read_request(s: &mut TcpStream) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

fn serve(mut s: TcpStream, reply: Reply, sent: &AtomicU64) {
    read_request(&mut s);
    let chunk = vec![b'['; 64 << 10];
    let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
    framed.extend_from_slice(&chunk);
    framed.extend_from_slice(b"\r\n");
    let (head, body): (String, &[u8]) = match reply {
        Reply::AnnouncedHuge => (
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n".into(),
            &chunk,
        ),
        Reply::Endless => (
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".into(),
            &framed,
        ),
        Reply::EndlessError => (
            "HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".into(),
            &framed,
        ),
        Reply::Exactly(n) => {
            let mut body = vec![b' '; n];
            body[0] = b'[';
            body[n - 1] = b']';
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
            );
            let _ = s.write_all(head.as_bytes());
            if s.write_all(&body).is_ok() {
                sent.fetch_add(n as u64, Ordering::SeqCst);
            }
            return;
        }
    };
    if s.write_all(head.as_bytes()).is_err() {
        return;
    }
    // Until the client hangs up (or 4 GiB, so that a client that reads it all fails the test
    // instead of running forever).
    while sent.load(Ordering::SeqCst) < 4 << 30 {
        if s.write_all(body).is_err() {
            return;
        }
        sent.fetch_add(body.len() as u64, Ordering::SeqCst);
    }
}

impl FakePool {
    fn start(reply: Reply) -> FakePool {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let sent = Arc::new(AtomicU64::new(0));
        let served = Arc::new(AtomicU64::new(0));
        let (counter, done) = (sent.clone(), served.clone());
        let thread = std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                serve(s, reply, &counter);
                done.fetch_add(1, Ordering::SeqCst);
            }
        });
        FakePool {
            url,
            sent,
            served,
            _thread: thread,
        }
    }

    fn client(&self, max_reply: usize) -> PoolClient {
        let mut ep = PoolEndpoint::new(self.url.clone());
        ep.request_timeout = Duration::from_secs(30);
        PoolClient::new(&ep).unwrap().with_max_reply(max_reply)
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// What the server had sent when it stopped: waits until it is done with its first
    /// connection (its write failed because the client hung up, or it sent 4 GiB). An event,
    /// not a pause: a client that kept reading fails the test on the count.
    async fn sent_when_done(&self) -> u64 {
        common::eventually(common::HUNG, "the server ends the connection", || {
            (self.served.load(Ordering::SeqCst) >= 1).then_some(())
        })
        .await;
        self.sent()
    }
}

fn assert_too_large(e: &PoolError, limit: usize) {
    match e {
        PoolError::TooLarge { limit: l, .. } => assert_eq!(*l, limit, "{e}"),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let text = e.to_string();
    assert!(text.contains("too large"), "{text}");
    assert!(text.contains(&limit.to_string()), "{text}");
}

/// Socket buffers on both ends hold a few MiB at most on loopback; a client that kept reading
/// would have been sent hundreds of MiB by the time it answered.
const SLACK: u64 = 32 << 20;

#[tokio::test]
async fn an_endless_reply_is_refused_at_the_cap_and_not_read_further() {
    let pool = FakePool::start(Reply::Endless);
    let cap = 1 << 20;
    let e = pool.client(cap).sessions().await.unwrap_err();
    assert_too_large(&e, cap);
    assert!(e.to_string().contains("/v1/sessions"), "{e}");
    // The client hung up: the server's writes fail, and it had sent little (this used to be
    // "refused within 5 s" and two 300 ms pauses; the byte count is the claim).
    let sent = pool.sent_when_done().await;
    assert!(sent < cap as u64 + SLACK, "{sent} bytes were sent");
}

#[tokio::test]
async fn the_default_cap_stops_an_endless_reply_too() {
    let pool = FakePool::start(Reply::Endless);
    let mut ep = PoolEndpoint::new(pool.url.clone());
    ep.request_timeout = Duration::from_secs(30);
    let e = PoolClient::new(&ep).unwrap().devices().await.unwrap_err();
    assert_too_large(&e, vfiod::pool::client::MAX_REPLY_SIZE);
    let sent = pool.sent_when_done().await;
    assert!(
        sent < vfiod::pool::client::MAX_REPLY_SIZE as u64 + SLACK,
        "{sent} bytes were sent"
    );
}

#[tokio::test]
async fn an_announced_huge_reply_is_refused_before_its_body_is_read() {
    let pool = FakePool::start(Reply::AnnouncedHuge);
    let cap = 1 << 20;
    let e = pool.client(cap).health().await.unwrap_err();
    assert_too_large(&e, cap);
    assert!(e.to_string().contains("announced 1000000000000"), "{e}");
    let sent = pool.sent_when_done().await;
    assert!(sent < SLACK, "{sent} bytes were sent");
}

#[tokio::test]
async fn an_endless_error_reply_is_refused_at_its_own_smaller_cap() {
    let pool = FakePool::start(Reply::EndlessError);
    // The success cap is large: the error cap applies to refusals whatever it is.
    let e = pool.client(1 << 30).quiesce("s1", 1).await.unwrap_err();
    assert_too_large(&e, MAX_ERROR_REPLY_SIZE);
    assert!(e.to_string().contains("409"), "{e}");
    let sent = pool.sent_when_done().await;
    assert!(sent < SLACK, "{sent} bytes were sent");
}

#[tokio::test]
async fn a_reply_of_exactly_the_cap_is_read_and_one_byte_more_is_refused() {
    let cap = 256 << 10;
    let pool = FakePool::start(Reply::Exactly(cap));
    let sessions = pool.client(cap).sessions().await.unwrap();
    assert!(sessions.is_empty());
    let e = pool.client(cap - 1).sessions().await.unwrap_err();
    assert_too_large(&e, cap - 1);
}
