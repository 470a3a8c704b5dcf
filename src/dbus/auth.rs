//! Authorization of mutating calls: a caller with CAP_SYS_ADMIN is allowed, as systemd's daemons
//! allow it; any other asks polkit, with the message sender as the subject. Reads never ask.
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
    /// Allow every caller. Only for the simulation on a private bus, where it is announced.
    AllowAll,
}

impl Authorizer {
    /// Succeeds when the sender of `header` may do what `check` asks; otherwise `NotAuthorized`
    /// (naming the action), and nothing has been changed.
    pub async fn check(
        &self,
        conn: &zbus::Connection,
        header: &Header<'_>,
        check: &Check,
    ) -> Result<(), Error> {
        if *self == Authorizer::AllowAll {
            return Ok(());
        }
        // As systemd's own daemons decide (sd_bus_query_sender_privilege): a caller holding
        // CAP_SYS_ADMIN may, without asking polkit, so that root can manage the host on one
        // where polkitd is not installed. Everyone else asks polkit.
        if privileged(conn, header).await {
            tracing::debug!(%check, "allowed: the caller holds CAP_SYS_ADMIN");
            return Ok(());
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
                         is refused for this caller; a caller with CAP_SYS_ADMIN (root) is \
                         allowed without it: {e}"
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

impl Authorizer {
    /// Succeeds for a caller running as root (libvirt runs its hooks as root, and a hook's call
    /// may not wait for a polkit agent; only root may name a file for vfiod to read), or for
    /// anyone under [`Authorizer::AllowAll`].
    pub async fn require_root(
        &self,
        requesters: &Requesters,
        conn: &zbus::Connection,
        header: &Header<'_>,
        what: &str,
    ) -> Result<(), Error> {
        if *self == Authorizer::AllowAll {
            return Ok(());
        }
        match requesters.uid(conn, header).await {
            Some(0) => Ok(()),
            Some(uid) => Err(Error::NotAuthorized(format!(
                "{what} is accepted from root only, not uid {uid}"
            ))),
            None => Err(Error::NotAuthorized(format!(
                "{what} is accepted from root only, and the bus does not say who the caller is"
            ))),
        }
    }
}

/// CAP_SYS_ADMIN's bit in a capability set (`linux/capability.h`).
const CAP_SYS_ADMIN: u32 = 21;

/// Whether the sender of `header` holds CAP_SYS_ADMIN in its effective set, as systemd's
/// daemons ask: the bus says which process it is (and its uid); `/proc/PID/status` says what it
/// holds, trusted only when that process has the uid the bus reported (a pid reused by
/// another user's process is not taken for the caller) and, where the bus hands a pidfd, while
/// the pidfd still names that pid. A bus that names no process: uid 0 is privileged.
async fn privileged(conn: &zbus::Connection, header: &Header<'_>) -> bool {
    let Some(sender) = header.sender() else {
        return false;
    };
    let Ok(bus) = zbus::fdo::DBusProxy::new(conn).await else {
        return false;
    };
    let Ok(creds) = bus.get_connection_credentials(sender.clone().into()).await else {
        return false;
    };
    let Some(uid) = creds.unix_user_id() else {
        return false;
    };
    let Some(pid) = creds.process_id() else {
        return uid == 0;
    };
    let pidfd = creds.into_process_fd();
    // procfs reads can stall (a process whose memory map is locked): off the async threads.
    tokio::task::spawn_blocking(move || {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return false;
        };
        let still_that_process = match &pidfd {
            None => true,
            Some(fd) => {
                use std::os::fd::AsRawFd;
                std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
                    .map(|info| pidfd_pid(&info) == Some(pid))
                    .unwrap_or(false)
            }
        };
        still_that_process && holds_cap_sys_admin(&status, uid)
    })
    .await
    .unwrap_or(false)
}

/// From a `/proc/PID/status`: the process's effective uid is `uid` and its effective
/// capabilities include CAP_SYS_ADMIN.
fn holds_cap_sys_admin(status: &str, uid: u32) -> bool {
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
    euid == Some(uid) && cap_eff.is_some_and(|c| c & (1 << CAP_SYS_ADMIN) != 0)
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
                    let mut uids = self.uids();
                    if uids.len() >= Self::MAX {
                        uids.clear();
                    }
                    uids.insert(sender.to_string(), uid);
                }
                uid
            }
        };
        uid
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
    fn cap_sys_admin_is_read_from_the_effective_set_of_the_callers_uid() {
        let status = |uid: &str, eff: &str| {
            format!(
                "Name:\tvfioctl\nUid:\t{uid}\nGid:\t0\t0\t0\t0\nCapInh:\t0000000000000000\n\
                 CapPrm:\t000001ffffffffff\nCapEff:\t{eff}\n"
            )
        };
        let table = [
            // (Uid line, CapEff, uid the bus reported, privileged)
            ("0\t0\t0\t0", "000001ffffffffff", 0, true),
            // root that dropped CAP_SYS_ADMIN (a container's root, say): asks polkit
            ("0\t0\t0\t0", "000001ffffdfffff", 0, false),
            // a user given CAP_SYS_ADMIN (ambient, file capability): privileged, as in systemd
            ("1000\t1000\t1000\t1000", "0000000000200000", 1000, true),
            // an ordinary user
            ("1000\t1000\t1000\t1000", "0000000000000000", 1000, false),
            // the pid now belongs to another uid than the bus's caller: not trusted
            ("0\t0\t0\t0", "000001ffffffffff", 1000, false),
            // the effective uid decides, not the real one
            ("1000\t0\t0\t0", "000001ffffffffff", 0, true),
            ("0\t1000\t0\t0", "000001ffffffffff", 0, false),
            // unreadable fields
            ("0\t0\t0\t0", "zz", 0, false),
            ("", "000001ffffffffff", 0, false),
        ];
        for (uid_line, eff, uid, want) in table {
            assert_eq!(
                holds_cap_sys_admin(&status(uid_line, eff), uid),
                want,
                "Uid {uid_line:?} CapEff {eff} bus uid {uid}"
            );
        }
        assert!(!holds_cap_sys_admin("", 0));
        assert_eq!(
            pidfd_pid("pos:\t0\nflags:\t02000002\nPid:\t4242\n"),
            Some(4242)
        );
        assert_eq!(pidfd_pid("Pid:\t-1\n"), None);
        assert_eq!(pidfd_pid("flags:\t0\n"), None);
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
