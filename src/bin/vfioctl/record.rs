//! `vfioctl record`: what vfiod reads of this host into a tarball for a bug report
//! (`vfiod::host::record`), written atomically, or to stdout with `-o -`. Needs no daemon.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use vfiod::error_chain;
use vfiod::host::record::{self, Options};

/// The default name: `vfiod-recording-20261206T032329Z.tar.gz` in the current directory (no
/// host name: that is the user's to add).
fn default_name(recorded_at: &str) -> PathBuf {
    let compact: String = recorded_at
        .chars()
        .filter(|c| *c != '-' && *c != ':')
        .collect();
    PathBuf::from(format!("vfiod-recording-{compact}.tar.gz"))
}

fn size_text(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MB", bytes as f64 / f64::from(1 << 20))
    } else {
        format!("{:.1} kB", bytes as f64 / 1024.0)
    }
}

pub fn run(root: &Path, output: Option<PathBuf>, force: bool, with_hostname: bool) -> ExitCode {
    let options = Options {
        tool: format!("vfioctl {}", env!("CARGO_PKG_VERSION")),
        with_hostname,
    };
    let recording = match record::record(root, &options) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vfioctl: {}", error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let m = &recording.manifest;
    let output = output.unwrap_or_else(|| default_name(&m.recorded_at));
    let (written, size) = if output == Path::new("-") {
        let stdout = std::io::stdout().lock();
        let to_stdout = |e: record::RecordError| match e {
            record::RecordError::Write { source, .. } => record::RecordError::Write {
                path: "standard output".into(),
                source,
            },
            other => other,
        };
        match recording
            .write_tar_gz(std::io::BufWriter::new(stdout))
            .and_then(|mut w| {
                w.flush().map_err(|source| record::RecordError::Write {
                    path: "standard output".into(),
                    source,
                })
            })
            .map_err(to_stdout)
        {
            Ok(()) => ("standard output".to_string(), None),
            Err(e) => {
                eprintln!("vfioctl: {}", error_chain(&e));
                return ExitCode::FAILURE;
            }
        }
    } else {
        match recording.write_file(&output, force) {
            Ok(size) => (output.display().to_string(), Some(size)),
            Err(e) => {
                eprintln!("vfioctl: {}", error_chain(&e));
                return ExitCode::FAILURE;
            }
        }
    };
    // On stderr: stdout may be the tarball.
    let failed = if m.unreadable.is_empty() {
        String::new()
    } else {
        format!(
            ", {} reads failed (listed in the manifest)",
            m.unreadable.len()
        )
    };
    eprintln!(
        "recorded {} PCI functions, {} IOMMU groups{failed} into {written}{}",
        m.counts.functions,
        m.counts.iommu_groups,
        size.map(|s| format!(" ({})", size_text(s)))
            .unwrap_or_default()
    );
    eprintln!("replay it with: vfiod --simulate --replay FILE -- vfioctl list");
    eprintln!("it leaves out:");
    for l in &m.left_out {
        eprintln!("  - {l}");
    }
    ExitCode::SUCCESS
}
