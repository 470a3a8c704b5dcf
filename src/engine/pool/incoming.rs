//! The destination's `migrate begin` hook, for the pooled sessions the domain's metadata
//! carries: each is prepare-moved to this host (and quiesced with `quiesce_at = "begin"`) and
//! recorded before the hook answers.

use super::PooledError;
use crate::engine::Engine;
use crate::host::libvirt::xml::MetadataPooled;
use crate::model::pool::PooledState;
use crate::store::NewPooled;
use std::sync::Arc;

impl Engine {
    /// The destination's `migrate begin` hook, for the pooled sessions the domain's metadata
    /// carries: prepare-move each to this host (and quiesce with `quiesce_at = "begin"`), and
    /// record it `moving` (or `quiesced`). `Err` is the hook's one line; what was recorded
    /// before the failure is forgotten again.
    pub(in crate::engine) async fn hook_migrate_pooled(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
        sessions: &[MetadataPooled],
    ) -> Result<Vec<i64>, String> {
        let here = self
            .store_op(|s| s.pooled_claims(false))
            .await
            .map_err(|e| format!("vfiod: {}", crate::error_chain(&e)))?;
        let settings = self.settings();
        let plan = crate::pool::migrate_begin(
            name,
            sessions,
            |p| settings.pool(p).map(|p| p.quiesce_at),
            &here,
        )?;
        let host = settings.host_name.clone();
        let mut made: Vec<i64> = Vec::new();
        let fail = |made: Vec<i64>, line: String| async move {
            for id in made {
                let _ = self
                    .step(
                        id,
                        PooledState::Forgotten,
                        None,
                        "the migration was refused".into(),
                        "forgotten: the migration was refused".into(),
                    )
                    .await;
            }
            line
        };
        for incoming in plan {
            if incoming.existing.is_some() {
                continue;
            }
            let mut s = incoming.session;
            if let Err(e) = self.move_here(&mut s, &host).await {
                return Err(fail(
                    made,
                    format!(
                        "vfiod: domain {name} cannot come here: {}",
                        crate::error_chain(&e)
                    ),
                )
                .await);
            }
            let mut state = PooledState::Moving;
            let mut what = format!(
                "incoming migration of {name} from {}: the pool accepted to move the session to {host} (prepare-move at epoch {})",
                if s.host.is_empty() { "?" } else { &s.host },
                s.epoch
            );
            if incoming.quiesce {
                match self
                    .pool_call(
                        &s.pool,
                        &format!("cannot quiesce session {}", s.session),
                        async |c| c.quiesce(&s.session, s.epoch).await,
                    )
                    .await
                {
                    Ok(q) => {
                        state = PooledState::Quiesced;
                        what.push_str(&format!(
                            "; quiesced at migrate begin (quiesce_at = \"begin\", {} in flight)",
                            q.in_flight
                        ));
                    }
                    Err(e) => {
                        return Err(fail(
                            made,
                            format!(
                                "vfiod: domain {name} cannot come here: {}",
                                crate::error_chain(&e)
                            ),
                        )
                        .await)
                    }
                }
            }
            let new = NewPooled {
                pool: s.pool.clone(),
                session: s.session.clone(),
                device: s.device.clone(),
                epoch: s.epoch,
                state,
                vm_name: Some(name.to_string()),
                vm_uuid: uuid.map(str::to_string),
                peer_host: Some(s.host.clone()).filter(|h| !h.is_empty()),
                requested_by: crate::hook::BY_INCOMING.to_string(),
            };
            match self
                .committed_pooled(move |st| st.insert_pooled(&new, &what))
                .await
            {
                Ok(c) => made.push(c.id),
                Err(e) => {
                    return Err(fail(
                        made,
                        format!("vfiod: domain {name}: {}", crate::error_chain(&e)),
                    )
                    .await)
                }
            }
        }
        Ok(made)
    }

    /// Prepare-moves session `s` to `host`. After a stale epoch, once more at the pool's epoch
    /// when the pool still gives the session to the host the metadata names
    /// ([`crate::pool::ask_owner_after_move`], [`crate::pool::owned_by`]); `s` then carries
    /// that epoch. The error is the last refusal.
    async fn move_here(&self, s: &mut MetadataPooled, host: &str) -> Result<(), PooledError> {
        let e = match self.prepare_move(s, host).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let Some(current) = crate::pool::ask_owner_after_move(s, e.refusal()) else {
            return Err(e);
        };
        let found = self
            .pool_call(&s.pool, "cannot read the session", async |c| {
                c.session(&s.session).await
            })
            .await
            .ok();
        if !crate::pool::owned_by(s, current, found.as_ref()) {
            return Err(e);
        }
        s.epoch = current;
        self.prepare_move(s, host).await.map(drop)
    }

    async fn prepare_move(
        &self,
        s: &MetadataPooled,
        host: &str,
    ) -> Result<crate::pool::client::Session, PooledError> {
        self.pool_call(
            &s.pool,
            &format!("refused to move session {} here", s.session),
            async |c| c.prepare_move(&s.session, s.epoch, host).await,
        )
        .await
    }
}
