//! `org.vfiod.Vfiod1.Manager` on the root object: what the daemon is and counts, lookups, the
//! event history, and the (authorized) reload and rescan calls.

use super::auth::{Authorizer, ACTION_MANAGE};
use super::error::Error;
use super::{device_path, DbusPublisher};
use crate::engine::Service;
use crate::model::pci::PciAddress;
use std::sync::Arc;
use zbus::message::Header;
use zbus::{interface, Connection, OwnedObjectPath};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Manager";

pub struct Manager {
    pub service: Arc<Service<DbusPublisher>>,
    pub authorizer: Authorizer,
    pub simulated: bool,
}

fn check_limit(limit: u32) -> Result<(), Error> {
    if limit == 0 || limit > 10_000 {
        return Err(Error::InvalidArgument(format!(
            "limit must be 1..=10000, got {limit}"
        )));
    }
    Ok(())
}

fn parse_address(s: &str) -> Result<PciAddress, Error> {
    s.parse()
        .map_err(|e: crate::model::pci::AddressError| Error::InvalidArgument(e.to_string()))
}

#[interface(name = "org.vfiod.Vfiod1.Manager")]
impl Manager {
    #[zbus(property(emits_changed_signal = "const"))]
    fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").into()
    }

    /// "public" or "private": the cloud scenario the mode policy follows.
    #[zbus(property)]
    fn scenario(&self) -> String {
        self.service.engine.settings().scenario.as_str().into()
    }

    /// True when running on the simulated kernel (`vfiod --simulate`).
    #[zbus(property(emits_changed_signal = "const"))]
    fn simulated(&self) -> bool {
        self.simulated
    }

    #[zbus(property)]
    fn device_count(&self) -> zbus::fdo::Result<u32> {
        Ok(self.counts()?.total)
    }

    #[zbus(property)]
    fn usable_count(&self) -> zbus::fdo::Result<u32> {
        Ok(self.counts()?.usable)
    }

    #[zbus(property)]
    fn protected_count(&self) -> zbus::fdo::Result<u32> {
        Ok(self.counts()?.protected)
    }

    #[zbus(property)]
    fn broken_count(&self) -> zbus::fdo::Result<u32> {
        Ok(self.counts()?.broken)
    }

    /// Config files in effect, in the order they were read.
    #[zbus(property)]
    fn config_sources(&self) -> Vec<String> {
        self.service
            .engine
            .settings()
            .sources
            .iter()
            .map(|p| p.display().to_string())
            .collect()
    }

    /// The object path of the device at `address` (`DDDD:BB:SS.F`).
    async fn get_device(&self, address: &str) -> Result<OwnedObjectPath, Error> {
        let a = parse_address(address)?;
        match self.service.engine.store().device(a)? {
            Some(_) => Ok(device_path(a)),
            None => Err(Error::NoSuchDevice(format!(
                "no PCI function {a} on this host"
            ))),
        }
    }

    /// Inventory history, oldest first: (id, time in ms since the epoch, address or "", kind,
    /// message). `address` "" means every device; `after_id` pages.
    async fn get_events(
        &self,
        address: &str,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<super::wire::EventRow>, Error> {
        let a = if address.is_empty() {
            None
        } else {
            Some(parse_address(address)?)
        };
        check_limit(limit)?;
        let events = self
            .service
            .engine
            .store()
            .events(a, after_id, limit as usize)?;
        Ok(events
            .into_iter()
            .map(|e| {
                (
                    e.id,
                    e.time_ms,
                    e.address.map(|a| a.to_string()).unwrap_or_default(),
                    e.kind,
                    e.message,
                )
            })
            .collect())
    }

    /// The policy's plan for one device, as a dry run: (decision, reason, program, steps as
    /// shell-like lines, plan as JSON). Nothing is written.
    async fn get_plan(&self, address: &str) -> Result<super::wire::Plan, Error> {
        let a = parse_address(address)?;
        let engine = Arc::clone(&self.service.engine);
        let p = tokio::task::spawn_blocking(move || {
            crate::modes::planner::plan_device(
                engine.sysfs(),
                engine.store(),
                &engine.settings(),
                a,
            )
        })
        .await
        .map_err(|e| Error::Failed(e.to_string()))??;
        Ok(plan_tuple(&p))
    }

    /// Plans for every selected device: (address, decision, reason, program, steps, JSON).
    async fn get_plans(&self) -> Result<Vec<super::wire::PlanRow>, Error> {
        let engine = Arc::clone(&self.service.engine);
        let plans = tokio::task::spawn_blocking(move || {
            crate::modes::planner::plan_all(engine.sysfs(), engine.store(), &engine.settings())
        })
        .await
        .map_err(|e| Error::Failed(e.to_string()))??;
        Ok(plans
            .iter()
            .map(|p| {
                let (d, r, prog, steps, json) = plan_tuple(p);
                (p.address.to_string(), d, r, prog, steps, json)
            })
            .collect())
    }

    /// Task history, newest first: (id, kind, address, state, step, percent, result, created
    /// ms, finished ms or 0, requested by). `address` "" means every device.
    async fn get_tasks(
        &self,
        address: &str,
        limit: u32,
    ) -> Result<Vec<super::wire::TaskRow>, Error> {
        let a = if address.is_empty() {
            None
        } else {
            Some(parse_address(address)?)
        };
        check_limit(limit)?;
        let tasks = self.service.engine.store().tasks(a, limit as usize)?;
        Ok(tasks
            .into_iter()
            .map(|t| {
                (
                    t.id,
                    t.kind,
                    t.address.to_string(),
                    t.state.as_str().to_string(),
                    t.step,
                    t.percent,
                    t.message,
                    t.created_ms,
                    t.finished_ms.unwrap_or(0),
                    t.requested_by,
                )
            })
            .collect())
    }

    /// Re-reads the configuration (as SIGHUP does) and runs an inventory pass. A bad file is
    /// refused with InvalidConfig and the running settings are kept.
    async fn reload(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        self.authorizer.check(conn, &header, ACTION_MANAGE).await?;
        self.service.reload().await?;
        // New settings may select or re-target devices: start their tasks (not awaited; they
        // report through their task objects).
        self.service.reconcile("reload (D-Bus)").await;
        Ok(())
    }

    /// Runs an inventory pass now instead of waiting for the next uevent or poll.
    async fn rescan(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        self.authorizer.check(conn, &header, ACTION_MANAGE).await?;
        self.service.refresh().await?;
        Ok(())
    }
}

fn plan_tuple(p: &crate::modes::planner::DevicePlan) -> super::wire::Plan {
    let decision = match &p.decision {
        crate::modes::policy::Decision::Leave { .. } => "leave",
        crate::modes::policy::Decision::Target { .. } => "target",
        crate::modes::policy::Decision::Refuse { .. } => "refuse",
    };
    let program = serde_json::to_value(&p.program)
        .ok()
        .and_then(|v| {
            v.get("program")
                .and_then(|x| x.as_str())
                .map(str::to_string)
        })
        .unwrap_or_default();
    let steps = p
        .plan
        .as_ref()
        .map(|pl| pl.steps.iter().map(|s| s.to_string()).collect())
        .unwrap_or_default();
    let json = serde_json::to_string(p).unwrap_or_default();
    (
        decision.into(),
        p.decision.reason().to_string(),
        program,
        steps,
        json,
    )
}

impl Manager {
    fn counts(&self) -> zbus::fdo::Result<crate::store::Counts> {
        self.service
            .engine
            .counts()
            .map_err(|e| zbus::fdo::Error::Failed(crate::error_chain(&e)))
    }
}
