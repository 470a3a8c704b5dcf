//! Split of 64 VFs with vfio-pci binding on the simulated kernel: vfiod's task (snapshot,
//! plan, every write read back, progress recorded durably, inventory untouched) against a
//! plain writer that performs exactly the same writes through the same simulated kernel and
//! checks nothing, the equivalent of a shell script of `echo ... > ...` lines. Both restore
//! after each run; each round runs both, in alternating order, and the result is the median of
//! the rounds' ratios.
//!
//! Run: `cargo bench --bench split`. Target: ratio <= 1.1.

use std::sync::Arc;
use std::time::{Duration, Instant};
use vfiod::config::Settings;
use vfiod::engine::job::ModeJob;
use vfiod::engine::{task, Core, Modprobe};
use vfiod::host::sysfs::Backend;
use vfiod::mode::plan::Step;
use vfiod::mode::policy::Target;
use vfiod::model::pci::PciAddress;
use vfiod::sim::kernel::{HostModel, SimKernel};
use vfiod::store::Store;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let dir = tempfile::Builder::new()
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let sysfs = kernel.sysfs();
    let settings = Settings::from_toml_str(
        "scenario = \"private\"\n[[select]]\nid = \"8086:1572\"\n",
        std::path::Path::new("bench.toml"),
    )
    .unwrap();
    let store = Arc::new(Store::open(&dir.path().join("state")).unwrap());
    let engine = Core::new(
        settings,
        None,
        sysfs.clone(),
        Arc::clone(&store),
        Arc::new(Modprobe),
    )
    .unwrap();
    engine.refresh().unwrap();
    let nic: PciAddress = "0000:3b:00.0".parse().unwrap();
    // The whole life of a task, as the daemon gives it: admitted, created, prepared from the
    // state it holds, guarded, run with recorded progress, outcome recorded.
    let task = |target: Target| {
        let cx = engine.job_context();
        let job = Box::new(ModeJob::new(nic, Some(target)));
        let started = task::begin(&cx, job, "bench", &|_, _| {}).unwrap();
        // No pass before the end (the daemon's settle): the inventory is refreshed untimed.
        task::run(&cx, started, &|_, _| {}, &|| {}).unwrap()
    };
    let target = Target::Vf {
        num_vfs: 64,
        vf_driver: "vfio-pci".into(),
    };
    let rounds: usize = std::env::var("VFIOD_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(31);

    let restore = || {
        let t = task(Target::Pf { driver: None });
        assert_eq!(t.state.as_str(), "success", "{}", t.message);
        engine.refresh().unwrap();
    };
    // The writes of the split, as a script would have them.
    let script: Vec<(std::path::PathBuf, String)> = {
        let d = store.device(nic).unwrap().unwrap();
        let (_, plan, _) = vfiod::mode::planner::plan_to(&sysfs, &store, &d, &target).unwrap();
        plan.unwrap()
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Write { path, value } => Some((path.resolve(&sysfs), value.clone())),
                _ => None,
            })
            .collect()
    };
    assert!(script
        .iter()
        .all(|(p, _)| !p.to_string_lossy().contains("new_id")));

    let run_plain = || {
        let t = Instant::now();
        for (path, value) in &script {
            kernel.write(path, value.as_bytes()).expect("plain write");
        }
        let took = t.elapsed();
        assert_eq!(kernel.num_vfs(nic), Some(64));
        engine.refresh().unwrap();
        restore();
        took
    };
    let run_vfiod = || {
        let t = Instant::now();
        let task = task(target.clone());
        let took = t.elapsed();
        assert_eq!(task.state.as_str(), "success", "{}", task.message);
        engine.refresh().unwrap();
        restore();
        took
    };
    // Paired rounds, the order alternating: each round's ratio compares two runs made moments
    // apart, which cancels most of the drift of a shared machine.
    let (mut plain, mut vfiod, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (p, v) = if round % 2 == 0 {
            let p = run_plain();
            (p, run_vfiod())
        } else {
            let v = run_vfiod();
            (run_plain(), v)
        };
        ratios.push(v.as_secs_f64() / p.as_secs_f64());
        plain.push(p);
        vfiod.push(v);
    }
    if std::env::var_os("VFIOD_BENCH_VERBOSE").is_some() {
        for (p, v) in plain.iter().zip(&vfiod) {
            eprintln!(
                "{:6.1} {:6.1}",
                p.as_secs_f64() * 1e3,
                v.as_secs_f64() * 1e3
            );
        }
    }
    ratios.sort_by(f64::total_cmp);
    let (p, v) = (median(plain), median(vfiod));
    println!("split of 64 VFs + vfio-pci binding, simulated kernel, {rounds} rounds, medians");
    println!(
        "plain writes (shell-script equivalent): {:>8.1} ms ({} writes)",
        p.as_secs_f64() * 1e3,
        script.len()
    );
    println!(
        "vfiod task (verified, recorded)        : {:>8.1} ms",
        v.as_secs_f64() * 1e3
    );
    println!(
        "ratio vfiod/plain, median of rounds    : {:>8.3} (target <= 1.1; rounds {:.3}..{:.3})",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
}
