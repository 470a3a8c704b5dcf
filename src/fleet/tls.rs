//! Connections to the fleet database ([`connect`]: the client, its notifications, the task
//! that drives it) and their TLS: rustls with the ring provider, the system's CA certificates and,
//! if configured, the operator's own CA (`[fleet] ca_file`). The server's certificate is always
//! verified against those, for its host name: `sslmode=require` in the connection string asks
//! for TLS, `prefer` (the default) uses it when the server offers it, `disable` never. Unix
//! sockets never use TLS (the server does not offer it there).

use futures_util::StreamExt;
use std::path::Path;
use std::sync::Arc;
use tokio::sync::mpsc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the CA certificates in {path}")]
    CaFile {
        path: String,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path} holds no usable CA certificate")]
    NoCertificate { path: String },
    #[error("cannot set up TLS")]
    Rustls(#[from] rustls::Error),
}

/// A connector that verifies the server against the system's CAs and those in `ca_file`.
pub fn connector(
    ca_file: Option<&Path>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    // The system's store may be missing or hold a certificate rustls refuses: neither stops a
    // connection that needs only the operator's CA (or no TLS at all).
    let native = rustls_native_certs::load_native_certs();
    let _ = roots.add_parsable_certificates(native.certs);
    if let Some(path) = ca_file {
        let shown = path.display().to_string();
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|source| TlsError::CaFile {
                path: shown.clone(),
                source,
            })?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(TlsError::NoCertificate { path: shown });
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// An open connection: the client, the notifications' payloads (the channel closes with the
/// connection), and the task that drives it (aborted when this is dropped).
pub struct Connection {
    pub client: tokio_postgres::Client,
    pub notes: mpsc::UnboundedReceiver<String>,
    pub driver: AbortOnDrop,
}

/// Connects as `config` says: without TLS when every host is a unix socket or `sslmode` is
/// `disable` (a unix socket has no host name to verify, and the server offers no TLS there),
/// else with [`connector`].
pub async fn connect(
    config: &tokio_postgres::Config,
    ca_file: Option<&Path>,
) -> Result<Connection, super::FleetError> {
    use tokio_postgres::config::{Host, SslMode};
    let (notes_tx, notes) = mpsc::unbounded_channel();
    let plain = config.get_ssl_mode() == SslMode::Disable
        || config
            .get_hosts()
            .iter()
            .all(|h| matches!(h, Host::Unix(_)));
    let (client, driver) = if plain {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        (client, tokio::spawn(drive(connection, notes_tx)))
    } else {
        let (client, connection) = config.connect(connector(ca_file)?).await?;
        (client, tokio::spawn(drive(connection, notes_tx)))
    };
    Ok(Connection {
        client,
        notes,
        driver: AbortOnDrop(Some(driver)),
    })
}

/// Drives the connection, handing notifications' payloads on; ends when it closes (the sender
/// drops, which the session sees as a closed connection).
async fn drive<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    notes: mpsc::UnboundedSender<String>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    while let Some(m) = messages.next().await {
        match m {
            Ok(tokio_postgres::AsyncMessage::Notification(n)) => {
                let _ = notes.send(n.payload().to_string());
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("fleet: connection ended: {e}");
                break;
            }
        }
    }
}

/// Aborts the task when dropped.
pub struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl AbortOnDrop {
    /// Waits for the task to end by itself.
    pub async fn join(mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.await;
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = &self.0 {
            h.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        assert!(connector(None).is_ok());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ca.pem");
        std::fs::write(&p, "not a certificate\n").unwrap();
        let e = connector(Some(&p)).err().unwrap().to_string();
        assert!(e.contains("no usable CA certificate"), "{e}");
        let e = connector(Some(&dir.path().join("missing.pem")))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot read the CA certificates"), "{e}");
    }
}
