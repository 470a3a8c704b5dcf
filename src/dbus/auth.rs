//! Authorization of mutating calls: root is allowed, and so is a caller holding CAP_SYS_ADMIN in
//! vfiod's own user namespace, as systemd's daemons allow them; any other asks polkit, with the
//! message sender as the subject. Reads never ask.
//!
//! Who the caller is, is what the bus daemon says (`GetConnectionCredentials`: its uid, its
//! process): the bus daemon runs in the initial user namespace and reports the real uid, which a
//! caller cannot choose. What a process shows in `/proc` is its own namespace's view: inside a
//! user namespace it made itself, any user holds every capability, of that namespace only. So a
//! capability stands in for polkit only when the caller's user namespace is vfiod's own
//! ([`privilege`] decides; [`inspect_process`] reads), and a uid is never read from `/proc`.
//!
//! One action per verb family (as systemd-machined has one per verb), each asked with details
//! that rules files can read (`action.lookup("device")`): a [`Check`] is the action and its
//! details, built by the method from what it was asked; [`action_for_task`] says which family
//! owns an existing task. `docs/polkit.md` is the operator's view of the same.

use super::error::Error;
use crate::mode::policy::Target;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use std::collections::HashMap;
use std::fmt;
use zbus::message::Header;
use zbus_polkit::policykit1::{AuthorityProxy, CheckAuthorizationFlags, Subject};

/// Change how vfiod runs: `Manager.Reload`, `Manager.Rescan`.
pub const ACTION_CONFIGURE: &str = "org.vfiod.vfiod1.configure";
/// Change a device's mode: `Device.SetMode`, `Device.Apply`, and `Device.ResetTask` of a mode task.
pub const ACTION_MODE: &str = "org.vfiod.vfiod1.mode";
/// Claim a device for a VM, and release (later attach and detach) a claim.
pub const ACTION_CLAIM: &str = "org.vfiod.vfiod1.claim";
/// Program or verify an accelerator, reset such a task, and change the image catalog
/// (`Images.Add`, `Deactivate`, `Activate`, `Remove`).
pub const ACTION_PROGRAM: &str = "org.vfiod.vfiod1.program";
/// Carry a device through a live migration, and reset such a task (the migration issues).
pub const ACTION_MIGRATE: &str = "org.vfiod.vfiod1.migrate";

/// Every action the policy file declares, in its order.
pub const ACTIONS: [&str; 5] = [
    ACTION_CONFIGURE,
    ACTION_MODE,
    ACTION_CLAIM,
    ACTION_PROGRAM,
    ACTION_MIGRATE,
];

/// The keys of the details sent with a check. Operators' rules files name them, so a key is
/// never renamed; a new one may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Detail {
    /// The D-Bus method asked for, e.g. `SetMode`: on every check.
    Verb,
    /// The PCI address of the device, `DDDD:BB:SS.F`: on every device method.
    Device,
    /// The mode asked for, `pf` or `vf` (SetMode).
    Mode,
    /// The number of VFs the task will ask for (SetMode to `vf`): a request for 0 ("as many as
    /// allowed") is sent as the number it resolves to, so a rule that limits the count cannot
    /// be passed with 0.
    NumVfs,
    /// The libvirt domain's name, where the call concerns a VM (the UUID when only that is
    /// known).
    Vm,
    /// The device kind (gpu, fpga, crypto, nvme, nic, other): of the device for a claim's
    /// Release, of the requirement for Claim ("" when the request names no kind).
    Kind,
    /// The FPGA image's name: on `Program`, `Verify` and the image catalog's methods.
    Image,
}

impl Detail {
    pub const ALL: [Detail; 7] = [
        Detail::Verb,
        Detail::Device,
        Detail::Mode,
        Detail::NumVfs,
        Detail::Vm,
        Detail::Kind,
        Detail::Image,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Detail::Verb => "verb",
            Detail::Device => "device",
            Detail::Mode => "mode",
            Detail::NumVfs => "num_vfs",
            Detail::Vm => "vm",
            Detail::Kind => "kind",
            Detail::Image => "image",
        }
    }
}

/// One question for polkit: may the caller perform `action`, given these details?
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    action: &'static str,
    details: Vec<(Detail, String)>,
}

impl Check {
    /// `verb`, a method on the daemon as a whole, under `action`.
    pub fn new(action: &'static str, verb: &str) -> Check {
        Check {
            action,
            details: vec![(Detail::Verb, verb.to_string())],
        }
    }

    /// `verb`, a method on `device`, under `action`.
    pub fn on_device(action: &'static str, verb: &str, device: PciAddress) -> Check {
        Check::new(action, verb).with(Detail::Device, device)
    }

    /// `Device.SetMode` towards `target`.
    pub fn set_mode(device: PciAddress, target: &Target) -> Check {
        let check = Check::on_device(ACTION_MODE, "SetMode", device);
        match target {
            Target::Pf { .. } => check.with(Detail::Mode, "pf"),
            Target::Vf { num_vfs, .. } => {
                check.with(Detail::Mode, "vf").with(Detail::NumVfs, num_vfs)
            }
        }
    }

    /// `Device.ResetTask` of the device's task of `kind` (`None`: the device has none, and the
    /// call will say so once authorized).
    pub fn reset_task(device: PciAddress, kind: Option<TaskKind>) -> Check {
        let action = kind.map_or(ACTION_MODE, action_for_task);
        Check::on_device(action, "ResetTask", device)
    }

    /// With one more detail (a key given twice keeps the last value).
    pub fn with(mut self, key: Detail, value: impl fmt::Display) -> Check {
        self.details.retain(|(k, _)| *k != key);
        self.details.push((key, value.to_string()));
        self
    }

    pub fn action(&self) -> &'static str {
        self.action
    }

    pub fn detail(&self, key: Detail) -> Option<&str> {
        self.details
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The details as polkit's `CheckAuthorization` takes them. polkitd accepts details only
    /// from a trusted caller (root, as vfiod runs, or an action's declared owner).
    pub fn details(&self) -> HashMap<&'static str, &str> {
        self.details
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

/// "org.vfiod.vfiod1.mode (SetMode on 0000:af:00.0)": what a refusal names.
impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.action)?;
        match (self.detail(Detail::Verb), self.detail(Detail::Device)) {
            (Some(verb), Some(device)) => write!(f, " ({verb} on {device})"),
            (Some(verb), None) => write!(f, " ({verb})"),
            _ => Ok(()),
        }
    }
}

/// The action that owns a task of `kind`: whoever may start such a task may also clear it
/// when it failed, and nobody else.
pub fn action_for_task(kind: TaskKind) -> &'static str {
    match kind {
        TaskKind::Program | TaskKind::Verify => ACTION_PROGRAM,
        TaskKind::Migrate => ACTION_MIGRATE,
        TaskKind::Attach | TaskKind::Detach => ACTION_CLAIM,
        TaskKind::Check
        | TaskKind::Split
        | TaskKind::Restore
        | TaskKind::Resplit
        | TaskKind::Rebind
        | TaskKind::Bind
        | TaskKind::Unbind
        | TaskKind::Clean
        | TaskKind::Test => ACTION_MODE,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authorizer {
    /// Ask polkitd on the system bus (the default).
    Polkit,
    /// The simulation's: every method, without polkit, for the user who runs vfiod (and root),
    /// and for no one else; root-only methods stay root's and that user's
    /// ([`Gate::require_root`]). The simulation's private bus admits that user only anyway.
    SameUser,
}

/// How the objects authorize a call: the [`Authorizer`], and the bus's answers about callers
/// ([`Requesters`]) that both it and the records use. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Gate {
    authorizer: Authorizer,
    requesters: std::sync::Arc<Requesters>,
}

impl Gate {
    pub fn new(authorizer: Authorizer, requesters: std::sync::Arc<Requesters>) -> Gate {
        Gate {
            authorizer,
            requesters,
        }
    }

    /// Succeeds when the sender of `header` may do what `check` asks; otherwise `NotAuthorized`
    /// (naming the action), and nothing has been changed.
    pub async fn check(
        &self,
        conn: &zbus::Connection,
        header: &Header<'_>,
        check: &Check,
    ) -> Result<(), Error> {
        if self.authorizer == Authorizer::SameUser {
            let own = own_uid();
            return match self.requesters.uid(conn, header).await {
                Some(uid) if has_vfiods_access(uid, own) => Ok(()),
                Some(uid) => Err(Error::NotAuthorized(format!(
                    "{check}: this simulation serves the user who runs it (uid {own}) and root \
                     only, not uid {uid}; run your own: vfiod --simulate"
                ))),
                None => Err(Error::NotAuthorized(format!(
                    "{check}: the bus does not say who the caller is"
                ))),
            };
        }
        // As systemd's own daemons decide (sd_bus_query_sender_privilege): root, or a caller
        // holding CAP_SYS_ADMIN where it counts, may without asking polkit, so that root can
        // manage the host on one where polkitd is not installed. Everyone else asks polkit.
        match caller_privilege(&self.requesters, conn, header).await {
            Privilege::Root => {
                tracing::debug!(%check, "allowed: the caller is root");
                return Ok(());
            }
            Privilege::CapSysAdmin => {
                tracing::debug!(%check, "allowed: the caller holds CAP_SYS_ADMIN");
                return Ok(());
            }
            Privilege::None => {}
        }
        let subject = Subject::new_for_message_header(header)
            .map_err(|e| Error::NotAuthorized(format!("cannot identify the caller: {e}")))?;
        // The subject is a unique name on vfiod's own bus, so polkitd must be asked on that bus
        // (the system bus in production, a private "system" bus in tests).
        let authority = AuthorityProxy::new(conn)
            .await
            .map_err(|e| Error::NotAuthorized(format!("polkit cannot be asked: {e}")))?;
        let result = authority
            .check_authorization(
                &subject,
                check.action(),
                &check.details(),
                CheckAuthorizationFlags::ALLOW_USER_INTERACTION,
                "",
            )
            .await
            .map_err(|e| {
                if polkit_absent(&e) {
                    Error::NotAuthorized(format!(
                        "polkitd is not running (is the polkitd package installed?), so {check} \
                         is refused for this caller; root (or a caller holding CAP_SYS_ADMIN in \
                         vfiod's own user namespace) is allowed without it: {e}"
                    ))
                } else {
                    Error::NotAuthorized(format!("polkit check for {check} failed: {e}"))
                }
            })?;
        if result.is_authorized {
            Ok(())
        } else if result.is_challenge {
            Err(Error::NotAuthorized(format!(
                "{check} needs authentication (run vfioctl through an agent, e.g. pkexec, or as root)"
            )))
        } else {
            Err(Error::NotAuthorized(format!(
                "{check} is not allowed for this caller"
            )))
        }
    }
}

impl Gate {
    /// Succeeds for a caller that has vfiod's own access to the host: root, or the user vfiod
    /// runs as (root in production; the user who runs a simulation), as the bus reports the
    /// caller's uid. libvirt runs its hooks as root, and a hook's call may not wait for a polkit
    /// agent; a file vfiod opens for a caller (`AddFromPath`) is opened with vfiod's access, so
    /// only a caller who has that access already may name one. No capability and no
    /// [`Authorizer`] lifts this.
    pub async fn require_root(
        &self,
        conn: &zbus::Connection,
        header: &Header<'_>,
        what: &str,
    ) -> Result<(), Error> {
        let own = own_uid();
        let only = if own == 0 {
            "root only".to_string()
        } else {
            format!("root and uid {own} (vfiod's own) only")
        };
        match self.requesters.uid(conn, header).await {
            Some(uid) if has_vfiods_access(uid, own) => Ok(()),
            Some(uid) => Err(Error::NotAuthorized(format!(
                "{what} is accepted from {only}, not uid {uid}"
            ))),
            None => Err(Error::NotAuthorized(format!(
                "{what} is accepted from {only}, and the bus does not say who the caller is"
            ))),
        }
    }
}

/// The uid vfiod runs as (its effective uid).
fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Whether a caller with (the bus's) `uid` has what a vfiod running as `own_uid` has: it is
/// root, or that same user.
pub fn has_vfiods_access(uid: u32, own_uid: u32) -> bool {
    uid == 0 || uid == own_uid
}

/// CAP_SYS_ADMIN's bit in a capability set (`linux/capability.h`).
const CAP_SYS_ADMIN: u32 = 21;

/// What lets a caller past polkit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Privilege {
    /// The bus reports uid 0: root of the host (the bus daemon, in the initial user namespace,
    /// reports real uids; no user namespace can make a process uid 0 there).
    Root,
    /// CAP_SYS_ADMIN in its effective set, in vfiod's own user namespace.
    CapSysAdmin,
    /// Neither: polkit decides.
    None,
}

/// What vfiod read of a caller's process (the one the bus named), through `/proc/PID`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessView {
    /// Its user namespace is vfiod's own (the same `ns/user` inode on the same device).
    pub same_user_namespace: bool,
    /// Its effective uid, as `/proc` shows it to vfiod, is the uid the bus reported: a
    /// consistency check only (where the bus gives no pidfd, a pid reused by another user's
    /// process is not taken for the caller), never the caller's identity.
    pub euid_is_bus_uid: bool,
    /// CAP_SYS_ADMIN is in its effective set (of its own user namespace).
    pub cap_sys_admin: bool,
}

/// The decision, from the uid the bus reported and what was read of the caller's process
/// (`None`: the bus names no process, or it could not be read, or it is gone). A capability
/// counts only in vfiod's own user namespace: in one it made itself, any user holds them all.
pub fn privilege(bus_uid: u32, process: Option<ProcessView>) -> Privilege {
    if bus_uid == 0 {
        return Privilege::Root;
    }
    match process {
        Some(ProcessView {
            same_user_namespace: true,
            euid_is_bus_uid: true,
            cap_sys_admin: true,
        }) => Privilege::CapSysAdmin,
        _ => Privilege::None,
    }
}

/// The privilege of the sender of `header`: its uid and process as the bus reports them
/// (`GetConnectionCredentials`; the uid is remembered in `requesters` for the records), what
/// it holds from `/proc` ([`inspect_process`]). Anything unknown: no privilege.
async fn caller_privilege(
    requesters: &Requesters,
    conn: &zbus::Connection,
    header: &Header<'_>,
) -> Privilege {
    let Some(sender) = header.sender() else {
        return Privilege::None;
    };
    let Ok(bus) = zbus::fdo::DBusProxy::new(conn).await else {
        return Privilege::None;
    };
    let creds = match bus.get_connection_credentials(sender.clone().into()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!("cannot ask the bus who {sender} is: {e}");
            return Privilege::None;
        }
    };
    let Some(uid) = creds.unix_user_id() else {
        return Privilege::None;
    };
    requesters.remember(sender.as_str(), uid);
    if uid == 0 {
        return privilege(uid, None);
    }
    let Some(pid) = creds.process_id() else {
        return privilege(uid, None);
    };
    let pidfd: Option<std::os::fd::OwnedFd> = creds.into_process_fd().map(Into::into);
    // procfs reads can stall (a process whose memory map is locked): off the async threads.
    let seen = tokio::task::spawn_blocking(move || inspect_process(pid, pidfd.as_ref(), uid))
        .await
        .unwrap_or_else(|e| Err(InspectError::Panicked(e.to_string())));
    match seen {
        Ok(view) => privilege(uid, Some(view)),
        Err(e) => {
            tracing::debug!(
                "caller {sender} (uid {uid}, pid {pid}): {}",
                crate::error_chain(&e)
            );
            privilege(uid, None)
        }
    }
}

/// Why a caller's process could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("cannot open {path}")]
    Open {
        path: String,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("its pidfd no longer names pid {pid}: the process is gone")]
    Gone { pid: u32 },
    #[error("{path} has no readable {field} line")]
    Field { path: String, field: &'static str },
    #[error("the inspection panicked: {0}")]
    Panicked(String),
}

/// Reads what the process `pid` holds and where: its effective uid and CAP_SYS_ADMIN
/// (`status`) and whether its user namespace (`ns/user`) is vfiod's own (`/proc/self/ns/user`,
/// the same inode on the same device). Everything is read through one descriptor of
/// `/proc/PID`, which keeps naming that process (or fails) once opened; with the bus's `pidfd`
/// the process is checked to be alive as `pid` after that open, so the descriptor is the
/// caller's and not a later process that reused the pid: race-free. Without a pidfd (a bus
/// that does not offer `ProcessFD`, as dbus-daemon before 1.15.8) the effective uid must be
/// the bus's (`bus_uid`), so a reused pid could only be another process of the same user.
pub fn inspect_process(
    pid: u32,
    pidfd: Option<&std::os::fd::OwnedFd>,
    bus_uid: u32,
) -> Result<ProcessView, InspectError> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{fstatat, stat, Mode};
    use std::io::Read;
    let proc_dir = format!("/proc/{pid}");
    let open_err = |path: String| move |source| InspectError::Open { path, source };
    let dir = nix::fcntl::open(
        proc_dir.as_str(),
        OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(open_err(proc_dir.clone()))?;
    if let Some(fd) = pidfd {
        use std::os::fd::AsRawFd;
        let info = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
        let text = std::fs::read_to_string(&info).map_err(|source| InspectError::Read {
            path: info.clone(),
            source,
        })?;
        if pidfd_pid(&text) != Some(pid) {
            return Err(InspectError::Gone { pid });
        }
    }
    let status_path = format!("{proc_dir}/status");
    let status_fd = openat(
        &dir,
        "status",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(open_err(status_path.clone()))?;
    let mut status = String::new();
    std::fs::File::from(status_fd)
        .read_to_string(&mut status)
        .map_err(|source| InspectError::Read {
            path: status_path.clone(),
            source,
        })?;
    let (euid, cap_eff) = status_fields(&status);
    let field = |field| InspectError::Field {
        path: status_path.clone(),
        field,
    };
    let euid = euid.ok_or_else(|| field("Uid"))?;
    let cap_eff = cap_eff.ok_or_else(|| field("CapEff"))?;
    let theirs = fstatat(&dir, "ns/user", nix::fcntl::AtFlags::empty())
        .map_err(open_err(format!("{proc_dir}/ns/user")))?;
    let ours = stat("/proc/self/ns/user").map_err(open_err("/proc/self/ns/user".into()))?;
    Ok(ProcessView {
        same_user_namespace: (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino),
        euid_is_bus_uid: euid == bus_uid,
        cap_sys_admin: cap_eff & (1 << CAP_SYS_ADMIN) != 0,
    })
}

/// From a `/proc/PID/status`: the effective uid (the second field of `Uid:`) and the
/// effective capability set (`CapEff:`), each `None` when missing or unreadable.
fn status_fields(status: &str) -> (Option<u32>, Option<u64>) {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let euid = field("Uid")
        .and_then(|v| v.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u32>().ok());
    let cap_eff = field("CapEff").and_then(|v| u64::from_str_radix(v, 16).ok());
    (euid, cap_eff)
}

/// The pid a pidfd's `/proc/self/fdinfo` names (`Pid: -1` once the process has exited).
fn pidfd_pid(fdinfo: &str) -> Option<u32> {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// True when the error says no polkitd answered (not running, or gone while asked), as opposed
/// to an error polkitd itself returned. zbus reports these bus errors as `Error::FDO`.
fn polkit_absent(e: &zbus::Error) -> bool {
    use zbus::fdo::Error as Fdo;
    matches!(e, zbus::Error::FDO(f)
        if matches!(**f, Fdo::ServiceUnknown(_) | Fdo::NameHasNoOwner(_) | Fdo::NoReply(_)))
}

/// The uid behind each unique bus name, asked of the bus once per name: every mutating call
/// records who asked, and a question to the bus daemon per call cost a round trip as long as
/// the call itself. The bus never gives a unique name to another connection while it runs, so
/// an answer stays true. One per vfiod connection (another bus has other names); emptied when
/// it reaches [`Requesters::MAX`] names, so a long run of short-lived clients cannot grow it.
#[derive(Debug, Default)]
pub struct Requesters {
    uids: std::sync::Mutex<HashMap<String, u32>>,
}

impl Requesters {
    pub const MAX: usize = 4096;

    fn uids(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.uids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Who asked, for the records: the caller's uid when the bus tells it, else its name.
    pub async fn of(&self, conn: &zbus::Connection, header: &Header<'_>) -> String {
        let Some(sender) = header.sender() else {
            return "unknown".into();
        };
        match self.uid(conn, header).await {
            Some(u) => format!("uid {u} ({sender})"),
            None => sender.to_string(),
        }
    }

    /// The caller's uid, as the bus tells it (asked once per unique name).
    pub async fn uid(&self, conn: &zbus::Connection, header: &Header<'_>) -> Option<u32> {
        let sender = header.sender()?;
        let known = self.uids().get(sender.as_str()).copied();
        let uid = match known {
            Some(uid) => Some(uid),
            None => {
                let uid = match zbus::fdo::DBusProxy::new(conn).await {
                    Ok(p) => p.get_connection_unix_user(sender.clone().into()).await.ok(),
                    Err(_) => None,
                };
                if let Some(uid) = uid {
                    self.remember(sender.as_str(), uid);
                }
                uid
            }
        };
        uid
    }

    /// Records `uid` for `sender` as the bus reported it (with `GetConnectionCredentials`).
    fn remember(&self, sender: &str, uid: u32) {
        let mut uids = self.uids();
        if uids.len() >= Self::MAX {
            uids.clear();
        }
        uids.insert(sender.to_string(), uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn af() -> PciAddress {
        "0000:af:00.0".parse().unwrap()
    }

    fn sorted(c: &Check) -> Vec<(&'static str, String)> {
        let mut d: Vec<_> = c
            .details()
            .into_iter()
            .map(|(k, v)| (k, v.to_string()))
            .collect();
        d.sort();
        d
    }

    #[test]
    fn the_effective_uid_and_capabilities_are_read_from_the_status() {
        let status = |uid: &str, eff: &str| {
            format!(
                "Name:\tvfioctl\nUid:\t{uid}\nGid:\t0\t0\t0\t0\nCapInh:\t0000000000000000\n\
                 CapPrm:\t000001ffffffffff\nCapEff:\t{eff}\n"
            )
        };
        let table = [
            // (Uid line, CapEff, effective uid, effective set)
            (
                "0\t0\t0\t0",
                "000001ffffffffff",
                Some(0),
                Some(0x1ff_ffff_ffff),
            ),
            (
                "0\t0\t0\t0",
                "000001ffffdfffff",
                Some(0),
                Some(0x1ff_ffdf_ffff),
            ),
            // the effective uid is the second field, not the real one
            ("1000\t0\t0\t0", "0000000000200000", Some(0), Some(1 << 21)),
            ("0\t1000\t0\t0", "0000000000000000", Some(1000), Some(0)),
            // unreadable fields
            ("0\t0\t0\t0", "zz", Some(0), None),
            ("", "000001ffffffffff", None, Some(0x1ff_ffff_ffff)),
            ("x\ty", "0", None, Some(0)),
        ];
        for (uid_line, eff, euid, caps) in table {
            assert_eq!(
                status_fields(&status(uid_line, eff)),
                (euid, caps),
                "Uid {uid_line:?} CapEff {eff}"
            );
        }
        assert_eq!(status_fields(""), (None, None));
        assert_eq!(
            pidfd_pid("pos:\t0\nflags:\t02000002\nPid:\t4242\n"),
            Some(4242)
        );
        assert_eq!(pidfd_pid("Pid:\t-1\n"), None);
        assert_eq!(pidfd_pid("flags:\t0\n"), None);
    }

    #[test]
    fn a_capability_counts_only_in_vfiods_own_user_namespace() {
        let view = |same_user_namespace, euid_is_bus_uid, cap_sys_admin| {
            Some(ProcessView {
                same_user_namespace,
                euid_is_bus_uid,
                cap_sys_admin,
            })
        };
        let table = [
            // (bus uid, what /proc showed, decision)
            // root as the bus reports it, whatever its process shows or if it shows nothing
            (0, view(true, true, true), Privilege::Root),
            (0, view(true, true, false), Privilege::Root),
            (0, view(false, false, false), Privilege::Root),
            (0, None, Privilege::Root),
            // a user given CAP_SYS_ADMIN in vfiod's namespace (ambient, file capability)
            (1000, view(true, true, true), Privilege::CapSysAdmin),
            // issue 33: every capability, of a user namespace the caller made itself
            (65534, view(false, true, true), Privilege::None),
            (1000, view(false, true, true), Privilege::None),
            // an ordinary user
            (1000, view(true, true, false), Privilege::None),
            // the pid now names a process of another uid (reused): not the caller
            (1000, view(true, false, true), Privilege::None),
            // nothing known of the process
            (1000, None, Privilege::None),
        ];
        for (uid, process, want) in table {
            assert_eq!(privilege(uid, process), want, "uid {uid}, {process:?}");
        }
    }

    #[test]
    fn root_and_vfiods_own_user_have_vfiods_access() {
        let table = [
            // (caller's uid, vfiod's uid, has its access)
            (0, 0, true),
            (1000, 0, false),
            (65534, 0, false),
            (1000, 1000, true),
            (0, 1000, true),
            (1001, 1000, false),
        ];
        for (uid, own, want) in table {
            assert_eq!(has_vfiods_access(uid, own), want, "uid {uid}, vfiod {own}");
        }
    }

    /// The edge, for real: this process is in its own namespace, with its uid; a process in a
    /// user namespace it made (`unshare --user --keep-caps`, as any user can) shows
    /// CAP_SYS_ADMIN, in a namespace that is not ours.
    #[test]
    fn inspect_process_tells_a_user_namespace_from_ours() {
        let me = std::process::id();
        let own = nix::unistd::geteuid().as_raw();
        let seen = inspect_process(me, None, own).unwrap();
        assert!(seen.same_user_namespace && seen.euid_is_bus_uid, "{seen:?}");
        assert!(!inspect_process(me, None, own + 1).unwrap().euid_is_bus_uid);

        let mut child = std::process::Command::new("unshare")
            .args(["--user", "--keep-caps", "--", "sleep", "60"])
            .spawn()
            .expect("unshare (util-linux)");
        let pid = child.id();
        // Once unshare has made the namespace and exec'd sleep.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()
            .as_deref()
            != Some("sleep\n")
        {
            assert!(
                std::time::Instant::now() < deadline && child.try_wait().unwrap().is_none(),
                "unshare --user did not run sleep (are user namespaces allowed?)"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let theirs = inspect_process(pid, None, own);
        let _ = child.kill();
        let _ = child.wait();
        let theirs = theirs.unwrap();
        assert_eq!(
            theirs,
            ProcessView {
                same_user_namespace: false,
                euid_is_bus_uid: true,
                cap_sys_admin: true,
            }
        );
        assert_eq!(privilege(65534, Some(theirs)), Privilege::None);
        // A process that is gone is read as nothing.
        assert!(matches!(
            inspect_process(pid, None, own),
            Err(InspectError::Open { .. })
        ));
    }

    #[test]
    fn a_task_is_reset_under_the_action_that_owns_its_kind() {
        for kind in TaskKind::ALL {
            let want = match kind.as_str() {
                "program" | "verify" => "org.vfiod.vfiod1.program",
                "migrate" => "org.vfiod.vfiod1.migrate",
                "attach" | "detach" => "org.vfiod.vfiod1.claim",
                _ => "org.vfiod.vfiod1.mode",
            };
            assert_eq!(action_for_task(*kind), want, "{kind}");
            let c = Check::reset_task(af(), Some(*kind));
            assert_eq!(c.action(), want, "{kind}");
            assert_eq!(
                sorted(&c),
                [
                    ("device", "0000:af:00.0".into()),
                    ("verb", "ResetTask".into())
                ]
            );
        }
        // No task: the mode family, whose reset it would be.
        assert_eq!(Check::reset_task(af(), None).action(), ACTION_MODE);
    }

    #[test]
    fn set_mode_sends_the_mode_and_the_resolved_vf_count() {
        let vf = Target::Vf {
            num_vfs: 4,
            vf_driver: "vfio-pci".into(),
        };
        let c = Check::set_mode(af(), &vf);
        assert_eq!(c.action(), "org.vfiod.vfiod1.mode");
        assert_eq!(
            sorted(&c),
            [
                ("device", "0000:af:00.0".into()),
                ("mode", "vf".into()),
                ("num_vfs", "4".into()),
                ("verb", "SetMode".into()),
            ]
        );
        let pf = Check::set_mode(af(), &Target::Pf { driver: None });
        assert_eq!(
            sorted(&pf),
            [
                ("device", "0000:af:00.0".into()),
                ("mode", "pf".into()),
                ("verb", "SetMode".into()),
            ]
        );
    }

    #[test]
    fn daemon_checks_carry_the_verb_only_and_refusals_name_the_call() {
        let c = Check::new(ACTION_CONFIGURE, "Reload");
        assert_eq!(sorted(&c), [("verb", "Reload".into())]);
        assert_eq!(c.to_string(), "org.vfiod.vfiod1.configure (Reload)");
        let d = Check::on_device(ACTION_MODE, "Apply", af()).with(Detail::Vm, "vm1");
        assert_eq!(d.detail(Detail::Vm), Some("vm1"));
        assert_eq!(
            d.to_string(),
            "org.vfiod.vfiod1.mode (Apply on 0000:af:00.0)"
        );
        // A key set twice is sent once, with the last value.
        let twice = d.with(Detail::Vm, "vm2");
        assert_eq!(twice.details().get("vm"), Some(&"vm2"));
        assert_eq!(twice.details().len(), 3);
    }

    #[test]
    fn detail_keys_are_the_documented_ones() {
        let keys: Vec<_> = Detail::ALL.iter().map(|d| d.as_str()).collect();
        assert_eq!(
            keys,
            ["verb", "device", "mode", "num_vfs", "vm", "kind", "image"]
        );
    }
}
