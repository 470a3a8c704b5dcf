//! libvirt's qemu hook, carried out: [`crate::hook`] decides from the domain XML the hook was
//! given and vfiod's records; this module reads the records, makes the claims and bindings
//! `prepare` needs, and records what `started`, `stopped` and `release` mean for the claims.
//! It never asks libvirt (libvirt waits for the hook: a call back would deadlock it), and the
//! whole answer is bounded by `[hooks]` deadlines.

use super::job::attach::{bind_to_vfio, give_back, Bound};
use super::Engine;
use crate::claim::lifecycle::Step;
use crate::claim::{Owner, Requirements};
use crate::hook::deadline::{self, Admit, Stamp, Timing};
use crate::hook::{self, AfterStop, DomainId, HostUses, Operation, Verdict};
use crate::host::libvirt;
use crate::host::sysfs::hostuse;
use crate::model::claim::ClaimState;
use crate::model::pci::PciAddress;
use crate::store::{ClaimDetails, ClaimRecord, StoreError};
use std::sync::Arc;
use std::time::Duration;

/// Who the claims a hook makes and changes name.
const BY: &str = hook::BY_PREPARE;

/// One run of the hook, as libvirt called it.
#[derive(Clone, Debug)]
pub struct HookCall {
    pub domain: String,
    pub operation: String,
    pub sub_operation: String,
    pub extra: String,
    pub xml: String,
    /// When the hook sent it and stops waiting (`HookWithOptions`); `None` from a hook that
    /// does not say (`Hook`): then from when it arrived and `[hooks]` deadlines.
    pub timing: Option<Timing>,
}

/// Each domain's hook runs, served one at a time in the order they arrive, with the newest
/// send stamp seen for the domain (see [`crate::hook::deadline`]).
#[derive(Default)]
pub(super) struct HookOrder {
    domains:
        std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<Option<Stamp>>>>>,
}

impl HookOrder {
    fn domain(&self, name: &str) -> Arc<tokio::sync::Mutex<Option<Stamp>>> {
        let mut m = self.domains.lock().unwrap_or_else(|p| p.into_inner());
        // Domains that come and go leave an entry each: a few bytes, dropped once idle when
        // the map grows.
        if m.len() > 4096 {
            m.retain(|_, lock| Arc::strong_count(lock) > 1);
        }
        Arc::clone(m.entry(name.to_string()).or_default())
    }
}

/// The domain XML as the hook needs it: its UUID and PCI hostdevs.
struct Parsed {
    uuid: Option<String>,
    /// Host function and guest address.
    assigned: Vec<(PciAddress, Option<String>)>,
}

fn parse(xml: &str) -> Result<Parsed, String> {
    let d = libvirt::xml::parse_domain(xml)?;
    Ok(Parsed {
        uuid: d.uuid,
        assigned: d
            .hostdevs
            .into_iter()
            .map(|h| (h.source, h.guest_address))
            .collect(),
    })
}

/// The largest domain XML the hook parses on the async thread; a bigger one is parsed on the
/// blocking pool. `benches/domain_xml.rs` measures the parser: far under a millisecond here.
const INLINE_PARSE_BYTES: usize = 64 << 10;

/// Runs `f` (a parse of the domain XML, which may take long on a big document) on the blocking
/// pool, so that the hook's deadline, a timer on the async threads, can still fire while it
/// runs.
pub(super) async fn off_the_executor<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("the parse did not finish: {e}"))?
}

/// The host's uses read now through the holder index (bounded: see
/// [`hostuse::read_indexed`]), with the console GPUs the settings allow left out.
fn detect_now(core: &super::core::Core) -> hostuse::HostUse {
    let read = hostuse::read_indexed(
        core.sysfs(),
        hostuse::Scope::All,
        &core.settings().host.allow_console_gpu,
        &core.holders(),
    );
    crate::hostuse::host_uses(&read.facts)
}

/// What the host uses among everything vfiod knows (the records and the host's uses read now),
/// for the host guard; nothing when `[hooks] guard_host_devices` is off, with a warning naming
/// what the guard would have refused in `functions`.
fn host_uses_now(
    core: &super::core::Core,
    devices: &[crate::model::device::Device],
    domain: &str,
    functions: &[PciAddress],
    guard: bool,
) -> HostUses {
    // The XML's functions and their group-mates (a mate's use refuses a function too): what
    // the kernel says of them now, decided by `crate::hostuse`. Bounded in time: of the
    // processes, the holder index's holders of these functions and those started since it was
    // built (see `host::sysfs::hostuse` for the window this leaves).
    let scope = hook::guard_scope(devices, functions);
    let read = hostuse::read_indexed(
        core.sysfs(),
        hostuse::Scope::Only(&scope),
        &core.settings().host.allow_console_gpu,
        &core.holders(),
    );
    if read.left_to_refresh > 0 {
        tracing::debug!(
            domain,
            "host guard: {} process(es) started since the last holder scan are left to the \
             next one",
            read.left_to_refresh
        );
    }
    let configured = crate::inventory::protected_by_config(&core.settings(), devices);
    let uses = hook::host_uses(
        devices,
        &configured,
        &crate::hostuse::host_uses(&read.facts),
    );
    if guard {
        return uses;
    }
    let problems = hook::host_problems(functions, &uses);
    if !problems.is_empty() {
        tracing::warn!(
            domain,
            "[hooks] guard_host_devices = false: left to libvirt although {}",
            problems.join("; ")
        );
    }
    HostUses::new()
}

/// The owner of the claims a hook makes for domain `name`, through the checks of a D-Bus
/// `Claim`; `Err` is the one line refusing what the domain would do (`verb`).
pub(super) fn hook_owner(name: &str, uuid: Option<&str>, verb: &str) -> Result<Owner, String> {
    let quoted = crate::config::Quoted(name);
    if name.is_empty() {
        return Err(format!("vfiod: a domain cannot {verb} without a name"));
    }
    Owner::new(Some(name), uuid, 0, false)
        .map_err(|e| format!("vfiod: domain {quoted} cannot {verb}: {e}"))
}

/// The answer to a run that is not carried out (`why`): refused when it may fail, else passed
/// as not recorded, as the hook said when it gave up.
fn not_carried_out(op: Operation, what: &str, why: &str) -> Verdict {
    if op.may_fail() {
        Verdict::fail(format!(
            "vfiod: {what} not carried out: {why}; nothing was changed"
        ))
    } else {
        Verdict::pass(format!(
            "vfiod: {what} not recorded: {why}; the reconcile will catch up"
        ))
    }
}

/// A notification's verdict: it passes whatever happened, and says what it recorded.
fn notified(
    done: Result<Result<Vec<String>, StoreError>, super::EngineError>,
    what: &str,
) -> Verdict {
    match done {
        Ok(Ok(ids)) if ids.is_empty() => Verdict::pass(""),
        Ok(Ok(ids)) => Verdict::pass(format!("claims {} {what}", ids.join(", "))),
        Ok(Err(e)) => Verdict::pass(format!("not recorded: {}", crate::error_chain(&e))),
        Err(e) => Verdict::pass(format!("not recorded: {}", crate::error_chain(&e))),
    }
}

impl Engine {
    /// Answers one run of the hook, within its deadline: an operation that may stop libvirt
    /// fails closed when the answer does not come in time, a notification passes. A domain's
    /// runs are served one at a time; a run whose deadline has passed, or that a later run of
    /// its domain overtook, is not carried out, and one that finishes after its deadline is
    /// undone ([`crate::hook::deadline`]): what libvirt was told is what happened.
    pub async fn hook(self: &Arc<Self>, call: HookCall) -> Verdict {
        let op = Operation::parse(&call.operation);
        let settings = self.settings().hooks.clone();
        let hook_deadline = Duration::from_millis(u64::from(if op.may_fail() {
            settings.deadline_ms
        } else {
            settings.notify_deadline_ms
        }));
        // A hook that does not say (`Hook`): its deadline from now, its place in its domain's
        // order from when its turn comes (two such runs are never each other's stale copy).
        let given = call.timing;
        let answer_by = given
            .unwrap_or_else(|| Timing::of(Stamp::now(), hook_deadline))
            .deadline;
        let what = format!(
            "{} {} {} of {}",
            call.operation, call.sub_operation, call.extra, call.domain
        );
        let asked = std::time::Instant::now();
        let (operation, domain) = (call.operation.clone(), call.domain.clone());
        let order = self.hook_order.domain(&call.domain);
        let me = Arc::clone(self);
        let w = what.clone();
        // The work runs to its end even when the answer goes out at the deadline first: a
        // run cut off half-way would leave half its claims, and its end undoes a late run.
        let work = tokio::spawn(async move {
            let mut newest = order.lock_owned().await;
            let now = Stamp::now();
            let timing = given.unwrap_or(Timing {
                sent: now,
                deadline: answer_by,
            });
            let admitted = deadline::admit(now, timing, *newest);
            *newest = Some(deadline::newest(*newest, timing.sent));
            match admitted {
                Admit::Go => me.decide_hook(op, &call, timing).await,
                Admit::TooLate { late } => not_carried_out(
                    op,
                    &w,
                    &format!(
                        "its hook gave up waiting {} ms ago (vfiod was not answering)",
                        late.as_millis()
                    ),
                ),
                Admit::Overtaken { .. } => not_carried_out(
                    op,
                    &w,
                    "a later run of the hook for this domain was already answered",
                ),
            }
        });
        let left = Stamp::now().until(answer_by);
        let verdict = match tokio::time::timeout(left, work).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => Verdict::fail(format!("vfiod: internal error answering {what}: {e}")),
            Err(_) if op.may_fail() => Verdict::fail(format!(
                "vfiod: no answer for {what} within {} ms",
                hook_deadline.as_millis()
            )),
            Err(_) => Verdict::pass(format!(
                "vfiod: {what} not recorded within {} ms; the reconcile will catch up",
                hook_deadline.as_millis()
            )),
        };
        self.metrics
            .hook_answered(&operation, verdict.exit_code == 0, asked.elapsed());
        if verdict.exit_code != 0 {
            tracing::warn!(domain = %domain, "hook {what}: {}", verdict.message);
        } else if !verdict.message.is_empty() {
            tracing::info!(domain = %domain, "hook {what}: {}", verdict.message);
        }
        verdict
    }

    async fn decide_hook(
        self: &Arc<Self>,
        op: Operation,
        call: &HookCall,
        timing: Timing,
    ) -> Verdict {
        if matches!(op, Operation::Other | Operation::Attach | Operation::Start) {
            return Verdict::pass("");
        }
        if op == Operation::Migrate {
            return self.hook_migrate(&call.domain, &call.xml, timing).await;
        }
        if op == Operation::Reconnect {
            // Never fails (libvirt kills the VM if it does), and never waits for libvirt.
            let me = Arc::clone(self);
            let domain = call.domain.clone();
            tokio::spawn(async move {
                me.reconcile_claims(Some(domain)).await;
            });
            return Verdict::pass("reconcile scheduled");
        }
        // A usual domain's XML (a few KiB) parses in microseconds: on this thread, which saves
        // libvirt the hand-over to the blocking pool on every hook. A big one goes there, so
        // that the deadline can still fire while it is parsed.
        let parsed = if call.xml.len() <= INLINE_PARSE_BYTES {
            parse(&call.xml)
        } else {
            let xml = call.xml.clone();
            off_the_executor(move || parse(&xml)).await
        };
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) if op.may_fail() => {
                return Verdict::fail(format!(
                    "vfiod: cannot read the XML of domain {}: {e}",
                    call.domain
                ))
            }
            Err(e) => return Verdict::pass(format!("cannot read the domain XML: {e}")),
        };
        match op {
            Operation::Prepare => self.hook_prepare(call, parsed, timing).await,
            Operation::Restore => {
                let functions: Vec<PciAddress> = parsed.assigned.iter().map(|(f, _)| *f).collect();
                match self.host_guard(&call.domain, "start", &functions).await {
                    Ok(()) => Verdict::pass(""),
                    Err(refusal) => Verdict::fail(refusal),
                }
            }
            Operation::Started => self.hook_started(call, parsed).await,
            Operation::Stopped | Operation::Release => self.hook_stopped(call, parsed).await,
            // Filters: the XML stays as it is (empty output).
            _ => Verdict::pass(""),
        }
    }

    async fn hook_prepare(
        self: &Arc<Self>,
        call: &HookCall,
        parsed: Parsed,
        timing: Timing,
    ) -> Verdict {
        let name = call.domain.clone();
        // The claims this run makes name the domain as a D-Bus `Claim` would: the same checks
        // first, so that no claim for "" or for a name no domain has is recorded (nor echoed).
        let owner = match hook_owner(&name, parsed.uuid.as_deref(), "start") {
            Ok(o) => o,
            Err(line) => return Verdict::fail(line),
        };
        let uuid = owner.vm_uuid.clone();
        let functions: Vec<PciAddress> = parsed.assigned.iter().map(|(f, _)| *f).collect();
        let auto_claim = self.settings().hooks.auto_claim;
        let guard = self.settings().hooks.guard_host_devices;
        // A domain that starts again at once (`virsh destroy`, then `virsh start`) finds its
        // functions still being cleaned after the claim its stop ended: it waits for them
        // rather than failing, within most of the hook's deadline.
        let budget = Stamp::now().until(timing.deadline) * 3 / 4;
        self.wait_for_cleans(&functions, budget).await;
        let (n, u, fs) = (name.clone(), uuid.clone(), functions.clone());
        let decided = self
            .read(move |core| {
                let mut snapshot = core.store().claim_snapshot()?;
                // What the holds say, even before a pass has recorded it as the state.
                snapshot.devices = crate::inventory::with_holds(
                    std::mem::take(&mut snapshot.devices),
                    &snapshot.cleaning,
                );
                let claims = core.store().active_claim_records()?;
                let domain = DomainId {
                    name: &n,
                    uuid: u.as_deref(),
                };
                let uses = host_uses_now(core, &snapshot.devices, &n, &fs, guard);
                // Functions the records lack, with the PF sysfs gives each (a VF a split is
                // creating): not to be left to libvirt when vfiod manages that PF.
                let unrecorded: Vec<(PciAddress, PciAddress)> = fs
                    .iter()
                    .filter(|f| snapshot.devices.iter().all(|d| d.address != **f))
                    .filter_map(|f| {
                        let link = core.sysfs().device_attr(*f, "physfn");
                        let pf = core.sysfs().read_optional_link_name(&link).ok()??;
                        Some((*f, pf.parse().ok()?))
                    })
                    .collect();
                Ok::<_, StoreError>(hook::prepare(
                    domain,
                    &fs,
                    &snapshot.devices,
                    &claims,
                    &snapshot.busy,
                    auto_claim,
                    &uses,
                    &unrecorded,
                ))
            })
            .await;
        let plan = match decided {
            Ok(Ok(Ok(plan))) => plan,
            Ok(Ok(Err(refusal))) => return Verdict::fail(refusal),
            Ok(Err(e)) => return Verdict::fail(format!("vfiod: {}", crate::error_chain(&e))),
            Err(e) => return Verdict::fail(format!("vfiod: {}", crate::error_chain(&e))),
        };
        if !plan.to_claim.is_empty() || !plan.to_bind.is_empty() {
            let iommu = self
                .read(|core| crate::host::sysfs::iommu::read(core.sysfs()))
                .await;
            if let Ok(Err(e)) = iommu.map(|i| i.passthrough()) {
                return Verdict::fail(format!("vfiod: domain {name} cannot start: {e}"));
            }
        }
        let mut claimed = Vec::new();
        // What this run claimed: given back if the start is refused after all.
        let mut made = Vec::new();
        for f in &plan.to_claim {
            // A claim takes a function's whole IOMMU group: an earlier one may hold it now.
            let f = *f;
            let (n, u) = (name.clone(), uuid.clone());
            let mine = self
                .read(move |core| {
                    core.store().active_claim_records().map(|all| {
                        all.iter().any(|c| {
                            c.functions.contains(&f)
                                && DomainId {
                                    name: &n,
                                    uuid: u.as_deref(),
                                }
                                .owns(c)
                        })
                    })
                })
                .await;
            if matches!(mine, Ok(Ok(true))) {
                continue;
            }
            let req = Requirements {
                address: Some(f),
                ..Requirements::default()
            };
            match self.claim(req, owner.clone(), BY).await {
                Ok(c) => {
                    made.push(c.id);
                    claimed.push(format!("claim {} on {}", c.id, c.address));
                }
                Err(e) => {
                    self.release_all(&made, "the start of its domain was refused")
                        .await;
                    return Verdict::fail(format!(
                        "vfiod: domain {name} cannot start: {f} cannot be claimed for it: {}",
                        crate::error_chain(&e)
                    ));
                }
            }
        }
        let mut bound = None;
        if !plan.to_bind.is_empty() {
            let me = Arc::clone(self);
            let to_bind = plan.to_bind.clone();
            let done = self
                .read(move |_| {
                    let cx = me.job_context();
                    let mut bound = Bound::default();
                    let result =
                        bind_to_vfio(&cx, to_bind[0], &to_bind, &mut bound, &mut |_, _, _| {});
                    // A bind that failed half-way: what moved goes back (the start is refused).
                    if result.is_err() {
                        if let Err(e) = give_back(&cx, to_bind[0], &bound) {
                            tracing::warn!(device = %to_bind[0], "{e}");
                        }
                    }
                    (result, (to_bind[0], bound))
                })
                .await;
            let failed = match done {
                Ok((Ok(()), b)) => {
                    bound = Some(b);
                    None
                }
                Ok((Err(e), _)) => Some(e),
                Err(e) => Some(e.to_string()),
            };
            if let Some(e) = failed {
                self.release_all(&made, "the start of its domain was refused")
                    .await;
                return Verdict::fail(format!("vfiod: domain {name}: {e}"));
            }
        }
        // Done after the hook gave up: libvirt did not start the domain, so nothing of this
        // run may stay.
        if !deadline::in_time(Stamp::now(), timing) {
            let me = Arc::clone(self);
            if let Some((device, bound)) = bound {
                let _ = self
                    .read(move |_| {
                        if let Err(e) = give_back(&me.job_context(), device, &bound) {
                            tracing::warn!(%device, "{e}");
                        }
                    })
                    .await;
            }
            self.release_all(
                &made,
                "its hook gave up before vfiod answered: the start was refused",
            )
            .await;
            self.flush().await;
            return Verdict::fail(format!(
                "vfiod: domain {name} cannot start: vfiod answered after the hook's deadline; \
                 what it did for this start is undone"
            ));
        }
        self.flush().await;
        if claimed.is_empty() {
            Verdict::pass("")
        } else {
            Verdict::pass(format!("claimed {} for {name}", claimed.join(", ")))
        }
    }

    /// Waits, at most `within`, until none of `functions` is held for a clean that is still to
    /// come or under a clean that still runs (a quarantine is not waited for: it lasts until an
    /// operator clears it).
    async fn wait_for_cleans(self: &Arc<Self>, functions: &[PciAddress], within: Duration) {
        use crate::model::clean::HoldState;
        let deadline = tokio::time::Instant::now() + within;
        let mut changes = self.subscribe_changes();
        loop {
            let fs = functions.to_vec();
            // Held for a clean to come, or under a clean still running: a clean gives its
            // functions back (drops their holds) a moment before its task ends, and until it
            // ends the task makes them busy.
            let pending = self
                .read(move |core| {
                    let store = core.store();
                    let held = store
                        .clean_holds()?
                        .iter()
                        .any(|h| h.state == HoldState::Pending && fs.contains(&h.address));
                    if held {
                        return Ok(true);
                    }
                    for f in &fs {
                        if store.blocking_task(*f)?.is_some_and(|t| {
                            t.kind == crate::model::task::TaskKind::Clean && !t.state.is_final()
                        }) {
                            return Ok(true);
                        }
                    }
                    Ok::<_, StoreError>(false)
                })
                .await;
            if !matches!(pending, Ok(Ok(true))) {
                return;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return;
            }
            // A clean's end is a task change; the poll covers a wake-up lost in between.
            let _ =
                tokio::time::timeout(left.min(Duration::from_millis(100)), changes.changed()).await;
        }
    }

    /// The host guard for an operation that lets domain `name` start or arrive with
    /// `functions` (`verb`: what it cannot do). `Err` is the one line for libvirt; a failure to
    /// read the records refuses too (fail closed).
    pub(super) async fn host_guard(
        self: &Arc<Self>,
        name: &str,
        verb: &'static str,
        functions: &[PciAddress],
    ) -> Result<(), String> {
        if functions.is_empty() {
            return Ok(());
        }
        let guard = self.settings().hooks.guard_host_devices;
        let (n, fs) = (name.to_string(), functions.to_vec());
        let uses = self
            .read(move |core| {
                let devices = core.store().devices()?;
                Ok::<_, StoreError>(host_uses_now(core, &devices, &n, &fs, guard))
            })
            .await;
        match uses {
            Ok(Ok(uses)) => hook::refuse_host_devices(name, verb, functions, &uses),
            Ok(Err(e)) => Err(format!("vfiod: {}", crate::error_chain(&e))),
            Err(e) => Err(format!("vfiod: {}", crate::error_chain(&e))),
        }
    }

    /// libvirt's device-added event: a function the host uses, hot-plugged into a running
    /// domain by someone else than vfiod, is an error event naming the domain (libvirt runs no
    /// hook for a live attach: vfiod cannot refuse it, only say so).
    pub(super) async fn device_added(self: &Arc<Self>, d: &crate::host::libvirt::DomainEvent) {
        let crate::host::libvirt::DomainEventKind::DeviceAdded { alias } = &d.kind else {
            return;
        };
        if super::job::detach::claim_of_alias(alias).is_some() {
            return;
        }
        let (name, alias) = (d.name.clone(), alias.clone());
        let done = self
            .read(move |core| {
                let xml = core
                    .libvirt()
                    .domain_xml(&name, libvirt::Definition::Live)
                    .map_err(|e| crate::error_chain(&e))?;
                let hostdevs = libvirt::xml::hostdevs(&xml)?;
                let devices = core.store().devices().map_err(|e| crate::error_chain(&e))?;
                let configured = crate::inventory::protected_by_config(&core.settings(), &devices);
                let uses = hook::host_uses(&devices, &configured, &detect_now(core));
                let Some((f, line)) =
                    hook::hot_plugged_host_device(&name, &alias, &hostdevs, &uses, |a| {
                        super::job::detach::claim_of_alias(a).is_some()
                    })
                else {
                    return Ok(());
                };
                tracing::error!(domain = %name, device = %f, "{line}");
                core.store()
                    .record_event(crate::store::NewEvent::new(
                        Some(f),
                        crate::model::event::EventKind::Protected,
                        line,
                    ))
                    .map(|_| ())
                    .map_err(|e| crate::error_chain(&e))
            })
            .await;
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(domain = %d.name, "cannot check a hot-plugged device: {e}")
            }
            Err(e) => tracing::warn!(domain = %d.name, "cannot check a hot-plugged device: {e}"),
        }
    }

    async fn hook_started(self: &Arc<Self>, call: &HookCall, parsed: Parsed) -> Verdict {
        let name = call.domain.clone();
        let me = Arc::clone(self);
        let done = self
            .read(move |core| {
                let claims = core.store().active_claim_records()?;
                let domain = DomainId {
                    name: &name,
                    uuid: parsed.uuid.as_deref(),
                };
                let mut marked = Vec::new();
                for (c, guest) in hook::started(domain, &parsed.assigned, &claims) {
                    let details = ClaimDetails {
                        vm_name: Some(name.clone()),
                        vm_uuid: parsed.uuid.clone(),
                        guest_address: Some(guest),
                    };
                    let what = format!("attached: domain {name} started with it");
                    if c.state == ClaimState::Claimed {
                        me.claim_step(c.id, Step::Attach, ClaimDetails::default(), &what)?;
                    }
                    if matches!(c.state, ClaimState::Claimed | ClaimState::Attaching) {
                        me.claim_step(c.id, Step::Attached, details, &what)?;
                        marked.push(c.id.to_string());
                    }
                }
                Ok::<_, StoreError>(marked)
            })
            .await;
        // Published before the answer, when this run may have changed a claim; nothing to
        // wait for when it surely did not (every `started` after the first of a run).
        if !matches!(&done, Ok(Ok(marked)) if marked.is_empty()) {
            self.flush().await;
        }
        notified(done, "attached")
    }

    async fn hook_stopped(self: &Arc<Self>, call: &HookCall, parsed: Parsed) -> Verdict {
        let name = call.domain.clone();
        // Pooled sessions: a quiesced one went with the VM (forgotten), an incoming one that
        // never ran here is given back. In the background: a pool call may outlast the
        // notification's deadline, and must not be cut short by it.
        let me = Arc::clone(self);
        let (n, u) = (name.clone(), parsed.uuid.clone());
        tokio::spawn(async move {
            me.pooled_step(
                &n,
                u.as_deref(),
                crate::pool::DomainStep::Stopped { migrated: false },
            )
            .await;
        });
        let me = Arc::clone(self);
        let done = self
            .read(move |core| {
                let claims = core.store().active_claim_records()?;
                let domain = DomainId {
                    name: &name,
                    uuid: parsed.uuid.as_deref(),
                };
                let mut changed = Vec::new();
                for (c, after) in hook::stopped(domain, &claims) {
                    me.after_stop(c, after, &name)?;
                    changed.push(c.id.to_string());
                }
                Ok::<_, StoreError>(changed)
            })
            .await;
        self.flush().await;
        notified(done, "out of the domain")
    }

    /// The domain stopped: `claim` is out of it, and released unless it outlives the run.
    fn after_stop(
        &self,
        claim: &ClaimRecord,
        after: AfterStop,
        domain: &str,
    ) -> Result<(), StoreError> {
        let what = format!("domain {domain} stopped");
        let none = ClaimDetails::default;
        match claim.state {
            ClaimState::Attaching => {
                self.claim_step(claim.id, Step::AttachFailed, none(), &what)?;
                return Ok(());
            }
            ClaimState::Detaching => {
                self.claim_step(claim.id, Step::Detached, none(), &what)?;
                return Ok(());
            }
            ClaimState::Attached => {
                let details = ClaimDetails {
                    guest_address: Some(None),
                    ..ClaimDetails::default()
                };
                self.claim_step(claim.id, Step::Detached, details, &what)?;
            }
            ClaimState::Claimed | ClaimState::Released => {}
        }
        if after == AfterStop::Release {
            self.claim_step(
                claim.id,
                Step::Release,
                none(),
                &format!("released: {what} (the claim was for its run)"),
            )?;
        }
        Ok(())
    }
}
