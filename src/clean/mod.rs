//! Cleaning a device between tenants: the clean job's rules live here, as pure decisions (no
//! I/O) that the job in `engine/` carries out. [`reset`] decides how a claim's functions are
//! reset (each alone, by which methods in which order, or the whole group through the bridge);
//! [`health`] decides whether a function came back healthy from its reset.

pub mod health;
pub mod reset;
