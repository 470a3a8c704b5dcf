//! The conductor's decisions, pure: whether a reported record may be offered to the fleet
//! ([`verdict`], the completeness rule), and what a report changes in the database
//! ([`compare`]: by key, with the events the changes record).
//!
//! They run inside the host's report transaction (see `super::db`), on the rows that
//! transaction has locked, so the comparison and its writes are one atomic step per host.

use super::record::Record;
use std::collections::BTreeMap;

/// Where a reported function stands in the fleet's pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Complete, usable, selected, free on its host: offered to fleet claims.
    Offered,
    /// Sound but not free: claimed or busy on its host, used by the host, or not selected.
    /// Not an event: this is ordinary life.
    Held(String),
    /// Incomplete or broken: removed from the pool, with an event, until a report shows it
    /// whole again.
    Withdrawn(String),
}

impl Verdict {
    /// The `pool` column's text.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Offered => "offered",
            Verdict::Held(_) => "held",
            Verdict::Withdrawn(_) => "withdrawn",
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            Verdict::Offered => "",
            Verdict::Held(r) | Verdict::Withdrawn(r) => r,
        }
    }
}

/// The completeness rule, then the state: a record missing a key field (ids, class, IOMMU
/// group, a VF's PF) is withdrawn whatever else it says, and so is a broken one.
pub fn verdict(r: &Record) -> Verdict {
    let mut missing = Vec::new();
    if r.vendor_id.is_none() {
        missing.push("vendor id");
    }
    if r.device_id.is_none() {
        missing.push("device id");
    }
    if r.class.is_none() {
        missing.push("class");
    }
    if r.iommu_group.is_none() {
        // VFIO hands out whole IOMMU groups: a function without one cannot be passed through.
        missing.push("IOMMU group");
    }
    if r.role == "vf" && r.parent_pf.is_none() {
        missing.push("parent PF");
    }
    if !missing.is_empty() {
        return Verdict::Withdrawn(format!("incomplete record: no {}", missing.join(", ")));
    }
    match r.state.as_str() {
        "usable" => {}
        "broken" => return Verdict::Withdrawn(format!("broken: {}", r.state_reason)),
        "protected" => return Verdict::Held(format!("used by the host: {}", r.state_reason)),
        other => return Verdict::Withdrawn(format!("unknown state {other:?}")),
    }
    if !r.managed {
        return Verdict::Held("not selected by its host's configuration".into());
    }
    match &r.local_reason {
        Some(why) => Verdict::Held(why.clone()),
        None => Verdict::Offered,
    }
}

/// A device row as the database holds it, for the comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRow {
    pub address: String,
    /// The digest of the record the row was written from.
    pub digest: String,
    /// `offered`, `held` or `withdrawn`.
    pub pool: String,
    pub reservation_id: Option<i64>,
}

/// A reported record with its digest and verdict.
#[derive(Clone, Debug)]
pub struct Judged<'a> {
    pub record: &'a Record,
    pub digest: String,
    pub verdict: Verdict,
}

/// One event row the comparison records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub address: String,
    pub kind: &'static str,
    pub message: String,
}

/// What a report changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Indexes (into the judged records) of rows to insert.
    pub insert: Vec<usize>,
    /// Indexes of rows to rewrite (a field or the verdict changed).
    pub update: Vec<usize>,
    /// Addresses no longer reported, with the reservation that held them, if any.
    pub delete: Vec<(String, Option<i64>)>,
    pub events: Vec<Event>,
}

/// Compares a report with the host's rows, by address.
pub fn compare(stored: &[StoredRow], report: &[Judged<'_>]) -> Changes {
    let mut out = Changes::default();
    let by_address: BTreeMap<&str, &StoredRow> =
        stored.iter().map(|s| (s.address.as_str(), s)).collect();
    let mut reported = std::collections::BTreeSet::new();
    for (i, j) in report.iter().enumerate() {
        let address = j.record.address.to_string();
        let withdrawn = matches!(j.verdict, Verdict::Withdrawn(_));
        let event = |kind, message| Event {
            address: address.clone(),
            kind,
            message,
        };
        match by_address.get(address.as_str()) {
            None => {
                out.insert.push(i);
                out.events
                    .push(event("device-added", format!("{address} reported")));
                if withdrawn {
                    out.events.push(event(
                        "device-withdrawn",
                        format!("{address} not offered: {}", j.verdict.reason()),
                    ));
                }
            }
            Some(s) => {
                if s.digest != j.digest || s.pool != j.verdict.as_str() {
                    out.update.push(i);
                }
                let was_withdrawn = s.pool == "withdrawn";
                if withdrawn && !was_withdrawn {
                    out.events.push(event(
                        "device-withdrawn",
                        format!("{address} removed from the pool: {}", j.verdict.reason()),
                    ));
                } else if !withdrawn && was_withdrawn {
                    out.events.push(event(
                        "device-restored",
                        format!("{address} is whole again"),
                    ));
                }
            }
        }
        reported.insert(address);
    }
    for s in stored {
        if !reported.contains(&s.address) {
            out.delete.push((s.address.clone(), s.reservation_id));
            out.events.push(Event {
                address: s.address.clone(),
                kind: "device-removed",
                message: format!("{} no longer reported by its host", s.address),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim::Snapshot;
    use crate::fleet::record::tests::device;
    use crate::fleet::record::Report;

    fn rec(addr: &str) -> Record {
        let snapshot = Snapshot {
            devices: vec![device(addr)],
            ..Snapshot::default()
        };
        Report::build(&snapshot, &[]).records.remove(0)
    }

    #[test]
    fn the_completeness_rule_and_the_state_decide_the_verdict() {
        let base = rec("0000:3b:02.0");
        type Change = Box<dyn Fn(&mut Record)>;
        let cases: Vec<(&str, Change, Verdict)> = vec![
            ("whole and free", Box::new(|_| {}), Verdict::Offered),
            (
                "no vendor id",
                Box::new(|r| r.vendor_id = None),
                Verdict::Withdrawn("incomplete record: no vendor id".into()),
            ),
            (
                "no ids, no group",
                Box::new(|r| {
                    r.vendor_id = None;
                    r.device_id = None;
                    r.class = None;
                    r.iommu_group = None;
                }),
                Verdict::Withdrawn(
                    "incomplete record: no vendor id, device id, class, IOMMU group".into(),
                ),
            ),
            (
                "a VF without its PF",
                Box::new(|r| r.role = "vf".into()),
                Verdict::Withdrawn("incomplete record: no parent PF".into()),
            ),
            (
                "broken",
                Box::new(|r| {
                    r.state = "broken".into();
                    r.state_reason = "config space reads all-ones".into();
                }),
                Verdict::Withdrawn("broken: config space reads all-ones".into()),
            ),
            (
                "incomplete beats broken",
                Box::new(|r| {
                    r.state = "broken".into();
                    r.class = None;
                }),
                Verdict::Withdrawn("incomplete record: no class".into()),
            ),
            (
                "protected",
                Box::new(|r| {
                    r.state = "protected".into();
                    r.state_reason = "mounted".into();
                }),
                Verdict::Held("used by the host: mounted".into()),
            ),
            (
                "not selected",
                Box::new(|r| r.managed = false),
                Verdict::Held("not selected by its host's configuration".into()),
            ),
            (
                "claimed on its host",
                Box::new(|r| r.local_reason = Some("held by claim 3".into())),
                Verdict::Held("held by claim 3".into()),
            ),
        ];
        for (what, change, wanted) in cases {
            let mut r = base.clone();
            change(&mut r);
            assert_eq!(verdict(&r), wanted, "{what}");
        }
    }

    fn stored(addr: &str, digest: &str, pool: &str, reservation: Option<i64>) -> StoredRow {
        StoredRow {
            address: addr.into(),
            digest: digest.into(),
            pool: pool.into(),
            reservation_id: reservation,
        }
    }

    #[test]
    fn a_report_is_compared_by_key() {
        let (a, b, c) = (
            rec("0000:3b:02.0"),
            rec("0000:3b:02.1"),
            rec("0000:3b:02.2"),
        );
        let judged = |r: &'static Record, d: &str, v: Verdict| Judged {
            record: r,
            digest: d.into(),
            verdict: v,
        };
        let (a, b, c): (&'static Record, &'static Record, &'static Record) = (
            Box::leak(Box::new(a)),
            Box::leak(Box::new(b)),
            Box::leak(Box::new(c)),
        );
        let broken = Verdict::Withdrawn("broken: EIO".into());
        // (stored rows, report) -> (insert, update, delete, event kinds)
        type Case = (
            &'static str,
            Vec<StoredRow>,
            Vec<Judged<'static>>,
            (
                Vec<usize>,
                Vec<usize>,
                Vec<(String, Option<i64>)>,
                Vec<&'static str>,
            ),
        );
        let cases: Vec<Case> = vec![
            (
                "first report",
                vec![],
                vec![
                    judged(a, "1", Verdict::Offered),
                    judged(b, "2", broken.clone()),
                ],
                (
                    vec![0, 1],
                    vec![],
                    vec![],
                    vec!["device-added", "device-added", "device-withdrawn"],
                ),
            ),
            (
                "nothing changed",
                vec![stored("0000:3b:02.0", "1", "offered", None)],
                vec![judged(a, "1", Verdict::Offered)],
                (vec![], vec![], vec![], vec![]),
            ),
            (
                "a device breaks, then comes back",
                vec![
                    stored("0000:3b:02.0", "1", "offered", None),
                    stored("0000:3b:02.1", "2", "withdrawn", None),
                ],
                vec![
                    judged(a, "1b", broken.clone()),
                    judged(b, "2b", Verdict::Offered),
                ],
                (
                    vec![],
                    vec![0, 1],
                    vec![],
                    vec!["device-withdrawn", "device-restored"],
                ),
            ),
            (
                "claimed locally: updated, no event",
                vec![stored("0000:3b:02.0", "1", "offered", None)],
                vec![judged(a, "1c", Verdict::Held("held by claim 1".into()))],
                (vec![], vec![0], vec![], vec![]),
            ),
            (
                "a device the host stops reporting goes, with its reservation",
                vec![
                    stored("0000:3b:02.0", "1", "offered", None),
                    stored("0000:3b:02.2", "3", "offered", Some(9)),
                ],
                vec![judged(a, "1", Verdict::Offered)],
                (
                    vec![],
                    vec![],
                    vec![("0000:3b:02.2".into(), Some(9))],
                    vec!["device-removed"],
                ),
            ),
            (
                "a new device beside known ones",
                vec![stored("0000:3b:02.0", "1", "offered", None)],
                vec![
                    judged(a, "1", Verdict::Offered),
                    judged(c, "3", Verdict::Offered),
                ],
                (vec![1], vec![], vec![], vec!["device-added"]),
            ),
        ];
        for (what, rows, report, (insert, update, delete, kinds)) in cases {
            let out = compare(&rows, &report);
            assert_eq!(out.insert, insert, "{what}");
            assert_eq!(out.update, update, "{what}");
            assert_eq!(out.delete, delete, "{what}");
            let got: Vec<_> = out.events.iter().map(|e| e.kind).collect();
            assert_eq!(got, kinds, "{what}");
        }
    }
}
