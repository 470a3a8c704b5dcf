//! `vfioctl record` of a simulated host with about 1,000 PCI functions (the reference host plus
//! 15 X710 NICs with 64 VFs each), against `tar czf` of the same files read from the same tree,
//! measured in the same run: the time and the size of each, and their ratios.
//!
//! Run: `cargo bench --bench record` (needs GNU tar). Targets: under 1 s and under 2 MB for
//! the recording; the ratios say how that compares with archiving the same files by hand.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};
use vfiod::host::record::{self, Member, Options};
use vfiod::sim::kernel::{HostModel, SimKernel};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kernel =
        SimKernel::build(&dir.path().join("root"), &HostModel::large(15)).expect("simulated host");
    let root = kernel.root().to_path_buf();
    let rounds: usize = std::env::var("VFIOD_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(11);
    let options = Options {
        tool: "bench".into(),
        with_hostname: false,
    };
    let out = dir.path().join("recording.tar.gz");

    // The same members for tar: every file, link and directory the recording holds, read from
    // the same tree (tar reads whole files where the recording reads 256 bytes of `config`).
    let first = record::record(&root, &options).expect("record");
    let functions = first.manifest.counts.functions;
    let list = dir.path().join("members.txt");
    {
        let mut f = std::fs::File::create(&list).unwrap();
        for (path, m) in first.members() {
            if matches!(m, Member::File(_) | Member::Link(_) | Member::Dir) {
                writeln!(f, "{}", path.display()).unwrap();
            }
        }
    }
    let tar_out = dir.path().join("reference.tar.gz");

    let ours = |times: &mut Vec<Duration>| -> u64 {
        let _ = std::fs::remove_file(&out);
        let t = Instant::now();
        let rec = record::record(&root, &options).expect("record");
        let size = rec.write_file(&out, true).expect("write");
        times.push(t.elapsed());
        size
    };
    let tar = |times: &mut Vec<Duration>| -> u64 {
        let t = Instant::now();
        let o = Command::new("tar")
            .arg("czf")
            .arg(&tar_out)
            .arg("-C")
            .arg(&root)
            .args(["--no-recursion", "-T"])
            .arg(&list)
            .output()
            .expect("run tar (GNU tar)");
        times.push(t.elapsed());
        assert!(
            o.status.success(),
            "tar: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::metadata(&tar_out).unwrap().len()
    };

    // Warm the page cache for both, then interleave so drift hits both equally.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    ours(&mut Vec::new());
    tar(&mut Vec::new());
    let (mut size, mut tar_size) = (0, 0);
    for _ in 0..rounds {
        size = ours(&mut a);
        tar_size = tar(&mut b);
    }
    let (r, t) = (median(a), median(b));
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "simulated host: {functions} PCI functions, {} members, {rounds} rounds, medians",
        first.members().len() + 1
    );
    println!(
        "vfioctl record          : {:>8.1} ms {:>7.3} MB (targets < 1000 ms, < 2 MB)",
        r.as_secs_f64() * 1e3,
        mb(size)
    );
    println!(
        "tar czf, same members   : {:>8.1} ms {:>7.3} MB",
        t.as_secs_f64() * 1e3,
        mb(tar_size)
    );
    println!(
        "ratio record/tar czf    : {:>8.3} time, {:.3} size",
        r.as_secs_f64() / t.as_secs_f64(),
        size as f64 / tar_size as f64
    );
    let ok = r < Duration::from_secs(1) && size < 2_000_000;
    println!("targets: {}", if ok { "met" } else { "MISSED" });
}
