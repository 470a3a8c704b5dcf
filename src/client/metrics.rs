//! `vfioctl metrics`: the daemon's Prometheus metrics (`Manager.GetMetrics`), printed as the
//! daemon renders them, so that a pipe into `promtool check metrics` or a file for
//! node_exporter gets exactly the exposition text.

use super::ClientError;
use zbus::Connection;

/// The metrics as text, ending in a line break as the format requires.
pub async fn text(conn: &Connection) -> Result<String, ClientError> {
    let mut text = super::manager(conn).await?.get_metrics().await?;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    Ok(text)
}
