//! The kinds of job the engine runs, one module each. A new kind of job is a new module here
//! that implements [`super::Job`]; the engine needs no change.

pub mod attach;
pub mod detach;
pub mod mode;

pub use attach::AttachJob;
pub use detach::DetachJob;
pub use mode::ModeJob;
