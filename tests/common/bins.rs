//! Binaries of the workspace's other targets: cargo names a binary to an integration test
//! (`CARGO_BIN_EXE_*`) only when it is the test's own package's, but builds every one into the
//! same directory as `vfiod`. `cargo test` at the top of the tree builds them all (every package
//! is a default member, and examples are built with the tests); a run limited to a package or a
//! test (`-p vfiod`, `--test pool`) needs them built first.

use std::path::{Path, PathBuf};

/// `target/<profile>`, where cargo put `vfiod`.
fn out_dir() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_vfiod"))
        .parent()
        .expect("vfiod is in a directory")
}

fn existing(path: PathBuf, build: &str) -> String {
    assert!(
        path.exists(),
        "{} is missing: build it first with `{build}` (a plain `cargo test` at the top of the \
         tree does)",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

/// `vfiod-pool`, the reference pool service (crates/vfiod-pool).
pub fn vfiod_pool() -> String {
    existing(out_dir().join("vfiod-pool"), "cargo build -p vfiod-pool")
}

/// The pooled demo, `cargo run --example pool-demo` (examples/pool-demo.rs).
pub fn pool_demo() -> String {
    existing(
        out_dir().join("examples").join("pool-demo"),
        "cargo build --example pool-demo",
    )
}
