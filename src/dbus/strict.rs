//! Two checks zbus's generated interfaces leave out, for every vfiod object: a method call must
//! carry exactly the arguments the method declares (zbus ignores extra arguments, so
//! `GetPlans("x")` was accepted), and setting a read-only property says it is read-only (zbus says
//! "Unknown property", which sends a client looking for a typo).
//!
//! [`Strict`] wraps a generated interface and forwards everything else to it. It learns each
//! method's argument signature and each property's access from the interface's own
//! introspection, so it cannot drift from the code. zbus calls the `Interface` trait "unstable":
//! this file is the one place to adapt when zbus changes it (Cargo.lock pins the version).

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use zbus::message::{Header, Message};
use zbus::names::{InterfaceName, MemberName};
use zbus::object_server::{DispatchResult, Interface, SignalEmitter};
use zbus::{fdo, BoxDBusError, Connection, ObjectServer, OwnedVariant, Variant};

/// A generated interface with strict arguments and read-only errors.
pub struct Strict<I> {
    pub inner: I,
    /// Method name -> the signature of its in-arguments ("" for none).
    methods: HashMap<String, String>,
    read_only: HashSet<String>,
}

impl<I: Interface> Strict<I> {
    pub fn new(inner: I) -> Strict<I> {
        let mut xml = String::new();
        inner.introspect_to_writer(&mut xml, 0);
        let (methods, read_only) = shape(&xml);
        Strict {
            inner,
            methods,
            read_only,
        }
    }
}

impl<I> std::ops::Deref for Strict<I> {
    type Target = I;
    fn deref(&self) -> &I {
        &self.inner
    }
}

/// Methods with their in-signatures, and read-only properties, from introspection XML.
fn shape(xml: &str) -> (HashMap<String, String>, HashSet<String>) {
    let mut methods = HashMap::new();
    let mut read_only = HashSet::new();
    // zbus writes doc comments as XML comments without escaping "--": drop the comments.
    let mut text = String::with_capacity(xml.len());
    let mut rest = xml;
    while let Some(start) = rest.find("<!--") {
        text.push_str(&rest[..start]);
        rest = match rest[start + 4..].find("-->") {
            Some(end) => &rest[start + 4 + end + 3..],
            None => "",
        };
    }
    text.push_str(rest);
    let doc = match roxmltree::Document::parse(&text) {
        Ok(doc) => doc,
        Err(e) => {
            tracing::error!("cannot parse an interface's own introspection: {e}");
            return (methods, read_only);
        }
    };
    for node in doc.descendants().filter(|n| n.is_element()) {
        match node.tag_name().name() {
            "method" => {
                let signature: String = node
                    .children()
                    .filter(|a| a.has_tag_name("arg") && a.attribute("direction") != Some("out"))
                    .filter_map(|a| a.attribute("type"))
                    .collect();
                if let Some(name) = node.attribute("name") {
                    methods.insert(name.to_string(), signature);
                }
            }
            "property" if node.attribute("access") == Some("read") => {
                if let Some(name) = node.attribute("name") {
                    read_only.insert(name.to_string());
                }
            }
            _ => {}
        }
    }
    (methods, read_only)
}

fn refuse<'a>(e: fdo::Error) -> DispatchResult<'a> {
    DispatchResult::Async(Box::pin(async move { Err(BoxDBusError::from(e)) }))
}

#[zbus::export::async_trait::async_trait]
impl<I: Interface> Interface for Strict<I> {
    fn name() -> InterfaceName<'static> {
        I::name()
    }

    fn spawn_tasks_for_methods(&self) -> bool {
        self.inner.spawn_tasks_for_methods()
    }

    async fn get(
        &self,
        property_name: &str,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<Result<OwnedVariant, BoxDBusError>> {
        self.inner
            .get(property_name, server, connection, header, emitter)
            .await
    }

    async fn get_all(
        &self,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> fdo::Result<HashMap<String, OwnedVariant>> {
        self.inner
            .get_all(server, connection, header, emitter)
            .await
    }

    fn set<'call>(
        &'call self,
        property_name: &'call str,
        value: &'call Variant<'_>,
        server: &'call ObjectServer,
        connection: &'call Connection,
        header: Option<&'call Header<'_>>,
        emitter: &'call SignalEmitter<'_>,
    ) -> DispatchResult<'call> {
        if self.read_only.contains(property_name) {
            return refuse(fdo::Error::PropertyReadOnly(format!(
                "property {property_name} of {} is read-only",
                I::name()
            )));
        }
        self.inner
            .set(property_name, value, server, connection, header, emitter)
    }

    async fn set_mut(
        &mut self,
        property_name: &str,
        value: &Variant<'_>,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<Result<(), BoxDBusError>> {
        self.inner
            .set_mut(property_name, value, server, connection, header, emitter)
            .await
    }

    fn call<'call>(
        &'call self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult<'call> {
        if let Some(expected) = self.methods.get(name.as_str()) {
            let got = msg.body().signature().to_string();
            let got = got
                .strip_prefix('(')
                .and_then(|g| g.strip_suffix(')'))
                .filter(|_| expected.len() + 2 != got.len() || !expected.starts_with('('))
                .map(str::to_string)
                .unwrap_or(got);
            if got != *expected {
                let wants = if expected.is_empty() {
                    "no arguments".to_string()
                } else {
                    format!("arguments of signature \"{expected}\"")
                };
                return refuse(fdo::Error::InvalidArgs(format!(
                    "{}.{name} takes {wants}, not \"{got}\"",
                    I::name()
                )));
            }
        }
        self.inner.call(server, connection, msg, name)
    }

    fn call_mut<'call>(
        &'call mut self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult<'call> {
        self.inner.call_mut(server, connection, msg, name)
    }

    fn introspect_to_writer(&self, writer: &mut dyn Write, level: usize) {
        self.inner.introspect_to_writer(writer, level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_reads_in_arguments_and_read_only_properties() {
        let xml = r#"<interface name="org.x.Y">
          <!-- a comment -->
          <method name="GetPlans"><arg type="a(ss)" direction="out"/></method>
          <method name="GetEvents">
            <arg name="address" type="s" direction="in"/>
            <arg name="after_id" type="x" direction="in"/>
            <arg type="a(xxsss)" direction="out"/>
          </method>
          <method name="Implicit"><arg name="a" type="u"/></method>
          <property name="Address" type="s" access="read"/>
          <property name="Knob" type="u" access="readwrite"/>
        </interface>"#;
        let (methods, read_only) = shape(xml);
        assert_eq!(methods["GetPlans"], "");
        assert_eq!(methods["GetEvents"], "sx");
        assert_eq!(methods["Implicit"], "u");
        assert!(read_only.contains("Address"));
        assert!(!read_only.contains("Knob"));
    }
}
