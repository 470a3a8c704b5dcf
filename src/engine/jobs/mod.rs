//! The kinds of job the engine runs, one module each. A new kind of job is a new module here
//! that implements [`super::Job`]; the engine needs no change.

pub mod attach;
pub mod detach;
pub mod guard;
pub mod migrate;
pub mod mode;
pub mod program;

pub use attach::AttachJob;
pub use detach::DetachJob;
pub use migrate::MigrateJob;
pub use mode::ModeJob;
pub use program::FpgaJob;

/// For the crash tests (`tests/kill/claims.rs`), only in builds with the `test-hooks` feature:
/// `VFIOD_TEST_KILL_AT=<point>` makes the daemon kill itself (SIGKILL, no cleanup) when a job
/// reaches `point` ("attach:attaching", "attach:in-libvirt", "detach:asked", and for
/// `tests/kill/tasks.rs` "program:writing"; "program:downloading" before an image is downloaded
/// again). Release builds
/// carry neither the code nor the variable's name.
#[cfg(feature = "test-hooks")]
pub(crate) fn kill_point(point: &str) {
    if std::env::var("VFIOD_TEST_KILL_AT").is_ok_and(|p| p == point) {
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub(crate) fn kill_point(_point: &str) {}
