//! The doctor's report for a terminal of 80 columns: one block per check (verdict, name,
//! evidence; the fix below it), then the summary line. Pure.

use super::{Report, Verdict};

/// The widest line printed.
pub const WIDTH: usize = 80;
/// Where the check's name starts, and where its evidence starts.
const NAME_AT: usize = 6;
const EVIDENCE_AT: usize = 27;
/// Where the fix starts (`fix: ` at [`NAME_AT`]) and where its continuation lines start.
const FIX_CONTINUED_AT: usize = NAME_AT + 5;

/// `text` in lines of at most `width` characters, broken at spaces; a word longer than a line
/// (a path) is broken where the line ends.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let mut word: Vec<char> = word.chars().collect();
        loop {
            let used = line.chars().count();
            let gap = usize::from(used > 0);
            if used + gap + word.len() <= width {
                if gap == 1 {
                    line.push(' ');
                }
                line.extend(word.iter());
                break;
            }
            if word.len() > width {
                // Fill this line (or a fresh one) with the word's head.
                let room = if used == 0 { width } else { width - used - 1 };
                if room == 0 {
                    lines.push(std::mem::take(&mut line));
                    continue;
                }
                if used > 0 {
                    line.push(' ');
                }
                line.extend(word[..room].iter());
                lines.push(std::mem::take(&mut line));
                word.drain(..room);
                if word.is_empty() {
                    break;
                }
                continue;
            }
            lines.push(std::mem::take(&mut line));
        }
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}

/// The report as text, every line at most [`WIDTH`] columns (plus a newline).
pub fn text(report: &Report) -> String {
    let mut out = String::new();
    if report.root != "/" {
        for l in wrap(&format!("host root: {}", report.root), WIDTH) {
            out.push_str(&format!("{l}\n"));
        }
    }
    for c in &report.checks {
        let head = format!("{:<w$}{}", c.verdict.as_str(), c.name, w = NAME_AT);
        let evidence = wrap(&c.evidence, WIDTH - EVIDENCE_AT);
        let mut lines = evidence.iter();
        if head.chars().count() < EVIDENCE_AT {
            let first = lines.next().map(String::as_str).unwrap_or("");
            out.push_str(&format!("{head:<w$}{first}\n", w = EVIDENCE_AT));
        } else {
            out.push_str(&format!("{head}\n"));
        }
        for l in lines {
            out.push_str(&format!("{:w$}{l}\n", "", w = EVIDENCE_AT));
        }
        if c.verdict != Verdict::Ok && !c.fix.is_empty() {
            let fix = wrap(&format!("fix: {}", c.fix), WIDTH - NAME_AT);
            for (i, l) in fix.iter().enumerate() {
                if i == 0 {
                    out.push_str(&format!("{:w$}{l}\n", "", w = NAME_AT));
                } else {
                    // Continuations are narrower: re-wrap what is left at their width.
                    let rest = fix[i..].join(" ");
                    for r in wrap(&rest, WIDTH - FIX_CONTINUED_AT) {
                        out.push_str(&format!("{:w$}{r}\n", "", w = FIX_CONTINUED_AT));
                    }
                    break;
                }
            }
        }
    }
    out.push_str(&format!(
        "verdict: {} ({})\n",
        report.verdict.as_str(),
        report.tally()
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::{Check, Report, Verdict};

    #[test]
    fn wrap_breaks_at_spaces_and_inside_words_longer_than_a_line() {
        let table: [(&str, usize, &[&str]); 5] = [
            ("", 10, &[""]),
            ("one two three", 7, &["one two", "three"]),
            ("one two three", 80, &["one two three"]),
            (
                "/a/very/long/path x",
                6,
                &["/a/ver", "y/long", "/path", "x"],
            ),
            ("ab /abcdefgh", 6, &["ab /ab", "cdefgh"]),
        ];
        for (text, width, want) in table {
            assert_eq!(wrap(text, width), want, "{text:?} at {width}");
        }
    }

    #[test]
    fn every_line_fits_80_columns_and_fixes_follow_what_is_wrong() {
        let long = "a very long piece of evidence naming /sys/bus/pci/devices/0000:17:00.1 \
                    and /sys/kernel/iommu_groups/12/devices and more words to wrap around";
        let report = Report::new(
            "/tmp/some/simulated/root/that/is/quite/long/indeed/and/goes/past/the/edge/of/80",
            vec![
                Check {
                    name: "iommu groups".into(),
                    verdict: Verdict::Ok,
                    evidence: "24 groups in /sys/kernel/iommu_groups".into(),
                    fix: String::new(),
                },
                Check {
                    name: "group 0000:17:00.0".into(),
                    verdict: Verdict::Fail,
                    evidence: long.into(),
                    fix: long.into(),
                },
                Check {
                    name: "a check whose name is longer than its column".into(),
                    verdict: Verdict::Warn,
                    evidence: "short".into(),
                    fix: "do it".into(),
                },
            ],
        );
        let text = text(&report);
        for line in text.lines() {
            assert!(line.chars().count() <= WIDTH, "{line:?}\n{text}");
        }
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("host root:"), "{text}");
        assert!(text.contains("/tmp/some/simulated/root"), "{text}");
        let ok = lines
            .iter()
            .position(|l| l.starts_with("ok    iommu groups"))
            .unwrap();
        assert_eq!(
            lines[ok],
            "ok    iommu groups         24 groups in /sys/kernel/iommu_groups"
        );
        // An ok check has no fix line; the failing one's fix follows its evidence.
        assert!(!lines[ok + 1].trim_start().starts_with("fix:"), "{text}");
        let failing = lines
            .iter()
            .position(|l| l.starts_with("fail  group"))
            .unwrap();
        let fix = lines[failing..]
            .iter()
            .position(|l| l.starts_with("      fix: a very long"))
            .expect("a fix line");
        assert!(fix > 1, "{text}");
        assert!(text.contains("warn  a check whose name is longer than its column\n"));
        assert_eq!(
            lines.last().unwrap(),
            &"verdict: fail (1 failure, 1 warning, 1 ok)"
        );
    }
}
