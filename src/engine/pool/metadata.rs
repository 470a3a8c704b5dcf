//! A domain's pooled sessions, written in its `<metadata>` so that they travel with it (and
//! with a migration: the destination's `migrate begin` reads them).

use crate::engine::Engine;
use crate::host::libvirt::{self, Affect, Definition, LibvirtError};
use crate::model::pool::PooledClaim;
use std::sync::Arc;

impl Engine {
    /// Writes the domain's pooled sessions in its `<metadata>` (keeping the devices vfiod
    /// recorded there), through the libvirt worker, off the async threads. Not a hook's work
    /// (a hook must never call libvirt). A domain libvirt does not have (yet), or no libvirt,
    /// is an event, not an error: the claim stands in the store.
    pub(super) async fn write_pooled_metadata(self: &Arc<Self>, claim: &PooledClaim) {
        let domain = claim
            .vm_uuid
            .clone()
            .or(claim.vm_name.clone())
            .unwrap_or_default();
        // No libvirt on this host (`libvirt_uri = ""`): no domain to write into.
        if domain.is_empty() || self.settings().libvirt_uri.is_none() {
            return;
        }
        let (name, uuid) = (
            claim.vm_name.clone().unwrap_or_default(),
            claim.vm_uuid.clone(),
        );
        let host = self.settings().host_name.clone();
        let written = self
            .read(move |core| -> Result<(), String> {
                let claims = core
                    .store()
                    .pooled_of_domain(&name, uuid.as_deref())
                    .map_err(|e| crate::error_chain(&e))?;
                let lv = core.libvirt();
                let message = |e: LibvirtError| crate::error_chain(&e);
                let info = lv.lookup(&domain).map_err(message)?;
                let which = if info.active {
                    Definition::Live
                } else {
                    Definition::Persistent
                };
                let xml = lv.domain_xml(&info.name, which).map_err(message)?;
                let devices = libvirt::xml::parse_domain(&xml)?.metadata;
                let pooled = crate::pool::metadata_of(&claims, &host);
                let affect = match (info.active, info.persistent) {
                    (true, true) => Affect::Both,
                    (true, false) => Affect::Live,
                    _ => Affect::Persistent,
                };
                let element = (!devices.is_empty() || !pooled.is_empty())
                    .then(|| libvirt::xml::metadata_xml_with(&devices, &pooled));
                lv.set_metadata(&info.name, element.as_deref(), affect)
                    .map_err(message)
            })
            .await;
        let failed = match written {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(e) => crate::error_chain(&e),
        };
        self.note(claim, format!("domain metadata not written: {failed}"))
            .await;
    }
}
