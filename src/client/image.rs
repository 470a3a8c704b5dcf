//! The client side of the FPGA image catalog (`org.vfiod.Vfiod1.Images`) and of programming:
//! `vfioctl image ...` and `vfioctl fpga ...`.

use super::ClientError;
use crate::dbus::wire::{Dict, Entry};
use serde::{Deserialize, Serialize};
use zbus::Connection;

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Images",
    default_service = "org.vfiod.Vfiod1",
    default_path = "/org/vfiod/Vfiod1"
)]
pub trait Images {
    fn add(
        &self,
        name: &str,
        image: zbus::Fd<'_>,
        sha256: &str,
        options: Dict,
    ) -> zbus::Result<Dict>;
    fn add_from_path(
        &self,
        name: &str,
        path: &str,
        sha256: &str,
        options: Dict,
    ) -> zbus::Result<Dict>;
    fn add_from_url(
        &self,
        name: &str,
        url: &str,
        sha256: &str,
        options: Dict,
    ) -> zbus::Result<Dict>;
    fn downloads(&self) -> zbus::Result<Vec<Dict>>;
    fn cancel_download(&self, name: &str) -> zbus::Result<()>;
    fn list(&self) -> zbus::Result<Vec<Dict>>;
    fn get(&self, name: &str) -> zbus::Result<Dict>;
    fn deactivate(&self, name: &str) -> zbus::Result<()>;
    fn activate(&self, name: &str) -> zbus::Result<()>;
    fn remove(&self, name: &str) -> zbus::Result<()>;
}

pub async fn images(conn: &Connection) -> Result<ImagesProxy<'static>, ClientError> {
    Ok(ImagesProxy::builder(conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await?)
}

/// One catalog entry (`vfioctl image list --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageEntry {
    pub id: i64,
    pub name: String,
    pub format: String,
    pub sha256: String,
    pub size: u64,
    pub path: String,
    pub interface_id: String,
    pub afu_ids: Vec<String>,
    pub metadata: serde_json::Value,
    pub state: String,
    pub added_by: String,
    pub added_ms: i64,
    /// Where it was downloaded from ("" for an image passed by descriptor or path).
    #[serde(default)]
    pub source_url: String,
}

impl ImageEntry {
    pub fn from_dict(d: &Dict) -> ImageEntry {
        let e = Entry(d);
        ImageEntry {
            id: e.i64("id"),
            name: e.str("name"),
            format: e.str("format"),
            sha256: e.str("sha256"),
            size: d
                .get("size")
                .and_then(|v| u64::try_from(v).ok())
                .unwrap_or(0),
            path: e.str("path"),
            interface_id: e.str("interface_id"),
            afu_ids: e.strings("afu_ids"),
            metadata: serde_json::from_str(&e.str("metadata")).unwrap_or_default(),
            state: e.str("state"),
            added_by: e.str("added_by"),
            added_ms: e.i64("added"),
            source_url: e.str("source_url"),
        }
    }
}

/// `vfioctl image list`.
pub fn render_table(images: &[ImageEntry]) -> String {
    let rows = images.iter().map(|i| {
        vec![
            i.id.to_string(),
            i.name.clone(),
            i.format.clone(),
            i.state.clone(),
            i.size.to_string(),
            if i.interface_id.is_empty() {
                "-".into()
            } else {
                i.interface_id.clone()
            },
            i.sha256[..i.sha256.len().min(16)].to_string(),
        ]
    });
    super::table::render(
        &[
            "ID",
            "NAME",
            "FORMAT",
            "STATE",
            "SIZE",
            "INTERFACE",
            "SHA256",
        ],
        rows,
    )
}

/// `vfioctl image show`.
pub fn render_details(i: &ImageEntry) -> String {
    let mut out = String::new();
    let mut line = |k: &str, v: &str| out.push_str(&format!("{k:<13} {v}\n"));
    line("name:", &i.name);
    line("id:", &i.id.to_string());
    line("format:", &i.format);
    line("state:", &i.state);
    line("size:", &i.size.to_string());
    line("sha256:", &i.sha256);
    line(
        "interface id:",
        if i.interface_id.is_empty() {
            "-"
        } else {
            &i.interface_id
        },
    );
    line("afu ids:", &i.afu_ids.join(", "));
    line("path:", &i.path);
    if !i.source_url.is_empty() {
        line("source:", &i.source_url);
    }
    line("added by:", &i.added_by);
    line("metadata:", &i.metadata.to_string());
    out
}
