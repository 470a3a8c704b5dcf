//! Every object's introspection is well-formed XML (zbus writes doc comments as XML comments
//! without escaping, so a doc comment with "--" once broke the manager's, for every client and
//! for vfiod's own argument checks), and declares what docs/dbus.md promises.

use crate::common::{Harness, STEADY_CONFIG};

async fn introspect(h: &Harness, path: &str) -> String {
    zbus::fdo::IntrospectableProxy::builder(&h.client)
        .destination(vfiod::dbus::BUS_NAME)
        .path(path)
        .build()
        .await
        .unwrap()
        .introspect()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_object_introspects_as_well_formed_xml() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = vfiod::client::device(&h.client, "0000:af:00.0")
        .await
        .unwrap();
    let task = fpga
        .set_mode("vf", vfiod::client::mode_options(Some(2)))
        .await
        .unwrap();
    for (path, interface, members) in [
        (
            vfiod::dbus::ROOT_PATH.to_string(),
            "org.vfiod.Vfiod1.Manager",
            &[
                "GetDevice",
                "GetEvents",
                "GetTasks",
                "GetPlans",
                "Reload",
                "Simulated",
            ][..],
        ),
        (
            vfiod::dbus::device_path("0000:af:00.0".parse().unwrap()).to_string(),
            "org.vfiod.Vfiod1.Device",
            &["SetMode", "Apply", "ResetTask", "TaskState", "Address"][..],
        ),
        (
            task.to_string(),
            "org.vfiod.Vfiod1.Task",
            &["Kind", "State", "Percent", "Result"][..],
        ),
    ] {
        let xml = introspect(&h, &path).await;
        let options = roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        };
        let doc = roxmltree::Document::parse_with_options(&xml, options)
            .unwrap_or_else(|e| panic!("{path}: introspection is not well-formed XML: {e}"));
        let iface = doc
            .descendants()
            .find(|n| n.has_tag_name("interface") && n.attribute("name") == Some(interface))
            .unwrap_or_else(|| panic!("{path} lacks {interface}"));
        for m in members {
            assert!(
                iface.children().any(|c| c.attribute("name") == Some(m)),
                "{path}: {interface} lacks {m}"
            );
        }
    }
}
