//! Pooled accelerators (issue 11): the pool control protocol and its client, re-exported from
//! the `vfiod-pool-protocol` crate (crates/vfiod-pool-protocol), so that the daemon's code says
//! `crate::pool::protocol` and `crate::pool::client`. The reference pool service and its
//! stand-in driver are the `vfiod-pool` crate (crates/vfiod-pool): not linked into vfiod.

pub use vfiod_pool_protocol::{client, protocol};
