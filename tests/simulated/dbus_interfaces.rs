//! The introspection XML shipped in `dbus/interfaces/` (installed under
//! `/usr/share/dbus-1/interfaces/`, where client generators such as `gdbus-codegen`,
//! `zbus-xmlgen` and `qdbusxml2cpp` look) is what the daemon serves, interface for interface.
//!
//! The test starts vfiod on the simulated reference host on a private dbus-daemon, makes one
//! object of every kind it serves (the root's Manager and Images, a device, a task, a claim, a
//! pooled claim leased from a real `vfiod-pool` on loopback), introspects them and compares each
//! `org.vfiod.Vfiod1.*` interface with its file. Both sides are normalized before they are
//! compared: comments (zbus writes doc comments as XML comments, which are documentation and
//! may even be ill-formed XML: docs/dbus.md is the reference), whitespace, and the order of
//! members and annotations (arguments keep their order: it is the signature). An interface the
//! daemon serves without a file, or a file for an interface it no longer serves, fails too.
//!
//! After changing the API, regenerate the files with one command and review the diff:
//!
//! ```text
//! VFIOD_BLESS=1 cargo test --test simulated dbus_interfaces::
//! ```
//!
//! The files are written in the normalized form, so a regeneration changes only what changed.

use crate::common;

use crate::common::{dict, Harness, STEADY_CONFIG};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use zbus::OwnedObjectPath;
use zbus::Variant;

/// Our interfaces' prefix; the standard ones (Properties, Introspectable, Peer, ObjectManager)
/// are the bus's own and ship with it.
const PREFIX: &str = "org.vfiod.Vfiod1.";

/// Every interface the daemon serves today: the test fails if it could not make an object of
/// one of them (a new kind of object must be added here and below, so that it is checked).
const EXPECTED: &[&str] = &[
    "org.vfiod.Vfiod1.Claim",
    "org.vfiod.Vfiod1.Device",
    "org.vfiod.Vfiod1.Images",
    "org.vfiod.Vfiod1.Manager",
    "org.vfiod.Vfiod1.PooledClaim",
    "org.vfiod.Vfiod1.Task",
];

fn interfaces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("dbus/interfaces")
}

/// `path` from the top of the source tree, for messages.
fn relative(path: &Path) -> String {
    let top = Path::new(env!("CARGO_MANIFEST_DIR"));
    path.strip_prefix(top).unwrap_or(path).display().to_string()
}

/// `vfiod-pool` on a free loopback port, killed when dropped: a pooled claim needs a pool.
struct Pool {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Pool {
    fn start() -> Pool {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(common::bins::vfiod_pool())
            .args(["--listen", "127.0.0.1:0", "--state-dir"])
            .arg(dir.path())
            .args(["--devices", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("vfiod-pool starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("vfiod-pool: listening on ")
            .unwrap_or_else(|| panic!("vfiod-pool said {line:?}"))
            .trim_end_matches('/')
            .to_string();
        Pool {
            child,
            url,
            _dir: dir,
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The introspection XML of `path`, as any client gets it.
async fn introspect(h: &Harness, path: &str) -> String {
    zbus::fdo::IntrospectableProxy::builder(&h.client)
        .destination(vfiod::dbus::BUS_NAME)
        .path(path)
        .build()
        .await
        .unwrap()
        .introspect()
        .await
        .unwrap_or_else(|e| panic!("introspect {path}: {e}"))
}

/// The XML without its comments (a doc comment may hold "--", which XML forbids there).
fn without_comments(xml: &str) -> String {
    let mut out = String::with_capacity(xml.len());
    let mut rest = xml;
    while let Some(start) = rest.find("<!--") {
        out.push_str(&rest[..start]);
        let body = &rest[start + "<!--".len()..];
        rest = body
            .find("-->")
            .map_or("", |end| &body[end + "-->".len()..]);
    }
    out.push_str(rest);
    out
}

fn escape(value: &str) -> String {
    value
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('"', "&quot;")
        .replace('>', "&gt;")
}

/// One element as a line: its tag and its attributes in a fixed order (name first, then the
/// rest sorted), self-closed when `children` is empty.
fn element(out: &mut String, indent: usize, node: roxmltree::Node<'_, '_>, children: &[String]) {
    let mut attributes: Vec<(&str, &str)> =
        node.attributes().map(|a| (a.name(), a.value())).collect();
    // name, type, direction, access, value: the order introspection usually has; the rest after.
    let rank = |n: &str| {
        ["name", "type", "direction", "access", "value"]
            .iter()
            .position(|k| *k == n)
            .unwrap_or(usize::MAX)
    };
    attributes.sort_by(|a, b| (rank(a.0), a.0).cmp(&(rank(b.0), b.0)));
    let pad = "  ".repeat(indent);
    out.push_str(&pad);
    out.push('<');
    out.push_str(node.tag_name().name());
    for (k, v) in attributes {
        out.push_str(&format!(" {k}=\"{}\"", escape(v)));
    }
    if children.is_empty() {
        out.push_str("/>\n");
    } else {
        out.push_str(">\n");
        for c in children {
            out.push_str(c);
        }
        out.push_str(&format!("{pad}</{}>\n", node.tag_name().name()));
    }
}

/// A member (method, signal, property) normalized: arguments in their order (the signature),
/// annotations sorted.
fn member(node: roxmltree::Node<'_, '_>) -> String {
    let mut args = Vec::new();
    let mut annotations = Vec::new();
    for c in node.children().filter(|c| c.is_element()) {
        let mut text = String::new();
        let inner: Vec<String> = c
            .children()
            .filter(|a| a.has_tag_name("annotation"))
            .map(|a| {
                let mut s = String::new();
                element(&mut s, 4, a, &[]);
                s
            })
            .collect();
        element(&mut text, 3, c, &inner);
        if c.has_tag_name("arg") {
            args.push(text);
        } else {
            annotations.push(text);
        }
    }
    annotations.sort();
    args.extend(annotations);
    let mut out = String::new();
    element(&mut out, 2, node, &args);
    out
}

/// Every `org.vfiod.Vfiod1.*` interface in `xml`, normalized, by name.
fn normalized_interfaces(xml: &str, whence: &str) -> BTreeMap<String, String> {
    let xml = without_comments(xml);
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    let doc = roxmltree::Document::parse_with_options(&xml, options)
        .unwrap_or_else(|e| panic!("{whence}: not well-formed XML: {e}"));
    let mut out = BTreeMap::new();
    // The interfaces of this object only: not those of child nodes, if a child is described.
    for iface in doc
        .root_element()
        .children()
        .filter(|n| n.has_tag_name("interface"))
    {
        let Some(name) = iface.attribute("name").filter(|n| n.starts_with(PREFIX)) else {
            continue;
        };
        // Annotations of the interface first, then methods, signals, properties, each by name.
        let rank = |n: &roxmltree::Node<'_, '_>| match n.tag_name().name() {
            "annotation" => 0,
            "method" => 1,
            "signal" => 2,
            "property" => 3,
            _ => 4,
        };
        let mut members: Vec<_> = iface.children().filter(|c| c.is_element()).collect();
        members.sort_by_key(|m| (rank(m), m.attribute("name").unwrap_or("").to_string()));
        let members: Vec<String> = members.into_iter().map(member).collect();
        let mut text = String::new();
        element(&mut text, 1, iface, &members);
        out.insert(name.to_string(), text);
    }
    out
}

/// The file for one interface: a complete introspection document, as generators read it.
fn document(interface: &str) -> String {
    format!(
        "<!DOCTYPE node PUBLIC \"-//freedesktop//DTD D-BUS Object Introspection 1.0//EN\"\n \
         \"http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd\">\n\
         <!-- Generated by tests/simulated/dbus_interfaces.rs from what vfiod serves (its header \
         says\n     how to regenerate it). The reference is docs/dbus.md. -->\n\
         <node>\n{interface}</node>\n"
    )
}

/// The shipped files, `org.vfiod.Vfiod1.X.xml`, normalized, by interface name.
fn shipped() -> BTreeMap<String, (PathBuf, String)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(interfaces_dir()) else {
        return out;
    };
    for entry in dir {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("xml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // As a generator reads it: comments included (a "--" in one makes the file ill-formed
        // for expat, gdbus-codegen's parser, although the normalized form drops comments).
        let options = roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        };
        if let Err(e) = roxmltree::Document::parse_with_options(&text, options) {
            panic!("{}: not well-formed XML: {e}", relative(&path));
        }
        let found = normalized_interfaces(&text, &path.display().to_string());
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        assert_eq!(
            found.keys().collect::<Vec<_>>(),
            [&stem],
            "{}: one file per interface, named for it",
            path.display()
        );
        let (name, iface) = found.into_iter().next().unwrap();
        out.insert(name, (path, iface));
    }
    out
}

/// The first line where `a` and `b` differ, for the failure message.
fn first_difference(a: &str, b: &str) -> String {
    let (la, lb): (Vec<_>, Vec<_>) = (a.lines().collect(), b.lines().collect());
    for i in 0..la.len().max(lb.len()) {
        let (x, y) = (la.get(i), lb.get(i));
        if x != y {
            return format!(
                "line {}: shipped {:?}, served {:?}",
                i + 1,
                x.map_or("(end)", |s| s.trim()),
                y.map_or("(end)", |s| s.trim())
            );
        }
    }
    "no line differs".into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_interface_xml_is_what_the_daemon_serves() {
    let pool = Pool::start();
    // The steady host, without libvirt (no claim is attached here), with one pool.
    let config = format!(
        "host_name = \"hosta\"\nlibvirt_uri = \"\"\n{STEADY_CONFIG}\n\
         [[pool]]\nname = \"gpus\"\nurl = \"{}\"\nconnect_timeout_ms = 500\n\
         request_timeout_ms = 5000\nquiesce_at = \"switchover\"\n",
        pool.url
    );
    let h = Harness::start(&config).await;
    let manager = h.manager().await;

    // One object of every kind: a task (the FPGA split), a claim (the GPU), a pooled claim.
    let fpga = vfiod::client::device(&h.client, "0000:af:00.0")
        .await
        .unwrap();
    let task: OwnedObjectPath = fpga
        .set_mode("vf", vfiod::client::mode_options(Some(2)))
        .await
        .unwrap();
    let claim = manager
        .claim(
            dict(&[("kind", Variant::from("gpu"))]),
            dict(&[("vm_name", Variant::from("vm1"))]),
        )
        .await
        .expect("claim the GPU");
    let pooled = manager
        .lease_pooled("gpus", "dev0", dict(&[("vm_name", Variant::from("vm1"))]))
        .await
        .expect("lease the pool's device");
    assert!(pooled.contains_key("id"), "{pooled:?}");

    // Every object the daemon lists, and the root (which the ObjectManager does not list): one
    // path per interface is enough, introspection describes the interface.
    let managed = zbus::fdo::ObjectManagerProxy::builder(&h.client)
        .destination(vfiod::dbus::BUS_NAME)
        .path(vfiod::dbus::ROOT_PATH)
        .build()
        .await
        .unwrap()
        .get_managed_objects()
        .await
        .unwrap();
    let mut paths: Vec<String> = vec![vfiod::dbus::ROOT_PATH.to_string()];
    paths.extend(managed.keys().map(|p| p.to_string()));
    for made in [task.to_string(), claim.to_string()] {
        assert!(
            paths.contains(&made),
            "{made} is not among the managed objects"
        );
    }
    let mut served: BTreeMap<String, String> = BTreeMap::new();
    let mut seen_at: BTreeMap<String, String> = BTreeMap::new();
    for path in &paths {
        let interfaces_here: BTreeSet<String> =
            match managed.iter().find(|(p, _)| p.as_str() == path) {
                Some((_, ifaces)) => ifaces.keys().map(|i| i.to_string()).collect(),
                None => BTreeSet::new(), // the root: take whatever it serves
            };
        if !interfaces_here.is_empty() && interfaces_here.iter().all(|i| served.contains_key(i)) {
            continue;
        }
        let xml = introspect(&h, path).await;
        for (name, iface) in normalized_interfaces(&xml, path) {
            if let Some(known) = served.get(&name) {
                assert_eq!(
                    known, &iface,
                    "{name} differs between {} and {path}",
                    seen_at[&name]
                );
                continue;
            }
            seen_at.insert(name.clone(), path.clone());
            served.insert(name, iface);
        }
    }
    let names: Vec<&str> = served.keys().map(String::as_str).collect();
    for want in EXPECTED {
        assert!(
            names.contains(want),
            "no object served {want} (served: {names:?}): the test lost an object kind"
        );
    }

    if std::env::var_os("VFIOD_BLESS").is_some_and(|v| v != "0" && !v.is_empty()) {
        let dir = interfaces_dir();
        std::fs::create_dir_all(&dir).unwrap();
        // By file name only: a file that no longer parses is rewritten or removed, too.
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            let xml = path.extension().is_some_and(|e| e == "xml");
            if xml && !served.contains_key(&stem) {
                std::fs::remove_file(&path).unwrap();
            }
        }
        for (name, iface) in &served {
            std::fs::write(dir.join(format!("{name}.xml")), document(iface)).unwrap();
        }
        eprintln!(
            "wrote {} interface files to {}",
            served.len(),
            dir.display()
        );
    }

    let shipped = shipped();
    let mut problems = Vec::new();
    for (name, iface) in &served {
        match shipped.get(name) {
            None => problems.push(format!(
                "{name}: served, but dbus/interfaces/{name}.xml is missing"
            )),
            Some((path, text)) if text != iface => problems.push(format!(
                "{name}: {} differs from what {} serves: {}",
                relative(path),
                seen_at[name],
                first_difference(text, iface)
            )),
            Some(_) => {}
        }
    }
    for (name, (path, _)) in &shipped {
        if !served.contains_key(name) {
            problems.push(format!(
                "{}: {name} is not served by any object",
                relative(path)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the shipped interface XML is out of date (after an API change, regenerate it: \
         VFIOD_BLESS=1 cargo test --test simulated dbus_interfaces::, and review the diff):\n{}",
        problems.join("\n")
    );
}

/// The normalization itself: order and whitespace do not count, argument order and every
/// attribute do. Pure, on fixed input.
#[test]
fn normalization_ignores_order_and_whitespace_but_not_signatures() {
    let a = r#"<node><interface name="org.vfiod.Vfiod1.X">
        <!-- doc -- with dashes -->
        <method name="B"><arg type="s" name="x" direction="in"/><arg name="y" type="u" direction="in"/></method>
        <property name="P" type="s" access="read">
          <annotation name="z" value="1"/><annotation name="a" value="2"/>
        </property>
        <method name="A"/>
      </interface><interface name="org.freedesktop.DBus.Peer"/></node>"#;
    let b = r#"<node>
      <interface name="org.vfiod.Vfiod1.X"><method name="A"></method>
        <property access="read" type="s" name="P"><annotation name="a" value="2"/>
          <annotation value="1" name="z"/></property>
        <method name="B">
          <arg name="x" type="s" direction="in"/>
          <arg name="y" type="u" direction="in"/>
        </method>
      </interface></node>"#;
    let na = normalized_interfaces(a, "a");
    assert_eq!(na.keys().collect::<Vec<_>>(), ["org.vfiod.Vfiod1.X"]);
    assert_eq!(na, normalized_interfaces(b, "b"));
    // Swapped arguments, another type, another access: each a difference.
    for changed in [
        b.replace(
            r#"<arg name="x" type="s" direction="in"/>
          <arg name="y" type="u" direction="in"/>"#,
            r#"<arg name="y" type="u" direction="in"/>
          <arg name="x" type="s" direction="in"/>"#,
        ),
        b.replace(r#"name="y" type="u""#, r#"name="y" type="t""#),
        b.replace(r#"access="read""#, r#"access="readwrite""#),
    ] {
        assert_ne!(changed, b);
        assert_ne!(na, normalized_interfaces(&changed, "changed"));
    }
    // The file form is well-formed XML, comments included, and parses back to the same
    // interface.
    let file = document(&na["org.vfiod.Vfiod1.X"]);
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    roxmltree::Document::parse_with_options(&file, options).expect("the file form parses");
    assert_eq!(normalized_interfaces(&file, "file"), na);
}
