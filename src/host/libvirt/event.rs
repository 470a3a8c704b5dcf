//! libvirt's events: the typed values vfiod forwards, libvirt's default event loop on a thread of
//! its own, and the callbacks a connection reports through (domain lifecycle, device removed or
//! not, connection closed).
//!
//! The event loop also carries each connection's keepalive and notices a daemon that went away,
//! so it runs while any [`super::Libvirt`] worker does: the first [`EventLoop`] guard starts its
//! thread, the last one dropped ends it. libvirt's event implementation can be registered only
//! once per process, before any connection is opened; every connection vfiod opens goes through
//! the worker, which takes a guard first.
//!
//! The `virt` crate (0.5) wraps neither domain event callbacks nor close callbacks, so they are
//! registered here through its raw bindings: the crate's largest `unsafe` code (callbacks and
//! the ownership of their senders across the C boundary), kept to these few functions. The
//! crate's other `unsafe` blocks are one call each; docs/architecture.md lists every file with
//! `unsafe` code (and `tests/library/architecture.rs` keeps that list true).

use super::Cause;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use tokio::sync::mpsc::UnboundedSender;
use virt::connect::Connect;
use virt::sys;

/// What the worker reports on the events channel.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LibvirtEvent {
    /// Connected to `uri` and registered for events, at start or after an outage. Events that
    /// happened while disconnected are lost: a consumer re-reads what it tracks.
    Connected {
        uri: String,
    },
    /// The connection to `uri` closed (the daemon stopped, crashed, or missed its keepalive);
    /// the worker reconnects in the background.
    Disconnected {
        uri: String,
        reason: CloseReason,
    },
    Domain(DomainEvent),
}

/// A domain event: its lifecycle (`VIR_DOMAIN_EVENT_ID_LIFECYCLE`) or the end of a device
/// removal (`VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED`, `..._DEVICE_REMOVAL_FAILED`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DomainEvent {
    pub name: String,
    pub uuid: String,
    pub kind: DomainEventKind,
    /// libvirt's detail for a lifecycle kind (`virDomainEvent*DetailType`), e.g. for `Stopped`:
    /// 0 shut down, 1 destroyed, 2 crashed, 3 migrated. 0 for the device kinds.
    pub detail: i32,
}

/// `virDomainEventType` for the lifecycle, then the device removal events.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DomainEventKind {
    Defined,
    Undefined,
    Started,
    Suspended,
    Resumed,
    Stopped,
    Shutdown,
    PMSuspended,
    Crashed,
    /// A lifecycle kind newer than this code.
    Other(i32),
    /// The device with this alias (`<alias name=.../>` in the live XML, e.g. "hostdev0") is gone
    /// from the domain: a live detach has completed. For a PCI device that is when the guest
    /// acknowledged the hot-unplug, possibly long after the detach call returned.
    DeviceRemoved {
        alias: String,
    },
    /// The guest refused to release the device with this alias; it stays in the domain.
    DeviceRemovalFailed {
        alias: String,
    },
    /// A device with this alias was hot-plugged into the running domain (by vfiod's attach, or
    /// by hand: `virsh attach-device --live`).
    DeviceAdded {
        alias: String,
    },
}

impl DomainEventKind {
    pub fn from_raw(event: i32) -> DomainEventKind {
        use DomainEventKind::*;
        match event as u32 {
            sys::VIR_DOMAIN_EVENT_DEFINED => Defined,
            sys::VIR_DOMAIN_EVENT_UNDEFINED => Undefined,
            sys::VIR_DOMAIN_EVENT_STARTED => Started,
            sys::VIR_DOMAIN_EVENT_SUSPENDED => Suspended,
            sys::VIR_DOMAIN_EVENT_RESUMED => Resumed,
            sys::VIR_DOMAIN_EVENT_STOPPED => Stopped,
            sys::VIR_DOMAIN_EVENT_SHUTDOWN => Shutdown,
            sys::VIR_DOMAIN_EVENT_PMSUSPENDED => PMSuspended,
            sys::VIR_DOMAIN_EVENT_CRASHED => Crashed,
            _ => Other(event),
        }
    }
}

/// Why libvirt closed a connection (`virConnectCloseReason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CloseReason {
    Error,
    Eof,
    Keepalive,
    Client,
    Other(i32),
}

impl CloseReason {
    pub fn from_raw(reason: i32) -> CloseReason {
        match reason as u32 {
            sys::VIR_CONNECT_CLOSE_REASON_ERROR => CloseReason::Error,
            sys::VIR_CONNECT_CLOSE_REASON_EOF => CloseReason::Eof,
            sys::VIR_CONNECT_CLOSE_REASON_KEEPALIVE => CloseReason::Keepalive,
            sys::VIR_CONNECT_CLOSE_REASON_CLIENT => CloseReason::Client,
            _ => CloseReason::Other(reason),
        }
    }
}

impl std::fmt::Display for CloseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CloseReason::Error => f.write_str("a socket error"),
            CloseReason::Eof => f.write_str("the daemon closed it"),
            CloseReason::Keepalive => f.write_str("the daemon stopped answering keepalives"),
            CloseReason::Client => f.write_str("closed by this side"),
            CloseReason::Other(n) => write!(f, "reason {n}"),
        }
    }
}

/// A share in the event loop thread; the loop runs while any guard lives.
pub(super) struct EventLoop(());

struct LoopThread {
    users: usize,
    thread: Option<std::thread::JoinHandle<()>>,
}

static LOOP: Mutex<LoopThread> = Mutex::new(LoopThread {
    users: 0,
    thread: None,
});
static QUIT: AtomicBool = AtomicBool::new(false);

impl EventLoop {
    pub(super) fn acquire() -> Result<EventLoop, super::LibvirtError> {
        static REGISTERED: OnceLock<Result<(), virt::error::Error>> = OnceLock::new();
        REGISTERED
            .get_or_init(|| {
                // libvirt prints every error to stderr by default; vfiod reports them itself.
                virt::error::clear_error_callback();
                virt::event::event_register_default_impl()
            })
            .clone()
            .map_err(|e| super::LibvirtError::EventLoop(Cause::from(e)))?;
        let mut state = LOOP.lock().unwrap_or_else(|p| p.into_inner());
        if state.thread.is_none() {
            QUIT.store(false, Ordering::Release);
            let thread = std::thread::Builder::new()
                .name("libvirt-events".into())
                .spawn(run_loop)
                .map_err(|e| super::LibvirtError::Spawn(e.to_string()))?;
            state.thread = Some(thread);
        }
        state.users += 1;
        Ok(EventLoop(()))
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        let mut state = LOOP.lock().unwrap_or_else(|p| p.into_inner());
        state.users -= 1;
        if state.users > 0 {
            return;
        }
        if let Some(thread) = state.thread.take() {
            QUIT.store(true, Ordering::Release);
            wake_loop();
            // Joined under the lock so that a new guard cannot start a second loop meanwhile;
            // the wake-up makes this immediate (callbacks only send on channels).
            let _ = thread.join();
        }
    }
}

fn run_loop() {
    while !QUIT.load(Ordering::Acquire) {
        if let Err(e) = virt::event::event_run_default_impl() {
            tracing::warn!("libvirt's event loop failed: {}", e.message());
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Makes one `virEventRunDefaultImpl` return: a timer due at once, which removes itself.
fn wake_loop() {
    unsafe extern "C" fn fire_once(timer: c_int, _opaque: *mut c_void) {
        // SAFETY: `timer` is this timer's own id, as libvirt passes it; removing a timer from
        // its own callback is allowed (the removal takes effect after the dispatch).
        unsafe { sys::virEventRemoveTimeout(timer) };
    }
    // SAFETY: no opaque data and no free function; the callback has the C signature libvirt
    // calls. Fails only without a registered implementation, which `acquire` made sure of.
    unsafe { sys::virEventAddTimeout(0, Some(fire_once), std::ptr::null_mut(), None) };
}

/// The domain event callbacks registered on one connection, by libvirt's callback ids, for
/// [`deregister_domain_events`].
#[derive(Debug, Default)]
pub(super) struct DomainCallbacks(Vec<c_int>);

/// `virConnectDomainEventLifecycleCallback`.
type Lifecycle =
    unsafe extern "C" fn(sys::virConnectPtr, sys::virDomainPtr, c_int, c_int, *mut c_void) -> c_int;
/// `virConnectDomainEventDeviceRemovedCallback`, and `...DeviceRemovalFailedCallback` (the same).
type DeviceAlias =
    unsafe extern "C" fn(sys::virConnectPtr, sys::virDomainPtr, *const c_char, *mut c_void);
/// `virConnectDomainEventGenericCallback`: the type every callback is registered as.
type Generic = unsafe extern "C" fn(sys::virConnectPtr, sys::virDomainPtr, *mut c_void);

unsafe extern "C" fn on_lifecycle(
    _conn: sys::virConnectPtr,
    dom: sys::virDomainPtr,
    event: c_int,
    detail: c_int,
    opaque: *mut c_void,
) -> c_int {
    // SAFETY: libvirt passes the `dom` and `opaque` that `send_domain_event` requires.
    unsafe { send_domain_event(dom, opaque, DomainEventKind::from_raw(event), detail) };
    0
}

unsafe extern "C" fn on_device_removed(
    _conn: sys::virConnectPtr,
    dom: sys::virDomainPtr,
    alias: *const c_char,
    opaque: *mut c_void,
) {
    // SAFETY: `alias` is libvirt's NUL-terminated string, valid for the call; `dom` and
    // `opaque` as `send_domain_event` requires.
    unsafe {
        let alias = c_text(alias);
        send_domain_event(dom, opaque, DomainEventKind::DeviceRemoved { alias }, 0);
    }
}

unsafe extern "C" fn on_device_added(
    _conn: sys::virConnectPtr,
    dom: sys::virDomainPtr,
    alias: *const c_char,
    opaque: *mut c_void,
) {
    // SAFETY: as in `on_device_removed`.
    unsafe {
        let alias = c_text(alias);
        send_domain_event(dom, opaque, DomainEventKind::DeviceAdded { alias }, 0);
    }
}

unsafe extern "C" fn on_device_removal_failed(
    _conn: sys::virConnectPtr,
    dom: sys::virDomainPtr,
    alias: *const c_char,
    opaque: *mut c_void,
) {
    // SAFETY: as in `on_device_removed`.
    unsafe {
        let alias = c_text(alias);
        send_domain_event(
            dom,
            opaque,
            DomainEventKind::DeviceRemovalFailed { alias },
            0,
        );
    }
}

/// Sends a domain event about `dom` on the sender behind `opaque`.
///
/// # Safety
/// `dom` is the domain libvirt passed to a callback (valid for the call; its name and UUID are
/// read from the object without a call to the daemon); `opaque` is a sender boxed by
/// [`register_domain_events`], freed only by `free_sender` once its callback is deregistered.
unsafe fn send_domain_event(
    dom: sys::virDomainPtr,
    opaque: *mut c_void,
    kind: DomainEventKind,
    detail: c_int,
) {
    // SAFETY: as the caller promises.
    unsafe {
        let tx = &*(opaque as *const UnboundedSender<LibvirtEvent>);
        let name = c_text(sys::virDomainGetName(dom));
        let mut buf = [0 as c_char; sys::VIR_UUID_STRING_BUFLEN as usize];
        let uuid = if sys::virDomainGetUUIDString(dom, buf.as_mut_ptr()) == 0 {
            c_text(buf.as_ptr())
        } else {
            String::new()
        };
        // A closed receiver means nobody listens any more: nothing to do.
        let _ = tx.send(LibvirtEvent::Domain(DomainEvent {
            name,
            uuid,
            kind,
            detail,
        }));
    }
}

unsafe extern "C" fn free_sender(opaque: *mut c_void) {
    // SAFETY: libvirt calls this once, when the callback is gone, with a box made in
    // `register_domain_events`.
    drop(unsafe { Box::from_raw(opaque as *mut UnboundedSender<LibvirtEvent>) });
}

/// Registers, for every domain of `conn`, the callbacks of the events vfiod follows (lifecycle,
/// device removed, device removal failed, device added), each sending to its own clone of `tx`. All or none:
/// on an error the ones already registered are removed again.
pub(super) fn register_domain_events(
    conn: &Connect,
    tx: UnboundedSender<LibvirtEvent>,
) -> Result<DomainCallbacks, virt::error::Error> {
    // SAFETY: libvirt's C API takes every domain event callback as the generic type and calls
    // it with the arguments of the event id's own signature (its VIR_DOMAIN_EVENT_CALLBACK
    // cast): `Lifecycle` for LIFECYCLE, `DeviceAlias` for DEVICE_REMOVED, DEVICE_REMOVAL_FAILED
    // and DEVICE_ADDED (virConnectDomainEventDeviceRemoved/RemovalFailed/AddedCallback).
    let callbacks = unsafe {
        [
            (
                sys::VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                std::mem::transmute::<Lifecycle, Generic>(on_lifecycle),
            ),
            (
                sys::VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED,
                std::mem::transmute::<DeviceAlias, Generic>(on_device_removed),
            ),
            (
                sys::VIR_DOMAIN_EVENT_ID_DEVICE_REMOVAL_FAILED,
                std::mem::transmute::<DeviceAlias, Generic>(on_device_removal_failed),
            ),
            (
                sys::VIR_DOMAIN_EVENT_ID_DEVICE_ADDED,
                std::mem::transmute::<DeviceAlias, Generic>(on_device_added),
            ),
        ]
    };
    let mut registered = DomainCallbacks::default();
    for (event_id, cb) in callbacks {
        let opaque = Box::into_raw(Box::new(tx.clone())) as *mut c_void;
        // SAFETY: `conn` is a live connection; `cb` matches `event_id` (above); `opaque` is
        // the sender `free_sender` frees.
        let id = unsafe {
            sys::virConnectDomainEventRegisterAny(
                conn.as_ptr(),
                std::ptr::null_mut(),
                event_id as c_int,
                Some(cb),
                opaque,
                Some(free_sender),
            )
        };
        if id < 0 {
            let e = virt::error::Error::last_error();
            // SAFETY: a failed registration does not call the free function: the box is ours.
            drop(unsafe { Box::from_raw(opaque as *mut UnboundedSender<LibvirtEvent>) });
            deregister_domain_events(conn, registered);
            return Err(e);
        }
        registered.0.push(id);
    }
    Ok(registered)
}

/// Removes the domain event callbacks. Each holds a reference on the connection, so this must
/// come before the connection is closed. On a connection that already died the local part still
/// happens (the daemon cannot be told, and need not be), so an error is only worth a debug line.
pub(super) fn deregister_domain_events(conn: &Connect, callbacks: DomainCallbacks) {
    for id in callbacks.0 {
        // SAFETY: a live connection object and an id it returned.
        if unsafe { sys::virConnectDomainEventDeregisterAny(conn.as_ptr(), id) } < 0 {
            tracing::debug!(
                "deregistering domain event callback {id}: {}",
                virt::error::Error::last_error().message()
            );
        }
    }
}

type OnClose = Box<dyn Fn(CloseReason) + Send>;

unsafe extern "C" fn on_close(_conn: sys::virConnectPtr, reason: c_int, opaque: *mut c_void) {
    // SAFETY: `opaque` is the boxed closure of `register_close`, alive until `free_on_close`.
    let f = unsafe { &*(opaque as *const OnClose) };
    f(CloseReason::from_raw(reason));
}

unsafe extern "C" fn free_on_close(opaque: *mut c_void) {
    // SAFETY: called once by libvirt with the box made in `register_close`.
    drop(unsafe { Box::from_raw(opaque as *mut OnClose) });
}

/// Calls `f` (on the event loop thread, or on the thread whose call found the connection dead)
/// when `conn` closes for any reason but [`unregister_close`]. Drivers that run inside this
/// process (`test:///default`) accept and ignore it; the box then outlives the connection, a
/// few bytes per connection to such a driver.
pub(super) fn register_close(
    conn: &Connect,
    f: impl Fn(CloseReason) + Send + 'static,
) -> Result<(), virt::error::Error> {
    let opaque = Box::into_raw(Box::new(Box::new(f) as OnClose)) as *mut c_void;
    // SAFETY: a live connection; `on_close` has the C signature libvirt calls.
    let rc = unsafe {
        sys::virConnectRegisterCloseCallback(
            conn.as_ptr(),
            Some(on_close),
            opaque,
            Some(free_on_close),
        )
    };
    if rc < 0 {
        let e = virt::error::Error::last_error();
        // SAFETY: a failed registration does not call the free function: the box is ours.
        drop(unsafe { Box::from_raw(opaque as *mut OnClose) });
        return Err(e);
    }
    Ok(())
}

/// Removes the close callback (which holds a reference on the connection: it must go before
/// the connection is closed).
pub(super) fn unregister_close(conn: &Connect) {
    // SAFETY: a live connection; the callback pointer identifies what `register_close` set.
    if unsafe { sys::virConnectUnregisterCloseCallback(conn.as_ptr(), Some(on_close)) } < 0 {
        tracing::debug!(
            "unregistering the close callback: {}",
            virt::error::Error::last_error().message()
        );
    }
}

/// A C string from libvirt, or "" for none.
///
/// # Safety
/// `p` is null or a valid NUL-terminated string.
unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libvirt_event_numbers_map_to_kinds() {
        use DomainEventKind::*;
        let kinds: Vec<_> = (0..10).map(DomainEventKind::from_raw).collect();
        assert_eq!(
            kinds,
            vec![
                Defined,
                Undefined,
                Started,
                Suspended,
                Resumed,
                Stopped,
                Shutdown,
                PMSuspended,
                Crashed,
                Other(9)
            ]
        );
        assert_eq!(DomainEventKind::from_raw(-1), Other(-1));
        assert_eq!(CloseReason::from_raw(2), CloseReason::Keepalive);
        assert_eq!(CloseReason::from_raw(7), CloseReason::Other(7));
    }

    /// libvirt's test driver, in this process: the four callbacks register, and deregistering
    /// them frees every sender they held.
    #[test]
    fn the_domain_event_callbacks_register_and_deregister() {
        let _loop = EventLoop::acquire().unwrap();
        let conn = Connect::open(Some("test:///default")).unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let callbacks = register_domain_events(&conn, tx).unwrap();
        assert_eq!(callbacks.0.len(), 4, "{callbacks:?}");
        assert!(!rx.is_closed());
        deregister_domain_events(&conn, callbacks);
        assert!(rx.is_closed(), "a sender was not freed");
    }
}
