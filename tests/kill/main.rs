//! The real daemon killed with SIGKILL at the steps the `test-hooks` feature marks (a split, a
//! program, a download; a claim's attach and detach against a real libvirtd), then restarted;
//! and its state store's files damaged after a kill (store.rs).
//! One binary because it needs the `test-hooks` feature (`required-features` in Cargo.toml).

#[path = "../common/mod.rs"]
mod common;

mod claims;
mod store;
mod tasks;
