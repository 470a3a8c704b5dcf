//! Progress of a task or a download, for a person at a terminal: drawn on stderr only when it is
//! a terminal (nothing of it goes into a pipe or a log), fitted to the terminal's width, with
//! the step and an ETA once the rate is known. indicatif does the drawing.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};
use std::io::IsTerminal;

/// "ETA 12s" once there is progress to estimate from; nothing before.
fn eta(state: &ProgressState, w: &mut dyn std::fmt::Write) {
    if state.pos() > 0 && state.len().is_some_and(|len| state.pos() < len) {
        let _ = write!(w, " ETA {}", indicatif::HumanDuration(state.eta()));
    }
}

fn target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

fn bar(len: Option<u64>, template: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(len, target());
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .with_key("eta", eta)
        .progress_chars("#>-");
    bar.set_style(style);
    bar
}

/// A task's progress: its percent and step.
pub struct TaskProgress(ProgressBar);

impl TaskProgress {
    pub fn new(label: &str) -> TaskProgress {
        let b = bar(
            Some(100),
            "{prefix} [{bar:20}] {percent:>3}%{eta} {wide_msg}",
        );
        b.set_prefix(label.to_string());
        TaskProgress(b)
    }

    pub fn update(&self, percent: u8, step: &str) {
        self.0.set_position(u64::from(percent.min(100)));
        self.0.set_message(step.to_string());
    }

    /// Takes the bar off the terminal: the command's result line follows on stdout.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// A download's progress in bytes (`image add --url`); its size may be unknown.
pub struct DownloadProgress(ProgressBar);

impl DownloadProgress {
    pub fn new(name: &str) -> DownloadProgress {
        let b = bar(None, "downloading {prefix}: {bytes} {binary_bytes_per_sec}");
        b.set_prefix(name.to_string());
        DownloadProgress(b)
    }

    pub fn update(&self, received: u64, total: u64) {
        if total > 0 && self.0.length() != Some(total) {
            self.0.set_length(total);
            self.0.set_style(
                ProgressStyle::with_template(
                    "downloading {prefix}: [{bar:20}] {bytes}/{total_bytes} \
                     {binary_bytes_per_sec}{eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .with_key("eta", eta)
                .progress_chars("#>-"),
            );
        }
        self.0.set_position(received);
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}
