//! `vfioctl hook qemu`: what libvirt's hook shim runs. It forwards the run to vfiod in one call
//! (`Manager.Hook`) within a hard deadline, and decides alone when vfiod cannot answer: a
//! notification passes (libvirt must never be held up, and a failing `reconnect` would make it
//! kill the VM), while `prepare`, `start`, `migrate` and `restore` fail closed for a domain with
//! a device vfiod manages, and pass for any other domain.

use crate::config::{HookSettings, Settings, DEFAULT_CONFIG_PATH, DEFAULT_DROPIN_DIR};
use crate::dbus::BusTarget;
use crate::hooks::Operation;
use crate::model::pci::PciAddress;
use std::path::Path;
use std::time::Duration;

/// The most XML read from stdin: libvirt's largest domains are far smaller.
pub const MAX_XML: usize = 16 << 20;

/// libvirt's arguments.
#[derive(Clone, Debug)]
pub struct HookArgs {
    pub domain: String,
    pub operation: String,
    pub sub_operation: String,
    pub extra: String,
}

/// What the hook process does: its exit code, its output, and a line for its stderr.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Where the hook finds the daemon's settings (for the deadlines and the state directory):
/// `$VFIOD_CONFIG` (a main file, no drop-ins), else the installed files.
pub fn settings() -> Settings {
    let loaded = match std::env::var_os("VFIOD_CONFIG") {
        Some(p) => Settings::load(Path::new(&p), None, true),
        None => Settings::load(
            Path::new(DEFAULT_CONFIG_PATH),
            Some(Path::new(DEFAULT_DROPIN_DIR)),
            false,
        ),
    };
    // A configuration the daemon would refuse: the defaults, so that the hook still answers.
    loaded.unwrap_or_default()
}

/// Runs the hook: asks vfiod, or decides alone when it cannot.
pub async fn run(
    bus: &BusTarget,
    args: &HookArgs,
    xml: String,
    hooks: &HookSettings,
    state_dir: &Path,
) -> Outcome {
    let op = Operation::parse(&args.operation);
    let deadline = Duration::from_millis(u64::from(if op.may_fail() {
        hooks.deadline_ms
    } else {
        hooks.notify_deadline_ms
    }));
    let asked = tokio::time::timeout(deadline, ask(bus, args, &xml)).await;
    let why = match asked {
        Ok(Ok((exit_code, stdout, message))) => {
            return Outcome {
                exit_code,
                stdout,
                stderr: message,
            }
        }
        Ok(Err(e)) => e,
        Err(_) => format!("vfiod did not answer within {} ms", deadline.as_millis()),
    };
    alone(op, args, &xml, state_dir, &why)
}

async fn ask(bus: &BusTarget, a: &HookArgs, xml: &str) -> Result<(i32, String, String), String> {
    let conn = super::connect(bus)
        .await
        .map_err(|e| crate::error_chain(&e))?;
    let m = super::manager(&conn)
        .await
        .map_err(|e| crate::error_chain(&e))?;
    m.hook(&a.domain, &a.operation, &a.sub_operation, &a.extra, xml)
        .await
        .map_err(|e| match e {
            zbus::Error::MethodError(name, Some(msg), _) => format!("{msg} ({name})"),
            other => crate::error_chain(&other),
        })
}

/// vfiod did not answer (`why`): pass, or fail closed for a domain with managed devices.
fn alone(op: Operation, args: &HookArgs, xml: &str, state_dir: &Path, why: &str) -> Outcome {
    let what = format!(
        "{} {} of {}",
        args.operation, args.sub_operation, args.domain
    );
    if !op.may_fail() {
        return Outcome {
            exit_code: 0,
            stdout: String::new(),
            stderr: format!("vfiod: {what} not recorded: {why}; the reconcile will catch up"),
        };
    }
    let functions = match crate::host::libvirt::assigned_functions(xml) {
        Ok(f) => f,
        Err(e) => {
            return Outcome {
                exit_code: 1,
                stdout: String::new(),
                stderr: format!(
                    "vfiod: cannot read the XML of domain {}: {e} ({why})",
                    args.domain
                ),
            }
        }
    };
    if functions.is_empty() {
        return pass_unchanged();
    }
    match crate::store::managed_functions_read_only(state_dir) {
        Ok(managed) => {
            let ours: Vec<PciAddress> = functions
                .into_iter()
                .filter(|f| managed.contains(f))
                .collect();
            if ours.is_empty() {
                return pass_unchanged();
            }
            fail_closed(&what, &ours, why)
        }
        // Not even the records: any PCI hostdev may be one vfiod manages.
        Err(e) => fail_closed(
            &what,
            &functions,
            &format!(
                "{why}, and its records cannot be read: {}",
                crate::error_chain(&e)
            ),
        ),
    }
}

fn pass_unchanged() -> Outcome {
    Outcome {
        exit_code: 0,
        stdout: String::new(),
        stderr: String::new(),
    }
}

fn fail_closed(what: &str, functions: &[PciAddress], why: &str) -> Outcome {
    let list: Vec<String> = functions.iter().map(|f| f.to_string()).collect();
    Outcome {
        exit_code: 1,
        stdout: String::new(),
        stderr: format!(
            "vfiod: {what} refused: the domain has {} that vfiod manages and vfiod cannot check \
             them ({why}); start vfiod (systemctl start vfiod) and try again",
            list.join(", ")
        ),
    }
}

/// A line in the system log (the journal), for what libvirt does not show: a hook's stderr is
/// only logged by libvirtd when the hook fails.
pub fn journal(message: &str) {
    let Ok(text) = std::ffi::CString::new(message.replace('\0', " ")) else {
        return;
    };
    // SAFETY: static NUL-terminated identity and format; `text` outlives the call.
    unsafe {
        libc::openlog(c"vfiod-hook".as_ptr(), libc::LOG_PID, libc::LOG_DAEMON);
        libc::syslog(libc::LOG_WARNING, c"%s".as_ptr(), text.as_ptr());
        libc::closelog();
    }
}
