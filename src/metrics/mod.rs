//! Prometheus metrics in the text exposition format (version 0.0.4), the format node_exporter's
//! textfile collector and `promtool check metrics` read.
//!
//! - [`registry`]: the counters and histograms the engine updates at a few narrow points (a task
//!   finished, a hook answered, a pool call failed, the fleet reported), kept for the process's
//!   life as Prometheus expects of counters, and the rendering of everything as one text.
//! - [`state`]: the gauges that come from the store at render time (devices by kind and state,
//!   claims by state): counted from the records, never kept beside them.
//! - [`textfile`]: the file for node_exporter, replaced whole by a rename, and the task that
//!   keeps it fresh.
//!
//! The text is encoded by the `prometheus` crate (not hand-written): its encoder writes the
//! Prometheus text format, whose counter families keep their `_total` name. OpenMetrics text
//! (what `prometheus-client` writes) names a counter's family without the suffix, which the
//! Prometheus text parser of node_exporter and promtool reads as an untyped metric.

pub mod registry;
pub mod state;
pub mod textfile;

pub use registry::Metrics;
pub use state::State;
pub use textfile::{write_atomic, TextfileError};

/// Why the metrics could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot register metric {name}")]
    Register {
        name: &'static str,
        #[source]
        source: prometheus::Error,
    },
    #[error("cannot encode the metrics")]
    Encode(#[source] prometheus::Error),
}
