//! Two checks zbus's generated interfaces leave out, for every vfiod object: a method call must
//! carry exactly the arguments the method declares (zbus ignores extra arguments, so
//! `GetPlans("x")` was accepted), and setting a read-only property says it is read-only (zbus says
//! "Unknown property", which sends a client looking for a typo).
//!
//! [`Strict`] wraps a generated interface and forwards everything else to it. It learns each
//! method's argument signature and each property's access from the interface's own
//! introspection, so it cannot drift from the code. Signatures are compared parsed, not as
//! text: on the wire several arguments are written without parentheses, zbus shows them as one
//! structure, and a lone structure argument shows the same. zbus calls the `Interface` trait "unstable":
//! this file is the one place to adapt when zbus changes it (Cargo.lock pins the version).

use std::any::TypeId;
use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use zbus::message::{Header, Message};
use zbus::names::{InterfaceName, MemberName};
use zbus::object_server::{DispatchResult, Interface, SignalEmitter};
use zbus::{fdo, BoxDBusError, Connection, ObjectServer, OwnedVariant, Signature, Variant};

/// A generated interface with strict arguments and read-only errors.
pub struct Strict<I> {
    pub inner: I,
    shape: Arc<Shape>,
}

/// A method's in-arguments: as introspection writes them (for messages) and parsed (to compare
/// with a call's body, whose signature zbus gives parsed).
#[derive(Clone, Debug, PartialEq)]
struct InArgs {
    text: String,
    parsed: Signature,
}

impl<I: Interface> Strict<I> {
    pub fn new(inner: I) -> Strict<I> {
        // Introspection describes the interface, not the object: its shape is learnt once per
        // interface type, not for every object (a claim object is made for every claim).
        static SHAPES: OnceLock<Mutex<HashMap<TypeId, Arc<Shape>>>> = OnceLock::new();
        let shapes = SHAPES.get_or_init(Mutex::default);
        let known = shapes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&TypeId::of::<I>())
            .cloned();
        let shape = known.unwrap_or_else(|| {
            let mut xml = String::new();
            inner.introspect_to_writer(&mut xml, 0);
            let shape = Arc::new(shape(&xml));
            shapes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(TypeId::of::<I>(), Arc::clone(&shape));
            shape
        });
        Strict { inner, shape }
    }
}

impl<I> std::ops::Deref for Strict<I> {
    type Target = I;
    fn deref(&self) -> &I {
        &self.inner
    }
}

/// Introspection XML without its comments. zbus writes each doc comment as an XML comment, and
/// a doc comment may hold "--" (`vfiod --simulate`), which XML forbids there: the parser would
/// refuse the whole interface, and the wrapper would check nothing on it.
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

/// What an interface declares, from its introspection XML.
#[derive(Default)]
struct Shape {
    /// Methods with their in-signatures.
    methods: HashMap<String, InArgs>,
    read_only: HashSet<String>,
    /// Every property, for a GetAll that answers all of them or fails.
    properties: Vec<String>,
}

fn shape(xml: &str) -> Shape {
    let mut out = Shape::default();
    let xml = without_comments(xml);
    let doc = match roxmltree::Document::parse(&xml) {
        Ok(doc) => doc,
        Err(e) => {
            tracing::error!("cannot parse an interface's own introspection: {e}");
            return out;
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
                let Some(name) = node.attribute("name") else {
                    continue;
                };
                match Signature::try_from(signature.as_str()) {
                    Ok(parsed) => {
                        out.methods.insert(
                            name.to_string(),
                            InArgs {
                                text: signature,
                                parsed,
                            },
                        );
                    }
                    Err(e) => {
                        tracing::error!("method {name} has an invalid signature {signature:?}: {e}")
                    }
                }
            }
            "property" => {
                if let Some(name) = node.attribute("name") {
                    if node.attribute("access") == Some("read") {
                        out.read_only.insert(name.to_string());
                    }
                    out.properties.push(name.to_string());
                }
            }
            _ => {}
        }
    }
    out
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
        let all = self
            .inner
            .get_all(server, connection, header, emitter)
            .await?;
        // zbus leaves out a property whose getter fails, so an object whose device went away
        // during the read would answer with half its properties. The caller gets the getter's
        // error instead (UnknownObject for a gone device).
        if let Some(missing) = self.shape.properties.iter().find(|p| !all.contains_key(*p)) {
            let error = match self
                .inner
                .get(missing, server, connection, header, emitter)
                .await
            {
                Some(Err(e)) => {
                    let text = e.description().unwrap_or_default().to_string();
                    if e.name().as_str() == "org.freedesktop.DBus.Error.UnknownObject" {
                        fdo::Error::UnknownObject(text)
                    } else {
                        fdo::Error::Failed(text)
                    }
                }
                _ => fdo::Error::Failed(format!("property {missing} could not be read")),
            };
            return Err(error);
        }
        Ok(all)
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
        if self.shape.read_only.contains(property_name) {
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
        if let Some(expected) = self.shape.methods.get(name.as_str()) {
            let body = msg.body();
            let got = body.signature();
            if *got != expected.parsed {
                let wants = if expected.text.is_empty() {
                    "no arguments".to_string()
                } else {
                    format!("arguments of signature \"{}\"", expected.text)
                };
                let sent = match got.to_string_no_parens() {
                    none if none.is_empty() => "none".to_string(),
                    some => format!("\"{some}\""),
                };
                return refuse(fdo::Error::InvalidArgs(format!(
                    "{}.{name} takes {wants}, not {sent}",
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
        let Shape {
            methods, read_only, ..
        } = shape(xml);
        assert_eq!(methods["GetPlans"].text, "");
        assert_eq!(methods["GetPlans"].parsed, Signature::Unit);
        assert_eq!(methods["GetEvents"].text, "sx");
        assert_eq!(methods["Implicit"].text, "u");
        assert!(read_only.contains("Address"));
        assert!(!read_only.contains("Knob"));
    }

    #[test]
    fn doc_comments_with_double_dashes_do_not_hide_the_interface() {
        // What zbus writes for a doc comment that names a command-line option.
        let xml = r#"<interface name="org.x.Y">
          <!--
           True when running on the simulated kernel (`vfiod --simulate`).
           -->
          <property name="Simulated" type="b" access="read"/>
          <!-- -- <method name="Hidden"/> -->
          <method name="Reload"></method>
        </interface>"#;
        let Shape {
            methods, read_only, ..
        } = shape(xml);
        assert!(read_only.contains("Simulated"));
        assert_eq!(methods.keys().collect::<Vec<_>>(), vec!["Reload"]);
        assert_eq!(without_comments("a<!-- b -->c<!-- d"), "ac");
    }

    #[test]
    fn signatures_compare_parsed_not_as_text() {
        let Shape { methods, .. } = shape(
            r#"<interface name="org.x.Y">
              <method name="Pair"><arg name="p" type="(ss)" direction="in"/></method>
              <method name="PairThen">
                <arg name="p" type="(ss)" direction="in"/><arg name="n" type="u" direction="in"/>
              </method>
              <method name="Two">
                <arg name="a" type="s" direction="in"/><arg name="b" type="s" direction="in"/>
              </method>
            </interface>"#,
        );
        // A call's body signature as zbus parses it from the wire.
        let body = |wire: &str| Signature::try_from(wire).unwrap();
        assert_eq!(methods["Pair"].parsed, body("(ss)"));
        assert_eq!(methods["PairThen"].parsed, body("(ss)u"));
        assert_ne!(methods["PairThen"].parsed, body("ssu"));
        assert_eq!(methods["Two"].parsed, body("ss"));
        assert_ne!(methods["Two"].parsed, body("s"));
    }
}
