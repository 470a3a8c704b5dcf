//! Tests of the library that need no bus, no daemon and no service: the configuration, the
//! simulated kernel and what runs on it (conversions, the DFL card, the inventory, the planner,
//! resets and the health check), the domain XML parser (with libvirt's in-process test
//! driver), a host's recording and its replay, the SQLite store, the pool client against hostile
//! HTTP servers on loopback, the man pages as the built binaries print them, the module map, and
//! the guard that keeps tests from racing the clock.
//! One binary because they need nothing but a temporary directory.

#[path = "../common/mod.rs"]
mod common;

mod architecture;
mod config;
mod convert;
mod dfl;
mod domain_xml;
mod hostuse;
mod inventory;
mod man_pages;
mod planner;
mod pool_client_limits;
mod record;
mod reset;
mod simkernel;
mod store;
mod store_backup;
mod store_claims;
mod store_clean;
mod store_empty;
mod store_integrity;
mod store_retention;
mod store_tasks;
mod timing;
