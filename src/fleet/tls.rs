//! TLS to the fleet database: rustls with the ring provider, the system's CA certificates and,
//! if configured, the operator's own CA (`[fleet] ca_file`). The server's certificate is always
//! verified against those, for its host name: `sslmode=require` in the connection string asks
//! for TLS, `prefer` (the default) uses it when the server offers it, `disable` never. Unix
//! sockets never use TLS (the server does not offer it there).

use std::path::Path;
use std::sync::Arc;

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
