//! Argument and property strictness over a real bus: every vfiod object refuses a call whose
//! arguments are not exactly the method's (named InvalidArgs naming the method), says
//! PropertyReadOnly for a read-only property and UnknownProperty for a missing one, and never
//! sends a caller's huge argument back in an error. The wrapper that does it
//! (`vfiod::dbus::strict::Strict`) is also served around a probe interface with structure
//! arguments, the shapes vfiod's own methods do not have yet.

use crate::common;

use crate::common::{refusal, Harness, STEADY_CONFIG};
use std::time::Duration;
use vfiod::dbus::strict::Strict;
use zbus::Variant;

const ROOT: &str = "/org/vfiod/Vfiod1";
const MANAGER: &str = "org.vfiod.Vfiod1.Manager";
const DEVICE: &str = "org.vfiod.Vfiod1.Device";
const GPU_PATH: &str = "/org/vfiod/Vfiod1/device/pci_0000_17_00_0";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";

/// The longest error message a refusal may carry: enough to say what is wrong, never an echo
/// of a megabyte argument.
const SHORT: usize = 300;

/// Calls `member` with `body` on vfiod (bounded: a hang fails the test instead of blocking it).
async fn call<B>(
    conn: &zbus::Connection,
    path: &str,
    interface: &str,
    member: &str,
    body: &B,
) -> zbus::Result<zbus::Message>
where
    B: serde::Serialize + zbus::wire::Type,
{
    tokio::time::timeout(
        Duration::from_secs(30),
        conn.call_method(
            Some(vfiod::dbus::BUS_NAME),
            path,
            Some(interface),
            member,
            body,
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("{interface}.{member} got no reply within 30 s"))
}

fn assert_invalid_args(r: zbus::Result<zbus::Message>, what: &str, method: &str) {
    let (name, message) = refusal(r, what);
    assert_eq!(
        name, "org.freedesktop.DBus.Error.InvalidArgs",
        "{what}: {message}"
    );
    assert!(
        message.contains(method),
        "{what}: the error must name {method}: {message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extra_missing_and_wrong_arguments_are_refused_by_name() {
    let h = Harness::start(STEADY_CONFIG).await;
    let c = &h.client;

    // zbus alone would ignore the extra argument and answer.
    assert_invalid_args(
        call(c, ROOT, MANAGER, "GetPlans", &("x",)).await,
        "GetPlans(\"x\")",
        "GetPlans",
    );
    assert_invalid_args(
        call(c, ROOT, MANAGER, "GetDevice", &()).await,
        "GetDevice()",
        "GetDevice",
    );
    assert_invalid_args(
        call(c, ROOT, MANAGER, "GetDevice", &("0000:17:00.0", "b")).await,
        "GetDevice(\"0000:17:00.0\", \"b\")",
        "GetDevice",
    );
    assert_invalid_args(
        call(c, ROOT, MANAGER, "GetDevice", &(17u32,)).await,
        "GetDevice(17)",
        "GetDevice",
    );
    assert_invalid_args(
        call(c, GPU_PATH, DEVICE, "SetMode", &("pf",)).await,
        "SetMode(\"pf\")",
        "SetMode",
    );
    assert_invalid_args(
        call(c, GPU_PATH, DEVICE, "SetMode", &(0u32, "pf")).await,
        "SetMode(0, \"pf\")",
        "SetMode",
    );
    // The options are a{sv}: the old (s, u) signature is refused as any wrong one.
    assert_invalid_args(
        call(c, GPU_PATH, DEVICE, "SetMode", &("pf", 0u32)).await,
        "SetMode(\"pf\", 0)",
        "SetMode",
    );
    assert_invalid_args(
        call(c, GPU_PATH, DEVICE, "Apply", &(true,)).await,
        "Apply(true)",
        "Apply",
    );

    // The correct calls work.
    let path: zbus::OwnedObjectPath = call(c, ROOT, MANAGER, "GetDevice", &("0000:17:00.0",))
        .await
        .expect("GetDevice with one address")
        .body()
        .deserialize()
        .unwrap();
    assert_eq!(path.as_str(), GPU_PATH);
    let plans: Vec<vfiod::dbus::wire::Dict> = call(c, ROOT, MANAGER, "GetPlans", &())
        .await
        .expect("GetPlans with no argument")
        .body()
        .deserialize()
        .unwrap();
    assert!(!plans.is_empty());
    let tasks: Vec<vfiod::dbus::wire::Dict> = call(
        c,
        ROOT,
        MANAGER,
        "GetTasks",
        &(vfiod::dbus::wire::Dict::new(),),
    )
    .await
    .expect("GetTasks with an empty query")
    .body()
    .deserialize()
    .unwrap();
    assert!(tasks.is_empty(), "{tasks:?}");
    // A refusal changed nothing: no task was created by the refused SetMode/Apply.
    assert!(h.store().tasks(None, 10).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_and_unknown_properties_are_named_as_such() {
    let h = Harness::start(STEADY_CONFIG).await;
    let c = &h.client;
    let set = |path: &'static str, interface: &'static str, property: &'static str| {
        let value = Variant::from("0000:00:00.0");
        async move { call(c, path, PROPERTIES, "Set", &(interface, property, value)).await }
    };

    for (path, interface, property) in [
        (GPU_PATH, DEVICE, "Address"),
        (GPU_PATH, DEVICE, "TaskState"),
        (ROOT, MANAGER, "Version"),
        (ROOT, MANAGER, "Scenario"),
    ] {
        let what = format!("Set {interface}.{property}");
        let (name, message) = refusal(set(path, interface, property).await, &what);
        assert_eq!(
            name, "org.freedesktop.DBus.Error.PropertyReadOnly",
            "{what}: {message}"
        );
        assert!(message.contains(property), "{what}: {message}");
    }
    for (path, interface, property) in [(GPU_PATH, DEVICE, "Colour"), (ROOT, MANAGER, "Nope")] {
        let what = format!("Set {interface}.{property}");
        let (name, message) = refusal(set(path, interface, property).await, &what);
        assert_eq!(
            name, "org.freedesktop.DBus.Error.UnknownProperty",
            "{what}: {message}"
        );
    }
    // Nothing changed, and reads still work.
    let props: std::collections::HashMap<String, zbus::OwnedVariant> =
        call(c, GPU_PATH, PROPERTIES, "GetAll", &(DEVICE,))
            .await
            .unwrap()
            .body()
            .deserialize()
            .unwrap();
    assert_eq!(
        common::prop_str(&props, "Address").as_deref(),
        Some("0000:17:00.0")
    );
    let version: zbus::OwnedVariant = call(c, ROOT, PROPERTIES, "Get", &(MANAGER, "Version"))
        .await
        .unwrap()
        .body()
        .deserialize()
        .unwrap();
    assert_eq!(
        String::try_from(version).unwrap(),
        env!("CARGO_PKG_VERSION")
    );
}

/// A 1 MB argument is refused with a short message: the caller is told what is wrong, not sent
/// its megabyte back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_argument_gets_a_short_error() {
    let h = Harness::start(STEADY_CONFIG).await;
    let c = &h.client;
    let huge = "v".repeat(1 << 20);
    let (name, message) = refusal(
        call(
            c,
            GPU_PATH,
            DEVICE,
            "SetMode",
            &(huge.as_str(), vfiod::dbus::wire::Dict::new()),
        )
        .await,
        "SetMode(1 MB, {})",
    );
    assert_eq!(
        name, "org.vfiod.Vfiod1.Error.InvalidArgument",
        "{message:.300}"
    );
    assert!(
        message.len() < SHORT,
        "SetMode(1 MB): a {}-byte error message: {message:.300}",
        message.len()
    );
    // A megabyte query key is named short too.
    let query = vfiod::dbus::wire::Dict::from([(
        huge.clone(),
        zbus::OwnedVariant::try_from(Variant::from(1u32)).unwrap(),
    )]);
    let (name, message) = refusal(
        call(c, ROOT, MANAGER, "GetTasks", &(query,)).await,
        "GetTasks({1 MB key})",
    );
    assert_eq!(
        name, "org.vfiod.Vfiod1.Error.InvalidArgument",
        "{message:.300}"
    );
    assert!(
        message.len() < SHORT,
        "GetTasks(1 MB key): a {}-byte error message: {message:.300}",
        message.len()
    );
    // The daemon is fine afterwards.
    assert!(call(c, ROOT, MANAGER, "GetPlans", &()).await.is_ok());
}

/// The same for a 1 MB address: `GetDevice`, `GetPlan` and a query's `address` parse it as a PCI
/// address, and the parse error quotes the whole input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_address_gets_a_short_error() {
    let h = Harness::start(STEADY_CONFIG).await;
    let c = &h.client;
    let huge = "0".repeat(1 << 20);
    let query = vfiod::dbus::wire::Dict::from([(
        "address".to_string(),
        zbus::OwnedVariant::try_from(Variant::from(huge.as_str())).unwrap(),
    )]);
    let calls = [
        (
            "GetDevice(1 MB)",
            call(c, ROOT, MANAGER, "GetDevice", &(huge.as_str(),)).await,
        ),
        (
            "GetPlan(1 MB)",
            call(c, ROOT, MANAGER, "GetPlan", &(huge.as_str(),)).await,
        ),
        (
            "GetTasks({address: 1 MB})",
            call(c, ROOT, MANAGER, "GetTasks", &(query,)).await,
        ),
    ];
    let mut long = Vec::new();
    for (what, r) in calls {
        let (name, message) = refusal(r, what);
        assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{what}");
        if message.len() >= SHORT {
            long.push(format!("{what}: {} bytes", message.len()));
        }
    }
    assert!(long.is_empty(), "long error messages: {long:?}");
}

/// `object` behind `Strict` at `path` under `name` on a private bus of its own; returns what
/// must live as long as the test (its directory and bus), the service and a client.
async fn serve<I: zbus::object_server::Interface>(
    name: &str,
    path: &str,
    object: I,
) -> (
    tempfile::TempDir,
    vfiod::sim::bus::PrivateBus,
    zbus::Connection,
    zbus::Connection,
) {
    let dir = common::fast_tempdir();
    let bus = vfiod::sim::bus::PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let service = zbus::connection::Builder::address(bus.address())
        .name(name.to_string())
        .serve_at(path.to_string(), Strict::new(object))
        .build()
        .await
        .unwrap();
    let client = common::connect(bus.address()).await;
    (dir, bus, service, client)
}

// ----- the wrapper around structure arguments ----------------------------------------------

/// A probe interface with the argument shapes vfiod's methods do not have yet: a structure
/// alone, a structure then more, two strings (the same fields as the structure, unwrapped).
struct Probe;

#[zbus::interface(name = "org.vfiod.Test.Probe")]
impl Probe {
    fn pair(&self, p: (String, String)) -> String {
        format!("{}+{}", p.0, p.1)
    }
    fn pair_then(&self, p: (String, String), n: u32) -> String {
        format!("{}+{}*{n}", p.0, p.1)
    }
    fn two(&self, a: &str, b: &str) -> String {
        format!("{a}/{b}")
    }
    fn none(&self) -> String {
        "none".into()
    }
}

async fn probe_call<B>(conn: &zbus::Connection, member: &str, body: &B) -> zbus::Result<String>
where
    B: serde::Serialize + zbus::wire::Type,
{
    let reply = tokio::time::timeout(
        Duration::from_secs(30),
        conn.call_method(
            Some("org.vfiod.Test.Probe"),
            "/probe",
            Some("org.vfiod.Test.Probe"),
            member,
            body,
        ),
    )
    .await
    .expect("the probe answers")?;
    reply.body().deserialize::<String>()
}

/// `Strict` compares the call's body signature with the method's in-arguments. A body signature
/// has no parentheses around several arguments on the wire, but zbus shows it with them, and a
/// lone structure argument looks the same: the comparison must not strip or keep parentheses
/// by guesswork.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structure_arguments_pass_the_strict_wrapper() {
    let (_dir, _bus, service, client) = serve("org.vfiod.Test.Probe", "/probe", Probe).await;

    let one_struct = (("a".to_string(), "b".to_string()),);
    assert_eq!(
        probe_call(&client, "Pair", &one_struct).await.unwrap(),
        "a+b",
        "a method taking one structure, called with one"
    );
    assert_eq!(
        probe_call(&client, "PairThen", &(("a", "b"), 3u32))
            .await
            .unwrap(),
        "a+b*3",
        "a method taking a structure then a u32"
    );
    assert_eq!(
        probe_call(&client, "Two", &("a", "b")).await.unwrap(),
        "a/b"
    );
    assert_eq!(probe_call(&client, "None", &()).await.unwrap(), "none");

    // And the wrong shapes are still refused, naming the method.
    for (member, r) in [
        ("Pair", probe_call(&client, "Pair", &("a",)).await),
        (
            "Pair",
            probe_call(&client, "Pair", &(("a", "b"), 1u32)).await,
        ),
        (
            "PairThen",
            probe_call(&client, "PairThen", &(("a", "b"),)).await,
        ),
        (
            "PairThen",
            probe_call(&client, "PairThen", &("a", "b", 1u32)).await,
        ),
        ("Two", probe_call(&client, "Two", &("a",)).await),
        ("None", probe_call(&client, "None", &("x",)).await),
    ] {
        let (name, message) = refusal(r, member);
        assert_eq!(name, "org.freedesktop.DBus.Error.InvalidArgs", "{message}");
        assert!(message.contains(member), "{message}");
    }
    drop(service);
}

/// An object whose state can vanish between two property reads, as a device's does when it is
/// removed while a caller reads it.
struct Vanishing {
    gone: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Vanishing {
    fn check(&self) -> zbus::fdo::Result<()> {
        if self.gone.load(std::sync::atomic::Ordering::SeqCst) {
            Err(zbus::fdo::Error::UnknownObject("the probe is gone".into()))
        } else {
            Ok(())
        }
    }
}

#[zbus::interface(name = "org.vfiod.Test.Vanishing")]
impl Vanishing {
    #[zbus(property)]
    fn name(&self) -> String {
        "probe".into()
    }
    #[zbus(property)]
    fn size(&self) -> zbus::fdo::Result<u32> {
        self.check().map(|()| 7)
    }
}

/// zbus's GetAll leaves out a property whose getter fails; behind `Strict` the caller gets the
/// getter's named error instead of half an object (a client would read a device with no
/// NumaNode and take it for a daemon bug).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_all_answers_every_property_or_the_getters_error() {
    let gone = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let vanishing = Vanishing { gone: gone.clone() };
    let (_dir, _bus, service, client) =
        serve("org.vfiod.Test.Vanishing", "/vanishing", vanishing).await;
    let props = zbus::fdo::PropertiesProxy::builder(&client)
        .destination("org.vfiod.Test.Vanishing")
        .path("/vanishing")
        .build()
        .await
        .unwrap();
    let iface = zbus::names::InterfaceName::try_from("org.vfiod.Test.Vanishing").unwrap();
    let all = props.get_all(iface.clone()).await.unwrap();
    let mut names: Vec<_> = all.keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["Name", "Size"]);

    gone.store(true, std::sync::atomic::Ordering::SeqCst);
    let r = props.get_all(iface).await;
    let (name, message) = refusal(r.map_err(zbus::Error::from), "GetAll of a vanished object");
    assert_eq!(
        name, "org.freedesktop.DBus.Error.UnknownObject",
        "{message}"
    );
    assert!(message.contains("gone"), "{message}");
    drop(service);
}
