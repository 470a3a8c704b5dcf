//! The pool control protocol, version 1 (issue 11; docs/pool-protocol.md,
//! docs/pool-openapi.yaml): the shared contract between vfiod and a pool of accelerators.
//! [`protocol`] holds the wire types, the paths and the typed error codes (pure); [`client`] is
//! the HTTP client vfiod uses, one per `[[pool]]`. A vendor's pool implements the same protocol;
//! the reference one is the `vfiod-pool` crate. Nothing here depends on vfiod.

pub mod client;
pub mod protocol;

/// An error and all its causes on one line ("a: b: c"), for the client's messages (the same
/// rule as vfiod's own `error_chain`, which this crate cannot depend on).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
