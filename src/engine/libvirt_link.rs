//! What vfiod last learned of its libvirt connection, for `Manager.Libvirt` and `vfioctl
//! status`: an operator alerts on "disconnected", and a client (a test) waits for
//! "connected" to know that the claims were reconciled with libvirt's domains.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// The connection to the URI the config names, as the libvirt worker's events told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    /// Connected, and the claims were reconciled with libvirt's domains since.
    Connected,
    /// Not connected yet to this URI (just started, or the URI changed on a reload).
    Connecting,
    /// Lost; the worker reconnects in the background.
    Disconnected { reason: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub uri: String,
    pub state: LinkState,
    /// When the state was entered (Unix milliseconds).
    pub since_ms: u64,
}

impl Link {
    /// One word for scripts: "connected", "connecting", "disconnected".
    pub fn word(&self) -> &'static str {
        match self.state {
            LinkState::Connected => "connected",
            LinkState::Connecting => "connecting",
            LinkState::Disconnected { .. } => "disconnected",
        }
    }
}

/// The last state per URI; a state recorded for another URI than the configured one is stale.
#[derive(Debug, Default)]
pub struct LinkRecord(Mutex<Option<Link>>);

impl LinkRecord {
    pub fn set(&self, uri: &str, state: LinkState) {
        let link = Link {
            uri: uri.to_string(),
            state,
            since_ms: now_ms(),
        };
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(link);
    }

    /// The state of `configured` (None: no libvirt URI configured, nothing to connect to).
    pub fn get(&self, configured: Option<&str>) -> Option<Link> {
        let configured = configured?;
        let last = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Some(current(last, configured))
    }
}

/// The recorded link if it is of the configured URI, else "connecting" to it.
fn current(last: Option<Link>, configured: &str) -> Link {
    match last {
        Some(l) if l.uri == configured => l,
        _ => Link {
            uri: configured.to_string(),
            state: LinkState::Connecting,
            since_ms: 0,
        },
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_counts_only_for_the_uri_it_was_recorded_for() {
        let up = |uri: &str| Link {
            uri: uri.into(),
            state: LinkState::Connected,
            since_ms: 5,
        };
        let cases: [(Option<Link>, &str, &str); 4] = [
            (None, "qemu:///system", "connecting"),
            (Some(up("qemu:///system")), "qemu:///system", "connected"),
            (Some(up("test:///default")), "qemu:///system", "connecting"),
            (
                Some(Link {
                    uri: "qemu:///system".into(),
                    state: LinkState::Disconnected {
                        reason: "eof".into(),
                    },
                    since_ms: 7,
                }),
                "qemu:///system",
                "disconnected",
            ),
        ];
        for (last, configured, word) in cases {
            let got = current(last.clone(), configured);
            assert_eq!(got.word(), word, "{last:?} with {configured}");
            assert_eq!(got.uri, configured);
        }
        assert_eq!(LinkRecord::default().get(None), None, "no URI: no link");
    }
}
