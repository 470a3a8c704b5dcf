//! The reference pool service of the pool protocol (issue 11; docs/pool-protocol.md) and the
//! stand-in user-mode driver: the `vfiod-pool` binary (`vfiod-pool`, `vfiod-pool drive`), and a
//! library so that tests and vfiod's pooled demo (examples/pool-demo.rs of the vfiod package)
//! run both in-process. It depends on the protocol crate only, never on vfiod: the daemon on
//! every host links neither this HTTP server nor the stand-in accelerator.
//!
//! [`service`] is the pool (HTTP server, sessions in SQLite, the stand-in accelerator);
//! [`driver`] is what an application's driver inside a VM does with a pooled device.

pub mod driver;
pub mod service;

/// The protocol and its client, as the pool's code and its tests name them.
pub use vfiod_pool_protocol::{client, protocol};

use vfiod_pool_protocol::error_chain;
