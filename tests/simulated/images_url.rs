//! FPGA images downloaded from a URL (`Images.AddFromUrl`, `vfioctl image add --url`) against
//! a real HTTPS server on loopback (rustls, a CA and a server certificate made here with
//! rcgen, trusted through `[images] ca_file`): a good download is kept with its parsed header
//! and its source URL; a wrong digest, an HTTP error, an announced or streamed size over the
//! cap, a stalled server, a redirect to plain http and plain http to a non-loopback host are
//! refused with the URL in the message, leaving no record and no file; leftovers of a killed
//! download are removed at start; the program task downloads an image whose local copy is
//! gone in its `downloading` step.

use crate::common;

use crate::common::{dict, eventually_async, refusal, vfioctl, Harness};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use vfiod::client::image::{images, ImageEntry};
use vfiod::fpga::image::build;
use vfiod::sim::kernel::REFERENCE_FPGA_INTERFACE;

const IFACE: &str = "3a00972e7aac41debbd13901124e8cda";
const AFU: &str = "d8424dc4a4a3c413f89e433683f9040b";
const AF: &str = "0000:af:00.0";

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// What the test server answers for a path.
#[derive(Clone)]
enum Route {
    Body(Vec<u8>),
    /// The body in 4 KiB pieces, `Duration` apart.
    Slow(Vec<u8>, Duration),
    Status(u16, &'static str),
    /// A `Content-Length` of this many bytes, and no body.
    Announce(u64),
    /// No `Content-Length`; zeros until the client hangs up.
    Endless,
    /// A `Content-Length` of 1000, 10 bytes, then nothing.
    Stall,
    Redirect(String),
}

/// An HTTPS server on 127.0.0.1 with a certificate for 127.0.0.1 and localhost, issued by a
/// CA written to `ca_file`.
struct Https {
    port: u16,
    ca_file: PathBuf,
    routes: Arc<Mutex<HashMap<String, Route>>>,
    _dir: tempfile::TempDir,
}

impl Https {
    async fn start() -> Https {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
        let dir = tempfile::tempdir().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "vfiod test CA");
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        leaf.subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        let leaf_key = KeyPair::generate().unwrap();
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca_cert.pem()).unwrap();

        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf_cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let routes: Arc<Mutex<HashMap<String, Route>>> = Arc::default();
        let r = Arc::clone(&routes);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let routes = Arc::clone(&r);
                tokio::spawn(async move {
                    if let Ok(tls) = acceptor.accept(tcp).await {
                        let _ = serve(tls, routes).await;
                    }
                });
            }
        });
        Https {
            port,
            ca_file,
            routes,
            _dir: dir,
        }
    }

    fn route(&self, path: &str, route: Route) {
        self.routes.lock().unwrap().insert(path.to_string(), route);
    }

    fn url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}{path}", self.port)
    }

    /// `[images]` trusting this server's CA, with short deadlines between reads, and a day for
    /// the whole download: a stalled download can only end by the read deadline, so a test
    /// sees which deadline ended it without timing it.
    fn config(&self) -> String {
        format!(
            "[images]\nca_file = \"{}\"\nconnect_timeout_seconds = 2\nread_timeout_seconds = 2\n\
             timeout_seconds = 86400\n",
            self.ca_file.display()
        )
    }
}

async fn serve<S>(stream: S, routes: Arc<Mutex<HashMap<String, Route>>>) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut stream = BufReader::new(stream);
    let mut first = String::new();
    stream.read_line(&mut first).await?;
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await? == 0 || line == "\r\n" {
            break;
        }
    }
    let path = first.split_whitespace().nth(1).unwrap_or("/").to_string();
    let route = routes.lock().unwrap().get(&path).cloned();
    let head = |status: &str, extra: &str| {
        format!("HTTP/1.1 {status}\r\nConnection: close\r\n{extra}\r\n").into_bytes()
    };
    let s = &mut stream;
    match route {
        None => {
            s.write_all(&head("404 Not Found", "Content-Length: 0\r\n"))
                .await?
        }
        Some(Route::Body(b)) => {
            let h = head("200 OK", &format!("Content-Length: {}\r\n", b.len()));
            s.write_all(&h).await?;
            s.write_all(&b).await?;
        }
        Some(Route::Slow(b, gap)) => {
            let h = head("200 OK", &format!("Content-Length: {}\r\n", b.len()));
            s.write_all(&h).await?;
            for piece in b.chunks(4096) {
                s.write_all(piece).await?;
                s.flush().await?;
                tokio::time::sleep(gap).await;
            }
        }
        Some(Route::Status(code, reason)) => {
            let h = head(&format!("{code} {reason}"), "Content-Length: 0\r\n");
            s.write_all(&h).await?;
        }
        Some(Route::Announce(n)) => {
            let h = head("200 OK", &format!("Content-Length: {n}\r\n"));
            s.write_all(&h).await?;
        }
        Some(Route::Endless) => {
            s.write_all(&head("200 OK", "")).await?;
            let zeros = vec![0u8; 1 << 16];
            loop {
                s.write_all(&zeros).await?;
            }
        }
        Some(Route::Stall) => {
            s.write_all(&head("200 OK", "Content-Length: 1000\r\n"))
                .await?;
            s.write_all(&[0u8; 10]).await?;
            s.flush().await?;
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        Some(Route::Redirect(to)) => {
            let h = head(
                "302 Found",
                &format!("Location: {to}\r\nContent-Length: 0\r\n"),
            );
            s.write_all(&h).await?;
        }
    }
    s.flush().await?;
    s.get_mut().shutdown().await
}

/// The files under the images directory, sorted (temporary files included).
fn image_files(h: &Harness) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(h.dir.path().join("state/images"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn names(h: &Harness) -> Vec<String> {
    h.store()
        .images()
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect()
}

/// A local address of this machine that is not loopback (the one a packet to a test network
/// would leave from), if it has one.
fn non_loopback_address() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// Waits until the download of `name` has received some bytes.
async fn downloading(p: &vfiod::client::image::ImagesProxy<'static>, name: &str) {
    eventually_async(Duration::from_secs(20), "a download in progress", || {
        let p = p.clone();
        async move {
            let all = p.downloads().await.ok()?;
            all.iter()
                .any(|d| {
                    vfiod::dbus::wire::Entry(d).str("name") == name
                        && d.get("received")
                            .and_then(|v| u64::try_from(v).ok())
                            .is_some_and(|n| n > 0)
                })
                .then_some(())
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_are_kept_only_when_everything_holds() {
    let server = Https::start().await;
    let mut h = Harness::start(&server.config()).await;
    let p = images(&h.client).await.unwrap();

    // A gbs image: downloaded, its header parsed, its URL recorded.
    let gbs = build::gbs(IFACE, &[AFU], &vec![7u8; 100_000]);
    server.route("/nlb.gbs", Route::Body(gbs.clone()));
    let url = server.url("/nlb.gbs");
    let added = p
        .add_from_url("nlb", &url, &sha(&gbs), dict(&[]))
        .await
        .unwrap();
    let e = ImageEntry::from_dict(&added);
    assert_eq!((e.format.as_str(), e.state.as_str()), ("gbs", "active"));
    assert_eq!(
        (e.interface_id.as_str(), e.afu_ids.clone()),
        (IFACE, vec![AFU.to_string()])
    );
    assert_eq!((e.size, e.source_url.as_str()), (gbs.len() as u64, &*url));
    assert_eq!(std::fs::read(&e.path).unwrap(), gbs);
    assert_eq!(
        h.store().image("nlb").unwrap().source_url,
        Some(url.clone())
    );

    // An xclbin by host name: the certificate's name is checked against it.
    let x = build::xclbin([0xab; 16], [0x01; 16], b"payload");
    server.route("/shell.xclbin", Route::Body(x.clone()));
    let url = format!("https://localhost:{}/shell.xclbin", server.port);
    let added = p
        .add_from_url("shell", &url, &sha(&x), dict(&[]))
        .await
        .unwrap();
    assert_eq!(ImageEntry::from_dict(&added).format, "xclbin");

    // Refusals, each naming the URL, none leaving a record or a file.
    server.route("/tampered.gbs", Route::Body(b"not the image".to_vec()));
    server.route("/huge.gbs", Route::Announce(5 << 30));
    server.route("/stall.gbs", Route::Stall);
    server.route("/teapot", Route::Status(418, "I'm a teapot"));
    let plain = format!("http://127.0.0.1:{}/nlb.gbs", server.port);
    server.route("/to-http", Route::Redirect(plain.clone()));
    let cases: &[(&str, &str, &str, &[&str])] = &[
        ("/tampered.gbs", "InvalidArgument", "SHA-256", &[]),
        ("/missing.gbs", "DownloadFailed", "HTTP 404 Not Found", &[]),
        ("/teapot", "DownloadFailed", "HTTP 418", &[]),
        (
            "/huge.gbs",
            "InvalidArgument",
            "larger than 4294967296 bytes",
            &["5368709120"],
        ),
        ("/stall.gbs", "DownloadFailed", "deadline", &[]),
        (
            "/to-http",
            "InvalidArgument",
            "from https to plain http",
            &[],
        ),
    ];
    for (path, error, text, more) in cases {
        let url = server.url(path);
        // The stall is cut by the 2 s read deadline: the whole download's is a day, and the
        // deadline here only ends a hung test (this used to be "within 10 s").
        let r = tokio::time::timeout(
            common::HUNG,
            p.add_from_url("x", &url, &sha(&gbs), dict(&[])),
        )
        .await
        .unwrap_or_else(|_| panic!("{path}: no answer"));
        let (name, msg) = refusal(r, path);
        assert!(
            name.ends_with(error) && msg.contains(text) && msg.contains(&url),
            "{path}: {name}: {msg}"
        );
        for m in more.iter() {
            assert!(msg.contains(m), "{path}: {msg}");
        }
        assert_eq!(names(&h), ["nlb", "shell"], "{path}");
        assert_eq!(image_files(&h), ["nlb", "shell"], "{path}");
    }

    // Plain http to a host that is not loopback: refused before any connection (a listener
    // on this machine's own non-loopback address sees nobody).
    if let Some(ip) = non_loopback_address() {
        let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}/nlb.gbs", listener.local_addr().unwrap());
        let r = p.add_from_url("x", &url, &sha(&gbs), dict(&[])).await;
        let (name, msg) = refusal(r, "http to a non-loopback host");
        assert!(
            name.ends_with("InvalidArgument") && msg.contains("loopback"),
            "{msg}"
        );
        assert!(
            listener.accept().is_err(),
            "vfiod connected to {url} although it refused it"
        );
    }
    for (url, text) in [
        ("ftp://127.0.0.1/x", "scheme"),
        ("https://user:pw@127.0.0.1/x", "credentials"),
        ("no url", "not a valid URL"),
    ] {
        let r = p.add_from_url("x", url, &sha(&gbs), dict(&[])).await;
        let (name, msg) = refusal(r, url);
        assert!(
            name.ends_with("InvalidArgument") && msg.contains(text),
            "{url}: {msg}"
        );
    }
    // Refused before the download: a name in use, a bad digest.
    let r = p
        .add_from_url("nlb", &server.url("/nlb.gbs"), &sha(&gbs), dict(&[]))
        .await;
    assert!(refusal(r, "an existing name").1.contains("already exists"));
    let r = p
        .add_from_url("y", &server.url("/nlb.gbs"), "abc", dict(&[]))
        .await;
    assert!(refusal(r, "a bad digest").1.contains("64 hex"));

    // A slow download: its progress is visible while it runs, and a second add of the name
    // meanwhile is Busy.
    let slow = build::gbs(IFACE, &[AFU], &vec![9u8; 64 * 4096]);
    server.route(
        "/slow.gbs",
        Route::Slow(slow.clone(), Duration::from_millis(40)),
    );
    let url = server.url("/slow.gbs");
    let call = {
        let p = p.clone();
        let (url, digest) = (url.clone(), sha(&slow));
        tokio::spawn(async move { p.add_from_url("slow", &url, &digest, dict(&[])).await })
    };
    let progress = eventually_async(Duration::from_secs(20), "a download in progress", || {
        let p = p.clone();
        async move {
            let all = p.downloads().await.unwrap();
            all.iter().find_map(|d| {
                let e = vfiod::dbus::wire::Entry(d);
                let received = u64::try_from(d.get("received")?).ok()?;
                let total = u64::try_from(d.get("total")?).ok()?;
                (e.str("name") == "slow" && received > 0 && received < total)
                    .then(|| (e.str("url"), total))
            })
        }
    })
    .await;
    assert_eq!(progress, (url.clone(), slow.len() as u64));
    let r = p.add_from_url("slow", &url, &sha(&slow), dict(&[])).await;
    assert!(refusal(r, "a second download").0.ends_with("Busy"));
    call.await.unwrap().unwrap();
    assert!(p.downloads().await.unwrap().is_empty());
    assert_eq!(image_files(&h), ["nlb", "shell", "slow"]);

    // A cancelled download keeps nothing.
    let call = {
        let p = p.clone();
        let (url, digest) = (url.clone(), sha(&slow));
        tokio::spawn(async move { p.add_from_url("cut", &url, &digest, dict(&[])).await })
    };
    downloading(&p, "cut").await;
    p.cancel_download("cut").await.unwrap();
    let (name, msg) = refusal(call.await.unwrap(), "a cancelled download");
    assert!(
        name.ends_with("Cancelled") && msg.contains(&url),
        "{name}: {msg}"
    );
    assert_eq!(names(&h), ["nlb", "shell", "slow"]);
    assert_eq!(image_files(&h), ["nlb", "shell", "slow"]);
    let (name, _) = refusal(p.cancel_download("cut").await, "no download");
    assert!(name.ends_with("NoSuchImage"), "{name}");
    // From another terminal: vfioctl image cancel.
    let call = {
        let p = p.clone();
        let (url, digest) = (url.clone(), sha(&slow));
        tokio::spawn(async move { p.add_from_url("cut", &url, &digest, dict(&[])).await })
    };
    downloading(&p, "cut").await;
    let (ok, out) = vfioctl(h.bus.address(), &["image", "cancel", "cut"]);
    assert!(
        ok && out.contains("download of image cut cancelled"),
        "{out}"
    );
    let (name, _) = refusal(call.await.unwrap(), "a download cancelled by vfioctl");
    assert!(name.ends_with("Cancelled"), "{name}");
    assert_eq!(image_files(&h), ["nlb", "shell", "slow"]);

    // Every kept download is in the history with its URL.
    let events = h.store().events(None, 0, 1000).unwrap();
    let downloaded = events
        .iter()
        .filter(|e| e.message.contains("downloaded from https://"))
        .count();
    assert_eq!(downloaded, 3);

    // What a killed download left is removed at the next start.
    h.stop_server().await;
    let images = h.dir.path().join("state/images");
    std::fs::write(images.join(".downloading-abc123"), b"partial").unwrap();
    std::fs::write(images.join(".adding-def456"), b"partial").unwrap();
    h.start_server().await;
    assert_eq!(image_files(&h), ["nlb", "shell", "slow"]);
}

/// A body that grows past the cap without announcing its length is cut off, and the temporary
/// file goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_the_cap_is_cut_off() {
    use vfiod::host::download::{check_url, DownloadError, Downloader};
    let server = Https::start().await;
    server.route("/endless", Route::Endless);
    let settings = vfiod::config::Settings::from_toml_str(&server.config(), Path::new("t.toml"))
        .unwrap()
        .images;
    let d = Downloader::new(&settings).unwrap().with_limit(1 << 20);
    let dir = tempfile::tempdir().unwrap();
    let tmp = tempfile::NamedTempFile::new_in(dir.path()).unwrap();
    let url = check_url(&server.url("/endless"), false).unwrap();
    let seen = AtomicUsize::new(0);
    let r = d
        .fetch(&url, tmp, &mut |n, _| {
            seen.store(n as usize, Ordering::Relaxed)
        })
        .await;
    match r {
        Err(e @ DownloadError::TooLarge { .. }) => {
            assert!(e.to_string().contains("larger than 1048576 bytes"), "{e}")
        }
        Err(e) => panic!("{}", vfiod::error_chain(&e)),
        Ok(_) => panic!("an endless body was kept"),
    }
    assert!(seen.load(Ordering::Relaxed) <= 1 << 20);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // A server that keeps sending, slowly, passes no read deadline but the whole download's.
    server.route(
        "/slow",
        Route::Slow(vec![1u8; 64 * 4096], Duration::from_millis(300)),
    );
    let mut short = settings.clone();
    short.timeout = Duration::from_secs(2);
    let d = Downloader::new(&short).unwrap();
    let tmp = tempfile::NamedTempFile::new_in(dir.path()).unwrap();
    let url = check_url(&server.url("/slow"), false).unwrap();
    let start = Instant::now();
    let r = tokio::time::timeout(common::HUNG, d.fetch(&url, tmp, &mut |_, _| {}))
        .await
        .expect("the whole download's deadline ends it");
    let e = vfiod::error_chain(&r.err().expect("a 20 s body within 2 s"));
    assert!(e.contains("whole download 2s"), "{e}");
    // Ended by the 2 s total, not by the body's end 20 s on: it failed instead of completing
    // (an upper bound on the time, "under 6 s", raced on a loaded machine).
    assert!(start.elapsed() >= Duration::from_secs(2));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // Without the CA file the server's certificate is not trusted.
    let untrusted = Downloader::new(&vfiod::config::ImageSettings::default()).unwrap();
    let tmp = tempfile::NamedTempFile::new_in(dir.path()).unwrap();
    server.route("/x", Route::Body(b"x".to_vec()));
    let url = check_url(&server.url("/x"), false).unwrap();
    let e = untrusted.fetch(&url, tmp, &mut |_, _| {}).await.err();
    let e = vfiod::error_chain(&e.expect("an untrusted certificate was accepted"));
    assert!(
        e.contains("certificate") || e.contains("UnknownIssuer"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_image_add_url() {
    let server = Https::start().await;
    let h = Harness::start(&server.config()).await;
    let bus = h.bus.address().to_string();
    let gbs = build::gbs(IFACE, &[AFU], b"bits");
    server.route("/nlb.gbs", Route::Body(gbs.clone()));
    let url = server.url("/nlb.gbs");
    let (ok, out) = vfioctl(
        &bus,
        &["image", "add", "nlb", "--url", &url, "--sha256", &sha(&gbs)],
    );
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("image nlb downloaded from {url}: gbs")),
        "{out}"
    );
    let (ok, out) = vfioctl(&bus, &["image", "show", "nlb"]);
    assert!(ok && out.contains(&format!("source:       {url}")), "{out}");
    let (ok, out) = vfioctl(
        &bus,
        &[
            "image",
            "add",
            "gone",
            "--url",
            &server.url("/gone"),
            "--sha256",
            &sha(&gbs),
        ],
    );
    assert!(
        !ok && out.contains("DownloadFailed") && out.contains("404"),
        "{out}"
    );
    // Ctrl-C cancels the download in vfiod: nothing is kept.
    let slow = build::gbs(IFACE, &[AFU], &vec![9u8; 64 * 4096]);
    server.route(
        "/slow.gbs",
        Route::Slow(slow.clone(), Duration::from_millis(30)),
    );
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args(["image", "add", "slow", "--url", &server.url("/slow.gbs")])
        .args(["--sha256", &sha(&slow)])
        .env("VFIOD_BUS", &bus)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    downloading(&images(&h.client).await.unwrap(), "slow").await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Cancelled"), "{err}");
    assert_eq!(image_files(&h), ["nlb"]);

    // A file and a URL at once: refused by vfioctl itself.
    let (ok, _) = vfioctl(
        &bus,
        &[
            "image",
            "add",
            "x",
            "/dev/null",
            "--url",
            &url,
            "--sha256",
            "0",
        ],
    );
    assert!(!ok);
}

/// An image added from a URL whose local copy is gone is downloaded again by the program task,
/// as its `downloading` step, then written; a server that now serves other bytes fails the
/// task before anything is written, keeping no file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_program_task_downloads_an_image_whose_copy_is_gone() {
    let server = Https::start().await;
    let config = format!(
        "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nclass = \"0x12\"\n\
         kind = \"fpga\"\n{}",
        server.config()
    );
    let h = Harness::start(&config).await;
    let nlb = build::gbs(REFERENCE_FPGA_INTERFACE, &[AFU], &vec![0x5a; 64 * 4096]);
    server.route("/nlb.gbs", Route::Body(nlb.clone()));
    let p = images(&h.client).await.unwrap();
    let e = ImageEntry::from_dict(
        &p.add_from_url("nlb", &server.url("/nlb.gbs"), &sha(&nlb), dict(&[]))
            .await
            .unwrap(),
    );
    std::fs::remove_file(&e.path).unwrap();
    server.route(
        "/nlb.gbs",
        Route::Slow(nlb.clone(), Duration::from_millis(25)),
    );

    let d = vfiod::client::device(&h.client, AF).await.unwrap();
    let path = d.program("nlb", Default::default()).await.unwrap();
    let t = vfiod::client::task(&h.client, path.clone()).await.unwrap();
    let (state, pct) = eventually_async(Duration::from_secs(20), "the downloading step", || {
        let t = t.clone();
        async move {
            let step = t.step().await.ok()?;
            (step == "downloading").then_some(())?;
            Some((t.state().await.ok()?, t.percent().await.ok()?))
        }
    })
    .await;
    assert_eq!(state, "running");
    assert!(pct < 10, "the download phase weighs 10 of 100: {pct}");
    let (state, result) = finish(&t).await;
    assert_eq!(state, "success", "{result}");
    assert_eq!(std::fs::read(&e.path).unwrap(), nlb);
    assert_eq!(
        h.kernel.afu_id_of(common::addr(AF)).as_deref(),
        Some(AFU),
        "{result}"
    );

    // The server now serves other bytes: the task fails in its download, the card untouched.
    std::fs::remove_file(&e.path).unwrap();
    server.route("/nlb.gbs", Route::Body(b"something else".to_vec()));
    h.kernel.take_write_log();
    let path = d.program("nlb", Default::default()).await.unwrap();
    let t = vfiod::client::task(&h.client, path).await.unwrap();
    let (state, result) = finish(&t).await;
    assert_eq!(state, "error");
    assert!(
        result.contains("cannot download image nlb again") && result.contains("SHA-256"),
        "{result}"
    );
    assert!(!h
        .kernel
        .take_write_log()
        .iter()
        .any(|(p, _)| p.to_string_lossy().contains("dfl-fme")));
    assert_eq!(image_files(&h), Vec::<String>::new());
}

async fn finish(t: &vfiod::client::TaskProxy<'static>) -> (String, String) {
    eventually_async(Duration::from_secs(60), "the task ends", || {
        let t = t.clone();
        async move {
            let s = t.state().await.ok()?;
            (s == "success" || s == "error").then_some(())
        }
    })
    .await;
    (t.state().await.unwrap(), t.result().await.unwrap())
}
