//! libvirt's device-removed events, kept for a while so that a detach job can wait for the ones
//! it caused: an event may arrive before the job starts waiting (libvirt's detach call itself
//! waits up to 5 s for the guest), so the job takes a mark before it asks and waits for events
//! after the mark.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// How many events are kept: far more than detaches run at once.
const KEEP: usize = 1024;

/// One device event of a domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removal {
    seq: u64,
    pub domain_uuid: String,
    pub alias: String,
    /// `false`: the guest refused to release the device.
    pub removed: bool,
}

#[derive(Default)]
pub struct Removals {
    seen: Mutex<(u64, VecDeque<Removal>)>,
    arrived: Condvar,
}

/// What a wait found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waited {
    /// Every alias was removed.
    Removed,
    /// The guest refused to release this alias.
    Refused(String),
    /// The deadline passed with these aliases still in the domain.
    TimedOut(Vec<String>),
}

impl Removals {
    fn lock(&self) -> MutexGuard<'_, (u64, VecDeque<Removal>)> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The point after which [`Removals::wait`] looks.
    pub fn mark(&self) -> u64 {
        self.lock().0
    }

    /// Notes a device event of domain `domain_uuid`.
    pub fn record(&self, domain_uuid: &str, alias: &str, removed: bool) {
        let mut seen = self.lock();
        seen.0 += 1;
        let seq = seen.0;
        seen.1.push_back(Removal {
            seq,
            domain_uuid: domain_uuid.to_ascii_lowercase(),
            alias: alias.to_string(),
            removed,
        });
        while seen.1.len() > KEEP {
            seen.1.pop_front();
        }
        self.arrived.notify_all();
    }

    /// Waits until every one of `aliases` of domain `domain_uuid` has been removed by an event
    /// after `mark`, one was refused, or `deadline` passed.
    pub fn wait(
        &self,
        mark: u64,
        domain_uuid: &str,
        aliases: &[String],
        deadline: Instant,
    ) -> Waited {
        let uuid = domain_uuid.to_ascii_lowercase();
        let mut seen = self.lock();
        loop {
            let after = || {
                seen.1
                    .iter()
                    .filter(|r| r.seq > mark && r.domain_uuid == uuid)
            };
            if let Some(r) = after().find(|r| !r.removed && aliases.contains(&r.alias)) {
                return Waited::Refused(r.alias.clone());
            }
            let left: Vec<String> = aliases
                .iter()
                .filter(|a| !after().any(|r| r.removed && &r.alias == *a))
                .cloned()
                .collect();
            if left.is_empty() {
                return Waited::Removed;
            }
            let now = Instant::now();
            if now >= deadline {
                return Waited::TimedOut(left);
            }
            seen = self
                .arrived
                .wait_timeout(seen, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn aliases(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn waits_for_every_alias_after_the_mark() {
        let r = Arc::new(Removals::default());
        r.record("U", "ua-vfiod-1-0", true); // before the mark: not this detach's
        let mark = r.mark();
        r.record("u", "ua-vfiod-1-0", true); // UUIDs compare without case
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(
            r.wait(mark, "u", &aliases(&["ua-vfiod-1-0", "ua-vfiod-1-1"]), soon),
            Waited::TimedOut(aliases(&["ua-vfiod-1-1"]))
        );
        let r2 = Arc::clone(&r);
        let later = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            r2.record("other", "ua-vfiod-1-1", true); // another domain's
            r2.record("u", "ua-vfiod-1-1", true);
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(
            r.wait(
                mark,
                "u",
                &aliases(&["ua-vfiod-1-0", "ua-vfiod-1-1"]),
                deadline
            ),
            Waited::Removed
        );
        later.join().unwrap();
    }

    #[test]
    fn a_refusal_ends_the_wait() {
        let r = Removals::default();
        let mark = r.mark();
        r.record("u", "ua-vfiod-2-0", false);
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(
            r.wait(mark, "u", &aliases(&["ua-vfiod-2-0"]), deadline),
            Waited::Refused("ua-vfiod-2-0".into())
        );
    }
}
