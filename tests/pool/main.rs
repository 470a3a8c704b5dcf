//! Pooled devices through vfiod against the real reference pool service (`vfiod-pool` on
//! loopback, and the `pool-demo` example) with several simulated hosts, each on its own bus.
//! One binary because they need the pool service running beside the hosts, a binary of another
//! package (`common::bins`: built by a `cargo test` at the top of the tree); one test also
//! needs polkitd, and so root.

#[path = "../common/mod.rs"]
mod common;

mod pooled;
