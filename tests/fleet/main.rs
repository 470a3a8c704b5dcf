//! The fleet against a real PostgreSQL server (`common::postgres`: initdb and pg_ctl in a
//! temporary directory). One binary because it needs PostgreSQL's server binaries and the
//! `fleet` feature (`required-features` in Cargo.toml).

#[path = "../common/mod.rs"]
mod common;

mod hosts;
