//! `vfioctl record` and `vfiod --simulate --replay`, the real binaries: the simulated reference
//! host recorded by `vfioctl record --root`, replayed from the tarball and from its unpacked
//! directory, gives the `vfioctl list --json` vfiod gives on the host itself, field by field; a
//! replay refuses a split with the kernel's error and changes nothing, a writable one splits;
//! `vfioctl record` never replaces a file unless forced and writes to stdout with `-o -`.

use crate::common::{self, Harness, STEADY_CONFIG};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const NIC: &str = "0000:3b:00.0";

fn record(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .arg("record")
        .arg("--root")
        .arg(root)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run vfioctl record")
}

/// `vfiod --simulate --replay SOURCE --config CONFIG [extra] -- COMMAND...`: its output.
fn replay(source: &Path, config: &Path, extra: &[&str], command: &[&str]) -> Output {
    let bin = Path::new(env!("CARGO_BIN_EXE_vfioctl")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new(env!("CARGO_BIN_EXE_vfiod"))
        .args(["--simulate", "--replay"])
        .arg(source)
        .arg("--config")
        .arg(config)
        .args(extra)
        .arg("--")
        .args(command)
        .env("VFIOD_LOG", "warn")
        .env("PATH", path)
        .stdin(Stdio::null())
        .output()
        .expect("run vfiod --simulate --replay")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn by_address(json: &str) -> BTreeMap<String, serde_json::Value> {
    let list: Vec<serde_json::Value> =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("not JSON ({e}): {json}"));
    list.into_iter()
        .map(|d| (d["address"].as_str().unwrap().to_string(), d))
        .collect()
}

/// Every disagreement between two `list --json`, one per field.
fn differences(
    want: &BTreeMap<String, serde_json::Value>,
    got: &BTreeMap<String, serde_json::Value>,
) -> Vec<String> {
    let mut out = Vec::new();
    for a in want.keys().filter(|a| !got.contains_key(*a)) {
        out.push(format!("{a}: missing in the replay"));
    }
    for a in got.keys().filter(|a| !want.contains_key(*a)) {
        out.push(format!("{a}: only in the replay"));
    }
    for (a, w) in want {
        let Some(g) = got.get(a) else { continue };
        for (field, value) in w.as_object().unwrap() {
            if g.get(field) != Some(value) {
                out.push(format!(
                    "{a} {field}: host {value}, replay {:?}",
                    g.get(field)
                ));
            }
        }
    }
    out
}

/// Every path under `dir` with its content or link target: what "nothing changed" compares.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let t = e.file_type().unwrap();
            let v = if t.is_symlink() {
                std::fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if t.is_dir() {
                stack.push(p.clone());
                b"<dir>".to_vec()
            } else {
                std::fs::read(&p).unwrap()
            };
            out.insert(p, v);
        }
    }
    out
}

/// The reference host under vfiod (STEADY_CONFIG: start-up changes nothing), its
/// `list --json`, and a recording of it made by `vfioctl record` in `dir`.
async fn recorded_host() -> (Harness, tempfile::TempDir, String, PathBuf, PathBuf) {
    let h = Harness::start(STEADY_CONFIG).await;
    let bus = h.bus.address().to_string();
    let (ok, list) = common::vfioctl(&bus, &["list", "--json"]);
    assert!(ok, "{list}");
    let dir = common::fast_tempdir();
    let file = dir.path().join("host.tar.gz");
    let out = record(h.kernel.root(), &["-o", file.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "vfioctl record: {err}");
    let functions = h.kernel.addresses().len();
    assert!(
        err.contains(&format!("recorded {functions} PCI functions")),
        "{err}"
    );
    assert!(err.contains("it leaves out:"), "{err}");
    let config = dir.path().join("vfiod.toml");
    std::fs::write(&config, STEADY_CONFIG).unwrap();
    (h, dir, list, file, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_lists_what_the_host_lists_from_a_tarball_or_a_directory() {
    let (_h, dir, host_list, file, config) = recorded_host().await;
    let want = by_address(&host_list);
    let out = replay(&file, &config, &[], &["vfioctl", "list", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let problems = differences(&want, &by_address(&text(&out.stdout)));
    assert!(problems.is_empty(), "tarball:\n{}", problems.join("\n"));
    assert!(
        text(&out.stderr).contains("Read-only"),
        "{}",
        text(&out.stderr)
    );

    let unpacked = dir.path().join("unpacked/deep");
    std::fs::create_dir_all(&unpacked).unwrap();
    untar(&file, &unpacked);
    let out = replay(
        &dir.path().join("unpacked"),
        &config,
        &[],
        &["vfioctl", "list", "--json"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let problems = differences(&want, &by_address(&text(&out.stdout)));
    assert!(problems.is_empty(), "directory:\n{}", problems.join("\n"));
}

/// Unpacks the recording `file` into `into` (with the system's tar: what a user does).
fn untar(file: &Path, into: &Path) {
    let ok = Command::new("tar")
        .arg("xzf")
        .arg(file)
        .arg("-C")
        .arg(into)
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar xzf {}", file.display());
}

/// A split of the NIC, then the list: (split's exit status, its output, the list). The split's
/// output and status go to files in `scratch`.
fn split_then_list(
    source: &Path,
    config: &Path,
    extra: &[&str],
    scratch: &Path,
) -> (i32, String, String) {
    let (said, rc) = (scratch.join("split.out"), scratch.join("split.rc"));
    let out = replay(
        source,
        config,
        extra,
        &[
            "sh",
            "-c",
            &format!(
                "vfioctl mode {NIC} vf --vfs 4 --wait >'{}' 2>&1; echo $? >'{}'; \
                 vfioctl list --json",
                said.display(),
                rc.display()
            ),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rc = std::fs::read_to_string(rc).unwrap().trim().parse().unwrap();
    let said = std::fs::read_to_string(said).unwrap();
    (rc, said, text(&out.stdout))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_refuses_a_split_with_the_kernels_error_and_a_writable_one_splits() {
    let (_h, dir, host_list, file, config) = recorded_host().await;
    let unpacked = dir.path().join("unpacked");
    std::fs::create_dir_all(&unpacked).unwrap();
    untar(&file, &unpacked);
    let before = tree(&unpacked);
    let read_only = split_then_list(&unpacked, &config, &[], dir.path());
    let writable = split_then_list(&file, &config, &["--replay-writable"], dir.path());

    let (rc, said, list) = read_only;
    assert_ne!(rc, 0, "the split succeeded on a read-only replay: {said}");
    assert!(
        said.contains("Permission denied") && said.contains("sriov"),
        "the refusal is the kernel's EACCES on an SR-IOV attribute: {said}"
    );
    let nic = &by_address(&list)[NIC];
    assert_eq!(nic["num_vfs"], 0, "{nic}");
    assert_eq!(
        tree(&unpacked),
        before,
        "the replayed directory is unchanged"
    );
    let host = by_address(&host_list);
    let listed = by_address(&list);
    assert_eq!(
        listed.keys().collect::<Vec<_>>(),
        host.keys().collect::<Vec<_>>(),
        "no function appeared or went"
    );

    let (rc, said, list) = writable;
    assert_eq!(rc, 0, "the split failed on a writable replay: {said}");
    let listed = by_address(&list);
    assert_eq!(listed[NIC]["num_vfs"], 4, "{}", listed[NIC]);
    assert_eq!(listed[NIC]["mode"], "vf", "{}", listed[NIC]);
    let vfs: Vec<&String> = listed
        .iter()
        .filter(|(_, d)| d["parent_pf"] == NIC)
        .map(|(a, _)| a)
        .collect();
    assert_eq!(vfs.len(), 4, "{vfs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_record_replaces_no_file_unless_forced_and_writes_to_stdout() {
    let h = Harness::start(STEADY_CONFIG).await;
    let dir = common::fast_tempdir();
    let file = dir.path().join("taken.tar.gz");
    std::fs::write(&file, "keep me").unwrap();
    let out = record(h.kernel.root(), &["-o", file.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("exists") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    let out = record(h.kernel.root(), &["-o", file.to_str().unwrap(), "--force"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(&std::fs::read(&file).unwrap()[..2], &[0x1f, 0x8b]);

    let out = record(h.kernel.root(), &["-o", "-"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        &out.stdout[..2],
        &[0x1f, 0x8b],
        "a gzip'd tarball on stdout"
    );
    assert!(text(&out.stderr).contains("into standard output"));
    let out = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args(["record", "--root"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("cannot list the PCI functions"),
        "{}",
        text(&out.stderr)
    );
}
