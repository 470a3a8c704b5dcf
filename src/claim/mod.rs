//! Claims ("resource pre-declaration"): which device a VM's request gets, decided by pure
//! functions over a [`Snapshot`] of the store. The store reads the snapshot, calls [`choose`] and
//! records the choice inside one write transaction, so the choice and its record are one atomic
//! step: concurrent requests never get the same function. The database enforces it again (one
//! active claim per function, a PF never claimed beside its VFs), whatever the code above does.
//!
//! [`requirements`] says what a request asks for and who asks; [`choice`] what is claimable and
//! which candidate wins; [`lifecycle`] what attach, detach, release and the reconcile with
//! libvirt do to a claim.

pub mod choice;
pub mod lifecycle;
pub mod requirements;

pub use choice::{
    candidates, choose, unavailable, Choice, ClaimFunction, Held, Reason, Snapshot, SplitPolicy,
    Unavailable,
};
pub use requirements::{Owner, Requirements};
