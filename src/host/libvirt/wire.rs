//! What the daemon and its libvirt helper (`vfiod-libvirt`, [`super::serve`]) say to each other:
//! one JSON object per line, requests on the helper's standard input, answers and libvirt's
//! events on its standard output. Both ends are this crate, built together, so the shapes are
//! these types and nothing else; a line that does not parse is a bug of one end, logged and
//! dropped by the other.

use super::{Affect, Definition, DomainDefinitions, DomainDevices, DomainInfo, LibvirtError};
use super::{LibvirtEvent, Migration};
use serde::{Deserialize, Serialize};

/// A request to the helper.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Request {
    /// Echoed in the answer.
    pub id: u64,
    /// How long the caller waits, in ms (`None`: until it is done, a migration): a request
    /// still queued past it is not run.
    pub wait_ms: Option<u64>,
    pub call: Call,
}

/// What a request asks: the calls of [`super::Libvirt`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Call {
    RunningDomains,
    DomainXml {
        domain: String,
        which: Definition,
    },
    Lookup {
        domain: String,
    },
    AllDomains,
    SetMetadata {
        domain: String,
        xml: Option<String>,
        affect: Affect,
    },
    AttachDevice {
        domain: String,
        xml: String,
        affect: Affect,
    },
    DetachDevice {
        domain: String,
        xml: String,
        affect: Affect,
    },
    /// On connections of the helper's own, from `source`: the worker keeps answering meanwhile.
    Migrate {
        source: String,
        domain: String,
        migration: Migration,
    },
    /// Not answered: the worker moves to another URI (`None`: none).
    SetUri(Option<String>),
}

/// What an answer carries, by call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Value {
    Unit,
    Xml(String),
    Info(DomainInfo),
    Running(Vec<DomainDevices>),
    All(Vec<DomainDefinitions>),
}

/// A line from the helper.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Line {
    Answer {
        id: u64,
        result: Result<Value, LibvirtError>,
    },
    Event(LibvirtEvent),
}
