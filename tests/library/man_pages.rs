//! The four man pages, as `make install` prints them from the built binaries: each is valid roff
//! that groff formats without a warning (`-ww`), has its sections, and says what its source says
//! (vfioctl(1) every exit code, vfiod.toml(5) every section and key of docs/config.md), and no
//! page shows a hidden option.

use crate::common::bins;
use std::process::Command;

/// `(binary, arguments, name, section)` of each page.
fn pages() -> [(String, &'static [&'static str], &'static str, &'static str); 4] {
    [
        (
            env!("CARGO_BIN_EXE_vfioctl").into(),
            &["man"],
            "vfioctl",
            "1",
        ),
        (bins::vfiod_pool(), &["man"], "vfiod-pool", "1"),
        (
            env!("CARGO_BIN_EXE_vfiod").into(),
            &["--man", "vfiod.8"],
            "vfiod",
            "8",
        ),
        (
            env!("CARGO_BIN_EXE_vfiod").into(),
            &["--man", "vfiod.toml.5"],
            "vfiod.toml",
            "5",
        ),
    ]
}

fn page(binary: &str, args: &[&str]) -> String {
    let out = Command::new(binary).args(args).output().expect("run");
    assert!(out.status.success(), "{binary} {args:?}: {out:?}");
    assert!(
        out.stderr.is_empty(),
        "{binary} {args:?} wrote on stderr: {out:?}"
    );
    String::from_utf8(out.stdout).expect("UTF-8 roff")
}

/// groff's text rendering of `roff`, failing on any warning; None where groff is missing.
fn groff(roff: &str, what: &str) -> Option<String> {
    use std::io::Write;
    let mut child = match Command::new("groff")
        .args(["-man", "-Tutf8", "-ww", "-P-c", "-P-b", "-P-u"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("groff is not installed: {what} checked as roff source only");
            return None;
        }
        Err(e) => panic!("groff: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(roff.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "groff warns about {what}:\n{stderr}"
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn every_page_renders_without_warnings_and_has_its_sections() {
    for (binary, args, name, section) in pages() {
        let roff = page(&binary, args);
        let what = format!("{name}({section})");
        assert!(
            roff.contains(&format!(".TH {name} {section} ")),
            "{what}: no title line"
        );
        let mut sections = vec!["NAME", "DESCRIPTION", "SEE ALSO"];
        if section != "5" {
            sections.extend(["SYNOPSIS", "OPTIONS"]);
        }
        for s in &sections {
            let quoted = format!(".SH \"{s}\"\n");
            let plain = format!(".SH {s}\n");
            assert!(
                roff.contains(&quoted) || roff.contains(&plain),
                "{what}: no {s} section"
            );
        }
        // clap_mangen's own SUBCOMMANDS section names pages that nothing installs.
        assert!(!roff.contains("SUBCOMMANDS"), "{what}: {roff}");
        if let Some(text) = groff(&roff, &what) {
            for s in &sections {
                assert!(text.contains(s), "{what}: {s} not in the formatted page");
            }
        }
    }
}

#[test]
fn vfioctl_page_documents_every_exit_code_and_command() {
    let roff = page(env!("CARGO_BIN_EXE_vfioctl"), &["man"]);
    let text = groff(&roff, "vfioctl(1)").unwrap_or_else(|| roff.clone());
    let exit = text.find("EXIT STATUS").expect("an EXIT STATUS section");
    for (code, meaning) in vfiod::client::exit::TABLE {
        let line = format!(
            "{code}      {}",
            meaning.split(' ').next().unwrap_or(meaning)
        );
        assert!(
            roff.contains(&format!(".TP\n\\fB{code}\\fR\n{meaning}\n")),
            "exit code {code} not documented"
        );
        if text != roff {
            assert!(
                text[exit..].contains(&line),
                "{line:?} not in:\n{}",
                &text[exit..]
            );
        }
    }
    // Each command in COMMANDS with its own options; the hidden ones not at all.
    for command in [
        "vfioctl list",
        "vfioctl task list",
        "vfioctl image add",
        "vfioctl events",
    ] {
        assert!(text.contains(command), "{command} not in the page");
    }
    assert!(
        !text.contains("vfioctl hook"),
        "the hidden hook command is in the page"
    );
    assert!(
        !text.contains("vfioctl man"),
        "the hidden man command is in the page"
    );
}

#[test]
fn hidden_man_options_stay_out_of_their_pages() {
    let daemon = page(env!("CARGO_BIN_EXE_vfiod"), &["--man", "vfiod.8"]);
    assert!(!daemon.contains("\\-\\-man"), "{daemon}");
    assert!(daemon.contains("\\-\\-check\\-config"), "{daemon}");
    let pool = page(&bins::vfiod_pool(), &["man"]);
    assert!(!pool.contains("vfiod\\-pool man"), "{pool}");
    assert!(pool.contains("vfiod\\-pool drive"), "{pool}");
}

#[test]
fn config_page_says_what_docs_config_md_says() {
    let roff = page(env!("CARGO_BIN_EXE_vfiod"), &["--man", "vfiod.toml.5"]);
    let text = groff(&roff, "vfiod.toml(5)").unwrap_or(roff);
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/config.md")).unwrap();
    // Every heading, and every key of every table (a row's first cell).
    for line in source.lines() {
        let wanted = if let Some(h) = line.strip_prefix("## ") {
            h.replace('`', "")
        } else if line.starts_with("| `") {
            line.split('|').nth(1).unwrap().trim().replace('`', "")
        } else {
            continue;
        };
        assert!(
            text.contains(&wanted),
            "{wanted:?} of docs/config.md is not in vfiod.toml(5)"
        );
    }
    assert!(text.contains("vfiod.toml - vfiod configuration"), "{text}");
}
