//! Downloads of FPGA images over HTTP(S): `Images.AddFromUrl`, and the program task's download
//! step for an image whose local copy is gone.
//!
//! What is allowed is decided first, without any connection ([`check_url`]): `https` to any
//! host, plain `http` only to a loopback host unless `[images] allow_http` says otherwise, and
//! never a redirect from `https` to `http`. The body is streamed into a temporary file the
//! caller made in the images directory, its SHA-256 computed on the way; a `Content-Length`
//! over [`MAX_IMAGE_SIZE`] is refused before the body is read, and a body that grows past it
//! (a server that announced less, or nothing) is cut off. Connect, between-reads and total deadlines bound every download. The caller
//! checks the digest and keeps or drops the file (dropping the temporary file removes it).

use crate::config::ImageSettings;
use crate::store::image::MAX_IMAGE_SIZE;
use futures_util::StreamExt;
use reqwest::Url;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Why a download was refused or failed. Each message names the URL.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    #[error("{url:?} is not a valid URL: {reason}")]
    BadUrl { url: String, reason: String },
    /// The URL (or a redirect's) is not one vfiod may fetch: nothing was sent.
    #[error("{url}: {reason}")]
    Refused { url: String, reason: String },
    #[error("cannot read the CA file {}", path.display())]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up the HTTP client")]
    Client(#[source] reqwest::Error),
    #[error("{url}: the server answered HTTP {status}")]
    Status { url: String, status: String },
    #[error("{url}: the image is larger than {limit} bytes{}", .announced.map(|n| format!(" (the server announced {n})")).unwrap_or_default())]
    TooLarge {
        url: String,
        limit: u64,
        announced: Option<u64>,
    },
    #[error("{url}: no answer within the deadline (connect {connect}s, between reads {read}s, whole download {total}s)")]
    Timeout {
        url: String,
        connect: u64,
        read: u64,
        total: u64,
    },
    #[error("{url}: the download failed")]
    Transfer {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}: cannot write the download to {}", path.display())]
    Write {
        url: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A host that is this machine: a loopback address or `localhost`.
fn is_loopback(url: &Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(a)) => a.is_loopback(),
        Some(url::Host::Ipv6(a)) => a.is_loopback(),
        Some(url::Host::Domain(d)) => {
            d.eq_ignore_ascii_case("localhost")
                || d.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
        }
        None => false,
    }
}

/// Whether vfiod may fetch `url` (reached from `from`, for a redirect). Pure: decided before
/// any connection.
pub fn allowed(url: &Url, allow_http: bool, from: Option<&Url>) -> Result<(), String> {
    if url.host().is_none() {
        return Err("the URL names no host".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        // They would end up in the catalog, the events and the logs.
        return Err("credentials in the URL are not accepted".into());
    }
    match url.scheme() {
        "https" => Ok(()),
        "http" if from.is_some_and(|f| f.scheme() == "https") => Err(format!(
            "redirected from https to plain http ({url}): refused"
        )),
        "http" if allow_http || is_loopback(url) => Ok(()),
        "http" => Err(
            "plain http is accepted only to a loopback host: use https (or set [images] \
             allow_http = true)"
                .into(),
        ),
        other => Err(format!("scheme {other:?} is not http or https")),
    }
}

/// Parses `url` and checks it with [`allowed`].
pub fn check_url(url: &str, allow_http: bool) -> Result<Url, DownloadError> {
    let parsed = Url::parse(url).map_err(|e| DownloadError::BadUrl {
        url: url.chars().take(200).collect(),
        reason: e.to_string(),
    })?;
    allowed(&parsed, allow_http, None).map_err(|reason| DownloadError::Refused {
        url: parsed.to_string(),
        reason,
    })?;
    Ok(parsed)
}

/// What a finished download gave: the temporary file (still to be checked and kept), its
/// SHA-256 as 64 lowercase hex digits and its size.
pub struct Fetched {
    pub file: tempfile::NamedTempFile,
    pub sha256: String,
    pub size: u64,
}

/// An HTTP client set up from `[images]`.
pub struct Downloader {
    client: reqwest::Client,
    settings: ImageSettings,
    /// The most bytes kept: [`MAX_IMAGE_SIZE`].
    limit: u64,
}

impl Downloader {
    pub fn new(settings: &ImageSettings) -> Result<Downloader, DownloadError> {
        // reqwest is built without a crypto provider of its own (aws-lc-rs builds slowly):
        // ring, installed once for the process. An earlier install (of ring) stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let allow_http = settings.allow_http;
        let policy = reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= 10 {
                return attempt.error("more than 10 redirects");
            }
            match allowed(attempt.url(), allow_http, attempt.previous().last()) {
                Ok(()) => attempt.follow(),
                Err(reason) => attempt.error(reason),
            }
        });
        let mut builder = reqwest::Client::builder()
            .connect_timeout(settings.connect_timeout)
            .read_timeout(settings.read_timeout)
            .timeout(settings.timeout)
            .redirect(policy)
            .user_agent(concat!("vfiod/", env!("CARGO_PKG_VERSION")));
        if let Some(path) = &settings.ca_file {
            let pem = std::fs::read(path).map_err(|source| DownloadError::CaFile {
                path: path.clone(),
                source,
            })?;
            let certs =
                reqwest::Certificate::from_pem_bundle(&pem).map_err(DownloadError::Client)?;
            if certs.is_empty() {
                return Err(DownloadError::CaFile {
                    path: path.clone(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "no PEM certificate in it",
                    ),
                });
            }
            builder = builder.tls_certs_merge(certs);
        }
        Ok(Downloader {
            client: builder.build().map_err(DownloadError::Client)?,
            settings: settings.clone(),
            limit: MAX_IMAGE_SIZE,
        })
    }

    /// A smaller cap than [`MAX_IMAGE_SIZE`] (tests of the cap without 4 GiB of traffic).
    pub fn with_limit(mut self, limit: u64) -> Downloader {
        self.limit = limit.min(MAX_IMAGE_SIZE);
        self
    }

    fn timeout(&self, url: &Url) -> DownloadError {
        let s = |d: Duration| d.as_secs();
        DownloadError::Timeout {
            url: url.to_string(),
            connect: s(self.settings.connect_timeout),
            read: s(self.settings.read_timeout),
            total: s(self.settings.timeout),
        }
    }

    fn transfer(&self, url: &Url, e: reqwest::Error) -> DownloadError {
        if e.is_timeout() {
            return self.timeout(url);
        }
        if e.is_redirect() {
            // The policy's reason is in the chain; the URL refused is the redirect's.
            return DownloadError::Refused {
                url: url.to_string(),
                reason: crate::error_chain(&e),
            };
        }
        DownloadError::Transfer {
            url: url.to_string(),
            source: e,
        }
    }

    /// Downloads `url` (already checked with [`check_url`]) into `file`; `progress` hears the
    /// bytes received so far and the announced size. On failure `file` is dropped, which
    /// removes it.
    pub async fn fetch(
        &self,
        url: &Url,
        mut file: tempfile::NamedTempFile,
        progress: &mut impl FnMut(u64, Option<u64>),
    ) -> Result<Fetched, DownloadError> {
        allowed(url, self.settings.allow_http, None).map_err(|reason| DownloadError::Refused {
            url: url.to_string(),
            reason,
        })?;
        // reqwest's total timeout covers the body too; the outer one is the same deadline,
        // kept so that no await here can outlive it.
        let work = async {
            let response = self
                .client
                .get(url.clone())
                .send()
                .await
                .map_err(|e| self.transfer(url, e))?;
            let status = response.status();
            if !status.is_success() {
                return Err(DownloadError::Status {
                    url: url.to_string(),
                    status: status.to_string(),
                });
            }
            let announced = response.content_length();
            if announced.is_some_and(|n| n > self.limit) {
                return Err(DownloadError::TooLarge {
                    url: url.to_string(),
                    limit: self.limit,
                    announced,
                });
            }
            progress(0, announced);
            let mut hasher = Sha256::new();
            let mut size = 0u64;
            let mut body = response.bytes_stream();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| self.transfer(url, e))?;
                size += chunk.len() as u64;
                if size > self.limit {
                    return Err(DownloadError::TooLarge {
                        url: url.to_string(),
                        limit: self.limit,
                        announced,
                    });
                }
                hasher.update(&chunk);
                // A local file in the page cache: a short write, not worth a thread hop per
                // chunk. The caller syncs it before keeping it.
                file.as_file_mut()
                    .write_all(&chunk)
                    .map_err(|source| DownloadError::Write {
                        url: url.to_string(),
                        path: file.path().to_path_buf(),
                        source,
                    })?;
                progress(size, announced);
            }
            Ok((hasher, size))
        };
        let (hasher, size) = tokio::time::timeout(self.settings.timeout, work)
            .await
            .map_err(|_| self.timeout(url))??;
        let sha256 = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Fetched { file, sha256, size })
    }

    /// [`Downloader::fetch`] from a blocking thread (a job's): on the runtime this thread was
    /// spawned from, else on a runtime of its own.
    pub fn fetch_blocking(
        settings: &ImageSettings,
        url: &Url,
        file: tempfile::NamedTempFile,
        progress: &mut impl FnMut(u64, Option<u64>),
    ) -> Result<Fetched, DownloadError> {
        let work = async {
            let d = Downloader::new(settings)?;
            d.fetch(url, file, progress).await
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => handle.block_on(work),
            Err(_) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|source| DownloadError::Write {
                    url: url.to_string(),
                    path: PathBuf::new(),
                    source,
                })?
                .block_on(work),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_urls_are_fetched() {
        let u = |s: &str| Url::parse(s).unwrap();
        // (url, allow_http, redirected from, Ok or a part of the refusal)
        type Case<'a> = (&'a str, bool, Option<&'a str>, Result<(), &'a str>);
        let cases: &[Case] = &[
            ("https://images.example/a.gbs", false, None, Ok(())),
            ("http://127.0.0.1:8080/a", false, None, Ok(())),
            ("http://127.3.4.5/a", false, None, Ok(())),
            ("http://[::1]:80/a", false, None, Ok(())),
            ("http://localhost/a", false, None, Ok(())),
            ("http://images.example/a", false, None, Err("loopback")),
            ("http://10.0.0.1/a", false, None, Err("loopback")),
            ("http://images.example/a", true, None, Ok(())),
            ("ftp://images.example/a", true, None, Err("scheme")),
            ("file:///etc/passwd", true, None, Err("host")),
            (
                "https://u:p@images.example/a",
                false,
                None,
                Err("credentials"),
            ),
            (
                "http://127.0.0.1/a",
                true,
                Some("https://images.example/a"),
                Err("from https to plain http"),
            ),
            (
                "https://mirror.example/a",
                false,
                Some("https://images.example/a"),
                Ok(()),
            ),
        ];
        for (url, allow_http, from, want) in cases {
            let got = allowed(&u(url), *allow_http, from.map(u).as_ref());
            match (want, &got) {
                (Ok(()), Ok(())) => {}
                (Err(part), Err(msg)) if msg.contains(part) => {}
                _ => panic!("{url} (allow_http {allow_http}, from {from:?}): {got:?}"),
            }
        }
        assert!(matches!(
            check_url("not a url", false),
            Err(DownloadError::BadUrl { .. })
        ));
    }
}
