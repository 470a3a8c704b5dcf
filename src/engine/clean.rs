//! The cleaner: starts a `clean` task ([`super::job::clean`]) for the functions held for one.
//!
//! A claim's end holds its functions in the store, in the transaction that ends it, and wakes
//! the engine's loop ([`crate::store::Store::clean_wanted`]); the loop then calls
//! [`Engine::start_cleans`], which also runs every second for holds whose clean could not start
//! (a guard's refusal: the VM's QEMU still has the VFIO group open) and at start-up (holds of a
//! vfiod that stopped). Functions of one claim are cleaned together, as are held group-mates
//! no claim explains. A held function that is gone (a VF removed with its PF's VFs) or that the
//! host now uses is let go: there is nothing vfiod may clean.
//!
//! A group whose clean was refused is tried again after a pause that doubles up to a minute, so
//! that a function held open for long does not fill the task history with refusals.

use super::job::clean::CleanJob;
use super::Engine;
use crate::model::clean::HoldState;
use crate::model::device::State;
use crate::model::pci::PciAddress;
use crate::store::{StoreError, TaskRecord};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The first pause after a refused clean, and the longest.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const LONGEST_RETRY: Duration = Duration::from_secs(60);

/// When each refused group may be tried again (by its first function), and its pause; and
/// whether the last look found no held function at all, so that an idle vfiod does not read the
/// holds every second for nothing (a new hold wakes the cleaner through the store).
#[derive(Default)]
pub(super) struct Retries {
    pauses: std::sync::Mutex<HashMap<PciAddress, (Instant, Duration)>>,
    none_held: std::sync::atomic::AtomicBool,
}

impl Retries {
    /// Whether the every-second look is worth making: holds were seen last time.
    pub(super) fn worth_a_look(&self) -> bool {
        !self.none_held.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The store said a hold was written (or a quarantine cleared): look again.
    pub(super) fn wake(&self) {
        self.none_held
            .store(false, std::sync::atomic::Ordering::Release);
    }

    fn due(&self, address: PciAddress, now: Instant) -> bool {
        self.lock().get(&address).is_none_or(|(at, _)| *at <= now)
    }

    fn refused(&self, address: PciAddress, now: Instant) {
        let mut m = self.lock();
        let pause = m
            .get(&address)
            .map_or(FIRST_RETRY, |(_, p)| (*p * 2).min(LONGEST_RETRY));
        m.insert(address, (now + pause, pause));
    }

    fn started(&self, address: PciAddress) {
        self.lock().remove(&address);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PciAddress, (Instant, Duration)>> {
        self.pauses.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Which functions are cleaned together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Together {
    Claim(i64),
    Group(u32),
    Alone(PciAddress),
}

/// One clean to start: its functions (the claim's device first) and why.
struct Wanted {
    functions: Vec<PciAddress>,
    claim: Option<i64>,
}

impl Engine {
    /// Starts a clean for every group of held functions that has none and may have one now
    /// (see the module's header). Returns the tasks started.
    pub async fn start_cleans(self: &Arc<Self>) -> Vec<TaskRecord> {
        let wanted = self.read(wanted_cleans).await;
        let (wanted, any_held) = match wanted {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                tracing::error!("cannot read the cleaning holds: {}", crate::error_chain(&e));
                return Vec::new();
            }
            Err(e) => {
                tracing::error!("cannot read the cleaning holds: {}", crate::error_chain(&e));
                return Vec::new();
            }
        };
        self.clean_retries
            .none_held
            .store(!any_held, std::sync::atomic::Ordering::Release);
        let now = Instant::now();
        let due: Vec<Wanted> = wanted
            .into_iter()
            .filter(|w| self.clean_retries.due(w.functions[0], now))
            .collect();
        if due.is_empty() {
            return Vec::new();
        }
        // The holds show as `cleaning` before their tasks start.
        if let Err(e) = self.refresh().await {
            tracing::error!(
                "inventory pass before cleaning failed: {}",
                crate::error_chain(&e)
            );
        }
        let mut started = Vec::new();
        for w in due {
            let first = w.functions[0];
            let job = match w.claim {
                Some(claim) => CleanJob::after_claim(w.functions.clone(), claim),
                None => CleanJob::held(w.functions.clone()),
            };
            let who = match w.claim {
                Some(claim) => format!("vfiod (claim {claim} ended)"),
                None => "vfiod (held for a clean)".to_string(),
            };
            match self.start_task(Box::new(job), &who).await {
                Ok(t) => {
                    self.clean_retries.started(first);
                    started.push(t);
                }
                Err(e) if e.is_busy() => {}
                Err(e) => {
                    self.clean_retries.refused(first, now);
                    tracing::info!(
                        device = %first,
                        "clean not started yet, tried again later: {}",
                        crate::error_chain(&e)
                    );
                }
            }
        }
        started
    }
}

/// The cleans to start: held functions (pending, present, not held by a task) grouped by the
/// claim that ended, else by IOMMU group; and whether any function is held at all. Lets go of
/// holds on functions that are gone or that the host now uses.
fn wanted_cleans(core: &super::Core) -> Result<(Vec<Wanted>, bool), StoreError> {
    let store = core.store();
    let holds = store.clean_holds()?;
    if !holds.iter().any(|h| h.state == HoldState::Pending) {
        return Ok((Vec::new(), false));
    }
    let devices: BTreeMap<PciAddress, crate::model::device::Device> = store
        .devices()?
        .into_iter()
        .map(|d| (d.address, d))
        .collect();
    let mut groups: BTreeMap<Together, Vec<PciAddress>> = BTreeMap::new();
    let mut claims: BTreeMap<i64, PciAddress> = BTreeMap::new();
    for h in holds.iter().filter(|h| h.state == HoldState::Pending) {
        let Some(d) = devices.get(&h.address) else {
            store.drop_clean_hold(h.address, "the function is gone")?;
            continue;
        };
        match d.state {
            State::Protected => {
                let why = format!("the host uses it now ({})", d.state_reason);
                store.drop_clean_hold(h.address, &why)?;
                continue;
            }
            // Unreadable: it waits until it reads again.
            State::Broken => continue,
            State::Usable | State::Cleaning => {}
        }
        // A task holds it (its clean running, or one in error until an operator resets it).
        if store.blocking_task(h.address)?.is_some() {
            continue;
        }
        let key = match (h.claim_id, d.iommu_group) {
            (Some(c), _) => Together::Claim(c),
            (None, Some(g)) => Together::Group(g),
            (None, None) => Together::Alone(h.address),
        };
        if let Some(c) = h.claim_id {
            if let std::collections::btree_map::Entry::Vacant(e) = claims.entry(c) {
                if let Some(claim) = store.claim_record(c)? {
                    e.insert(claim.address);
                }
            }
        }
        groups.entry(key).or_default().push(h.address);
    }
    Ok((
        groups
            .into_iter()
            .map(|(key, mut functions)| {
                let claim = match key {
                    Together::Claim(c) => Some(c),
                    _ => None,
                };
                // The claim's device first: the task shows on it.
                if let Some(first) = claim.and_then(|c| claims.get(&c)) {
                    if let Some(i) = functions.iter().position(|a| a == first) {
                        functions.swap(0, i);
                    }
                }
                Wanted { functions, claim }
            })
            .collect(),
        true,
    ))
}
