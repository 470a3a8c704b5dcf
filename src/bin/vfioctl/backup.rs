//! `vfioctl backup FILE`: a consistent copy of the state database while vfiod runs
//! (`vfiod::store::backup`), read by vfioctl itself, with the caller's rights: no daemon
//! needed, and the daemon never writes where a client says (see that module for why).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use vfiod::config::{ConfigError, Settings, DEFAULT_CONFIG_PATH, DEFAULT_DROPIN_DIR};
use vfiod::error_chain;
use vfiod::store::backup;

/// The state directory: `--state-dir`, else the configuration's `state_dir` (the file in
/// $VFIOD_CONFIG, else /etc/vfiod/vfiod.toml and conf.d, as the daemon reads them).
fn state_dir(given: Option<PathBuf>) -> Result<PathBuf, ConfigError> {
    if let Some(d) = given {
        return Ok(d);
    }
    let loaded = match std::env::var_os("VFIOD_CONFIG") {
        Some(p) => Settings::load(Path::new(&p), None, true),
        None => Settings::load(
            Path::new(DEFAULT_CONFIG_PATH),
            Some(Path::new(DEFAULT_DROPIN_DIR)),
            false,
        ),
    };
    loaded.map(|s| s.state_dir)
}

pub fn run(file: &Path, force: bool, dir: Option<PathBuf>, json: bool) -> ExitCode {
    // Both errors become the one line the operator reads here, at the edge that prints it.
    let result = match state_dir(dir) {
        Ok(d) => backup::backup(&d, file, force).map_err(|e| error_chain(&e)),
        Err(e) => Err(format!(
            "{}; pass the state directory with --state-dir",
            error_chain(&e)
        )),
    };
    match result {
        Ok(r) if json => match serde_json::to_string_pretty(&r) {
            Ok(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("vfioctl: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(r) => {
            println!(
                "wrote {} ({} bytes, schema {}): {} events, {} tasks, {} claims; change {}, \
                 last event {}",
                r.path.display(),
                r.bytes,
                r.schema_version,
                r.events,
                r.tasks,
                r.claims,
                r.changes.unwrap_or(0),
                r.last_event
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            if json {
                eprintln!("{}", serde_json::json!({ "error": null, "message": e }));
            } else {
                eprintln!("vfioctl: {e}");
            }
            ExitCode::FAILURE
        }
    }
}
