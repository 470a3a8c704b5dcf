//! The domain XML parser (`host::libvirt::xml::parse_domain`, what the qemu hook and the
//! daemon run on a hook's stdin) on 16 MiB inputs (the hook's size cap, `client::hook::MAX_XML`)
//! built for roxmltree's quadratic cases and for the bounds vfiod puts on them (issue 24): one
//! element with a million attributes, many elements with many attributes, namespaces declared
//! deep and wide, the node cap, deep nesting, huge texts. Each is answered (parsed or refused),
//! and the time is reported absolute and as a ratio against a reference measured in the same
//! run on the same bytes: their SHA-256, one linear pass.
//!
//! Run: `cargo bench --bench domain_xml`. Target: every input answered in under 1 s (the hook's
//! deadline is 10 s). `VFIOD_BENCH_RUNS` sets the runs of each (default 3; the slowest counts).
//! Exits 1 when an input misses the target.

use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};
use vfiod::client::hook::MAX_XML;
use vfiod::host::libvirt::xml::{parse_domain, MAX_ATTRIBUTES_PER_ELEMENT, MAX_NODES};

const TARGET: Duration = Duration::from_secs(1);

/// `<domain>` around `inner` in its `<metadata>` (kept verbatim by libvirt), padded with a
/// comment to exactly `MAX_XML` bytes.
fn domain(inner: &str) -> String {
    let head = "<domain type='kvm'><name>vm1</name><metadata>";
    let tail = "</metadata><devices/></domain>";
    let mut xml = String::with_capacity(MAX_XML);
    xml.push_str(head);
    xml.push_str(inner);
    xml.push_str(tail);
    pad(xml)
}

fn pad(mut xml: String) -> String {
    if xml.len() + 7 <= MAX_XML {
        let room = MAX_XML - xml.len() - 7;
        xml.push_str("<!--");
        xml.extend(std::iter::repeat_n(' ', room));
        xml.push_str("-->");
    }
    xml
}

/// `unit` repeated to fill `bytes`.
fn fill(unit: &str, bytes: usize) -> String {
    unit.repeat(bytes / unit.len())
}

fn attributes(n: usize) -> String {
    (0..n).map(|i| format!(" a{i}='1'")).collect()
}

fn cases() -> Vec<(&'static str, String)> {
    let room = MAX_XML - 200;
    let mut out = Vec::new();
    // The reproducer scaled to the cap: one <hostdev> with ~1.5 M attributes.
    let one: String = {
        let mut s = String::from("<hostdev mode='subsystem' type='pci'");
        let mut i = 0;
        while s.len() < room - 64 {
            s.push_str(&format!(" a{i}='1'"));
            i += 1;
        }
        s.push_str("/>");
        s
    };
    out.push((
        "one element, attributes to the cap",
        pad(format!(
            "<domain><name>vm1</name><devices>{one}</devices></domain>"
        )),
    ));
    // Elements each with the most attributes one may have: refused by the total.
    let max = MAX_ATTRIBUTES_PER_ELEMENT as usize;
    out.push((
        "elements of 1024 attributes",
        domain(&fill(&format!("<x{}/>", attributes(max)), room)),
    ));
    // Elements of 32 attributes: accepted until the document's attribute cap.
    out.push((
        "elements of 32 attributes",
        domain(&fill(&format!("<x{}/>", attributes(32)), room)),
    ));
    // The most costly input accepted: elements of 256 attributes, just under the work bound,
    // then padding.
    out.push((
        "elements of 256 attributes, accepted",
        domain(&format!("<x{}/>", attributes(256)).repeat(1000)),
    ));
    out.push((
        "elements of 32 attributes, accepted",
        domain(&format!("<x{}/>", attributes(32)).repeat(31_000)),
    ));
    // Each element declares a namespace inside the previous one: quadratic copies.
    let nested: String = {
        let mut s = String::new();
        let mut i = 0;
        while s.len() < room / 2 {
            s.push_str(&format!("<p{i}:x xmlns:p{i}='u'>"));
            i += 1;
        }
        for j in (0..i).rev() {
            s.push_str(&format!("</p{j}:x>"));
        }
        s
    };
    out.push(("namespaces declared deep", domain(&nested)));
    // Prefixed names under 1000 namespaces: a scan of them all per name.
    let declarations: String = (0..1000).map(|i| format!(" xmlns:p{i}='u{i}'")).collect();
    out.push((
        "prefixed names under 1000 namespaces",
        domain(&format!(
            "<m{declarations}>{}</m>",
            fill("<p7:y p7:a='1'/>", room - 20_000)
        )),
    ));
    out.push((
        "empty elements to the node cap",
        domain(&fill("<a/>", room)),
    ));
    out.push((
        "empty elements under the node cap",
        domain(&"<a/>".repeat(MAX_NODES as usize - 100)),
    ));
    out.push((
        "nesting 2 M deep",
        domain(&format!(
            "{}{}",
            "<x>".repeat(room / 7),
            "</x>".repeat(room / 7)
        )),
    ));
    out.push((
        "text and CDATA alternating",
        domain(&fill("a<![CDATA[b]]>", room)),
    ));
    out.push((
        "one text of 16 MiB",
        domain(&format!("<description>{}</description>", "x".repeat(room))),
    ));
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let runs: usize = std::env::var("VFIOD_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let mut failed = false;
    println!(
        "{:<40} {:>10} {:>10} {:>8}  answer",
        "input (16 MiB)", "parse ms", "sha256 ms", "ratio"
    );
    for (name, xml) in cases() {
        assert!(xml.len() <= MAX_XML, "{name}: {} bytes", xml.len());
        let mut worst = Duration::ZERO;
        let mut reference = Duration::MAX;
        let mut answer = String::new();
        for _ in 0..runs {
            // Interleaved, so that drift on a shared machine hits both alike.
            let t = Instant::now();
            let digest = Sha256::digest(xml.as_bytes());
            reference = reference.min(t.elapsed());
            std::hint::black_box(digest);
            let t = Instant::now();
            let r = parse_domain(std::hint::black_box(&xml));
            worst = worst.max(t.elapsed());
            answer = match r {
                Ok(d) => format!("parsed ({} hostdevs)", d.hostdevs.len()),
                Err(e) => format!("refused: {}", e.chars().take(90).collect::<String>()),
            };
        }
        let ratio = worst.as_secs_f64() / reference.as_secs_f64();
        let ok = worst < TARGET;
        failed |= !ok;
        println!(
            "{:<40} {:>10.1} {:>10.1} {:>8.2}  {}{answer}",
            name,
            ms(worst),
            ms(reference),
            ratio,
            if ok { "" } else { "OVER 1 s: " }
        );
    }
    if failed {
        eprintln!("an input was not answered within {TARGET:?}");
        std::process::exit(1);
    }
    println!("every input answered within {TARGET:?}");
}
