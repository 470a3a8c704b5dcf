//! Claims through the engine: the store decides and records them atomically (see
//! [`crate::claims`]); the engine runs that off the async threads and publishes each change in
//! the order it was committed.

use super::{EngineError, EngineEvent};
use crate::claims::{Owner, Requirements};
use crate::model::pci::PciAddress;
use crate::store::{ClaimRecord, StoreError};
use std::sync::Arc;

impl super::Engine {
    /// Claims the best matching device for `owner` (recorded durably before this returns).
    pub async fn claim(
        &self,
        req: Requirements,
        owner: Owner,
        requested_by: &str,
    ) -> Result<ClaimRecord, ClaimError> {
        let by = requested_by.to_string();
        self.committed(move |core| core.store().claim(&req, &owner, &by))
            .await
    }

    /// Releases claim `id`; its functions return to the pool.
    pub async fn release_claim(
        &self,
        id: i64,
        by: &str,
        why: &str,
    ) -> Result<ClaimRecord, ClaimError> {
        let (by, why) = (by.to_string(), why.to_string());
        self.committed(move |core| core.store().release_claim(id, &by, &why))
            .await
    }

    /// Releases the claims whose lease ran out before an attach (each recorded as an event).
    pub async fn expire_leases(&self) -> Result<Vec<ClaimRecord>, ClaimError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let released = self
            .committed_all(move |core| core.store().release_lapsed_claims(now))
            .await?;
        for c in &released {
            tracing::info!(claim_id = c.id, device = %c.address, vm = c.vm(), "claim's lease ran out: released");
        }
        Ok(released)
    }

    /// libvirt says a domain was undefined: its claims go, but for persistent ones (kept, and
    /// reported).
    pub async fn domain_undefined(
        &self,
        name: &str,
        uuid: &str,
    ) -> Result<Vec<ClaimRecord>, ClaimError> {
        let (name, uuid) = (name.to_string(), uuid.to_string());
        let released = self
            .committed_all(move |core| core.store().domain_undefined(&name, &uuid))
            .await?;
        for c in &released {
            tracing::info!(claim_id = c.id, device = %c.address, vm = c.vm(), "domain undefined: claim released");
        }
        Ok(released)
    }

    /// The claimable devices that match `req`, best first.
    pub async fn find_devices(&self, req: Requirements) -> Result<Vec<PciAddress>, ClaimError> {
        let snapshot = self
            .read(|core| core.store().claim_snapshot())
            .await
            .map_err(ClaimError::Engine)??;
        Ok(crate::claims::candidates(&snapshot, &req))
    }

    /// Runs a claim change on the blocking pool and sends its event before anyone else can send
    /// a later one: the bus sees claims in commit order.
    async fn committed<F>(&self, change: F) -> Result<ClaimRecord, ClaimError>
    where
        F: FnOnce(&super::Core) -> Result<ClaimRecord, StoreError> + Send + 'static,
    {
        let mut one = self
            .committed_all(move |core| change(core).map(|c| vec![c]))
            .await?;
        Ok(one.remove(0))
    }

    /// [`Self::committed`] for a change of several claims.
    async fn committed_all<F>(&self, change: F) -> Result<Vec<ClaimRecord>, ClaimError>
    where
        F: FnOnce(&super::Core) -> Result<Vec<ClaimRecord>, StoreError> + Send + 'static,
    {
        let (publishing, events) = (Arc::clone(&self.publishing), self.events.clone());
        let claims = self
            .read(move |core| {
                let _publishing = publishing.lock().unwrap_or_else(|p| p.into_inner());
                let claims = change(core)?;
                for c in &claims {
                    let _ = events.send(EngineEvent::Claim(c.clone()));
                }
                Ok::<_, StoreError>(claims)
            })
            .await
            .map_err(ClaimError::Engine)??;
        Ok(claims)
    }
}

/// Errors of claim requests.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Engine(EngineError),
}
