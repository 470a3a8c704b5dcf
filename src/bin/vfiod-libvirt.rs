//! `vfiod-libvirt`: the process in which vfiod's libvirt client runs (see
//! `vfiod::host::libvirt::serve`). vfiod starts it when a `libvirt_uri` is configured, and
//! talks to it on its standard input and output; it is not meant to be run by hand.

use nix::sys::signal::{signal, SigHandler, Signal};
use std::process::ExitCode;

fn main() -> ExitCode {
    // It ends when vfiod closes its standard input (vfiod's stop, or its death), never on a
    // signal meant for vfiod: systemd's stop sends SIGTERM to every process of the service at
    // once, and Ctrl-C in a terminal sends SIGINT to the whole process group; a helper gone
    // first would make vfiod, still running, report it lost and start another.
    // SAFETY: set first thing, before any other thread exists; SIG_IGN runs no code.
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        unsafe {
            let _ = signal(s, SigHandler::SigIgn);
        }
    }
    let mut args = std::env::args().skip(1);
    let (mut root, mut uri) = (std::path::PathBuf::from("/"), None);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--root", Some(v)) => root = v.into(),
            ("--uri", Some(v)) => uri = Some(v),
            _ => {
                eprintln!(
                    "vfiod-libvirt: vfiod's libvirt helper, started by vfiod \
                     (usage: vfiod-libvirt [--root DIR] [--uri URI], requests on stdin)"
                );
                return ExitCode::from(2);
            }
        }
    }
    vfiod::init_logging("vfiod-libvirt", "info");
    match vfiod::host::libvirt::serve::serve(root, uri) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{}", vfiod::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
