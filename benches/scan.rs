//! Inventory scan of a simulated host with about 1,000 PCI functions, against
//! `lspci -A linux-sysfs -nnk` reading the same tree, measured in the same run.
//!
//! Run: `cargo bench --bench scan` (needs pciutils). Prints both medians and the ratio
//! vfiod/lspci; the target is <= 0.5.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};
use vfiod::config::Settings;
use vfiod::sim::kernel::{HostModel, SimKernel};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kernel = SimKernel::build(dir.path(), &HostModel::large(15)).expect("simulated host");
    // The production read path (plain files), over the tree the simulated kernel rendered.
    let sysfs = vfiod::host::sysfs::Sysfs::host(kernel.root());
    let settings = Settings::default();
    let functions = sysfs.list_functions().expect("list").len();
    let pci_path = format!("sysfs.path={}", kernel.root().join("sys/bus/pci").display());
    let rounds: usize = std::env::var("VFIOD_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(21);

    let lspci = |out: &mut Vec<Duration>| {
        let t = Instant::now();
        let o = Command::new("lspci")
            .args(["-A", "linux-sysfs", "-O", &pci_path, "-nnk", "-D"])
            .output()
            .expect("run lspci (install pciutils)");
        out.push(t.elapsed());
        assert!(
            o.status.success(),
            "lspci failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let lines = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.starts_with('\t'))
            .count();
        assert_eq!(lines, functions, "lspci saw a different tree");
    };
    let scan = |out: &mut Vec<Duration>| {
        let t = Instant::now();
        let devices = vfiod::inventory::scan(&sysfs, &settings, &BTreeMap::new()).expect("scan");
        out.push(t.elapsed());
        assert_eq!(devices.len(), functions);
    };

    // Warm the page cache for both, then interleave so drift hits both equally.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    lspci(&mut Vec::new());
    scan(&mut Vec::new());
    for _ in 0..rounds {
        lspci(&mut a);
        scan(&mut b);
    }
    let (l, v) = (median(a), median(b));
    println!("simulated host: {functions} PCI functions, {rounds} rounds, medians");
    println!(
        "lspci -A linux-sysfs -nnk -D : {:>8.2} ms",
        l.as_secs_f64() * 1e3
    );
    println!(
        "vfiod inventory scan         : {:>8.2} ms",
        v.as_secs_f64() * 1e3
    );
    println!(
        "ratio vfiod/lspci            : {:>8.3} (target <= 0.5)",
        v.as_secs_f64() / l.as_secs_f64()
    );
}
