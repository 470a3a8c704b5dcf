//! The FPGA image catalog over D-Bus (`org.vfiod.Vfiod1.Images`) and through vfioctl: images
//! added from a file descriptor (a pipe, a file unlinked before the call: the daemon cannot
//! have reopened a path) and from a path, digests that must match, malformed headers refused,
//! list/show/deactivate/activate/remove.

use crate::common;

use crate::common::{dict, refusal, vfioctl, Harness, STEADY_CONFIG};
use sha2::{Digest, Sha256};
use std::io::Write;
use vfiod::client::image::{images, ImageEntry};
use vfiod::fpga::image::build;

const IFACE: &str = "3a00972e7aac41debbd13901124e8cda";
const AFU: &str = "d8424dc4a4a3c413f89e433683f9040b";

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_from_descriptors_and_paths() {
    let h = Harness::start(STEADY_CONFIG).await;
    let p = images(&h.client).await.unwrap();
    let gbs = build::gbs(IFACE, &[AFU], &vec![7u8; 100_000]);

    // A file unlinked before the call: only the descriptor leads to it.
    let path = h.dir.path().join("nlb.gbs");
    std::fs::write(&path, &gbs).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let added = p
        .add("nlb", zbus::Fd::from(&file), &sha(&gbs), dict(&[]))
        .await
        .unwrap();
    let e = ImageEntry::from_dict(&added);
    assert_eq!((e.format.as_str(), e.state.as_str()), ("gbs", "active"));
    assert_eq!(e.interface_id, IFACE);
    assert_eq!(e.afu_ids, vec![AFU.to_string()]);
    assert_eq!(e.size, gbs.len() as u64);
    let stored = std::path::PathBuf::from(&e.path);
    assert!(
        stored.starts_with(h.dir.path().join("state/images")),
        "{}",
        e.path
    );
    assert_eq!(std::fs::read(&stored).unwrap(), gbs);

    // A pipe: a stream, read to its end.
    let x = build::xclbin([0xab; 16], [0x01; 16], b"payload");
    let (reader, mut writer) = std::io::pipe().unwrap();
    let bytes = x.clone();
    let feeder = std::thread::spawn(move || writer.write_all(&bytes));
    let added = p
        .add("shell", zbus::Fd::from(&reader), &sha(&x), dict(&[]))
        .await
        .unwrap();
    feeder.join().unwrap().unwrap();
    assert_eq!(ImageEntry::from_dict(&added).format, "xclbin");

    // Refusals: wrong digest, malformed header, existing name, bad name, bad format option.
    let file = std::fs::File::open(&stored).unwrap();
    let wrong = p
        .add("other", zbus::Fd::from(&file), &sha(b"x"), dict(&[]))
        .await;
    let (name, msg) = refusal(wrong, "a wrong digest");
    assert!(
        name.ends_with("InvalidArgument") && msg.contains("SHA-256"),
        "{name}: {msg}"
    );
    let mut bad = gbs.clone();
    bad[25] = b'{';
    let bad_path = h.dir.path().join("bad.gbs");
    std::fs::write(&bad_path, &bad).unwrap();
    let r = p
        .add(
            "bad",
            zbus::Fd::from(&std::fs::File::open(&bad_path).unwrap()),
            &sha(&bad),
            dict(&[]),
        )
        .await;
    let (name, msg) = refusal(r, "a malformed header");
    assert!(
        name.ends_with("InvalidArgument") && msg.contains("malformed image header"),
        "{msg}"
    );
    let r = p
        .add(
            "nlb",
            zbus::Fd::from(&std::fs::File::open(&stored).unwrap()),
            &sha(&gbs),
            dict(&[]),
        )
        .await;
    assert!(refusal(r, "an existing name").1.contains("already exists"));
    let r = p
        .add(
            "../etc",
            zbus::Fd::from(&std::fs::File::open(&stored).unwrap()),
            &sha(&gbs),
            dict(&[]),
        )
        .await;
    assert!(refusal(r, "a bad name").1.contains("not allowed"));
    let r = p
        .add(
            "o",
            zbus::Fd::from(&std::fs::File::open(&stored).unwrap()),
            &sha(&gbs),
            dict(&[("format", "bit".into())]),
        )
        .await;
    assert!(refusal(r, "a bad format")
        .1
        .contains("unknown image format"));

    // From a path (root only; this harness allows every caller), an opaque image with declared
    // ids.
    let raw = h.dir.path().join("raw.bin");
    std::fs::write(&raw, b"opaque bits").unwrap();
    let added = p
        .add_from_path(
            "raw",
            raw.to_str().unwrap(),
            &sha(b"opaque bits"),
            dict(&[("format", "opaque".into()), ("interface_id", IFACE.into())]),
        )
        .await
        .unwrap();
    let e = ImageEntry::from_dict(&added);
    assert_eq!(
        (e.format.as_str(), e.interface_id.as_str()),
        ("opaque", IFACE)
    );
    let r = p
        .add_from_path("rel", "raw.bin", &sha(b"opaque bits"), dict(&[]))
        .await;
    assert!(refusal(r, "a relative path").1.contains("absolute"));

    let names: Vec<String> = p
        .list()
        .await
        .unwrap()
        .iter()
        .map(|d| ImageEntry::from_dict(d).name)
        .collect();
    assert_eq!(names, ["nlb", "shell", "raw"]);

    p.deactivate("nlb").await.unwrap();
    assert_eq!(
        ImageEntry::from_dict(&p.get("nlb").await.unwrap()).state,
        "inactive"
    );
    p.activate("nlb").await.unwrap();
    assert_eq!(
        ImageEntry::from_dict(&p.get("nlb").await.unwrap()).state,
        "active"
    );
    p.remove("shell").await.unwrap();
    let (name, _) = refusal(p.get("shell").await, "a removed image");
    assert!(name.ends_with("NoSuchImage"), "{name}");
    // Every change is in the history.
    let events = h.manager().await.get_events(dict(&[])).await.unwrap();
    let images: Vec<String> = events
        .iter()
        .map(vfiod::client::EventEntry::from_dict)
        .filter(|e| e.kind == "image")
        .map(|e| e.message)
        .collect();
    assert_eq!(images.len(), 6, "{images:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_adds_lists_shows_deactivates_activates_and_removes_images() {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let gbs = build::gbs(IFACE, &[AFU], b"bits");
    let file = h.dir.path().join("nlb.gbs");
    std::fs::write(&file, &gbs).unwrap();
    let f = file.to_str().unwrap();
    let digest = sha(&gbs);

    let (ok, out) = vfioctl(&bus, &["image", "add", "nlb", f, "--sha256", &digest]);
    assert!(ok, "{out}");
    assert!(out.contains("image nlb added: gbs"), "{out}");
    let (ok, out) = vfioctl(
        &bus,
        &[
            "image",
            "add",
            "again",
            f,
            "--sha256",
            &digest,
            "--from-path",
        ],
    );
    assert!(ok, "{out}");
    let (ok, out) = vfioctl(&bus, &["image", "add", "bad", f, "--sha256", &sha(b"no")]);
    assert!(!ok && out.contains("InvalidArgument"), "{out}");
    let (ok, out) = vfioctl(&bus, &["image", "list"]);
    assert!(ok && out.contains("nlb") && out.contains(IFACE), "{out}");
    let (ok, out) = vfioctl(&bus, &["image", "show", "nlb", "--json"]);
    assert!(ok, "{out}");
    let shown: ImageEntry = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (shown.sha256.as_str(), shown.afu_ids.clone()),
        (digest.as_str(), vec![AFU.to_string()])
    );
    assert!(vfioctl(&bus, &["image", "deactivate", "nlb"]).0);
    let (_, out) = vfioctl(&bus, &["image", "show", "nlb"]);
    assert!(out.contains("inactive"), "{out}");
    // With --json: the image as it is left, and the removed one named.
    let (ok, out) = vfioctl(&bus, &["image", "activate", "nlb", "--json"]);
    assert!(ok, "{out}");
    let active: ImageEntry = serde_json::from_str(&out).unwrap();
    assert_eq!(active.state, shown.state, "{out}");
    assert!(vfioctl(&bus, &["image", "remove", "again"]).0);
    let (ok, out) = vfioctl(&bus, &["image", "show", "again"]);
    assert!(!ok && out.contains("NoSuchImage"), "{out}");
    let (ok, out) = vfioctl(&bus, &["image", "remove", "nlb", "--json"]);
    assert!(ok, "{out}");
    let removed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        removed,
        serde_json::json!({"name": "nlb", "state": "removed"})
    );
}

/// `[images]` deadlines short enough for a test: 1 s between reads, 3 s in all.
fn short_deadlines() -> String {
    format!("{STEADY_CONFIG}\n[images]\nread_timeout_seconds = 1\ntimeout_seconds = 3\n")
}

/// Issue 24 (2): a FIFO named to `AddFromPath` froze the daemon (a blocking open on an async
/// thread, waiting for a writer). It is refused at once, before a read, and the daemon answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_or_a_device_given_to_add_from_path_is_refused_at_once() {
    let h = Harness::start(STEADY_CONFIG).await;
    let p = images(&h.client).await.unwrap();
    let fifo = h.dir.path().join("f");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // Refused before a read, whatever the load: a FIFO opened would wait for a writer for
    // ever, /dev/zero would be read for ever, so the deadline only ends a hung test.
    let bound = common::HUNG;
    let digest = sha(b"never sent");
    for (path, kind) in [
        (fifo.to_str().unwrap(), "a FIFO"),
        ("/dev/zero", "a character device"),
        (h.dir.path().to_str().unwrap(), "a directory"),
    ] {
        let r = tokio::time::timeout(bound, p.add_from_path("fp1", path, &digest, dict(&[])))
            .await
            .unwrap_or_else(|_| panic!("AddFromPath on {kind} did not answer within {bound:?}"));
        let (name, msg) = refusal(r, kind);
        assert!(
            name.ends_with("InvalidArgument")
                && msg.contains(&format!("not a regular file but {kind}")),
            "{name}: {msg}"
        );
    }
    // The daemon answers, and nothing was kept.
    let listed = tokio::time::timeout(bound, p.list())
        .await
        .unwrap()
        .unwrap();
    assert!(listed.is_empty(), "{listed:?}");
    // A path of a megabyte is quoted back short.
    let long = format!("/{}", "x".repeat(1_000_000));
    let (_, msg) = refusal(
        p.add_from_path("fp1", &long, &digest, dict(&[])).await,
        "a long path",
    );
    assert!(
        msg.len() < 400 && msg.contains("(1000001 characters)"),
        "{}",
        &msg[..msg.len().min(400)]
    );
}

/// An add from `fd` on its own connection, tried again while it is refused as Busy (the cap is
/// shared with the probes of the test): its final answer.
async fn add_until_admitted(
    bus: String,
    name: String,
    fd: std::io::PipeReader,
    digest: String,
) -> (
    zbus::Connection,
    tokio::task::JoinHandle<zbus::Result<vfiod::dbus::wire::Dict>>,
) {
    let conn = common::connect(&bus).await;
    let c = conn.clone();
    let call = tokio::spawn(async move {
        let p = images(&c).await.unwrap();
        loop {
            match p.add(&name, zbus::Fd::from(&fd), &digest, dict(&[])).await {
                Err(zbus::Error::MethodError(n, _, _)) if n.ends_with("Busy") => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await
                }
                other => return other,
            }
        }
    });
    (conn, call)
}

/// Waits until the adds from descriptors are all taken: a quick add (an empty file whose digest
/// does not match) is refused as Busy rather than for its digest. Returns the refusal.
async fn until_capped(p: &vfiod::client::image::ImagesProxy<'_>, dir: &std::path::Path) -> String {
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").unwrap();
    common::eventually_async(
        std::time::Duration::from_secs(10),
        "the add past the cap refused",
        || async {
            let f = std::fs::File::open(&empty).unwrap();
            match p
                .add("probe", zbus::Fd::from(&f), &sha(b"x"), dict(&[]))
                .await
            {
                Err(zbus::Error::MethodError(n, m, _)) if n.ends_with("Busy") => {
                    Some(m.unwrap_or_default())
                }
                _ => None,
            }
        },
    )
    .await
}

/// Issue 24 (6): adds from pipes that never close held a blocking thread each, for good. Now
/// at most MAX_LOCAL_ADDS read at once (one more is Busy, "try again"), a silent pipe fails
/// within `read_timeout_seconds`, a trickle within `timeout_seconds`, and an add whose caller
/// left the bus stops and frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adds_from_descriptors_are_capped_bounded_and_stopped_with_their_caller() {
    use std::time::{Duration, Instant};
    use vfiod::dbus::image::MAX_LOCAL_ADDS;
    let h = Harness::start(&short_deadlines()).await;
    let p = images(&h.client).await.unwrap();
    let digest = sha(b"whatever");
    let bus = h.bus.address().to_string();

    // MAX_LOCAL_ADDS callers, each with a pipe whose writer stays open and silent: the next
    // add is refused at once, and the daemon answers meanwhile.
    let mut writers = Vec::new();
    let mut callers = Vec::new();
    for i in 0..MAX_LOCAL_ADDS {
        let (r, w) = std::io::pipe().unwrap();
        writers.push(w);
        callers.push(add_until_admitted(bus.clone(), format!("held{i}"), r, digest.clone()).await);
    }
    let msg = until_capped(&p, h.dir.path()).await;
    assert!(msg.contains("busy, try again"), "{msg}");
    // (That the daemon answers while adds are held, with no read deadline near, is proven in
    // `an_add_stops_when_its_caller_leaves_the_bus`; here the adds time out after 1 s.)
    tokio::time::timeout(common::HUNG, h.manager().await.get_events(dict(&[])))
        .await
        .expect("Manager answers while adds are held")
        .unwrap();
    // The silent pipes fail on the 1 s read deadline, as TimedOut, keeping nothing (how soon
    // after it is not a claim: the error says which deadline ended them).
    for (_conn, call) in callers {
        let r = tokio::time::timeout(common::HUNG, call)
            .await
            .expect("a silent pipe fails within the read deadline")
            .unwrap();
        let (name, msg) = refusal(r, "a silent pipe");
        assert!(
            name.ends_with("TimedOut") && msg.contains("nothing could be read"),
            "{name}: {msg}"
        );
    }
    drop(writers);
    assert!(p.list().await.unwrap().is_empty());

    // A trickle (a byte every 100 ms, for ever) fails on the 3 s total deadline.
    let (r, mut w) = std::io::pipe().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = std::sync::Arc::clone(&stop);
    let trickle = std::thread::spawn(move || {
        while !s.load(std::sync::atomic::Ordering::Relaxed) && w.write_all(b"x").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let started = Instant::now();
    let (name, msg) = refusal(
        p.add("trickle", zbus::Fd::from(&r), &digest, dict(&[]))
            .await,
        "a trickle",
    );
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(r);
    trickle.join().unwrap();
    assert!(
        name.ends_with("TimedOut") && msg.contains("longer than 3 s"),
        "{name}: {msg}"
    );
    // Not before the total deadline; the message names it (an upper bound on how long it took
    // would be a race on a loaded machine).
    assert!(took >= Duration::from_millis(2900), "{took:?}");
}

/// Issue 24 (6): the adds kept reading after their callers had gone. An add whose caller left
/// the bus stops and frees its place. The read and total deadlines are a day here: nothing else
/// can end the held adds within the test's deadline, so the freed place proves the stop, with
/// no bound on how quickly (it used to be "within 3 s").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_stops_when_its_caller_leaves_the_bus() {
    use vfiod::dbus::image::MAX_LOCAL_ADDS;
    let h = Harness::start(&format!(
        "{STEADY_CONFIG}\n[images]\nread_timeout_seconds = 86400\ntimeout_seconds = 86400\n"
    ))
    .await;
    let p = images(&h.client).await.unwrap();
    let digest = sha(b"whatever");
    let bus = h.bus.address().to_string();
    let mut writers = Vec::new();
    let mut callers = Vec::new();
    for i in 0..MAX_LOCAL_ADDS {
        let (r, w) = std::io::pipe().unwrap();
        writers.push(w);
        callers.push(add_until_admitted(bus.clone(), format!("gone{i}"), r, digest.clone()).await);
    }
    until_capped(&p, h.dir.path()).await;
    // The daemon answers while every place is held by a silent pipe.
    tokio::time::timeout(common::HUNG, h.manager().await.get_events(dict(&[])))
        .await
        .expect("Manager answers while adds are held")
        .unwrap();
    for (conn, call) in callers {
        call.abort();
        let _ = call.await;
        conn.close().await.unwrap();
    }
    let x = build::xclbin([0xab; 16], [0x01; 16], b"after");
    let file = h.dir.path().join("after.xclbin");
    std::fs::write(&file, &x).unwrap();
    let added = common::eventually_async(common::HUNG, "a place freed", || async {
        let f = std::fs::File::open(&file).unwrap();
        p.add("after", zbus::Fd::from(&f), &sha(&x), dict(&[]))
            .await
            .ok()
    })
    .await;
    assert_eq!(ImageEntry::from_dict(&added).name, "after");
    // Nothing of the abandoned adds was kept; the writers are still open.
    let names: Vec<String> = p
        .list()
        .await
        .unwrap()
        .iter()
        .map(|d| ImageEntry::from_dict(d).name)
        .collect();
    assert_eq!(names, ["after"]);
    drop(writers);
}
