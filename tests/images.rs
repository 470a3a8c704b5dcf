//! The FPGA image catalog over D-Bus (`org.vfiod.Vfiod1.Images`) and through vfioctl: images
//! added from a file descriptor (a pipe, a file unlinked before the call: the daemon cannot
//! have reopened a path) and from a path, digests that must match, malformed headers refused,
//! list/show/deactivate/activate/remove.

mod common;

use common::{dict, refusal, vfioctl, Harness, STEADY_CONFIG};
use sha2::{Digest, Sha256};
use std::io::Write;
use vfiod::client::images::{images, ImageEntry};
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
async fn vfioctl_image_commands() {
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
    assert!(vfioctl(&bus, &["image", "remove", "again"]).0);
    let (ok, out) = vfioctl(&bus, &["image", "show", "again"]);
    assert!(!ok && out.contains("NoSuchImage"), "{out}");
}
