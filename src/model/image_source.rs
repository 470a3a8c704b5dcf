//! Why the read of an image's source (a descriptor a caller passed, a path root named) stopped
//! before its end: a value the host layer that reads ([`crate::host::image_source`]), the store
//! that copies and the D-Bus edge that names the error all speak, so it lives in the model.

use std::io;
use std::time::Duration;

/// Why a read of a source stopped before its end. It travels inside the `io::Error` that
/// [`Source::read`] returns; [`SourceError::of`] finds it again.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// Nothing came for this long (a pipe whose writer stays open and silent).
    #[error("nothing could be read from it for {} s", .0.as_secs())]
    Stalled(Duration),
    /// The whole read took longer than this.
    #[error("reading it took longer than {} s", .0.as_secs())]
    TimedOut(Duration),
    /// The caller that asked for it went away (its bus connection closed).
    #[error("its caller went away")]
    Abandoned,
}

impl SourceError {
    /// The `SourceError` inside an `io::Error` that [`Source`] returned, if it is one.
    pub fn of(e: &io::Error) -> Option<SourceError> {
        e.get_ref()?.downcast_ref::<SourceError>().cloned()
    }
}
