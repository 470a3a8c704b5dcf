//! Loading configuration files from disk: the malformed files under `tests/data/config/bad`, the
//! shipped default, drop-ins, and the examples in `docs/config.md`.
//!
//! Each file in `bad/` starts with two comment lines:
//! `# expect: <substring of the error>` and `# at: <line>:<column>` (1-based, characters).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;
use vfiod::config::{ConfigError, Scenario, Settings};

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The value of `# <name>: <value>` on line `index` of a test file.
fn header<'a>(path: &Path, text: &'a str, index: usize, name: &str) -> &'a str {
    let prefix = format!("# {name}: ");
    text.lines()
        .nth(index)
        .and_then(|line| line.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| {
            panic!(
                "{}: line {} must be `{prefix}...`",
                path.display(),
                index + 1
            )
        })
}

#[test]
fn malformed_files_are_rejected_with_file_line_and_reason() {
    let dir = repo_path("tests/data/config/bad");
    let mut paths: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 12,
        "only {} bad files in {}",
        paths.len(),
        dir.display()
    );

    for path in &paths {
        let text = fs::read_to_string(path).unwrap();
        let expect = header(path, &text, 0, "expect");
        let at = header(path, &text, 1, "at");
        let (line, column) = at
            .split_once(':')
            .map(|(l, c)| (l.parse::<usize>().unwrap(), c.parse::<usize>().unwrap()))
            .unwrap_or_else(|| panic!("{}: bad `# at:` {at:?}", path.display()));

        // Through `load`, as the daemon reads it, and as a drop-in after a valid main file.
        let err = Settings::load(path, None, true).expect_err(&path.display().to_string());
        let message = err.to_string();
        let prefix = format!("{}:{line}:{column}: ", path.display());
        assert!(
            message.starts_with(&prefix),
            "{message}\n  does not start with {prefix:?}"
        );
        assert!(
            message.contains(expect),
            "{message}\n  does not contain {expect:?}"
        );
        match err {
            ConfigError::Invalid {
                file,
                line: l,
                column: c,
                ..
            } => {
                assert_eq!((file.as_path(), l, c), (path.as_path(), line, column));
            }
            other => panic!("{}: expected Invalid, got {other:?}", path.display()),
        }
    }
}

#[test]
fn bad_dropin_after_good_main_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("vfiod.toml");
    fs::write(
        &main,
        "scenario = \"public\"\n[[select]]\nid = \"8086:4940\"\n",
    )
    .unwrap();
    let dropins = tmp.path().join("conf.d");
    fs::create_dir(&dropins).unwrap();
    fs::write(dropins.join("10-good.toml"), "poll_interval = 60\n").unwrap();
    let bad = dropins.join("20-bad.toml");
    fs::write(
        &bad,
        "# a typo on line 3\n\n[[protect]]\nadress = \"0000:00:1f.6\"\n",
    )
    .unwrap();
    fs::write(dropins.join("30-later.toml"), "poll_interval = 90\n").unwrap();

    let err = Settings::load(&main, Some(&dropins), true).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}:4:1: [[protect]] #1: unknown field `adress`, expected one of `address`, `id`, `class`",
            bad.display()
        )
    );

    // The same directory without the bad file loads, with every source recorded in order.
    fs::remove_file(&bad).unwrap();
    let settings = Settings::load(&main, Some(&dropins), true).unwrap();
    assert_eq!(settings.poll_interval, Duration::from_secs(90));
    assert_eq!(settings.scenario, Scenario::Public);
    assert_eq!(
        settings.sources,
        [
            main,
            dropins.join("10-good.toml"),
            dropins.join("30-later.toml")
        ]
    );
}

#[test]
fn shipped_default_file_loads_to_the_defaults() {
    let path = repo_path("conf/vfiod.toml");
    let settings = Settings::load(&path, None, true).unwrap();
    assert_eq!(settings.sources, [path]);
    assert_eq!(
        Settings {
            sources: Vec::new(),
            ..settings
        },
        Settings::default()
    );
}

#[test]
fn shipped_default_sets_every_key_and_its_examples_are_valid() {
    let text = fs::read_to_string(repo_path("conf/vfiod.toml")).unwrap();
    for key in [
        "scenario",
        "poll_interval",
        "state_dir",
        "sysfs_root",
        "libvirt_uri",
        "default_lease_seconds",
    ] {
        let set = text
            .lines()
            .any(|line| line.starts_with(&format!("{key} = ")));
        assert!(set, "conf/vfiod.toml does not set `{key}`");
    }
    // Uncommenting the examples must give a valid file: they are what operators copy.
    let is_example = |line: &str| {
        line.starts_with('[')
            || line.split_once(" = ").is_some_and(|(key, _)| {
                !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            })
    };
    let uncommented: String = text
        .lines()
        .map(|line| {
            line.strip_prefix("# ")
                .filter(|l| is_example(l))
                .unwrap_or(line)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    let settings = Settings::from_toml_str(&uncommented, Path::new("uncommented.toml")).unwrap();
    assert_eq!(settings.select.len(), 2, "{uncommented}");
    assert_eq!(settings.protect.len(), 1, "{uncommented}");
    assert_eq!(settings.fpga.len(), 1, "{uncommented}");
    assert_eq!(settings.clean.len(), 1, "{uncommented}");
    assert!(settings.metrics.textfile.is_some(), "{uncommented}");
}

#[test]
fn non_utf8_file_is_rejected_at_the_first_bad_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("latin1.toml");
    // "façade" in Latin-1 on line 2: 0xe7 is not valid UTF-8 on its own.
    fs::write(&path, b"scenario = \"public\"\n# fa\xe7ade\n").unwrap();
    let err = Settings::load(&path, None, true).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("{}:2:5: file is not valid UTF-8", path.display())
    );
}

#[test]
fn every_toml_example_in_the_docs_loads() {
    let docs = fs::read_to_string(repo_path("docs/config.md")).unwrap();
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in docs.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```toml") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(!blocks.is_empty(), "no ```toml blocks in docs/config.md");
    for (index, block) in blocks.iter().enumerate() {
        let origin = PathBuf::from(format!("docs/config.md block {}", index + 1));
        if let Err(err) = Settings::from_toml_str(block, &origin) {
            panic!("{err}\n{block}");
        }
    }
}

#[test]
fn libvirt_uri_defaults_to_the_system_qemu_driver_and_empty_turns_the_check_off() {
    let parse = |t: &str| Settings::from_toml_str(t, Path::new("t.toml")).unwrap();
    assert_eq!(
        parse("").libvirt_uri.as_deref(),
        Some(vfiod::config::DEFAULT_LIBVIRT_URI)
    );
    assert_eq!(parse("libvirt_uri = \"\"\n").libvirt_uri, None);
    assert_eq!(
        parse("libvirt_uri = \"qemu+unix:///system?socket=/run/x\"\n")
            .libvirt_uri
            .as_deref(),
        Some("qemu+unix:///system?socket=/run/x")
    );
    // A later file replaces the value, "" included.
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("vfiod.toml");
    let conf_d = dir.path().join("conf.d");
    fs::create_dir(&conf_d).unwrap();
    fs::write(&main, "libvirt_uri = \"test:///default\"\n").unwrap();
    fs::write(conf_d.join("10-off.toml"), "libvirt_uri = \"\"\n").unwrap();
    assert_eq!(
        Settings::load(&main, Some(&conf_d), true)
            .unwrap()
            .libvirt_uri,
        None
    );
}

/// Runs `load` on a thread and waits at most a few seconds for it: a load that blocks (a FIFO
/// opened for reading waits for a writer) fails the test instead of hanging it.
fn load_within_seconds(main: PathBuf, dropins: Option<PathBuf>) -> Result<Settings, ConfigError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Settings::load(&main, dropins.as_deref(), true));
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("loading the configuration blocked")
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(
        path,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
}

#[test]
fn fifo_main_file_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("vfiod.toml");
    mkfifo(&main);
    let err = load_within_seconds(main.clone(), None).unwrap_err();
    assert_eq!(
        vfiod::error_chain(&err),
        format!(
            "{}: cannot read config file: is a FIFO (named pipe), not a regular file",
            main.display()
        )
    );
}

#[test]
fn fifo_dropin_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("vfiod.toml");
    fs::write(&main, "scenario = \"public\"\n").unwrap();
    let dropins = tmp.path().join("conf.d");
    fs::create_dir(&dropins).unwrap();
    fs::write(dropins.join("10-good.toml"), "poll_interval = 60\n").unwrap();
    let fifo = dropins.join("20-fifo.toml");
    mkfifo(&fifo);
    let err = load_within_seconds(main, Some(dropins)).unwrap_err();
    assert!(
        matches!(&err, ConfigError::File { file, .. } if *file == fifo),
        "{err:?}"
    );
    assert_eq!(
        vfiod::error_chain(&err),
        format!(
            "{}: cannot read drop-in file: is a FIFO (named pipe), not a regular file",
            fifo.display()
        )
    );
}

#[test]
fn dropins_that_are_not_files_are_refused_by_what_they_are() {
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("vfiod.toml");
    fs::write(&main, "").unwrap();
    let dropins = tmp.path().join("conf.d");
    fs::create_dir(&dropins).unwrap();

    let dir = dropins.join("10-dir.toml");
    fs::create_dir(&dir).unwrap();
    let err = load_within_seconds(main.clone(), Some(dropins.clone())).unwrap_err();
    assert_eq!(
        vfiod::error_chain(&err),
        format!(
            "{}: cannot read drop-in file: is a directory, not a regular file",
            dir.display()
        )
    );
    fs::remove_dir(&dir).unwrap();

    let socket = dropins.join("10-socket.toml");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let err = load_within_seconds(main.clone(), Some(dropins.clone())).unwrap_err();
    assert_eq!(
        vfiod::error_chain(&err),
        format!(
            "{}: cannot read drop-in file: is a socket, not a regular file",
            socket.display()
        )
    );
    fs::remove_file(&socket).unwrap();

    // A link to a regular file is a regular file.
    let target = tmp.path().join("shared.toml");
    fs::write(&target, "poll_interval = 45\n").unwrap();
    std::os::unix::fs::symlink(&target, dropins.join("10-link.toml")).unwrap();
    let settings = load_within_seconds(main, Some(dropins)).unwrap();
    assert_eq!(settings.poll_interval, Duration::from_secs(45));
}

#[test]
fn oversize_file_is_refused_before_it_is_parsed() {
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("vfiod.toml");
    // Valid TOML (comments), one byte over the bound: only the size is wrong.
    let mut text = "# padding\n".repeat((1 << 20) / 10 + 1);
    text.truncate((1 << 20) + 1);
    fs::write(&main, text).unwrap();
    let err = Settings::load(&main, None, true).unwrap_err();
    assert_eq!(
        vfiod::error_chain(&err),
        format!(
            "{}: cannot read config file: is larger than 1048576 bytes",
            main.display()
        )
    );
}

#[test]
fn huge_driver_name_is_refused_with_a_short_message() {
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("vfiod.toml");
    let name = "x".repeat(1_000_000);
    fs::write(
        &main,
        format!("[[select]]\nid = \"8086:4940\"\nvf_driver = \"{name}\"\n"),
    )
    .unwrap();
    let err = Settings::load(&main, None, true).unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "{}:3:13: `vf_driver` in [[select]] #1: 1000000 bytes is too long, at most 55 allowed",
            main.display()
        )),
        "{}",
        &message[..message.len().min(300)]
    );
    assert!(
        message.len() < 300,
        "{} bytes: {}…",
        message.len(),
        &message[..300]
    );
}

#[test]
fn integer_beyond_64_bits_says_too_large_with_key_and_range() {
    let parse = |text: &str| {
        Settings::from_toml_str(text, Path::new("t.toml"))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        parse("poll_interval = 99999999999999999999\n"),
        "t.toml:1:17: `poll_interval`: the number is too large (beyond 64 bits): \
         expected 1..=86400 seconds"
    );
    assert_eq!(
        parse("[[select]]\nid = \"8086:*\"\nnum_vfs = -99999999999999999999\n"),
        "t.toml:3:11: `num_vfs` in [[select]] #1: the number is too large (beyond 64 bits): \
         expected 1..=65535"
    );
}

#[test]
fn check_config_warns_about_a_driver_no_module_provides_and_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    // A fake host: vfio-pci registered, the release's module index lists qat_4xxx.
    let root = tmp.path().join("root");
    fs::create_dir_all(root.join("sys/bus/pci/drivers/vfio-pci")).unwrap();
    fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    fs::create_dir_all(root.join("proc/sys/kernel")).unwrap();
    fs::write(root.join("proc/sys/kernel/osrelease"), "6.1.0-test\n").unwrap();
    let modules = root.join("lib/modules/6.1.0-test");
    fs::create_dir_all(&modules).unwrap();
    fs::write(
        modules.join("modules.dep"),
        "kernel/drivers/crypto/intel/qat/qat_4xxx/qat_4xxx.ko.zst: kernel/drivers/crypto/intel/qat/qat_common/intel_qat.ko.zst\n",
    )
    .unwrap();
    fs::write(
        modules.join("modules.builtin"),
        "kernel/drivers/pci/pci-stub.ko\n",
    )
    .unwrap();

    let config = tmp.path().join("10-x.toml");
    fs::write(
        &config,
        format!(
            "sysfs_root = \"{}\"\n\n[[select]]\nid = \"8086:4940\"\nvf_driver = \"vfio-pcii\"\n\
             pf_driver = \"qat-4xxx\"\n\n[[select]]\nclass = \"0x03\"\nvf_driver = \"vfio-pci\"\n\
             pf_driver = \"pci_stub\"\n",
            root.display()
        ),
    )
    .unwrap();
    let conf_d = tmp.path().join("conf.d");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfiod"))
        .arg("--check-config")
        .arg("--config")
        .arg(&config)
        .arg("--conf-dir")
        .arg(&conf_d)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.starts_with("configuration OK"), "{stdout}");
    // The rules match no function of this bare root: those warnings are another test's.
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("warning: ") && !l.contains("matches no PCI function"))
        .collect();
    assert_eq!(
        warnings,
        [format!(
            "warning: vf_driver \"vfio-pcii\" ({}:5:13) is not a loaded driver, a module or \
             built in: a task that needs it will be refused",
            config.display()
        )],
        "{stderr}"
    );
}

/// `vfiod --check-config` lists each `[[select]]` rule with where it is and its settings, and
/// warns about a rule that an earlier one leaves no device (the issue's `8086:*` before
/// `8086:1572 num_vfs=8`); the configuration is still valid (exit 0), as the daemon would run it.
#[test]
fn check_config_lists_each_rule_and_warns_of_a_shadowed_one() {
    let tmp = tempfile::tempdir().unwrap();
    // The simulated reference host (an X710 8086:1572, a GPU, ...; no serial bus controller).
    let kernel = vfiod::sim::kernel::SimKernel::build(
        &tmp.path().join("root"),
        &vfiod::sim::kernel::HostModel::reference(),
    )
    .unwrap();
    let config = tmp.path().join("vfiod.toml");
    fs::write(
        &config,
        format!(
            "sysfs_root = \"{}\"\n\n[[select]]\nid = \"8086:*\"\n\n[[select]]\nid = \"8086:1572\"\n\
             mode = \"vf\"\nnum_vfs = 8\n\n[[select]]\nclass = \"0x0c\"\n",
            kernel.root().display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfiod"))
        .arg("--check-config")
        .arg("--config")
        .arg(&config)
        .arg("--conf-dir")
        .arg(tmp.path().join("conf.d"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    let c = config.display();
    for line in [
        "select: 3 rule(s)".to_string(),
        format!("  #1 id=8086:* ({c}:3:1)"),
        format!("  #2 id=8086:1572 ({c}:6:1): mode=vf num_vfs=8"),
        format!("  #3 class=0x0c ({c}:11:1)"),
    ] {
        assert!(
            stdout.lines().any(|l| l == line),
            "no line {line:?} in\n{stdout}"
        );
    }
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("warning: "))
        .collect();
    let unmatched = |n: usize, sel: &str, line: usize| {
        format!(
            "warning: select rule #{n} ({sel}, {c}:{line}:1) matches no PCI function on this host \
             now (a VF appears only once its PF is split)"
        )
    };
    assert_eq!(
        warnings,
        [
            format!(
                "warning: select rule #2 (id=8086:1572, {c}:6:1) never applies: every device it \
                 selects matches rule #1 (id=8086:*, {c}:3:1) before it, whose settings apply; \
                 put the narrower rule first"
            ),
            unmatched(3, "class=0x0c", 11),
        ],
        "{stderr}"
    );
}

/// `vfiod --check-config` names every error, not the first only: each syntax error of a file
/// (in reading order), a file's unknown key, and once the files parse, each wrong top-level key
/// and each wrong entry, in the order the daemon validates them; then their count, exit 1.
#[test]
fn check_config_reports_every_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("conf.d");
    fs::create_dir(&dir).unwrap();
    let config = tmp.path().join("vfiod.toml");
    let check = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfiod"))
            .arg("--check-config")
            .arg("--config")
            .arg(&config)
            .arg("--conf-dir")
            .arg(&dir)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        assert!(out.stdout.is_empty(), "{out:?}");
        String::from_utf8(out.stderr).unwrap()
    };
    // Values wrong in four sections; the files parse.
    fs::write(
        &config,
        "scenario = \"cloudy\"\npoll_interval = 0\n[[select]]\nid = \"8086:zz\"\n[[select]]\n\
         id = \"8086:1572\"\n[[select]]\nid = \"8086:1572\"\nnum_vfs = 0\n[[protect]]\n\
         class = \"0xZZ\"\n",
    )
    .unwrap();
    let c = config.display();
    let errors = check();
    let lines: Vec<&str> = errors.lines().collect();
    assert_eq!(lines.len(), 6, "{errors}");
    for (line, want) in lines.iter().zip([
        format!("vfiod: {c}:1:12: `scenario`: invalid scenario"),
        format!("vfiod: {c}:2:17: `poll_interval`: 0 is out of range"),
        format!("vfiod: {c}:4:6: `id` in [[select]] #1: invalid id \"8086:zz\""),
        format!("vfiod: {c}:9:11: `num_vfs` in [[select]] #3: 0 is out of range"),
        format!("vfiod: {c}:11:9: `class` in [[protect]] #1: invalid class \"0xZZ\""),
        "vfiod: 5 errors in the configuration".to_string(),
    ]) {
        assert!(
            line.starts_with(&want),
            "{line:?} is not {want:?}...\n{errors}"
        );
    }
    // Syntax errors come first, all of a file's; a second file's unknown key after them. The
    // value errors of the main file are not looked at until every file parses.
    let bad = dir.join("10-bad.toml");
    fs::write(&bad, "scenario = \"public\nfoo = = 1\n[[select]\n").unwrap();
    let shape = dir.join("20-shape.toml");
    fs::write(&shape, "[[pool]]\nname = \"a\"\nbogus = 1\n").unwrap();
    let errors = check();
    let lines: Vec<&str> = errors.lines().collect();
    let (b, s) = (bad.display(), shape.display());
    assert!(lines.len() >= 4, "{errors}");
    let syntax: Vec<&str> = lines[..lines.len() - 2].to_vec();
    assert!(
        syntax
            .iter()
            .all(|l| l.starts_with(&format!("vfiod: {b}:")) && l.contains("invalid TOML")),
        "{errors}"
    );
    // In reading order: line 1's unclosed string before line 3's unclosed header.
    assert!(syntax[0].starts_with(&format!("vfiod: {b}:1:")), "{errors}");
    assert!(
        syntax
            .last()
            .unwrap()
            .starts_with(&format!("vfiod: {b}:3:")),
        "{errors}"
    );
    assert!(
        lines[lines.len() - 2].starts_with(&format!(
            "vfiod: {s}:3:1: [[pool]] #1: unknown field `bogus`"
        )),
        "{errors}"
    );
    assert_eq!(
        lines[lines.len() - 1],
        format!("vfiod: {} errors in the configuration", lines.len() - 1)
    );
}

/// `[claims] clean` and `reset_timeout`, and `[[clean]]` entries: their defaults, what each
/// applies to, and every wrong entry named with its place and reason.
#[test]
fn cleaning_settings_and_their_errors() {
    use vfiod::config::CleanMode;
    use vfiod::model::pci::ClassCode;
    let parse = |t: &str| Settings::from_toml_str(t, Path::new("t.toml"));
    let d = parse("").unwrap();
    assert_eq!(d.claims.clean, CleanMode::Reset, "safe by default");
    assert_eq!(d.claims.reset_timeout_seconds, 75);
    assert!(d.clean.is_empty());
    let a: vfiod::model::pci::PciAddress = "0000:3b:00.0".parse().unwrap();
    assert!(d.cleans_at_claim_end(a, 0x8086, 0x1572, ClassCode(0x020000)));

    let s = parse(
        "[claims]\nclean = \"none\"\nreset_timeout = 5\n\
         [[clean]]\nid = \"8086:1572\"\ncommand = \"/usr/bin/scrub {address} {group}\"\n\
         [[clean]]\nclass = \"0x03\"\nreset = false\ncommand = \"/usr/bin/gpu-scrub {address}\"\ntimeout_seconds = 30\n",
    )
    .unwrap();
    assert_eq!(s.claims.clean, CleanMode::None);
    assert_eq!(s.claims.reset_timeout_seconds, 5);
    let nic = s
        .clean_rule(a, 0x8086, 0x1572, ClassCode(0x020000))
        .unwrap();
    assert!(nic.reset);
    assert_eq!(
        nic.argv.as_deref().unwrap(),
        ["/usr/bin/scrub", "{address}", "{group}"]
    );
    assert_eq!(nic.timeout_seconds, 600);
    let gpu = s
        .clean_rule(a, 0x10de, 0x1db6, ClassCode(0x030200))
        .unwrap();
    assert_eq!((gpu.reset, gpu.timeout_seconds), (false, 30));
    // Under clean = "none" only what an entry names is cleaned.
    assert!(s.cleans_at_claim_end(a, 0x8086, 0x1572, ClassCode(0x020000)));
    assert!(!s.cleans_at_claim_end(a, 0x1b36, 0x0010, ClassCode(0x010802)));

    for (text, says) in [
        (
            "[claims]\nclean = \"scrub\"\n",
            "`claims.clean`: unknown value \"scrub\" (reset, none)",
        ),
        ("[claims]\nreset_timeout = 0\n", "claims.reset_timeout"),
        ("[claims]\nreset_timeout = 601\n", "out of range"),
        ("[[clean]]\ncommand = \"/bin/x\"\n", "needs at least one of"),
        (
            "[[clean]]\nclass = \"0x03\"\ncommand = \"x {address}\"\n",
            "absolute path",
        ),
        (
            "[[clean]]\nclass = \"0x03\"\ncommand = \"  \"\n",
            "the command is empty",
        ),
        (
            "[[clean]]\nclass = \"0x03\"\nreset = false\n",
            "reset = false needs a command",
        ),
        (
            "[[clean]]\nclass = \"0x03\"\ncommand = \"/bin/x\"\ntimeout_seconds = 0\n",
            "out of range",
        ),
        (
            "[[clean]]\nclass = \"0x03\"\nwipe = true\n",
            "unknown field",
        ),
    ] {
        let err = vfiod::error_chain(&parse(text).unwrap_err());
        assert!(err.contains(says), "{text}: {err}");
        assert!(err.contains("t.toml:"), "the place is named: {err}");
    }
}
