//! TLS of the pool service: rustls (ring provider) with the pool's certificate and mandatory
//! client certificates, checked against the client CA (`WebPkiClientVerifier`). A client
//! without a certificate the CA signed fails the handshake: it never reaches HTTP.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// The three files TLS needs.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// PEM: the pool's certificate chain.
    pub cert: PathBuf,
    /// PEM: its private key.
    pub key: PathBuf,
    /// PEM: the CA(s) whose client certificates are accepted (the hosts running vfiod).
    pub client_ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {}", .path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{what} {} holds no certificate", .path.display())]
    Empty { what: &'static str, path: PathBuf },
    #[error("client CA {}", .path.display())]
    Verifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    #[error("TLS configuration with {}", .path.display())]
    Config {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        what,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The server configuration from `files`; every file is read and checked now, so a bad file
/// stops the start with its name, not the first handshake.
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs("server certificate", &files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|source| TlsError::Pem {
        what: "server key",
        path: files.key.clone(),
        source,
    })?;
    let mut roots = RootCertStore::empty();
    for c in certs("client CA", &files.client_ca)? {
        roots.add(c).map_err(|source| TlsError::Config {
            path: files.client_ca.clone(),
            source,
        })?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|source| TlsError::Verifier {
            path: files.client_ca.clone(),
            source,
        })?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            path: files.cert.clone(),
            source,
        })?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Config {
            path: files.key.clone(),
            source,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
