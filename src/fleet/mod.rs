//! The fleet: this host's part in an accelerator database shared by many hosts, on PostgreSQL.
//! Optional (`[fleet]` in the configuration); vfiod stays whole without it.
//!
//! - [`record`]: what a host reports (pure);
//! - [`conductor`]: the completeness rule and the comparison of a report with the database
//!   (pure, run inside the report's transaction);
//! - [`backoff`]: when to try a failed database again (pure);
//! - [`credentials`]: the connection string, from an owner-only file;
//! - [`tls`]: connections, with TLS (rustls) where the host is a network one;
//! - [`schema`]: versioned migrations and row-level security;
//! - [`db`]: the queries (reports, reservations, the operator's views);
//! - [`reporter`]: the task that reports and turns reservations into local claims.
//!
//! See docs/fleet.md for the design.

pub mod backoff;
pub mod conductor;
pub mod credentials;
pub mod db;
pub mod record;
pub mod reporter;
pub mod schema;
pub mod tls;

pub use reporter::Reporter;

/// Errors of the fleet edge.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Credentials(#[from] credentials::CredentialsError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("fleet database")]
    Database(#[from] tokio_postgres::Error),
    #[error("the fleet database's schema is at version {found}, this vfiod needs {needed} (run `vfioctl fleet migrate` with the schema owner's credentials)")]
    SchemaTooOld { found: i32, needed: i32 },
    #[error("the connection to the fleet database closed")]
    ConnectionClosed,
    #[error("the fleet database did not answer within {0:?}")]
    Timeout(std::time::Duration),
    #[error("cannot read the local state for a report: {0}")]
    Local(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// This host's name in the fleet: the configured one, else `/etc/machine-id`, else the host
/// name.
pub fn host_name(configured: Option<&str>) -> String {
    if let Some(h) = configured {
        return h.to_string();
    }
    if let Ok(id) = std::fs::read_to_string("/etc/machine-id") {
        let id = id.trim();
        if crate::config::check_host_name(id).is_ok() {
            return id.to_string();
        }
    }
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| crate::config::check_host_name(h).is_ok())
        .unwrap_or_else(|| "localhost".to_string())
}
