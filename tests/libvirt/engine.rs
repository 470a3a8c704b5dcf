//! The engine and a real libvirtd (Debian's, a child of the test with its own sockets, serving
//! libvirt's test driver; see `tests/common/libvirtd.rs`): domain lifecycle events reach the
//! engine's event channel, and a task's guard asks the one libvirt worker, which gives a clear
//! error while libvirtd is down and is used again once it is back.

use crate::common;

use crate::common::libvirtd::Libvirtd;
use crate::common::{addr, Harness};
use std::sync::Arc;
use std::time::Duration;
use vfiod::config::Settings;
use vfiod::engine::{Core, Engine, EngineEvent, Modprobe};
use vfiod::host::libvirt::DomainEventKind;
use vfiod::sim::kernel::{HostModel, SimKernel};
use vfiod::store::Store;

fn define_and_start(d: &Libvirtd, name: &str) {
    let file = d.dir.path().join(format!("{name}.xml"));
    // VF 0000:3b:02.0 of the simulated NIC.
    std::fs::write(
        &file,
        common::libvirtd::test_domain_xml(name, "0000:3b:02.0"),
    )
    .unwrap();
    d.virsh(&["define", file.to_str().unwrap()]);
    d.virsh(&["start", name]);
}

async fn next_domain_event(
    stream: &mut vfiod::engine::EventStream,
    name: &str,
    kind: DomainEventKind,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ev = tokio::time::timeout_at(deadline, stream.recv())
            .await
            .unwrap_or_else(|_| {
                panic!("no {kind:?} event for {name} on the engine's channel within 30 s")
            })
            .expect("the engine's channel is open");
        if let EngineEvent::Domain(e) = ev {
            if e.name == name && e.kind == kind {
                return;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn domain_lifecycle_events_reach_the_engine_channel() {
    let d = Libvirtd::start();
    let dir = common::fast_tempdir();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let mut settings = Settings::from_toml_str(
        &format!("libvirt_uri = \"{}\"\n", d.uri()),
        std::path::Path::new("test.toml"),
    )
    .unwrap();
    settings.sysfs_root = kernel.root().to_path_buf();
    let store = Arc::new(Store::open(&dir.path().join("state")).unwrap());
    let core = Core::new(settings, None, kernel.sysfs(), store, Arc::new(Modprobe)).unwrap();
    let (engine, mut stream) = Engine::new(core);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let e = Arc::clone(&engine);
    let run = tokio::spawn(async move {
        e.run(None, None, async {
            let _ = stopped.await;
        })
        .await
    });

    // Domain events flow only once the worker has connected and registered for them.
    common::wait_for_libvirt(&engine).await;
    define_and_start(&d, "vm1");
    next_domain_event(&mut stream, "vm1", DomainEventKind::Defined).await;
    next_domain_event(&mut stream, "vm1", DomainEventKind::Started).await;
    d.virsh(&["destroy", "vm1"]);
    next_domain_event(&mut stream, "vm1", DomainEventKind::Stopped).await;

    let _ = stop.send(());
    run.await.unwrap();
}

/// A mode task's guard asks libvirt through the engine's one worker: a VF a running domain has
/// is refused naming the domain; while libvirtd is down the refusal is a clear error within the
/// bound and nothing is written; after libvirtd restarts the worker reconnects and the next
/// question is answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_guard_asks_libvirt_across_a_libvirtd_restart() {
    let mut d = Libvirtd::start();
    let config = format!(
        "scenario = \"private\"\nlibvirt_uri = \"{}\"\n[[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n",
        d.uri()
    );
    let h = Harness::start(&config).await;
    let nic = addr("0000:3b:00.0");
    assert_eq!(h.kernel.num_vfs(nic), Some(4), "boot split the NIC");
    define_and_start(&d, "web1");
    let device = vfiod::client::device(&h.client, "0000:3b:00.0")
        .await
        .unwrap();
    h.kernel.take_write_log();

    let refusal = |e: zbus::Error| match e {
        zbus::Error::MethodError(n, m, _) => (n.to_string(), m.unwrap_or_default()),
        other => panic!("not a method error: {other}"),
    };
    let (name, msg) = refusal(
        device
            .set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse", "{msg}");
    assert!(
        msg.contains("0000:3b:02.0 is assigned to running domain web1"),
        "{msg}"
    );

    d.kill();
    // Answered (bounded only against a hung test), with libvirt's failure named: the answer's
    // name and text are the claim ("within ANSWER_TIMEOUT + 5 s" raced a loaded machine).
    let (name, msg) = refusal(
        tokio::time::timeout(
            common::HUNG + vfiod::host::libvirt::ANSWER_TIMEOUT,
            device.set_mode("pf", vfiod::client::mode_options(None)),
        )
        .await
        .expect("the mode change is answered")
        .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Failed", "{msg}");
    assert!(
        msg.contains("cannot check which running domains use it") && msg.contains(&d.uri()),
        "{msg}"
    );
    assert!(
        h.kernel.take_write_log().is_empty(),
        "nothing may be written while libvirt cannot be asked"
    );
    assert_eq!(h.kernel.num_vfs(nic), Some(4));

    // The test driver keeps its domains in the daemon (the restarted one starts empty), and
    // only while a client holds it open: vfiod's worker may not have reconnected yet, so the
    // test holds a connection of its own while virsh defines the domain.
    d.restart();
    let keeper = vfiod::host::libvirt::Libvirt::start(
        Some(d.uri()),
        std::path::PathBuf::from("/nonexistent"),
        None,
    )
    .unwrap();
    common::eventually(Duration::from_secs(30), "a client connects", || {
        keeper.running_domains().ok()
    })
    .await;
    define_and_start(&d, "web2");
    let msg = common::eventually_async(
        Duration::from_secs(30),
        "the worker reconnects and sees web2",
        || async {
            match device
                .set_mode("pf", vfiod::client::mode_options(None))
                .await
            {
                Err(zbus::Error::MethodError(n, Some(m), _))
                    if n.as_str() == "org.vfiod.Vfiod1.Error.InUse" =>
                {
                    Some(m)
                }
                Err(_) => None,
                Ok(path) => panic!("the restore started while web2 has a VF: {path}"),
            }
        },
    )
    .await;
    assert!(msg.contains("running domain web2"), "{msg}");
    assert!(h.kernel.take_write_log().is_empty());

    d.virsh(&["destroy", "web2"]);
    let task = device
        .set_mode("pf", vfiod::client::mode_options(None))
        .await
        .unwrap();
    let t = vfiod::client::task(&h.client, task).await.unwrap();
    let (state, result) = vfiod::client::wait_task(&t, |_, _| {}).await.unwrap();
    assert_eq!(state, "success", "{result}");
    assert_eq!(h.kernel.num_vfs(nic), Some(0));
    keeper.stop();
}
