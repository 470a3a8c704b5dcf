//! Pooled accelerators (issue 11): the pool control protocol and its edges. [`protocol`] holds
//! the wire types and paths (pure); [`client`] is the HTTP client vfiod uses, one per
//! `[[pool]]`. The reference pool service (`vfiod-pool`) and the stand-in user-mode driver
//! live here too, so that tests and the demo run both ends from one crate.

pub mod client;
pub mod driver;
pub mod protocol;
pub mod service;
