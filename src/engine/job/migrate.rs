//! The migrate job, on the source host: moves a running domain that has devices vfiod manages
//! to another host. What each device is goes into the domain's `<metadata>` (it travels with
//! the domain: the destination's `migrate` hook claims equivalent devices of its own from it, or
//! refuses the migration before any memory is copied); the devices whose driver cannot migrate
//! are detached (the guest lets go, as for a detach); libvirt migrates the domain without them;
//! then the claims here are released. If the migration fails, the devices are attached again and
//! the VM keeps them.

use super::attach::{libvirt_message, LIBVIRT_OFF};
use super::detach::Unplug;
use super::guard;
use crate::claim::lifecycle::Step;
use crate::engine::context::JobContext;
use crate::engine::job::{Admission, Job, JobError, JobFailure, Phase, Progress};
use crate::engine::removals::Waited;
use crate::host::libvirt::{self, xml::MetadataDevice, DomainInfo, Migration};
use crate::migration::{migratable, Migratable};
use crate::model::claim::ClaimState;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::{ClaimDetails, ClaimRecord};

const RECORD: Phase = Phase::new("record the devices in the domain", 5);
const DETACH: Phase = Phase::new("detach the devices", 20);
const MIGRATE: Phase = Phase::new("migrate", 65);
const RELEASE: Phase = Phase::new("release the devices here", 10);

pub struct MigrateJob {
    domain: String,
    migration: Migration,
    /// The domain's claims, as read when the request came; refreshed by admit.
    claims: Vec<ClaimRecord>,
    info: Option<DomainInfo>,
    /// Claims detached for the migration (to attach again if it fails), with the definitions
    /// they were in (live, config).
    parked: Vec<(ClaimRecord, bool, bool)>,
}

impl MigrateJob {
    /// Migrate `domain`, whose claims are `claims` (at least one), as `migration` says.
    pub fn new(domain: &str, claims: Vec<ClaimRecord>, migration: Migration) -> MigrateJob {
        MigrateJob {
            domain: domain.to_string(),
            migration,
            claims,
            info: None,
            parked: Vec::new(),
        }
    }

    fn step(
        &self,
        cx: &JobContext,
        id: i64,
        step: Step,
        what: &str,
    ) -> Result<ClaimRecord, JobFailure> {
        cx.claims
            .step(id, step, ClaimDetails::default(), what)
            .map_err(|e| JobFailure::from_error(&e))
    }
}

/// The claims of `domain` (by name or UUID) that hold devices in it.
pub fn claims_of(all: Vec<ClaimRecord>, name: &str, uuid: &str) -> Vec<ClaimRecord> {
    all.into_iter()
        .filter(|c| {
            c.vm_uuid
                .as_deref()
                .is_some_and(|u| u.eq_ignore_ascii_case(uuid))
                || (c.vm_uuid.is_none() && c.vm_name.as_deref() == Some(name))
        })
        .collect()
}

impl Job for MigrateJob {
    fn device(&self) -> PciAddress {
        self.claims[0].address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        let address = self.device();
        if cx.libvirt.uri().is_none() {
            return Err(JobError::Unavailable {
                address,
                reason: LIBVIRT_OFF.into(),
            });
        }
        let mut scope = Vec::new();
        for c in &self.claims {
            if c.state != ClaimState::Attached {
                return Err(JobError::Invalid {
                    address: c.address,
                    reason: format!(
                        "claim {} of {} is {}: only attached devices can be carried",
                        c.id, self.domain, c.state
                    ),
                });
            }
            for f in &c.functions {
                let d = cx.store.device(*f)?.ok_or(JobError::NoSuchDevice(*f))?;
                if migratable(&d) == Migratable::No {
                    return Err(JobError::Invalid {
                        address: *f,
                        reason: format!(
                            "{f} cannot be carried through a migration ({}, {})",
                            d.state, d.state_reason
                        ),
                    });
                }
                if *f != address {
                    scope.push(*f);
                }
            }
        }
        Ok(Admission {
            kind: TaskKind::Migrate,
            scope,
            params: serde_json::json!({
                "domain": self.domain,
                "destination": self.migration.destination,
                "migrate_uri": self.migration.migrate_uri,
                "live": self.migration.live,
                "claims": self.claims.iter().map(|c| c.id).collect::<Vec<_>>(),
            }),
        })
    }

    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError> {
        let info = cx
            .libvirt
            .lookup(&self.domain)
            .map_err(|source| JobError::Libvirt {
                address: self.device(),
                source,
            })?;
        if !info.active {
            return Err(JobError::Invalid {
                address: self.device(),
                reason: format!(
                    "domain {} is not running: nothing to migrate live",
                    info.name
                ),
            });
        }
        self.info = Some(info);
        Ok(TaskKind::Migrate)
    }

    fn guard(&self, cx: &JobContext) -> Result<(), JobError> {
        // The domain's own claims and its QEMU are what the migration carries; anyone else
        // holding one of the functions (another claim, another running domain, a process with
        // the group open) stops it before the devices are detached.
        let ids: Vec<i64> = self.claims.iter().map(|c| c.id).collect();
        let functions: Vec<PciAddress> = self
            .claims
            .iter()
            .flat_map(|c| c.functions.iter().copied())
            .collect();
        let mut names = vec![self.domain.as_str()];
        if let Some(info) = &self.info {
            names.push(info.name.as_str());
        }
        guard::refuse_if_used(
            cx,
            self.device(),
            &functions,
            guard::Allowed {
                claims: &ids,
                domains: &names,
            },
        )
    }

    fn phases(&self) -> Vec<Phase> {
        vec![RECORD, DETACH, MIGRATE, RELEASE]
    }

    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        let info = self.info.clone().expect("prepared");
        let name = info.name.clone();
        let mut records = Vec::new();
        let mut carried = Vec::new();
        for c in &self.claims {
            let d = cx
                .store
                .device(c.address)
                .map_err(|e| JobFailure::from_error(&e))?
                .ok_or_else(|| JobFailure::new(format!("{} is gone", c.address)))?;
            records.push(MetadataDevice {
                source: c.address,
                kind: d.kind.as_str().into(),
                id: format!("{:04x}:{:04x}", d.vendor_id, d.device_id),
                role: d.role.as_str().into(),
                claim: Some(c.id),
            });
            let mut every = true;
            for f in &c.functions {
                let fd = cx.store.device(*f).ok().flatten();
                every &= fd.is_some_and(|fd| migratable(&fd) == Migratable::Yes);
            }
            if !every {
                carried.push(c.clone());
            }
        }
        let affect = if info.persistent {
            libvirt::Affect::Both
        } else {
            libvirt::Affect::Live
        };
        // vfiod's element is one per domain: the pooled sessions the domain holds go with it.
        let pooled = cx
            .store
            .pooled_of_domain(&name, Some(&info.uuid))
            .map_err(|e| JobFailure::from_error(&e))?;
        let pooled = crate::pool::metadata_of(&pooled, &cx.settings.host_name);
        cx.libvirt
            .set_metadata(
                &name,
                Some(&libvirt::xml::metadata_xml_with(&records, &pooled)),
                affect,
            )
            .map_err(|e| JobFailure::new(libvirt_message(&e)))?;

        progress.phase(DETACH.name);
        for c in carried {
            let functions = c.functions.clone();
            let unplug = Unplug {
                cx,
                info: &info,
                functions: &functions,
            };
            let (live, config) = unplug.definitions().map_err(JobFailure::new)?;
            self.step(
                cx,
                c.id,
                Step::Detach,
                &format!("detaching from {name} to migrate it"),
            )?;
            // From here on, a failure puts the claim back in the domain.
            self.parked
                .push((c.clone(), !live.is_empty(), !config.is_empty()));
            let asked = unplug.request(&live, &config).map_err(JobFailure::new)?;
            match unplug.wait(asked) {
                Waited::Removed => {}
                Waited::Refused(alias) => {
                    return Err(JobFailure::new(format!(
                        "the guest of {name} refused to release {alias}"
                    )))
                }
                Waited::TimedOut(left) => return Err(JobFailure::new(unplug.timed_out(&left))),
            }
            self.step(
                cx,
                c.id,
                Step::Park,
                &format!(
                    "out of {name} for its migration to {}",
                    self.migration.destination
                ),
            )?;
        }

        progress.phase(MIGRATE.name);
        let source = cx.libvirt.uri().unwrap_or_default();
        let started = std::time::Instant::now();
        cx.libvirt
            .migrate(&source, &name, &self.migration)
            .map_err(|e| JobFailure::new(libvirt_message(&e)))?;
        let took = started.elapsed();

        progress.phase(RELEASE.name);
        // The VM runs on the destination: nothing here is its any more.
        let what = format!(
            "released: {name} migrated to {}",
            self.migration.destination
        );
        for c in &self.claims {
            let now = cx.store.claim_record(c.id).ok().flatten();
            let Some(now) = now.filter(|n| n.state.holds()) else {
                continue;
            };
            if now.state == ClaimState::Attached {
                self.step(cx, c.id, Step::Detached, &what)?;
            }
            self.step(cx, c.id, Step::Release, &what)?;
        }
        self.parked.clear();
        Ok(format!(
            "migrated {name} to {} in {:.1} s",
            self.migration.destination,
            took.as_secs_f64()
        ))
    }

    fn rollback(&mut self, cx: &JobContext) -> Result<String, JobFailure> {
        let Some(info) = self.info.clone() else {
            return Ok("nothing to undo".into());
        };
        let mut back = Vec::new();
        let mut left = Vec::new();
        for (c, live, config) in std::mem::take(&mut self.parked) {
            let now = cx.store.claim_record(c.id).ok().flatten();
            let state = now.map(|n| n.state);
            let affect = match (live, config) {
                (true, true) => libvirt::Affect::Both,
                (true, false) => libvirt::Affect::Live,
                _ => libvirt::Affect::Persistent,
            };
            let mut ok = true;
            if state == Some(ClaimState::Claimed) {
                // Out of the domain: attach it again.
                for (i, f) in c.functions.iter().enumerate() {
                    let xml = libvirt::hostdev_xml(*f, &crate::claim::lifecycle::alias(c.id, i));
                    if let Err(e) = cx.libvirt.attach_device(&info.name, &xml, affect) {
                        left.push(format!("{f}: {}", libvirt_message(&e)));
                        ok = false;
                    }
                }
                if ok {
                    let what = format!("attached to {} again: its migration failed", info.name);
                    self.step(cx, c.id, Step::Attach, &what)?;
                    self.step(cx, c.id, Step::Attached, &what)?;
                }
            } else if state == Some(ClaimState::Detaching) {
                // The guest did not let go: it still has the device.
                self.step(
                    cx,
                    c.id,
                    Step::DetachRefused,
                    &format!("kept in {}: its migration failed", info.name),
                )?;
            }
            if ok {
                back.push(c.address.to_string());
            }
        }
        if !left.is_empty() {
            return Err(JobFailure::new(format!(
                "could not attach again: {}",
                left.join("; ")
            )));
        }
        Ok(if back.is_empty() {
            "the domain kept its devices".into()
        } else {
            format!("{} attached to {} again", back.join(", "), info.name)
        })
    }

    fn settles_failures(&self) -> bool {
        true
    }
}
