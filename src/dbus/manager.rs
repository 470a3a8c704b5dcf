//! `org.vfiod.Vfiod1.Manager` on the root object: what the daemon is and counts, lookups, the
//! event and task history, plans, claims, and the (authorized) reload and rescan calls.
//!
//! List replies are arrays of `a{sv}` dictionaries (see [`super::wire`]): a new field is a new
//! key, never a new signature. Queries are `a{sv}` too; an unknown key is an error naming it.

use super::auth::{Check, Detail, ACTION_CLAIM, ACTION_CONFIGURE, ACTION_MIGRATE};
use super::error::Error;
use super::wire::{self, Dict, Query};
use super::{device_path, Objects};
use crate::model::event::EventKind;
use crate::model::pci::PciAddress;
use crate::store::{EventFilter, Page};
use zbus::message::Header;
use zbus::object_server::SignalEmitter;
use zbus::{interface, Connection, OwnedObjectPath};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Manager";

/// The most entries one list reply carries.
pub const MAX_LIMIT: u32 = 10_000;

pub struct Manager {
    pub objects: Objects,
    pub simulated: bool,
}

fn parse_address(s: &str) -> Result<PciAddress, Error> {
    s.parse()
        .map_err(|e: crate::model::pci::AddressError| Error::InvalidArgument(e.to_string()))
}

fn limit(query: &Query, default: u32) -> Result<u32, Error> {
    let limit = query.u32("limit")?.unwrap_or(default);
    if limit == 0 || limit > MAX_LIMIT {
        return Err(Error::InvalidArgument(format!(
            "limit must be 1..={MAX_LIMIT}, got {limit}"
        )));
    }
    Ok(limit)
}

/// `PreviewPlans` computed at once, daemon-wide.
const MAX_PREVIEWS: usize = 2;
static PREVIEWS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_PREVIEWS);

/// `PreviewPlans`' files, bounded as [`crate::config`] bounds what it reads, and validated.
fn preview_settings(files: Vec<(String, String)>) -> Result<crate::config::Settings, Error> {
    use crate::config::{MAX_DROPINS, MAX_FILE_BYTES, MAX_PATH_BYTES, MAX_TOTAL_BYTES};
    if files.len() > MAX_DROPINS + 1 {
        return Err(Error::InvalidArgument(format!(
            "{} files: a configuration has at most {} (the main file and {MAX_DROPINS} drop-ins)",
            files.len(),
            MAX_DROPINS + 1
        )));
    }
    let mut total = 0u64;
    for (name, text) in &files {
        if name.len() > MAX_PATH_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a file name is longer than {MAX_PATH_BYTES} bytes"
            )));
        }
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{}: larger than {MAX_FILE_BYTES} bytes",
                super::error::quote(name)
            )));
        }
        total += text.len() as u64;
    }
    if total > MAX_TOTAL_BYTES {
        return Err(Error::InvalidArgument(format!(
            "the files together are larger than {MAX_TOTAL_BYTES} bytes"
        )));
    }
    crate::config::Settings::from_files(
        files
            .into_iter()
            .map(|(name, text)| (name.into(), text.into_bytes())),
    )
    .map_err(|errors| {
        Error::InvalidConfig(
            errors
                .iter()
                .map(|e| crate::error_chain(e))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    })
}

impl Manager {
    /// The address a query names, checked to be one vfiod knows (present, or with history).
    async fn known_address(&self, query: &Query) -> Result<Option<PciAddress>, Error> {
        let Some(text) = query.str("address")? else {
            return Ok(None);
        };
        let a = parse_address(&text)?;
        let known = self
            .objects
            .engine
            .read(move |core| core.store().knows(a))
            .await??;
        if known {
            Ok(Some(a))
        } else {
            Err(Error::NoSuchDevice(format!(
                "no PCI function {a} on this host, and none in the history"
            )))
        }
    }
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
        self.objects.engine.settings().scenario.as_str().into()
    }

    /// True when running on the simulated kernel (vfiod's simulate option).
    #[zbus(property(emits_changed_signal = "const"))]
    fn simulated(&self) -> bool {
        self.simulated
    }

    #[zbus(property)]
    fn device_count(&self) -> u32 {
        self.objects.view.counts().total
    }

    #[zbus(property)]
    fn usable_count(&self) -> u32 {
        self.objects.view.counts().usable
    }

    #[zbus(property)]
    fn protected_count(&self) -> u32 {
        self.objects.view.counts().protected
    }

    #[zbus(property)]
    fn broken_count(&self) -> u32 {
        self.objects.view.counts().broken
    }

    /// Devices being cleaned after a claim ended (state `cleaning`).
    #[zbus(property)]
    fn cleaning_count(&self) -> u32 {
        self.objects.view.counts().cleaning
    }

    /// The libvirt connection: `uri`, `state` ("connected": and the claims reconciled with
    /// libvirt's domains since; "connecting"; "disconnected", with `reason`), `since_ms`.
    /// Empty when no `libvirt_uri` is configured. Not signalled: read it when needed.
    #[zbus(property(emits_changed_signal = "false"))]
    fn libvirt(&self) -> Dict {
        wire::libvirt_link(self.objects.engine.libvirt_link().as_ref())
    }

    /// The host's IOMMU: "present", or "absent" (no IOMMU group: vfiod binds nothing to
    /// vfio-pci, claims and attaches nothing); "" before the first inventory pass. Not
    /// signalled: read it when needed.
    #[zbus(property(emits_changed_signal = "false"))]
    fn iommu(&self) -> String {
        self.objects
            .engine
            .iommu()
            .map(|i| i.as_str().to_string())
            .unwrap_or_default()
    }

    /// `vfioctl doctor`'s checks of this host in one line ("doctor: all 14 checks ok",
    /// "doctor: 2 warnings, run vfioctl doctor"), as of start-up or the last reload. Not
    /// signalled: read it when needed.
    #[zbus(property(emits_changed_signal = "false"))]
    fn doctor(&self) -> String {
        self.objects.engine.doctor_summary()
    }

    /// The fleet reporter: empty when `[fleet]` is off; else `report_interval_s` u and
    /// `last_report_ms` t (Unix ms of the last report the database took, 0 when none since
    /// vfiod started). Not signalled: read it when needed.
    #[zbus(property(emits_changed_signal = "false"))]
    fn fleet(&self) -> Dict {
        let last = self.objects.engine.metrics().fleet_last_report();
        wire::fleet(&self.objects.engine.settings(), last)
    }

    /// Config files in effect, in the order they were read.
    #[zbus(property)]
    fn config_sources(&self) -> Vec<String> {
        self.objects
            .engine
            .settings()
            .sources
            .iter()
            .map(|p| p.display().to_string())
            .collect()
    }

    /// Every metric in the Prometheus text exposition format (version 0.0.4): the same text
    /// as `[metrics] textfile`, rendered now. A read: no authorization.
    async fn get_metrics(&self) -> Result<String, Error> {
        Ok(self.objects.engine.metrics_text().await?)
    }

    /// The object path of the device at `address` (`DDDD:BB:SS.F`).
    async fn get_device(&self, address: &str) -> Result<OwnedObjectPath, Error> {
        let a = parse_address(address)?;
        match self.objects.view.device(a) {
            Some(_) => Ok(device_path(a)),
            None => Err(Error::NoSuchDevice(format!(
                "no PCI function {a} on this host"
            ))),
        }
    }

    /// Inventory history, oldest first, each entry `{id: x, time: x (Unix ms), address: s
    /// ("" for the daemon), kind: s, message: s}`. Query keys, all optional: `address` s (one
    /// device), `since` x (the entries after this id, oldest first: follow the history),
    /// `before` x (the newest entries before this id: page back), `limit` u (1..=10000, default
    /// 100). Without `since`, the newest entries.
    async fn get_events(&self, query: Dict) -> Result<Vec<Dict>, Error> {
        let q = Query::new(query, &["address", "kind", "since", "before", "limit"])?;
        let kind = match q.str("kind")? {
            Some(k) => Some(k.parse::<EventKind>().map_err(Error::InvalidArgument)?),
            None => None,
        };
        let address = self.known_address(&q).await?;
        let limit = limit(&q, 100)? as usize;
        let since = q.i64("since")?;
        let before = q.i64("before")?;
        let page = match (since, before) {
            (Some(_), Some(_)) => {
                return Err(Error::InvalidArgument(
                    "give since or before, not both".into(),
                ))
            }
            (Some(after), None) => Page::After(after),
            (None, before) => Page::Before(before.unwrap_or(i64::MAX)),
        };
        let filter = EventFilter { address, kind };
        let events = self
            .objects
            .engine
            .read(move |core| core.store().select_events(&filter, page, limit))
            .await??;
        Ok(events.iter().map(wire::event).collect())
    }

    /// An event was recorded (committed): the entry as `GetEvents` gives it, in id order, one
    /// signal each. What `vfioctl events` prints when it follows; a watcher that may have missed some
    /// (it subscribed late, the bus dropped some) reads `GetEvents` with `since`.
    #[zbus(signal)]
    pub async fn event(emitter: &SignalEmitter<'_>, entry: Dict) -> zbus::Result<()>;

    /// The policy's plan for one device, as a dry run: `{address, decision, reason, program: s,
    /// steps: as (shell-like lines), plan: s (JSON)}`. Nothing is written.
    async fn get_plan(&self, address: &str) -> Result<Dict, Error> {
        let a = parse_address(address)?;
        let p = self
            .objects
            .engine
            .read(move |core| {
                crate::mode::planner::plan_device(core.sysfs(), core.store(), &core.settings(), a)
            })
            .await??;
        Ok(wire::plan(&p))
    }

    /// Plans for every selected device, each as `GetPlan` gives it.
    async fn get_plans(&self) -> Result<Vec<Dict>, Error> {
        let plans = self
            .objects
            .engine
            .read(|core| {
                crate::mode::planner::plan_all(core.sysfs(), core.store(), &core.settings())
            })
            .await??;
        Ok(plans.iter().map(wire::plan).collect())
    }

    /// The plans of a configuration that is not installed, on this host now, each as
    /// `GetPlans` gives it (what `vfioctl plan` shows with a configuration to preview).
    /// `files`: its files as (name, content), in the order they apply (the main file, then the drop-ins); the caller reads
    /// them, the daemon opens no path a client names. Bounded as the daemon bounds its own
    /// files. A configuration with errors is refused with every one of them, a line each
    /// (`InvalidConfig`). What it protects and selects is its own: the host is read again
    /// under it. Nothing is written. `options`: none yet (an unknown key is an error).
    async fn preview_plans(
        &self,
        files: Vec<(String, String)>,
        options: Dict,
    ) -> Result<Vec<Dict>, Error> {
        Query::new(options, &[])?;
        // Each preview parses up to 4 MiB and reads the whole host: a few at a time, so that
        // a client repeating it cannot keep the blocking threads from everyone else's calls.
        let _permit = PREVIEWS.try_acquire().map_err(|_| {
            Error::Busy(format!(
                "{MAX_PREVIEWS} previews are being computed; try again when one is done"
            ))
        })?;
        let plans = self
            .objects
            .engine
            .read(move |core| -> Result<_, Error> {
                let settings = preview_settings(files)?;
                Ok(crate::mode::planner::plan_preview(
                    core.sysfs(),
                    core.store(),
                    &settings,
                )?)
            })
            .await??;
        Ok(plans.iter().map(wire::plan).collect())
    }

    /// Task history, newest first, each entry `{id: x, kind, device, state, step: s, percent:
    /// y, result, parameters, requested_by: s, created, started, finished: x (Unix ms, 0 = not
    /// yet), reset_by: s}`. Query keys, all optional: `address` s, `limit` u (1..=10000,
    /// default 20).
    async fn get_tasks(&self, query: Dict) -> Result<Vec<Dict>, Error> {
        let q = Query::new(query, &["address", "limit"])?;
        let address = self.known_address(&q).await?;
        let limit = limit(&q, 20)? as usize;
        let tasks = self
            .objects
            .engine
            .read(move |core| core.store().tasks(address, limit))
            .await??;
        Ok(tasks.iter().map(wire::task).collect())
    }

    /// The devices a `Claim` with these requirements could get now, best first: usable,
    /// selected, unclaimed, under no task. Requirement keys, all optional, all must match:
    /// `address` s, `kind` s (gpu, fpga, crypto, nvme, nic, other), `id` s ("8086:154c" or
    /// "8086:*"), `role` s (pf, vf, function), `numa_node` i, `parent` s (the PF's address).
    async fn find_devices(&self, requirements: Dict) -> Result<Vec<OwnedObjectPath>, Error> {
        let req = wire::requirements(requirements)?;
        let found = self.objects.engine.find_devices(req).await?;
        Ok(found.into_iter().map(device_path).collect())
    }

    /// Claims the best device matching `requirements` (as `FindDevices` takes them) for a VM,
    /// records the claim durably and returns its object. The claim holds the device's whole
    /// IOMMU group. Ties go to the NUMA node with the fewest claims, then the PF with the
    /// fewest claimed VFs, then the lowest address. Owner keys: `vm_name` s and/or `vm_uuid` s
    /// (one is needed), `lease_seconds` u (an unattached claim is released after it; 0 = none; default: the
    /// configuration's `[claims] default_lease_seconds`),
    /// `persistent` b (kept when the domain is undefined; default false). Nothing claimable:
    /// NoDeviceAvailable saying why; a named device that a task holds: Busy naming the task.
    async fn claim(
        &self,
        requirements: Dict,
        owner: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        let req = wire::requirements(requirements)?;
        let default_lease = self.objects.engine.settings().claims.default_lease_seconds;
        let owner = wire::owner(owner, default_lease)?;
        let mut check = Check::new(ACTION_CLAIM, "Claim")
            .with(Detail::Vm, owner.vm())
            .with(Detail::Kind, req.kind.map_or("", |k| k.as_str()));
        if let Some(a) = req.address {
            check = check.with(Detail::Device, a);
        }
        let o = &self.objects;
        o.authorizer.check(conn, &header, &check).await?;
        let who = o.requesters.of(conn, &header).await;
        let claim = o.engine.claim(req, owner, &who).await?;
        o.engine.flush().await;
        Ok(super::claim::claim_path(claim.id))
    }

    /// Deprecated: `Pools.HostName`.
    #[zbus(property)]
    fn host_name(&self) -> String {
        super::pool::host_name(&self.objects)
    }

    /// Deprecated: `Pools.List`.
    fn get_pools(&self) -> Vec<Dict> {
        super::pool::list(&self.objects)
    }

    /// Deprecated: `Pools.GetDevices`.
    async fn get_pool_devices(&self, pool: &str) -> Result<Vec<Dict>, Error> {
        super::pool::devices(&self.objects, pool).await
    }

    /// Deprecated: `Pools.GetClaims`.
    async fn get_pooled_claims(&self, query: Dict) -> Result<Vec<Dict>, Error> {
        super::pool::claims(&self.objects, query).await
    }

    /// Deprecated: `Pools.Lease` (which returns the claim's object). Returns the claim as
    /// `GetPooledClaims` gives it.
    async fn lease_pooled(
        &self,
        pool: &str,
        device: &str,
        owner: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<Dict, Error> {
        let claim = super::pool::lease(&self.objects, pool, device, owner, conn, &header).await?;
        Ok(wire::pooled(&claim))
    }

    /// Deprecated: `PooledClaim.Release` on the claim's object.
    async fn release_pooled(
        &self,
        id: i64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<Dict, Error> {
        super::pool_claim::release(&self.objects, id, conn, &header).await
    }

    /// The objects of the claims that hold their devices, oldest first.
    fn get_claims(&self) -> Vec<OwnedObjectPath> {
        self.objects
            .view
            .active_claims()
            .into_iter()
            .map(super::claim::claim_path)
            .collect()
    }

    /// Live-migrates running domain `domain` (name or UUID) with the devices vfiod manages for it
    /// to the libvirt at `destination` (`qemu+ssh://hostb/system`), as a task on its first
    /// device; returns the task at once. Options: `live` b (default true), `migrate_uri` s (where
    /// the memory goes, e.g. `tcp://10.0.0.2`). Devices whose driver cannot migrate are
    /// detached first (the guest lets go) and the destination attaches equivalent devices of
    /// its own; if the migration fails, they are attached again here. Authorized as
    /// `org.vfiod.vfiod1.migrate` with the VM and its first device.
    async fn migrate(
        &self,
        domain: String,
        destination: String,
        options: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<OwnedObjectPath, Error> {
        let o = &self.objects;
        let options = Query::new(options, &["live", "migrate_uri"])?;
        let live = options.bool("live")?.unwrap_or(true);
        let migrate_uri = options.str("migrate_uri")?.filter(|u| !u.is_empty());
        if destination.trim().is_empty() || domain.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "the domain and the destination URI must be named".into(),
            ));
        }
        let check = Check::new(ACTION_MIGRATE, "Migrate").with(Detail::Vm, &domain);
        o.authorizer.check(conn, &header, &check).await?;
        let who = o.requesters.of(conn, &header).await;
        let migration = crate::host::libvirt::Migration {
            destination,
            migrate_uri,
            live,
        };
        let started = o.engine.migrate_domain(&domain, migration, &who).await;
        o.engine.flush().await;
        Ok(super::task::task_path(started?.id))
    }

    /// libvirt's qemu hook, forwarded by `vfiod-qemu-hook` (what
    /// `/etc/libvirt/hooks/qemu.d/vfiod` links to) or `vfioctl hook qemu`: one call per run of the hook, with libvirt's
    /// arguments and the domain XML it gave on stdin. Returns the hook's exit code, its output
    /// (an XML filter's new XML; empty means unchanged) and a message. Decided from the XML and
    /// vfiod's records, never by asking libvirt (it waits for the hook), within `[hooks]`
    /// deadlines. Accepted from root only: libvirt runs hooks as root.
    // libvirt's four arguments and the XML, as the hook gets them, plus zbus's header and
    // connection.
    #[allow(clippy::too_many_arguments)]
    async fn hook(
        &self,
        domain: String,
        operation: String,
        sub_operation: String,
        extra: String,
        xml: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(i32, String, String), Error> {
        let call = crate::engine::HookCall {
            domain,
            operation,
            sub_operation,
            extra,
            xml,
            timing: None,
        };
        authorize_hook(&self.objects, conn, &header, "Manager.Hook", &call).await?;
        super::hook_socket::answer(&self.objects.engine, call).await
    }

    /// `Hook` with options: `sent_ms` and `deadline_ms`, when the hook sent the run and the
    /// last moment vfiod may answer it with its work done, in milliseconds of the host's
    /// `CLOCK_MONOTONIC`. A run whose deadline has passed, or that a later run for its domain
    /// overtook, is not carried out; one finished after its deadline is undone. Root only.
    #[allow(clippy::too_many_arguments)]
    async fn hook_with_options(
        &self,
        domain: String,
        operation: String,
        sub_operation: String,
        extra: String,
        xml: String,
        options: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(i32, String, String), Error> {
        let mut call = crate::engine::HookCall {
            domain,
            operation,
            sub_operation,
            extra,
            xml,
            timing: None,
        };
        authorize_hook(
            &self.objects,
            conn,
            &header,
            "Manager.HookWithOptions",
            &call,
        )
        .await?;
        call.timing = super::hook_socket::timing(options)?;
        super::hook_socket::answer(&self.objects.engine, call).await
    }

    /// Re-reads the configuration (as SIGHUP does), runs an inventory pass and starts the tasks
    /// the new settings call for. A bad file is refused with InvalidConfig and the running
    /// settings are kept.
    async fn reload(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        let o = &self.objects;
        o.authorizer
            .check(conn, &header, &Check::new(ACTION_CONFIGURE, "Reload"))
            .await?;
        o.engine.reload().await?;
        // New settings may select or re-target devices: start their tasks (not awaited; they
        // report through their task objects).
        o.engine.reconcile("reload (D-Bus)").await;
        o.engine.flush().await;
        Ok(())
    }

    /// Runs an inventory pass now instead of waiting for the next uevent or poll.
    async fn rescan(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        let o = &self.objects;
        o.authorizer
            .check(conn, &header, &Check::new(ACTION_CONFIGURE, "Rescan"))
            .await?;
        o.engine.refresh().await?;
        o.engine.flush().await;
        Ok(())
    }
}

/// A hook's call on the bus is accepted from root only (libvirt runs hooks as root). A refusal
/// is said in the log too, naming the run: the hook that asked may be gone (it gave up waiting),
/// and the operator reads why its run was not carried out.
async fn authorize_hook(
    o: &super::Objects,
    conn: &Connection,
    header: &Header<'_>,
    method: &str,
    call: &crate::engine::HookCall,
) -> Result<(), Error> {
    let authorized = o.authorizer.require_root(conn, header, method).await;
    if let Err(e) = &authorized {
        tracing::warn!(
            "{} {} {} of {}: not carried out: {e}",
            call.operation,
            call.sub_operation,
            call.extra,
            call.domain
        );
    }
    authorized
}
