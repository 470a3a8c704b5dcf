//! Typed daemon settings: the main TOML file (`/etc/vfiod/vfiod.toml`) plus `conf.d/*.toml`
//! drop-ins, validated once at load.
//!
//! Everything the rest of the daemon reads is already checked here: a value that reaches
//! [`Settings`] is valid, so no other module parses or re-validates configuration. A bad file is
//! rejected as a whole with `file:line:column: reason`, because a daemon that half-applies a
//! configuration could start managing a device the operator meant to protect.
//!
//! # Stages
//!
//! ```text
//!  files      raw          merge        validate (one module per section)      Settings
//!  bytes ──▶ Fragment ──▶ Inputs ──┬─ Inputs ──────────────────▶ daemon  ─┐
//!  + path    (one file,   (files   ├─ entries(|f| &f.select) ──▶ select  ─┼─▶ Settings
//!            spanned,     in order)└─ entries(|f| &f.protect) ─▶ protect ─┘
//!            bounded)
//! ```
//!
//! 1. `files`: finds and reads the files (main file, then drop-ins in byte order of their
//!    names, hidden ones skipped). The only I/O; regular files only, bounded in size and count,
//!    never a blocking open.
//! 2. `raw`: one file's text into a `raw::Fragment`: serde mirror structs that keep each
//!    value's span, reject unknown keys, and bound every string (`bounded`). Syntax and shape
//!    (type) errors are found here.
//! 3. `merge`: the fragments in order, as `merge::Inputs`: a scalar's values in file order
//!    (the last wins, every one is checked), array entries appended. Each value stays
//!    `located::Located` in its file, so validation reports `file:line:column`.
//! 4. One module per section validates its raw values into typed ones: `select`, `protect`
//!    (`selector` holds what the two share), `claims`. The pipeline hands each its own values from
//!    `Inputs`, so a section never sees the file struct. `daemon` validates the top-level keys,
//!    which are fields of the file struct itself, so it reads them from `Inputs`.
//! 5. `settle` (this module) assembles [`Settings`].
//!
//! Syntax and shape errors of every file come before value errors; value errors are reported
//! section by section, in file order within a section. [`Settings::load`] (the daemon) stops at
//! the first; [`Settings::check`] (`vfiod --check-config`) and [`Settings::from_files`]
//! (`vfioctl plan --config`) give them all: every syntax error of each file, the first unknown
//! key or wrong type of each file (serde stops there), and once every file parses, the first
//! error of each table section and of each array entry.
//!
//! # Module graph
//!
//! Sibling modules use each other in one direction only (no cycle:
//! `tests/library/architecture.rs`):
//!
//! ```text
//!  pipeline   mod.rs (load, settle)   uses every module
//!  top keys   daemon                  merge and below
//!  stage 3    merge                   raw, located
//!  stage 2    raw                     the sections' raw structs, bounded, position, error
//!  sections   select, protect, claims selector and the leaves
//!             hooks, host, fpga,      the leaves (fpga: selector too)
//!             images,
//!             pool, fleet, metrics,
//!             history
//!             selector                the leaves
//!  stage 1    files                   error
//!  leaves     located                 position, error  (Located, Entry, last_valid)
//!             bounded                 error            (bounded strings, Int)
//!             position                error            (Origin, Source, key at a span)
//!             error                   -                (ConfigError, Key, Quoted)
//! ```
//!
//! `raw` names each section's raw struct, so a section must not use `raw` or `merge`.
//!
//! # How to add a section
//!
//! For a `[hooks]` table (or a `[[pool]]` array):
//! 1. `src/config/hook.rs`: `RawHooks` (`#[derive(Deserialize)] #[serde(deny_unknown_fields)]`,
//!    values as `Spanned<bounded::Keyword>` / `Spanned<bounded::PathText>` /
//!    `Spanned<bounded::Int>`, never a bare `String`), the typed `Hooks`, and its validator,
//!    built on the leaves only (`located`, `bounded`, `error`; `selector` for selectors):
//!    - a table: `pub(crate) fn validate<'a>(tables: impl Iterator<Item = Located<'a,
//!      RawHooks>> + Clone) -> Result<Hooks, ConfigError>`, each key's last value winning:
//!      `last_valid(tables.clone().filter_map(|t| t.field(|h| h.dir.as_ref())), check)`;
//!    - an array: `pub(crate) fn validate<'a>(entries: impl Iterator<Item = Entry<'a,
//!      RawPool>>) -> Result<Vec<Pool>, ConfigError>`, entries appended;
//! 2. one field in `raw::RawFile`: `hooks: Option<Spanned<RawHooks>>`
//!    (or `#[serde(default)] pool: Vec<Spanned<RawPool>>`);
//! 3. one field in [`Settings`] (and its default);
//! 4. one line in `settle`: `hooks: hook::validate(inputs.values(|f| f.hooks.as_ref()))?,`
//!    (or `pool: pool::validate(inputs.entries(|f| &f.pool))?,`).
//!
//! Nothing in `files`, `merge` or the leaves changes. A new top-level daemon key is a field of
//! `raw::RawFile` and a check in `daemon::validate`.

mod bounded;
mod claim;
mod fleet;
mod clean;
mod fpga;
mod history;
mod hook;
mod host;
mod image;
mod daemon;
mod error;
mod files;
mod located;
mod merge;
mod metrics;
mod pool;
mod position;
mod protect;
mod raw;
mod select;
mod selector;

pub use bounded::{MAX_DRIVER_BYTES, MAX_KEYWORD_BYTES, MAX_PATH_BYTES};
pub use claim::{ClaimSettings, CleanMode, MAX_DETACH_TIMEOUT_SECONDS, MAX_LEASE_SECONDS};
pub use clean::CleanRule;
pub use daemon::{Scenario, DEFAULT_LIBVIRT_URI};
pub(crate) use error::Quoted;
pub use error::{ConfigError, FileRefusal};
pub use files::{MAX_DROPINS, MAX_FILE_BYTES, MAX_TOTAL_BYTES};
pub use fleet::{check_host_name, FleetSettings, DEFAULT_DOWN_AFTER};
pub use fpga::{FpgaBackend, FpgaRule};
pub use history::{
    HistorySettings, MAX_HISTORY_COUNT, MAX_HISTORY_DAYS, MAX_PRUNE_INTERVAL_SECONDS,
    MIN_EVENTS_KEPT, MIN_TASKS_KEPT,
};
pub use hook::HookSettings;
pub use host::{HostSettings, MAX_CONSOLE_GPUS};
pub use image::{ImageSettings, MAX_DOWNLOAD_SECONDS};
pub use metrics::MetricsSettings;
pub use pool::{PoolSettings, QuiesceAt, MAX_POOL_TIMEOUT_MS};
pub use position::Origin;
pub use select::{DeviceRule, RuleOrigin};
pub(crate) use selector::parse_id;
pub use selector::{shadowed, ClassPrefix, Selector};

use crate::model::pci::{ClassCode, PciAddress};
use merge::Inputs;
use raw::Fragment;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the packaged main file is installed.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/vfiod/vfiod.toml";
/// Where drop-ins are read from, after the main file.
pub const DEFAULT_DROPIN_DIR: &str = "/etc/vfiod/conf.d";

/// The validated configuration, merged from every file that was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub scenario: Scenario,
    /// Interval of the safety-net rescan; always within 1 s ..= 1 day.
    pub poll_interval: Duration,
    /// Absolute.
    pub state_dir: PathBuf,
    /// Absolute; every sysfs and proc path is derived from it (tests point it at a fake tree).
    pub sysfs_root: PathBuf,
    /// libvirt connection asked which running domains use a device before vfiod takes it
    /// down; `None` (configured as "") skips that question.
    pub libvirt_uri: Option<String>,
    /// Devices vfiod manages, in file order; the first matching rule applies.
    pub select: Vec<DeviceRule>,
    /// Where each `select` rule was written (same index), for messages after loading.
    pub select_origins: Vec<RuleOrigin>,
    /// Devices vfiod must never touch, on top of those the host is detected to use.
    pub protect: Vec<Selector>,
    /// `[claims]`.
    pub claims: ClaimSettings,
    /// `[hooks]`.
    pub hooks: HookSettings,
    /// `[host]`: what vfiod may take from the host on purpose (the console GPU).
    pub host: HostSettings,
    /// `[images]`: downloads of FPGA images.
    pub images: ImageSettings,
    /// `[[fpga]]`: how FPGA devices are programmed, in file order; the first match applies.
    pub fpga: Vec<FpgaRule>,
    /// `[[clean]]`: what cleaning a device runs besides its reset, in file order; the first
    /// match applies.
    pub clean: Vec<CleanRule>,
    /// `[[pool]]`: the remote device pools, names unique.
    pub pools: Vec<PoolSettings>,
    /// What the pools know this host as (`host_name`; default: the machine's host name).
    pub host_name: String,
    /// `[fleet]`: reports to the fleet's database; `None` = off.
    pub fleet: Option<FleetSettings>,
    /// `[metrics]`: the Prometheus textfile; off by default.
    pub metrics: MetricsSettings,
    /// `[history]`: how long events and finished tasks are kept.
    pub history: HistorySettings,
    /// files that were read, in order (for logs and `vfioctl` status)
    pub sources: Vec<PathBuf>,
}

impl Default for Settings {
    /// The settings of a host without any configuration: private scenario, nothing managed.
    fn default() -> Self {
        let daemon = daemon::Daemon::default();
        Settings {
            scenario: daemon.scenario,
            poll_interval: daemon.poll_interval,
            state_dir: daemon.state_dir,
            sysfs_root: daemon.sysfs_root,
            libvirt_uri: daemon.libvirt_uri,
            select: Vec::new(),
            select_origins: Vec::new(),
            protect: Vec::new(),
            claims: ClaimSettings::default(),
            hooks: HookSettings::default(),
            host: HostSettings::default(),
            images: ImageSettings::default(),
            fpga: Vec::new(),
            clean: Vec::new(),
            pools: Vec::new(),
            host_name: daemon.host_name,
            fleet: None,
            metrics: MetricsSettings::default(),
            history: HistorySettings::default(),
            sources: Vec::new(),
        }
    }
}

impl Settings {
    /// One line per `[[select]]` rule that an earlier rule leaves no device ([`shadowed`]):
    /// valid, but surely not what was meant. `--check-config` prints them, the daemon logs
    /// them at start and on every reload.
    pub fn shadowed_rule_warnings(&self) -> Vec<String> {
        let selectors: Vec<Selector> = self.select.iter().map(|r| r.selector.clone()).collect();
        let at = |i: usize| {
            self.select_origins
                .get(i)
                .map(|o| format!(", {}", o.entry))
                .unwrap_or_default()
        };
        shadowed(&selectors)
            .into_iter()
            .map(|(later, earlier)| {
                format!(
                    "select rule #{} ({}{}) never applies: every device it selects matches rule \
                     #{} ({}{}) before it, whose settings apply; put the narrower rule first",
                    later + 1,
                    selectors[later],
                    at(later),
                    earlier + 1,
                    selectors[earlier],
                    at(earlier)
                )
            })
            .collect()
    }

    /// One line per `[[select]]` rule that matches none of `functions` (the host's PCI
    /// functions now: address, vendor, device, class): a typo in an id, or a card that is not
    /// in this host. VFs exist only after a split, so a rule for VF ids says so.
    pub fn unmatched_rule_warnings(
        &self,
        functions: &[(PciAddress, u16, u16, ClassCode)],
    ) -> Vec<String> {
        self.select
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                !functions
                    .iter()
                    .any(|&(a, v, d, c)| r.selector.matches(a, v, d, c))
            })
            .map(|(i, r)| {
                let at = self
                    .select_origins
                    .get(i)
                    .map(|o| format!(", {}", o.entry))
                    .unwrap_or_default();
                format!(
                    "select rule #{} ({}{at}) matches no PCI function on this host now (a VF \
                     appears only once its PF is split)",
                    i + 1,
                    r.selector
                )
            })
            .collect()
    }

    /// Load the main file and the drop-ins. `main_required`: when false and the main file does not exist,
    /// start from defaults (a host with no config manages nothing). A missing drop-in dir is fine.
    pub fn load(
        main: &Path,
        dropin_dir: Option<&Path>,
        main_required: bool,
    ) -> Result<Settings, ConfigError> {
        Settings::check(main, dropin_dir, main_required).map_err(raw::first)
    }

    /// As [`Settings::load`], with every error found instead of the first (`--check-config`):
    /// each file's syntax errors (or its first unknown key or wrong type), and once every file
    /// parses, the first error of each top-level section and of each array entry. A file that
    /// cannot be read at all ends the reading there.
    pub fn check(
        main: &Path,
        dropin_dir: Option<&Path>,
        main_required: bool,
    ) -> Result<Settings, Vec<ConfigError>> {
        let files = files::read_all(main, dropin_dir, main_required).map_err(|e| vec![e])?;
        Settings::from_files(files.into_iter().map(|f| (f.path, f.bytes)))
    }

    /// The files of the configuration at `path`, read as vfiod reads its own, for a preview
    /// (`vfioctl plan --config`): a file is the whole configuration (a main file, no
    /// drop-ins); a directory is laid out as `/etc/vfiod` is: `vfiod.toml` when there, then
    /// `conf.d/*.toml`.
    pub fn read_files(path: &Path) -> Result<Vec<(PathBuf, Vec<u8>)>, ConfigError> {
        let files = if path.is_dir() {
            files::read_all(&path.join("vfiod.toml"), Some(&path.join("conf.d")), false)?
        } else {
            files::read_all(path, None, true)?
        };
        Ok(files.into_iter().map(|f| (f.path, f.bytes)).collect())
    }

    /// Files already read (name, content), in the order they apply, validated as
    /// [`Settings::check`] validates what it reads (`Manager.PreviewPlans`: a client sends the
    /// configuration it wants previewed, the daemon never opens a path a client names).
    pub fn from_files(
        files: impl IntoIterator<Item = (PathBuf, Vec<u8>)>,
    ) -> Result<Settings, Vec<ConfigError>> {
        let mut errors = Vec::new();
        let mut fragments = Vec::new();
        for (path, bytes) in files {
            match Fragment::parse_all(bytes, path) {
                Ok(f) => fragments.push(f),
                Err(e) => errors.extend(e),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        settle(&Inputs::new(fragments))
    }

    /// Parse one document as if it were the only file (used by tests and tools; `load` parses
    /// each of its files the same way).
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<Settings, ConfigError> {
        Settings::from_files([(origin.to_path_buf(), text.as_bytes().to_vec())]).map_err(raw::first)
    }

    /// First rule whose selector matches, if any (the device is then "selected").
    pub fn rule_for(
        &self,
        address: PciAddress,
        vendor: u16,
        device: u16,
        class: ClassCode,
    ) -> Option<&DeviceRule> {
        self.select
            .iter()
            .find(|rule| rule.selector.matches(address, vendor, device, class))
    }

    /// First `[[protect]]` selector that matches, if any, so the caller can say why.
    pub fn is_protected_by_config(
        &self,
        address: PciAddress,
        vendor: u16,
        device: u16,
        class: ClassCode,
    ) -> Option<&Selector> {
        self.protect
            .iter()
            .find(|selector| selector.matches(address, vendor, device, class))
    }

    /// The `[[pool]]` called `name`.
    pub fn pool(&self, name: &str) -> Option<&PoolSettings> {
        self.pools.iter().find(|p| p.name == name)
    }

    /// The `[[clean]]` entry for a device: the first that matches it.
    pub fn clean_rule(
        &self,
        address: PciAddress,
        vendor: u16,
        device: u16,
        class: ClassCode,
    ) -> Option<&CleanRule> {
        self.clean
            .iter()
            .find(|r| r.selector.matches(address, vendor, device, class))
    }

    /// Whether the end of a claim on this device cleans it before it returns to the pool:
    /// under `[claims] clean = "reset"`, or when a `[[clean]]` entry names it.
    pub fn cleans_at_claim_end(
        &self,
        address: PciAddress,
        vendor: u16,
        device: u16,
        class: ClassCode,
    ) -> bool {
        self.claims.clean == CleanMode::Reset
            || self.clean_rule(address, vendor, device, class).is_some()
    }

    /// How the device is programmed: the first `[[fpga]]` entry that matches it, else `dfl`.
    pub fn fpga_backend(
        &self,
        address: PciAddress,
        vendor: u16,
        device: u16,
        class: ClassCode,
    ) -> FpgaBackend {
        self.fpga
            .iter()
            .find(|r| r.selector.matches(address, vendor, device, class))
            .map_or(FpgaBackend::Dfl, |r| r.backend.clone())
    }
}

/// Errors as `--check-config` and `vfioctl plan --config` print them: a line each, then their
/// count when there are several.
pub fn error_lines(errors: &[ConfigError]) -> Vec<String> {
    let mut lines: Vec<String> = errors.iter().map(|e| crate::error_chain(e)).collect();
    if lines.len() > 1 {
        lines.push(format!("{} errors in the configuration", errors.len()));
    }
    lines
}

/// The last stage: every section validated, assembled into [`Settings`]. Every section is
/// validated even after one failed, and an array's entries one by one, so that one run names
/// every wrong entry; the errors come section by section in this order, entries in file order.
fn settle(inputs: &Inputs) -> Result<Settings, Vec<ConfigError>> {
    let mut found = Found::default();
    let daemon = daemon::validate(inputs)
        .map_err(|e| found.errors.extend(e))
        .ok();
    let select = found.array(inputs.entries(|f| &f.select), |e| {
        select::validate(e.into_iter())
    });
    let protect = found.array(inputs.entries(|f| &f.protect), |e| {
        protect::validate(e.into_iter())
    });
    let claims = found.section(claim::validate(inputs.values(|f| f.claims.as_ref())));
    let hooks = found.section(hook::validate(inputs.values(|f| f.hooks.as_ref())));
    let host = found.section(host::validate(inputs.values(|f| f.host.as_ref())));
    let images = found.section(image::validate(inputs.values(|f| f.images.as_ref())));
    let fpga = found.array(inputs.entries(|f| &f.fpga), |e| {
        fpga::validate(e.into_iter())
    });
    let clean = found.array(inputs.entries(|f| &f.clean), |e| {
        clean::validate(e.into_iter())
    });
    let pools = found.array(inputs.entries(|f| &f.pool), |e| {
        pool::validate(e.into_iter())
    });
    let fleet = found.section(fleet::validate(inputs.values(|f| f.fleet.as_ref())));
    let metrics = found.section(metrics::validate(inputs.values(|f| f.metrics.as_ref())));
    let history = found.section(history::validate(inputs.values(|f| f.history.as_ref())));
    let (
        Some(daemon),
        Some(select),
        Some(protect),
        Some(claims),
        Some(hooks),
        Some(host),
        Some(images),
        Some(fpga),
        Some(clean),
        Some(pools),
        Some(fleet),
        Some(metrics),
        Some(history),
    ) = (
        daemon, select, protect, claims, hooks, host, images, fpga, clean, pools, fleet, metrics,
        history,
    )
    else {
        return Err(found.errors);
    };
    let (select, select_origins) = select.into_iter().unzip();
    Ok(Settings {
        scenario: daemon.scenario,
        poll_interval: daemon.poll_interval,
        state_dir: daemon.state_dir,
        sysfs_root: daemon.sysfs_root,
        libvirt_uri: daemon.libvirt_uri,
        select,
        select_origins,
        protect,
        claims,
        hooks,
        host,
        images,
        fpga,
        clean,
        pools,
        host_name: daemon.host_name,
        fleet,
        metrics,
        history,
        sources: inputs.sources(),
    })
}

/// The errors `settle` has met so far.
#[derive(Default)]
struct Found {
    errors: Vec<ConfigError>,
}

impl Found {
    /// A section's value, or `None` with its error kept.
    fn section<T>(&mut self, result: Result<T, ConfigError>) -> Option<T> {
        result.map_err(|e| self.errors.push(e)).ok()
    }

    /// An array section: each entry validated alone first, so that every wrong entry is
    /// named; when each is right, all of them together, for what spans entries (two pools
    /// with one name).
    fn array<'a, R: 'a, T>(
        &mut self,
        entries: impl Iterator<Item = located::Entry<'a, R>> + Clone,
        validate: impl Fn(Vec<located::Entry<'a, R>>) -> Result<T, ConfigError>,
    ) -> Option<T> {
        let before = self.errors.len();
        for entry in entries.clone() {
            if let Err(e) = validate(vec![entry]) {
                self.errors.push(e);
            }
        }
        if self.errors.len() > before {
            return None;
        }
        self.section(validate(entries.collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::selector::tests::{selector, OTHER, QAT};
    use super::*;
    use crate::model::device::{Kind, Mode};
    use std::fs;
    use std::io;

    fn parse(text: &str) -> Settings {
        Settings::from_toml_str(text, Path::new("test.toml")).unwrap()
    }

    #[test]
    fn a_rule_that_matches_no_function_of_the_host_is_named() {
        let s = parse(
            "[[select]]\nid = \"8086:1572\"\n\n[[select]]\nclass = \"0x12\"\n\n\
             [[select]]\nid = \"8086:1573\"\n",
        );
        let host = [
            (QAT, 0x8086, 0x1572, ClassCode(0x020000)),
            (OTHER, 0x1af4, 0x1000, ClassCode(0x120000)),
        ];
        assert_eq!(
            s.unmatched_rule_warnings(&host),
            ["select rule #3 (id=8086:1573, test.toml:7:1) matches no PCI function on this host \
              now (a VF appears only once its PF is split)"]
        );
        assert_eq!(s.unmatched_rule_warnings(&host[..1]).len(), 2);
        assert!(parse("").unmatched_rule_warnings(&[]).is_empty());
    }

    fn parse_err(text: &str) -> String {
        Settings::from_toml_str(text, Path::new("test.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn fpga_entries_choose_a_backend_per_device() {
        use crate::model::pci::ClassCode;
        let s = parse(
            "[[fpga]]\naddress = \"0000:af:00.0\"\nbackend = \"exec\"\n\
             command = \"/bin/prog --dev {address} {image}\"\ntimeout_seconds = 5\n\
             [[fpga]]\nclass = \"0x12\"\n",
        );
        let af = "0000:af:00.0".parse().unwrap();
        let b1 = "0000:b1:00.0".parse().unwrap();
        assert_eq!(
            s.fpga_backend(af, 0x8086, 0x0b2b, ClassCode(0x120000)),
            FpgaBackend::Exec {
                argv: vec![
                    "/bin/prog".into(),
                    "--dev".into(),
                    "{address}".into(),
                    "{image}".into()
                ],
                timeout_seconds: 5
            }
        );
        assert_eq!(
            s.fpga_backend(b1, 0x8086, 0x0b2b, ClassCode(0x120000)),
            FpgaBackend::Dfl
        );
        assert_eq!(
            Settings::default().fpga_backend(af, 0, 0, ClassCode(0)),
            FpgaBackend::Dfl
        );
        for (text, wanted) in [
            ("[[fpga]]\nbackend = \"dfl\"\n", "needs at least one of"),
            ("[[fpga]]\nclass = \"0x12\"\nbackend = \"jtag\"\n", "unknown backend"),
            ("[[fpga]]\nclass = \"0x12\"\nbackend = \"exec\"\n", "needs a command"),
            ("[[fpga]]\nclass = \"0x12\"\nbackend = \"exec\"\ncommand = \"prog {image}\"\n", "absolute path"),
            ("[[fpga]]\nclass = \"0x12\"\nbackend = \"exec\"\ncommand = \"/bin/prog\"\n", "{image}"),
            ("[[fpga]]\nclass = \"0x12\"\ncommand = \"/bin/p {image}\"\n", "for backend = \"exec\""),
            ("[[fpga]]\nclass = \"0x12\"\nbackend = \"exec\"\ncommand = \"/bin/p {image}\"\ntimeout_seconds = 0\n", "out of range"),
            ("[[fpga]]\nclass = \"0x12\"\nspeed = 1\n", "unknown field"),
        ] {
            let e = parse_err(text);
            assert!(e.contains(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn pool_entries_are_checked_where_they_are_written() {
        let s = parse(
            "host_name = \"hosta\"\n[[pool]]\nname = \"gpus\"\nurl = \"http://127.0.0.1:9000/\"\n\
             [[pool]]\nname = \"fpgas\"\nurl = \"https://pool.example:8443\"\n\
             ca_file = \"/etc/vfiod/ca.pem\"\ncert_file = \"/etc/vfiod/c.pem\"\n\
             key_file = \"/etc/vfiod/c.key\"\nconnect_timeout_ms = 500\nrequest_timeout_ms = 900\n\
             quiesce_at = \"begin\"\n",
        );
        assert_eq!(s.host_name, "hosta");
        assert_eq!(s.pools.len(), 2);
        let gpus = s.pool("gpus").unwrap();
        assert_eq!(gpus.url, "http://127.0.0.1:9000");
        assert_eq!(gpus.quiesce_at, QuiesceAt::Switchover);
        assert_eq!(gpus.connect_timeout, Duration::from_millis(2000));
        let fpgas = s.pool("fpgas").unwrap();
        assert_eq!(fpgas.quiesce_at, QuiesceAt::Begin);
        assert_eq!(fpgas.request_timeout, Duration::from_millis(900));
        assert_eq!(
            fpgas.key_file.as_deref(),
            Some(Path::new("/etc/vfiod/c.key"))
        );
        assert!(s.pool("tpus").is_none());
        assert!(!Settings::default().host_name.is_empty());
        for (text, wanted) in [
            (
                "[[pool]]\nurl = \"http://127.0.0.1:1\"\n",
                "test.toml:1:1: `name` in [[pool]] #1: a pool needs a name",
            ),
            ("[[pool]]\nname = \"a\"\n", "needs a url"),
            (
                "[[pool]]\nname = \"a\"\nurl = \"http://10.1.2.3:80\"\n",
                "test.toml:3:7: `url` in [[pool]] #1: \"http://10.1.2.3:80\": plain http:// is \
                 allowed on a loopback host only",
            ),
            (
                "[[pool]]\nname = \"a\"\nurl = \"https://p\"\ncert_file = \"/c\"\n",
                "needs its key_file",
            ),
            (
                "[[pool]]\nname = \"a\"\nurl = \"https://p\"\nca_file = \"ca.pem\"\n",
                "not an absolute path",
            ),
            (
                "[[pool]]\nname = \"a\"\nurl = \"https://p\"\nquiesce_at = \"later\"\n",
                "test.toml:4:14: `quiesce_at` in [[pool]] #1: unknown value \"later\"",
            ),
            (
                "[[pool]]\nname = \"a\"\nurl = \"https://p\"\nrequest_timeout_ms = 0\n",
                "out of range",
            ),
            (
                "[[pool]]\nname = \"a\"\nurl = \"https://p\"\n[[pool]]\nname = \"a\"\nurl = \"https://q\"\n",
                "test.toml:5:8: `name` in [[pool]] #2: a pool named \"a\" is already configured",
            ),
            ("[[pool]]\nname = \"a b\"\nurl = \"https://p\"\n", "not a pool name"),
            ("[[pool]]\nname = \"a\"\nurl = \"https://p\"\nlease = 1\n", "unknown field"),
            ("host_name = \"a b\"\n", "test.toml:1:13: `host_name`: \"a b\" is not a host name"),
        ] {
            let e = parse_err(text);
            assert!(e.contains(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn the_host_table_lists_console_gpus_by_address() {
        assert!(Settings::default().host.allow_console_gpu.is_empty());
        let gpu: PciAddress = "0000:17:00.0".parse().unwrap();
        let s = parse("[host]\nallow_console_gpu = [\"0000:17:00.0\", \"0000:17:00.0\"]\n");
        assert_eq!(s.host.allow_console_gpu, [gpu]);
        assert!(parse("[host]\nallow_console_gpu = []\n")
            .host
            .allow_console_gpu
            .is_empty());
        let many = vec!["\"0000:17:00.0\""; MAX_CONSOLE_GPUS + 1].join(", ");
        for (text, wanted) in [
            (
                "[host]\nallow_console_gpu = [\"0000:17:00.0\", \"17:00\"]\n",
                "test.toml:2:38: `host.allow_console_gpu`: invalid PCI address \"17:00\"",
            ),
            (
                "[host]\nallow_console_gpu = \"0000:17:00.0\"\n",
                "test.toml:2:21: `allow_console_gpu`: invalid type: string \"0000:17:00.0\", expected a sequence",
            ),
            (
                "[host]\nconsole = true\n",
                "test.toml:2:1: unknown field `console`, expected `allow_console_gpu`",
            ),
            (
                &format!("[host]\nallow_console_gpu = [{many}]\n"),
                "test.toml:2:21: `host.allow_console_gpu`: at most 16 addresses, not 17",
            ),
        ] {
            let e = parse_err(text);
            assert!(e.starts_with(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn the_claims_table_is_checked_and_the_last_value_wins() {
        assert_eq!(Settings::default().claims.default_lease_seconds, 0);
        let s = parse("[claims]\ndefault_lease_seconds = 600\n");
        assert_eq!(s.claims.default_lease_seconds, 600);
        assert_eq!(s.claims.detach_timeout_seconds, 30, "the default");
        let s = parse("[claims]\ndetach_timeout = 5\n");
        assert_eq!(s.claims.detach_timeout_seconds, 5);
        let s = parse("[hooks]\nauto_claim = false\ndeadline_ms = 5000\n");
        assert_eq!(
            s.hooks,
            HookSettings {
                auto_claim: false,
                deadline_ms: 5000,
                notify_deadline_ms: 2000,
                guard_host_devices: true,
            }
        );
        assert!(
            !parse("[hooks]\nguard_host_devices = false\n")
                .hooks
                .guard_host_devices
        );
        for (text, wanted) in [
            (
                "[claims]\ndefault_lease_seconds = -1\n",
                "test.toml:2:25: `claims.default_lease_seconds`: -1 is out of range: \
                 expected 0..=31622400 seconds (0: no lease)",
            ),
            (
                "[claims]\ndefault_lease_seconds = 99999999999\n",
                "out of range",
            ),
            ("[claims]\nlease = 1\n", "unknown field `lease`"),
            (
                "[hooks]\nnotify_deadline_ms = 10\n",
                "test.toml:2:22: `hooks.notify_deadline_ms`: 10 is out of range",
            ),
            ("[hooks]\nauto_claim = 1\n", "invalid type"),
            (
                "[claims]\ndetach_timeout = 0\n",
                "test.toml:2:18: `claims.detach_timeout`: 0 is out of range",
            ),
            ("[claims]\ndefault_lease_seconds = \"1h\"\n", "invalid type"),
        ] {
            let e = parse_err(text);
            assert!(e.contains(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn the_images_table_is_checked_and_the_last_value_wins() {
        assert_eq!(Settings::default().images, ImageSettings::default());
        let s = parse(
            "[images]\nallow_http = true\nca_file = \"/etc/vfiod/ca.pem\"\n\
             connect_timeout_seconds = 5\nread_timeout_seconds = 7\ntimeout_seconds = 9\n",
        );
        assert_eq!(
            s.images,
            ImageSettings {
                allow_http: true,
                ca_file: Some(PathBuf::from("/etc/vfiod/ca.pem")),
                connect_timeout: Duration::from_secs(5),
                read_timeout: Duration::from_secs(7),
                timeout: Duration::from_secs(9),
            }
        );
        for (text, wanted) in [
            (
                "[images]\nca_file = \"ca.pem\"\n",
                "test.toml:2:11: `images.ca_file`: \"ca.pem\" is not an absolute path",
            ),
            (
                "[images]\ntimeout_seconds = 0\n",
                "test.toml:2:19: `images.timeout_seconds`: 0 is out of range",
            ),
            ("[images]\nread_timeout_seconds = 86401\n", "out of range"),
            ("[images]\nallow_http = \"yes\"\n", "invalid type"),
            ("[images]\nproxy = \"x\"\n", "unknown field `proxy`"),
        ] {
            let e = parse_err(text);
            assert!(e.contains(wanted), "{text}: {e}");
        }
    }

    #[test]
    fn defaults() {
        let d = Settings::default();
        assert_eq!(d.scenario, Scenario::Private);
        assert_eq!(d.poll_interval, Duration::from_secs(30));
        assert_eq!(d.state_dir, Path::new("/var/lib/vfiod"));
        assert_eq!(d.sysfs_root, Path::new("/"));
        assert!(d.select.is_empty() && d.protect.is_empty() && d.sources.is_empty());
        // The defaults are what no file at all gives.
        assert_eq!(settle(&Inputs::new(Vec::new())).unwrap(), d);

        // An empty document changes nothing but records where it came from.
        let empty = parse("# nothing\n");
        assert_eq!(
            empty,
            Settings {
                sources: vec![PathBuf::from("test.toml")],
                ..Settings::default()
            }
        );
    }

    #[test]
    fn every_key_parses_into_typed_settings() {
        let s = parse(
            r#"
scenario = "public"
poll_interval = 5
state_dir = "/tmp/state"
sysfs_root = "/tmp/root"

[[select]]
address = "0000:3b:00.0"
id = "8086:4940"
class = "0x1200"
kind = "crypto"
mode = "vf"
num_vfs = 16
vf_driver = "vfio-pci"
pf_driver = "qat_4xxx"

[[select]]
class = "0x03"
mode = "pf"

[[protect]]
id = "8086:*"
"#,
        );
        assert_eq!(s.scenario, Scenario::Public);
        assert_eq!(s.poll_interval, Duration::from_secs(5));
        assert_eq!(s.state_dir, Path::new("/tmp/state"));
        assert_eq!(s.sysfs_root, Path::new("/tmp/root"));
        assert_eq!(
            s.select[0],
            DeviceRule {
                selector: selector(Some("0000:3b:00.0"), Some("8086:4940"), Some("0x1200")),
                kind: Some(Kind::Crypto),
                mode: Some(Mode::Vf),
                num_vfs: Some(16),
                vf_driver: Some("vfio-pci".into()),
                pf_driver: Some("qat_4xxx".into()),
            }
        );
        assert_eq!(s.select[1].mode, Some(Mode::Pf));
        assert_eq!(s.select[1].num_vfs, None);
        assert_eq!(s.protect, vec![selector(None, Some("8086:*"), None)]);
    }

    #[test]
    fn rule_for_takes_the_first_match_and_protect_reports_its_selector() {
        let s = parse(
            r#"
[[select]]
address = "0000:3b:00.0"
num_vfs = 4
[[select]]
id = "8086:*"
num_vfs = 8
[[protect]]
class = "0x02"
"#,
        );
        let rule = s
            .rule_for(QAT, 0x8086, 0x4940, ClassCode(0x120000))
            .unwrap();
        assert_eq!(rule.num_vfs, Some(4));
        let rule = s
            .rule_for(OTHER, 0x8086, 0x4940, ClassCode(0x120000))
            .unwrap();
        assert_eq!(rule.num_vfs, Some(8));
        assert!(s
            .rule_for(OTHER, 0x10de, 0x20b5, ClassCode(0x030200))
            .is_none());

        let nic = ClassCode(0x020000);
        assert_eq!(
            s.is_protected_by_config(OTHER, 0x8086, 0x1572, nic)
                .map(ToString::to_string),
            Some("class=0x02".to_string())
        );
        assert!(s
            .is_protected_by_config(QAT, 0x8086, 0x4940, ClassCode(0x120000))
            .is_none());
    }

    #[test]
    fn semantic_errors_point_at_the_value() {
        let text = "[[select]]\nid = \"8086:4940\"\n\n[[select]]\nclass = \"0x12\"\n\n[[select]]\nid  =  \"8086:49\"\n";
        assert_eq!(
            parse_err(text),
            "test.toml:8:8: `id` in [[select]] #3: invalid id \"8086:49\": expected vendor:device \
             as 4 hex digits each (e.g. \"8086:4940\"); the device may be \"*\" for any device of the vendor"
        );
        // A missing selector is reported at the entry's header.
        let text = "[[select]]\nid = \"8086:4940\"\n[[protect]]\n[[select]]\nkind = \"gpu\"\n";
        let err = parse_err(text);
        assert!(
            err.starts_with("test.toml:4:1: [[select]] #2: a selector needs"),
            "{err}"
        );
        let err = parse_err("[[protect]]\naddress = \"0000:00:1f.6\"\n\n  [[protect]]\n");
        assert!(
            err.starts_with("test.toml:4:3: [[protect]] #2: a selector needs"),
            "{err}"
        );
    }

    #[test]
    fn shape_errors_name_the_key() {
        let err =
            parse_err("[[select]]\nid = \"8086:*\"\n[[select]]\nid = \"8086:*\"\nvf_driver = 5\n");
        assert_eq!(err, "test.toml:5:13: `vf_driver` in [[select]] #2: invalid type: integer `5`, expected a string");
        let err = parse_err("poll_interval = \"30\"\n");
        assert!(
            err.starts_with("test.toml:1:17: `poll_interval`: invalid type: string"),
            "{err}"
        );
        let err = parse_err("[select]\nid = \"8086:*\"\n");
        assert!(
            err.starts_with("test.toml:1:1: `select`: invalid type: map"),
            "{err}"
        );
        assert!(
            err.ends_with("(entries are written [[select]], not [select])"),
            "{err}"
        );
        let err = parse_err("[[protect]]\nid = \"8086:*\"\nnum_vfs = 2\n");
        assert!(
            err.starts_with(
                "test.toml:3:1: [[protect]] #1: unknown field `num_vfs`, expected one of"
            ),
            "{err}"
        );
        let err = parse_err("select = [{ id = \"8086:*\" }, { id = 1 }]\n");
        assert!(
            err.starts_with("test.toml:1:37: `id` in [[select]] #2: invalid type: integer"),
            "{err}"
        );
    }

    #[test]
    fn syntax_errors_are_positioned() {
        assert_eq!(
            parse_err("scenario = \"public\"\nscenario = \"private\"\n"),
            "test.toml:2:1: invalid TOML: duplicate key `scenario`"
        );
        let err = parse_err("# ok\n\nstate_dir = \"/var/lib\n");
        assert!(err.starts_with("test.toml:3:22: invalid TOML: "), "{err}");
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        // line_column itself is tested in `position`.
        let err = parse_err("# façade\nscenario = \"façade\"\n");
        assert!(
            err.starts_with("test.toml:2:12: `scenario`: invalid scenario"),
            "{err}"
        );
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn dropins_override_scalars_and_append_arrays_in_lexical_order() {
        let tmp = tempfile::tempdir().unwrap();
        let main = write(
            tmp.path(),
            "vfiod.toml",
            "scenario = \"public\"\npoll_interval = 10\n[[select]]\naddress = \"0000:3b:00.0\"\n[[protect]]\nclass = \"0x02\"\n",
        );
        let dir = tmp.path().join("conf.d");
        fs::create_dir(&dir).unwrap();
        // Written out of order: the order of creation (and of readdir) must not matter.
        let b = write(
            &dir,
            "20-b.toml",
            "poll_interval = 20\n[[select]]\nid = \"8086:*\"\n",
        );
        let a = write(
            &dir,
            "10-a.toml",
            "poll_interval = 15\nstate_dir = \"/srv/vfiod\"\n[[select]]\nclass = \"0x12\"\n",
        );
        let upper = write(&dir, "1Z.toml", "[[protect]]\naddress = \"0000:00:1f.6\"\n");
        // None of these is a drop-in, and each would fail to load if it were read.
        write(&dir, "30-c.toml.bak", "not toml at all [");
        write(&dir, "README", "not toml at all [");
        write(&dir, ".40-hidden.toml", "not toml at all [");
        write(&dir, "50-d.conf", "not toml at all [");

        let s = Settings::load(&main, Some(&dir), true).unwrap();
        // "10-a" < "1Z" < "20-b" in byte order.
        assert_eq!(s.sources, vec![main, a, upper, b]);
        assert_eq!(s.scenario, Scenario::Public, "kept from the main file");
        assert_eq!(s.poll_interval, Duration::from_secs(20), "last file wins");
        assert_eq!(s.state_dir, Path::new("/srv/vfiod"));
        assert_eq!(s.sysfs_root, Path::new("/"), "default when nobody sets it");
        let selectors: Vec<String> = s.select.iter().map(|r| r.selector.to_string()).collect();
        assert_eq!(
            selectors,
            ["address=0000:3b:00.0", "class=0x12", "id=8086:*"]
        );
        let protected: Vec<String> = s.protect.iter().map(ToString::to_string).collect();
        assert_eq!(protected, ["class=0x02", "address=0000:00:1f.6"]);
    }

    #[test]
    fn missing_files() {
        let tmp = tempfile::tempdir().unwrap();
        let main = tmp.path().join("vfiod.toml");
        let dir = tmp.path().join("conf.d");

        let s = Settings::load(&main, Some(&dir), false).unwrap();
        assert_eq!(s, Settings::default());

        match Settings::load(&main, Some(&dir), true) {
            Err(ConfigError::File {
                file,
                source: Some(source),
                ..
            }) => {
                assert_eq!(file, main);
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("expected a file error, got {other:?}"),
        }

        // Drop-ins alone, without a main file.
        fs::create_dir(&dir).unwrap();
        let only = write(&dir, "10-only.toml", "scenario = \"public\"\n");
        let s = Settings::load(&main, Some(&dir), false).unwrap();
        assert_eq!((s.scenario, s.sources), (Scenario::Public, vec![only]));
    }

    #[test]
    fn unreadable_dropin_is_an_error_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let main = write(tmp.path(), "vfiod.toml", "");
        let dir = tmp.path().join("conf.d");
        fs::create_dir(&dir).unwrap();
        // A directory cannot be read as a file, even by root (unlike a mode 000 file).
        let bad = dir.join("10-dir.toml");
        fs::create_dir(&bad).unwrap();
        let err = Settings::load(&main, Some(&dir), true).unwrap_err();
        assert!(
            matches!(&err, ConfigError::File { file, source: Some(_), .. } if *file == bad),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("10-dir.toml: cannot read drop-in file"),
            "{err}"
        );

        // So is a dangling link: only a missing main file is allowed.
        fs::remove_dir(&bad).unwrap();
        let link = dir.join("20-link.toml");
        std::os::unix::fs::symlink(tmp.path().join("gone.toml"), &link).unwrap();
        let err = Settings::load(&main, Some(&dir), false).unwrap_err();
        assert!(
            matches!(&err, ConfigError::File { file, .. } if *file == link),
            "{err:?}"
        );

        // A drop-in "directory" that is a file is an error too, not silently no drop-ins.
        let err = Settings::load(&main, Some(&main), true).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("vfiod.toml: cannot read drop-in directory"),
            "{err}"
        );
    }

    #[test]
    fn every_string_is_bounded_where_it_is_written() {
        let long = |n: usize| "a".repeat(n + 1);
        let keyword = long(MAX_KEYWORD_BYTES);
        let path = format!("/{}", long(MAX_PATH_BYTES - 1));
        let uri = format!("qemu:///{}", long(MAX_PATH_BYTES - 8));
        let driver = long(MAX_DRIVER_BYTES);
        let cases = [
            (
                format!("scenario = \"{keyword}\""),
                "`scenario`",
                MAX_KEYWORD_BYTES,
            ),
            (
                format!("state_dir = \"{path}\""),
                "`state_dir`",
                MAX_PATH_BYTES,
            ),
            (
                format!("sysfs_root = \"{path}\""),
                "`sysfs_root`",
                MAX_PATH_BYTES,
            ),
            (
                format!("libvirt_uri = \"{uri}\""),
                "`libvirt_uri`",
                MAX_PATH_BYTES,
            ),
            (
                format!("[[select]]\naddress = \"{keyword}\""),
                "`address` in [[select]] #1",
                MAX_KEYWORD_BYTES,
            ),
            (
                format!("[[select]]\nid = \"{keyword}\""),
                "`id` in [[select]] #1",
                MAX_KEYWORD_BYTES,
            ),
            (
                format!("[[select]]\nclass = \"{keyword}\""),
                "`class` in [[select]] #1",
                MAX_KEYWORD_BYTES,
            ),
            (
                format!("[[select]]\nkind = \"{keyword}\""),
                "`kind` in [[select]] #1",
                MAX_KEYWORD_BYTES,
            ),
            (
                format!("[[select]]\nmode = \"{keyword}\""),
                "`mode` in [[select]] #1",
                MAX_KEYWORD_BYTES,
            ),
            (
                format!("[[select]]\nvf_driver = \"{driver}\""),
                "`vf_driver` in [[select]] #1",
                MAX_DRIVER_BYTES,
            ),
            (
                format!("[[select]]\npf_driver = \"{driver}\""),
                "`pf_driver` in [[select]] #1",
                MAX_DRIVER_BYTES,
            ),
            (
                format!("[[protect]]\nid = \"{keyword}\""),
                "`id` in [[protect]] #1",
                MAX_KEYWORD_BYTES,
            ),
        ];
        for (text, key, max) in cases {
            let err = parse_err(&text);
            let expected = format!(
                "{key}: {} bytes is too long, at most {max} allowed: ",
                max + 1
            );
            assert!(err.contains(&expected), "{err}");
            assert!(err.len() < 300, "{err}");
        }
        // At the bound, each is accepted by the parser (and then judged as usual).
        let at = format!("state_dir = \"/{}\"\n", "a".repeat(MAX_PATH_BYTES - 1));
        assert_eq!(parse(&at).state_dir.as_os_str().len(), MAX_PATH_BYTES);
    }

    #[test]
    fn messages_quoting_huge_keys_or_values_stay_short() {
        let huge = "k".repeat(500_000);
        for text in [
            format!("{huge} = 1\n"),
            format!("poll_interval = \"{huge}\"\n"),
            format!("\"{huge}\" = 1\n[[select]]\n"),
            format!("scenario = \"public\"\nscenario = \"{huge}\"\n"),
            format!("\"{huge}\" = 1\n\"{huge}\" = 2\n"),
            format!("[[select]]\nid = {{ \"{huge}\" = 1 }}\n"),
            format!("[[{huge}]]\n"),
        ] {
            let err = parse_err(&text);
            assert!(err.len() < 500, "{} bytes: {}", err.len(), &err[..500]);
        }
        let err = parse_err(&format!("poll_interval = \"{huge}\"\n"));
        assert!(
            err.starts_with("test.toml:1:17: `poll_interval`: invalid type: string"),
            "{err}"
        );
        assert!(err.ends_with("expected i64"), "{err}");
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let text = format!("x = {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse_err(&text).starts_with("test.toml:1:"));
    }

    #[test]
    fn rules_keep_where_they_and_their_drivers_were_written() {
        let s = parse(
            "[[select]]\nid = \"8086:*\"\nvf_driver = \"vfio-pci\"\n\n  [[select]]\nclass = \"0x03\"\n",
        );
        let at = |line, column| Origin {
            file: PathBuf::from("test.toml"),
            line,
            column,
        };
        assert_eq!(
            s.select_origins,
            [
                RuleOrigin {
                    entry: at(1, 1),
                    vf_driver: Some(at(3, 13)),
                    pf_driver: None,
                },
                RuleOrigin {
                    entry: at(5, 3),
                    vf_driver: None,
                    pf_driver: None,
                },
            ]
        );
        assert_eq!(
            s.select_origins[0].vf_driver.as_ref().unwrap().to_string(),
            "test.toml:3:13"
        );
    }

    #[test]
    fn a_bad_value_is_an_error_even_where_a_later_file_overrides_it() {
        let tmp = tempfile::tempdir().unwrap();
        let main = write(tmp.path(), "vfiod.toml", "poll_interval = 0\n");
        let dir = tmp.path().join("conf.d");
        fs::create_dir(&dir).unwrap();
        write(&dir, "10-fix.toml", "poll_interval = 30\n");
        let err = Settings::load(&main, Some(&dir), true).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:1:17: `poll_interval`: 0 is out of range: expected 1..=86400 seconds",
                main.display()
            )
        );
    }
}
