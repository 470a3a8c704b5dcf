//! Authorization against a real polkitd on a private system bus in its own mount namespace
//! (`common::polkit`). One binary because they need polkitd, and so root: those tests are
//! `#[ignore = "needs root"]`, run as root with `--ignored`.

#[path = "../common/mod.rs"]
mod common;

mod authz;
