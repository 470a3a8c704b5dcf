//! `vfioctl doctor`: whether this host can pass devices through, checked without vfiod (it is
//! one of the checks) and without changing anything; see `vfiod::doctor`.

use super::*;
use vfiod::doctor::{render, run};

/// Prints the report (text, or JSON) and exits by its worst verdict.
pub(crate) async fn doctor(target: BusTarget, options: run::Options, json: bool) -> ExitCode {
    let report = run::examine(&options, &target).await;
    if json {
        if let Err(e) = print_json(&report) {
            eprintln!("vfioctl: {e}");
            return ExitCode::FAILURE;
        }
    } else {
        print!("{}", render::text(&report));
    }
    ExitCode::from(report.exit_code())
}
