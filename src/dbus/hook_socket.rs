//! The hook's own door: `STATE_DIR/hook.sock`, a Unix socket where vfiod answers
//! `org.vfiod.Vfiod1.Hook.Hook` peer to peer (D-Bus without a bus daemon), the same answer as
//! `Manager.Hook` on the bus (both call [`Engine::hook`]).
//!
//! Why a second door: libvirt waits for its qemu hook on every VM start, stop and migration,
//! and through the bus every run costs a `Hello` and two hops through dbus-daemon (and its
//! policy checks) besides the call itself. Peer to peer it is one handshake and one call. It
//! also keeps the hook answered by vfiod while dbus-daemon restarts. The hook asks here first
//! and goes to the bus when nothing answers here (an older vfiod, a path too long for a
//! socket, all slots taken).
//!
//! Who may use it: the socket is `0600` in the state directory (`0700`, root's), and each
//! connection's peer credentials (`SO_PEERCRED`) are checked before a byte is read: root, or the
//! uid vfiod runs as (a test or `--simulate` daemon run by a user). What a careless or stuck
//! peer can hold is bounded: [`MAX_PEERS`] connections at once (one more is closed at once,
//! and its hook asks the bus), [`HANDSHAKE`] to authenticate, [`LIFETIME`] in all.

use crate::engine::{Engine, HookCall};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The socket's file name in the state directory (the hook finds it from the same settings).
pub const SOCKET_NAME: &str = "hook.sock";
/// The interface served on it, at [`super::ROOT_PATH`].
pub const INTERFACE: &str = "org.vfiod.Vfiod1.Hook";

/// Peers served at once. libvirt runs one hook per domain event; sixteen is far more than
/// libvirt runs at once, and small enough that stuck peers cost little.
pub const MAX_PEERS: usize = 16;
/// From accept to a finished D-Bus handshake.
pub const HANDSHAKE: Duration = Duration::from_secs(2);
/// The longest a peer stays connected: a hook makes one call, bounded by `[hooks]` deadlines
/// of seconds; this only ends a peer that forgot to hang up.
pub const LIFETIME: Duration = Duration::from_secs(120);
/// The largest domain XML a hook call may carry, here and on `Manager.Hook`: libvirt's
/// largest domains are far smaller.
pub const MAX_XML: usize = 16 << 20;

/// Whether a peer with `peer_uid` may ask, for a vfiod running as `own_uid`.
pub fn peer_allowed(peer_uid: u32, own_uid: u32) -> bool {
    peer_uid == 0 || peer_uid == own_uid
}

/// The listening socket; stopping (or dropping) it stops accepting and removes the file.
pub struct HookSocket {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl HookSocket {
    /// Listens on `STATE_DIR/hook.sock` (a stale file from a killed vfiod is replaced: the
    /// state lock says no other vfiod uses this directory).
    pub fn listen(state_dir: &Path, engine: Arc<Engine>) -> std::io::Result<HookSocket> {
        let path = state_dir.join(SOCKET_NAME);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = tokio::net::UnixListener::bind(&path)?;
        // The directory already keeps others out; the mode says so on the file too.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let own_uid = nix::unistd::geteuid().as_raw();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_PEERS));
        let task = tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors, typically: the hook asks the bus meanwhile.
                        tracing::debug!("hook socket: accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    tracing::debug!(
                        "hook socket: {MAX_PEERS} peers already; this one asks the bus"
                    );
                    continue;
                };
                let engine = Arc::clone(&engine);
                tokio::spawn(async move {
                    serve_peer(stream, engine, own_uid).await;
                    drop(slot);
                });
            }
        });
        Ok(HookSocket { path, task })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for HookSocket {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

async fn serve_peer(stream: tokio::net::UnixStream, engine: Arc<Engine>, own_uid: u32) {
    let uid = match stream.peer_cred() {
        Ok(c) => c.uid(),
        Err(e) => {
            tracing::debug!("hook socket: no peer credentials: {e}");
            return;
        }
    };
    if !peer_allowed(uid, own_uid) {
        tracing::warn!("hook socket: refused a connection from uid {uid} (root only)");
        return;
    }
    let Ok(stream) = stream.into_std() else {
        return;
    };
    let build = zbus::connection::Builder::unix_stream(stream)
        .server(zbus::Guid::generate())
        .p2p()
        .serve_at(super::ROOT_PATH, HookEndpoint { engine })
        .build();
    let conn = match tokio::time::timeout(HANDSHAKE, build).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracing::debug!("hook socket: handshake: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!("hook socket: no handshake within {HANDSHAKE:?}");
            return;
        }
    };
    let _ = tokio::time::timeout(LIFETIME, conn.closed()).await;
}

/// The one object on the hook socket.
struct HookEndpoint {
    engine: Arc<Engine>,
}

#[zbus::interface(name = "org.vfiod.Vfiod1.Hook")]
impl HookEndpoint {
    /// libvirt's qemu hook, as `Manager.Hook` answers it: the exit code, what the hook writes
    /// on stdout, and the line for its stderr.
    async fn hook(
        &self,
        domain: String,
        operation: String,
        sub_operation: String,
        extra: String,
        xml: String,
    ) -> Result<(i32, String, String), super::error::Error> {
        let call = HookCall {
            domain,
            operation,
            sub_operation,
            extra,
            xml,
            timing: None,
        };
        answer(&self.engine, call).await
    }

    /// [`Self::hook`] with `options`: [`HOOK_OPTIONS`] (see [`timing`]).
    async fn hook_with_options(
        &self,
        domain: String,
        operation: String,
        sub_operation: String,
        extra: String,
        xml: String,
        options: crate::dbus::wire::Dict,
    ) -> Result<(i32, String, String), super::error::Error> {
        let call = HookCall {
            domain,
            operation,
            sub_operation,
            extra,
            xml,
            timing: timing(options)?,
        };
        answer(&self.engine, call).await
    }
}

/// The options `HookWithOptions` takes, on either door: when the hook sent the run and the
/// last moment vfiod may answer it with its work done, both in milliseconds of the host's
/// `CLOCK_MONOTONIC` (see [`crate::hook::deadline`]).
pub const HOOK_OPTIONS: &[&str] = &["sent_ms", "deadline_ms"];

/// The timing `HookWithOptions`' options give: both keys or neither.
pub(super) fn timing(
    options: crate::dbus::wire::Dict,
) -> Result<Option<crate::hook::deadline::Timing>, super::error::Error> {
    use crate::hook::deadline::{Stamp, Timing};
    let q = crate::dbus::wire::Query::new(options, HOOK_OPTIONS)?;
    match (q.u64("sent_ms")?, q.u64("deadline_ms")?) {
        (None, None) => Ok(None),
        (Some(sent), Some(deadline)) if deadline >= sent => Ok(Some(Timing {
            sent: Stamp(sent),
            deadline: Stamp(deadline),
        })),
        (Some(sent), Some(deadline)) => Err(super::error::Error::InvalidArgument(format!(
            "deadline_ms {deadline} is before sent_ms {sent}"
        ))),
        _ => Err(super::error::Error::InvalidArgument(
            "sent_ms and deadline_ms go together: give both or neither".into(),
        )),
    }
}

/// One hook run answered, on either door (this socket, `Manager.Hook` once it has checked the
/// caller): the XML's size bounded, then [`Engine::hook`]'s verdict as the hook's exit code,
/// stdout and stderr line.
pub(super) async fn answer(
    engine: &Arc<Engine>,
    call: HookCall,
) -> Result<(i32, String, String), super::error::Error> {
    if call.xml.len() > MAX_XML {
        return Err(super::error::Error::InvalidArgument(format!(
            "the domain XML is {} bytes, more than {MAX_XML}",
            call.xml.len()
        )));
    }
    let v = engine.hook(call).await;
    Ok((v.exit_code, v.stdout, v.message))
}

#[cfg(test)]
mod tests {
    use super::peer_allowed;

    #[test]
    fn who_may_use_the_hook_socket() {
        // (peer uid, vfiod's uid, allowed)
        let table = [
            (0, 0, true),       // root's hook, root's vfiod: the installed case
            (1000, 0, false),   // a user, root's vfiod
            (0, 1000, true),    // root, a user's test vfiod
            (1000, 1000, true), // a user's test vfiod and its own hook
            (1001, 1000, false),
            (65534, 0, false), // nobody
        ];
        for (peer, own, allowed) in table {
            assert_eq!(peer_allowed(peer, own), allowed, "peer {peer}, vfiod {own}");
        }
    }
}
