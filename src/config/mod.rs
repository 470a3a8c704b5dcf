//! Typed daemon settings: the main TOML file (`/etc/vfiod/vfiod.toml`) plus `conf.d/*.toml`
//! drop-ins, validated once at load.
//!
//! Everything the rest of the daemon reads is already checked here: a value that reaches
//! [`Settings`] is valid, so no other module parses or re-validates configuration. A bad file is
//! rejected as a whole with `file:line:column: reason`, because a daemon that half-applies a
//! configuration could start managing a device the operator meant to protect.
//!
//! Parsing runs in two steps. Serde reads each file into `Raw*` mirror structs whose fields keep
//! their byte span ([`toml::Spanned`]) and which reject unknown keys, so a typo is an error rather
//! than a silently ignored setting. Validation then turns the raw values into typed ones and
//! reports any bad value at the line where it is written.
//!
//! Files combine in order (main file, then drop-ins in byte order of their names): a scalar key
//! set by a later file replaces the earlier value; `[[select]]` and `[[protect]]` entries append.

use crate::model::device::{Kind, Mode};
use crate::model::pci::{ClassCode, PciAddress};
use serde::Deserialize;
use std::fmt;
use std::fs;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;
use toml::Spanned;

/// Where the packaged main file is installed.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/vfiod/vfiod.toml";
/// Where drop-ins are read from, after the main file.
pub const DEFAULT_DROPIN_DIR: &str = "/etc/vfiod/conf.d";

/// Default seconds between safety-net rescans (uevents drive normal operation).
const DEFAULT_POLL_SECS: u64 = 30;
/// The local system QEMU driver, where libvirt keeps the domains of a host like this one.
pub const DEFAULT_LIBVIRT_URI: &str = "qemu:///system";
/// Longest accepted rescan interval: one day. A longer one would leave missed events unnoticed
/// for so long that it is more likely a unit mistake (milliseconds?) than an intent.
const MAX_POLL_SECS: i64 = 86_400;
/// The SR-IOV capability's TotalVFs register is 16 bits wide: no device can have more VFs.
const MAX_NUM_VFS: i64 = u16::MAX as i64;

/// The deployment scenario, which decides the default mode of a separable (SR-IOV) device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Shared hosts: separable devices are split into VFs so several VMs can each get a slice.
    Public,
    /// Dedicated hosts: devices stay whole (PF mode) and go to one VM each.
    Private,
}

impl Scenario {
    pub fn as_str(self) -> &'static str {
        match self {
            Scenario::Public => "public",
            Scenario::Private => "private",
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "public" => Ok(Scenario::Public),
            "private" => Ok(Scenario::Private),
            other => Err(format!(
                "invalid scenario {other:?}: expected \"public\" or \"private\""
            )),
        }
    }
}

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
    /// Devices vfiod must never touch, on top of those the host is detected to use.
    pub protect: Vec<Selector>,
    /// files that were read, in order (for logs and `vfioctl` status)
    pub sources: Vec<PathBuf>,
}

impl Default for Settings {
    /// The settings of a host without any configuration: private scenario, nothing managed.
    fn default() -> Self {
        Settings {
            scenario: Scenario::Private,
            poll_interval: Duration::from_secs(DEFAULT_POLL_SECS),
            state_dir: PathBuf::from("/var/lib/vfiod"),
            sysfs_root: PathBuf::from("/"),
            libvirt_uri: Some(DEFAULT_LIBVIRT_URI.to_string()),
            select: Vec::new(),
            protect: Vec::new(),
            sources: Vec::new(),
        }
    }
}

/// A prefix of a 24-bit class code: the base class (2 hex digits), base and subclass (4), or the
/// full code with programming interface (6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClassPrefix {
    /// The prefix itself, right-aligned: `0x12` for "0x12", `0x1200` for "0x1200".
    pub value: u32,
    /// 2, 4 or 6.
    pub digits: u8,
}

impl ClassPrefix {
    pub fn matches(&self, class: ClassCode) -> bool {
        let shift = 4 * (6 - u32::from(self.digits.min(6)));
        (class.0 & 0x00ff_ffff) >> shift == self.value
    }
}

impl FromStr for ClassPrefix {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let err = || {
            format!(
                "invalid class {s:?}: expected \"0x\" and 2, 4 or 6 hex digits \
                 (base class, +subclass, +programming interface), e.g. \"0x12\" or \"0x0108\""
            )
        };
        let hex = s.strip_prefix("0x").ok_or_else(err)?;
        if !matches!(hex.len(), 2 | 4 | 6) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err());
        }
        let value = u32::from_str_radix(hex, 16).map_err(|_| err())?;
        Ok(ClassPrefix {
            value,
            digits: hex.len() as u8,
        })
    }
}

impl fmt::Display for ClassPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "0x{:0width$x}",
            self.value,
            width = usize::from(self.digits)
        )
    }
}

/// Which devices a `[[select]]` or `[[protect]]` entry means. Every part that is set must match;
/// a selector with no part set matches nothing (config loading never produces one), so that an
/// accidentally empty selector cannot grab every device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    pub address: Option<PciAddress>,
    /// Vendor and device id; `None` for the device means any device of that vendor.
    pub id: Option<(u16, Option<u16>)>,
    pub class: Option<ClassPrefix>,
}

impl Selector {
    pub fn matches(&self, address: PciAddress, vendor: u16, device: u16, class: ClassCode) -> bool {
        if self.is_empty() {
            return false;
        }
        let address_ok = self.address.is_none_or(|a| a == address);
        let id_ok = self
            .id
            .is_none_or(|(v, d)| v == vendor && d.is_none_or(|d| d == device));
        let class_ok = self.class.is_none_or(|c| c.matches(class));
        address_ok && id_ok && class_ok
    }

    fn is_empty(&self) -> bool {
        self.address.is_none() && self.id.is_none() && self.class.is_none()
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::with_capacity(3);
        if let Some(address) = self.address {
            parts.push(format!("address={address}"));
        }
        match self.id {
            Some((vendor, Some(device))) => parts.push(format!("id={vendor:04x}:{device:04x}")),
            Some((vendor, None)) => parts.push(format!("id={vendor:04x}:*")),
            None => {}
        }
        if let Some(class) = self.class {
            parts.push(format!("class={class}"));
        }
        if parts.is_empty() {
            f.write_str("(empty selector)")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

/// One `[[select]]` entry: which devices vfiod manages and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRule {
    pub selector: Selector,
    /// Overrides the kind derived from the class code.
    pub kind: Option<Kind>,
    /// Overrides the scenario's default mode; only `Mode::Pf` or `Mode::Vf`.
    pub mode: Option<Mode>,
    /// VFs to create when split; at least 1, and never set together with `mode = "pf"`.
    pub num_vfs: Option<u32>,
    /// Driver for the VFs (vfio-pci when unset).
    pub vf_driver: Option<String>,
    /// Driver for the PF in PF mode.
    pub pf_driver: Option<String>,
}

/// Why configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file was read but its content is wrong; `line` and `column` are 1-based, the column
    /// counts characters.
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        file: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    /// A file or directory could not be read at all.
    #[error("{file}: {message}")]
    File {
        file: PathBuf,
        message: String,
        #[source]
        source: Option<io::Error>,
    },
}

impl Settings {
    /// Load the main file and the drop-ins. `main_required`: when false and the main file does not exist,
    /// start from defaults (a host with no config manages nothing). A missing drop-in dir is fine.
    pub fn load(
        main: &Path,
        dropin_dir: Option<&Path>,
        main_required: bool,
    ) -> Result<Settings, ConfigError> {
        let mut settings = Settings::default();
        match fs::read(main) {
            Ok(bytes) => settings.apply(parse_layer(&bytes, main)?, main),
            Err(e) if e.kind() == io::ErrorKind::NotFound && !main_required => {
                tracing::debug!(file = %main.display(), "no config file, using defaults");
            }
            Err(e) => return Err(file_error(main, "cannot read config file", e)),
        }
        if let Some(dir) = dropin_dir {
            for path in dropin_files(dir)? {
                let bytes = fs::read(&path)
                    .map_err(|e| file_error(&path, "cannot read drop-in file", e))?;
                settings.apply(parse_layer(&bytes, &path)?, &path);
            }
        }
        Ok(settings)
    }

    /// Parse one document as if it were the only file (used by tests and tools; `load` parses
    /// each of its files the same way).
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<Settings, ConfigError> {
        let mut settings = Settings::default();
        settings.apply(Document { text, origin }.parse()?, origin);
        Ok(settings)
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

    fn apply(&mut self, layer: Layer, source: &Path) {
        if let Some(scenario) = layer.scenario {
            self.scenario = scenario;
        }
        if let Some(poll_interval) = layer.poll_interval {
            self.poll_interval = poll_interval;
        }
        if let Some(state_dir) = layer.state_dir {
            self.state_dir = state_dir;
        }
        if let Some(sysfs_root) = layer.sysfs_root {
            self.sysfs_root = sysfs_root;
        }
        if let Some(uri) = layer.libvirt_uri {
            self.libvirt_uri = (!uri.is_empty()).then_some(uri);
        }
        self.select.extend(layer.select);
        self.protect.extend(layer.protect);
        self.sources.push(source.to_path_buf());
    }
}

fn file_error(file: &Path, message: &str, source: io::Error) -> ConfigError {
    ConfigError::File {
        file: file.to_path_buf(),
        message: message.to_string(),
        source: Some(source),
    }
}

/// The `*.toml` files of the drop-in directory in byte order of their names, like `LC_ALL=C ls`.
/// Hidden files are skipped as a shell glob would, so editor and package-manager leftovers
/// (`.foo.toml.swp`, `foo.toml.rpmnew`) never take effect.
fn dropin_files(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(file_error(dir, "cannot read drop-in directory", e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| file_error(dir, "cannot read drop-in directory", e))?;
        let name = entry.file_name();
        let path = Path::new(&name);
        let hidden = name.as_encoded_bytes().starts_with(b".");
        if !hidden && path.extension().is_some_and(|ext| ext == "toml") {
            names.push(name);
        }
    }
    names.sort();
    Ok(names.into_iter().map(|name| dir.join(name)).collect())
}

/// What one file sets; `None` and empty lists leave earlier values alone.
#[derive(Debug, Default)]
struct Layer {
    scenario: Option<Scenario>,
    poll_interval: Option<Duration>,
    state_dir: Option<PathBuf>,
    sysfs_root: Option<PathBuf>,
    /// "" = no libvirt check.
    libvirt_uri: Option<String>,
    select: Vec<DeviceRule>,
    protect: Vec<Selector>,
}

fn parse_layer(bytes: &[u8], origin: &Path) -> Result<Layer, ConfigError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let (line, column) = line_column(bytes, e.valid_up_to());
        ConfigError::Invalid {
            file: origin.to_path_buf(),
            line,
            column,
            message: "file is not valid UTF-8".to_string(),
        }
    })?;
    Document { text, origin }.parse()
}

/// 1-based line and character column of a byte offset.
fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = &bytes[..offset.min(bytes.len())];
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    // Count characters, not bytes: UTF-8 continuation bytes (0b10xx_xxxx) do not start one.
    let column = before[line_start..]
        .iter()
        .filter(|&&b| b & 0xc0 != 0x80)
        .count()
        + 1;
    (line, column)
}

// The raw mirror of one file. Field names are the TOML keys; every value the validation looks at
// keeps its span so that errors point at it.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    scenario: Option<Spanned<String>>,
    poll_interval: Option<Spanned<i64>>,
    state_dir: Option<Spanned<String>>,
    sysfs_root: Option<Spanned<String>>,
    libvirt_uri: Option<Spanned<String>>,
    #[serde(default)]
    select: Vec<Spanned<RawRule>>,
    #[serde(default)]
    protect: Vec<Spanned<RawSelector>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    // Not `#[serde(flatten)]` of RawSelector: serde ignores deny_unknown_fields with flatten.
    address: Option<Spanned<String>>,
    id: Option<Spanned<String>>,
    class: Option<Spanned<String>>,
    kind: Option<Spanned<String>>,
    mode: Option<Spanned<String>>,
    num_vfs: Option<Spanned<i64>>,
    vf_driver: Option<Spanned<String>>,
    pf_driver: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSelector {
    address: Option<Spanned<String>>,
    id: Option<Spanned<String>>,
    class: Option<Spanned<String>>,
}

/// Names a key for messages: "`poll_interval`" or "`id` in [[select]] #3" (entries count from 1
/// within the file, as a reader counts headers).
#[derive(Clone, Copy)]
struct Key<'a> {
    entry: Option<(&'a str, usize)>,
    name: Option<&'a str>,
}

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.name, self.entry) {
            (Some(name), Some((array, index))) => {
                write!(f, "`{name}` in [[{array}]] #{}", index + 1)
            }
            (None, Some((array, index))) => write!(f, "[[{array}]] #{}", index + 1),
            (Some(name), None) => write!(f, "`{name}`"),
            (None, None) => f.write_str("document"),
        }
    }
}

/// One file's text and name, for positions in errors.
struct Document<'a> {
    text: &'a str,
    origin: &'a Path,
}

impl Document<'_> {
    fn parse(&self) -> Result<Layer, ConfigError> {
        let table = toml::de::DeTable::parse(self.text).map_err(|e| self.syntax_error(&e))?;
        let raw = RawFile::deserialize(toml::de::Deserializer::from(table))
            .map_err(|e| self.shape_error(&e))?;
        self.validate(raw)
    }

    fn error_at(&self, offset: usize, message: String) -> ConfigError {
        let (line, column) = line_column(self.text.as_bytes(), offset);
        ConfigError::Invalid {
            file: self.origin.to_path_buf(),
            line,
            column,
            message,
        }
    }

    fn syntax_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span().unwrap_or(0..0);
        let mut message = format!("invalid TOML: {}", e.message());
        // The parser's "duplicate key" does not say which; its span covers the key.
        if let Some(text) = self.text.get(span.clone()).filter(|t| !t.is_empty()) {
            if e.message() == "duplicate key" {
                message = format!("invalid TOML: duplicate key `{}`", text.trim());
            }
        }
        self.error_at(span.start, message)
    }

    /// An unknown key or a value of the wrong type, found by serde. Serde's message does not say
    /// which key it is about, so find the key whose span the error points into.
    fn shape_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span().unwrap_or(0..0);
        let path = key_path_at(self.text, &span);
        let (entry, inner) = match path.as_slice() {
            [Segment::Key(array), Segment::Index(index), inner @ ..] => {
                (Some((array.as_str(), *index)), inner)
            }
            whole => (None, whole),
        };
        let name = inner
            .iter()
            .rev()
            .find_map(|segment| match segment {
                Segment::Key(name) => Some(name.as_str()),
                Segment::Index(_) => None,
            })
            // "unknown field `x`, expected one of ..." names the key itself.
            .filter(|_| !e.message().starts_with("unknown field"));
        let mut message = match (entry, name) {
            (None, None) => e.message().to_string(),
            _ => format!("{}: {}", Key { entry, name }, e.message()),
        };
        if let [Segment::Key(array)] = path.as_slice() {
            if (array == "select" || array == "protect")
                && e.message().starts_with("invalid type: map")
            {
                message.push_str(&format!(
                    " (entries are written [[{array}]], not [{array}])"
                ));
            }
        }
        self.error_at(span.start, message)
    }

    fn validate(&self, raw: RawFile) -> Result<Layer, ConfigError> {
        let top = |name| Key {
            entry: None,
            name: Some(name),
        };
        let mut layer = Layer::default();
        if let Some(value) = raw.scenario {
            let scenario = value.get_ref().parse::<Scenario>();
            layer.scenario = Some(self.check(&value, top("scenario"), scenario)?);
        }
        if let Some(value) = raw.poll_interval {
            let secs = check_range(*value.get_ref(), 1, MAX_POLL_SECS, " seconds");
            let secs = self.check(&value, top("poll_interval"), secs)?;
            layer.poll_interval = Some(Duration::from_secs(secs as u64));
        }
        if let Some(value) = raw.state_dir {
            layer.state_dir = Some(self.check(&value, top("state_dir"), absolute_path(&value))?);
        }
        if let Some(value) = raw.sysfs_root {
            layer.sysfs_root =
                Some(self.check(&value, top("sysfs_root"), absolute_path(&value))?);
        }
        if let Some(value) = raw.libvirt_uri {
            layer.libvirt_uri =
                Some(self.check(&value, top("libvirt_uri"), libvirt_uri(&value))?);
        }
        for (index, rule) in raw.select.iter().enumerate() {
            layer.select.push(self.rule(rule, index)?);
        }
        for (index, selector) in raw.protect.iter().enumerate() {
            let entry = ("protect", index);
            let inner = selector.get_ref();
            layer.protect.push(self.selector(
                selector.span(),
                entry,
                [&inner.address, &inner.id, &inner.class],
            )?);
        }
        Ok(layer)
    }

    fn rule(&self, spanned: &Spanned<RawRule>, index: usize) -> Result<DeviceRule, ConfigError> {
        let entry = ("select", index);
        let key = |name| Key {
            entry: Some(entry),
            name: Some(name),
        };
        let raw = spanned.get_ref();
        let selector = self.selector(spanned.span(), entry, [&raw.address, &raw.id, &raw.class])?;
        let kind = match &raw.kind {
            Some(value) => Some(self.check(value, key("kind"), value.get_ref().parse::<Kind>())?),
            None => None,
        };
        let mode = match &raw.mode {
            Some(value) => Some(self.check(value, key("mode"), config_mode(value.get_ref()))?),
            None => None,
        };
        let num_vfs = match &raw.num_vfs {
            Some(value) => {
                let count = check_range(*value.get_ref(), 1, MAX_NUM_VFS, "");
                let count = self.check(value, key("num_vfs"), count)?;
                if mode == Some(Mode::Pf) {
                    let message = format!(
                        "{}: num_vfs = {count} conflicts with mode = \"pf\" \
                         (only valid with mode = \"vf\" or no mode)",
                        key("num_vfs")
                    );
                    return Err(self.error_at(value.span().start, message));
                }
                Some(count as u32)
            }
            None => None,
        };
        let driver = |value: &Option<Spanned<String>>, name| match value {
            Some(value) => self.check(value, key(name), driver_name(value)).map(Some),
            None => Ok(None),
        };
        let vf_driver = driver(&raw.vf_driver, "vf_driver")?;
        let pf_driver = driver(&raw.pf_driver, "pf_driver")?;
        Ok(DeviceRule {
            selector,
            kind,
            mode,
            num_vfs,
            vf_driver,
            pf_driver,
        })
    }

    /// `header` is the span of the entry (its `[[select]]` header), where a missing part is
    /// reported.
    fn selector(
        &self,
        header: Range<usize>,
        entry: (&str, usize),
        [address, id, class]: [&Option<Spanned<String>>; 3],
    ) -> Result<Selector, ConfigError> {
        let key = |name| Key {
            entry: Some(entry),
            name: Some(name),
        };
        let address = match address {
            Some(value) => {
                let parsed = value
                    .get_ref()
                    .parse::<PciAddress>()
                    .map_err(|e| e.to_string());
                Some(self.check(value, key("address"), parsed)?)
            }
            None => None,
        };
        let id = match id {
            Some(value) => Some(self.check(value, key("id"), parse_id(value.get_ref()))?),
            None => None,
        };
        let class = match class {
            Some(value) => Some(self.check(value, key("class"), value.get_ref().parse())?),
            None => None,
        };
        let selector = Selector { address, id, class };
        if selector.is_empty() {
            let key = Key {
                entry: Some(entry),
                name: None,
            };
            let message = format!(
                "{key}: a selector needs at least one of `address`, `id`, `class` \
                 (an entry without one would match every device)"
            );
            return Err(self.error_at(header.start, message));
        }
        Ok(selector)
    }

    /// Turns a validation result into a positioned error naming the key.
    fn check<T, V>(
        &self,
        value: &Spanned<V>,
        key: Key<'_>,
        result: Result<T, String>,
    ) -> Result<T, ConfigError> {
        result.map_err(|reason| self.error_at(value.span().start, format!("{key}: {reason}")))
    }
}

fn check_range(value: i64, min: i64, max: i64, unit: &str) -> Result<i64, String> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(format!(
            "{value} is out of range: expected {min}..={max}{unit}"
        ))
    }
}

/// "" (no libvirt check) or a libvirt URI: `driver[+transport]://[host]/path[?query]`.
fn libvirt_uri(value: &Spanned<String>) -> Result<String, String> {
    let uri = value.get_ref();
    if uri.is_empty() {
        return Ok(String::new());
    }
    let scheme_ok = uri.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty()
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-')
    });
    if !scheme_ok || uri.chars().any(char::is_whitespace) {
        return Err(format!(
            "invalid libvirt_uri {uri:?}: expected a libvirt URI such as \"qemu:///system\", \
             or \"\" to skip the libvirt check"
        ));
    }
    Ok(uri.clone())
}

fn absolute_path(value: &Spanned<String>) -> Result<PathBuf, String> {
    let path = Path::new(value.get_ref());
    if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Err(format!("{:?} is not an absolute path", value.get_ref()))
    }
}

/// Only the two modes a device can be put in; `none` is what a VF reports, not a choice.
fn config_mode(text: &str) -> Result<Mode, String> {
    match text {
        "pf" => Ok(Mode::Pf),
        "vf" => Ok(Mode::Vf),
        other => Err(format!("invalid mode {other:?}: expected \"pf\" or \"vf\"")),
    }
}

/// `VVVV:DDDD` or `VVVV:*`, 4 hex digits each, as lspci -n prints them.
fn parse_id(text: &str) -> Result<(u16, Option<u16>), String> {
    let err = || {
        format!(
            "invalid id {text:?}: expected vendor:device as 4 hex digits each \
             (e.g. \"8086:4940\"); the device may be \"*\" for any device of the vendor"
        )
    };
    let hex4 = |part: &str| {
        if part.len() == 4 && part.bytes().all(|b| b.is_ascii_hexdigit()) {
            u16::from_str_radix(part, 16).map_err(|_| err())
        } else {
            Err(err())
        }
    };
    let (vendor, device) = text.split_once(':').ok_or_else(err)?;
    let vendor = hex4(vendor)?;
    let device = if device == "*" {
        None
    } else {
        Some(hex4(device)?)
    };
    Ok((vendor, device))
}

/// A driver name ends up as a path component under /sys/bus/pci/drivers and is written to
/// `driver_override`: it must be one plain component.
fn driver_name(value: &Spanned<String>) -> Result<String, String> {
    let name = value.get_ref();
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control());
    if bad {
        Err(format!(
            "invalid driver name {name:?}: expected a non-empty name without '/' or whitespace"
        ))
    } else {
        Ok(name.clone())
    }
}

#[derive(Clone, Debug)]
enum Segment {
    Key(String),
    Index(usize),
}

/// The deepest key whose key or value span overlaps `span`, as a path from the document root.
/// Used only on the error path, so it re-parses the (syntactically valid) text.
fn key_path_at(text: &str, span: &Range<usize>) -> Vec<Segment> {
    let mut best = Vec::new();
    if let Ok(table) = toml::de::DeTable::parse(text) {
        walk_table(table.get_ref(), span, &mut Vec::new(), &mut best);
    }
    best
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    if b.is_empty() {
        a.start <= b.start && b.start <= a.end
    } else {
        a.start < b.end && b.start < a.end
    }
}

fn walk_table(
    table: &toml::de::DeTable<'_>,
    span: &Range<usize>,
    path: &mut Vec<Segment>,
    best: &mut Vec<Segment>,
) {
    for (key, value) in table {
        path.push(Segment::Key(key.get_ref().to_string()));
        if overlaps(&key.span(), span) || overlaps(&value.span(), span) {
            remember(path, best);
        }
        walk_value(value.get_ref(), span, path, best);
        path.pop();
    }
}

fn walk_value(
    value: &toml::de::DeValue<'_>,
    span: &Range<usize>,
    path: &mut Vec<Segment>,
    best: &mut Vec<Segment>,
) {
    match value {
        toml::de::DeValue::Table(table) => walk_table(table, span, path, best),
        toml::de::DeValue::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                path.push(Segment::Index(index));
                if overlaps(&item.span(), span) {
                    remember(path, best);
                }
                walk_value(item.get_ref(), span, path, best);
                path.pop();
            }
        }
        _ => {}
    }
}

fn remember(path: &[Segment], best: &mut Vec<Segment>) {
    // Deeper wins: a leaf value is more precise than the table holding it.
    if path.len() >= best.len() {
        *best = path.to_vec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QAT: PciAddress = PciAddress::new(0, 0x3b, 0, 0);
    const OTHER: PciAddress = PciAddress::new(0, 0x5e, 0, 1);

    fn selector(address: Option<&str>, id: Option<&str>, class: Option<&str>) -> Selector {
        Selector {
            address: address.map(|a| a.parse().unwrap()),
            id: id.map(|i| parse_id(i).unwrap()),
            class: class.map(|c| c.parse().unwrap()),
        }
    }

    fn parse(text: &str) -> Settings {
        Settings::from_toml_str(text, Path::new("test.toml")).unwrap()
    }

    fn parse_err(text: &str) -> String {
        Settings::from_toml_str(text, Path::new("test.toml"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn selector_by_address() {
        let s = selector(Some("0000:3b:00.0"), None, None);
        assert!(s.matches(QAT, 0x8086, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(OTHER, 0x8086, 0x4940, ClassCode(0x120000)));
        // The short form means domain 0.
        assert_eq!(selector(Some("3b:00.0"), None, None), s);
    }

    #[test]
    fn selector_by_id_with_and_without_device_wildcard() {
        let exact = selector(None, Some("8086:4940"), None);
        assert!(exact.matches(QAT, 0x8086, 0x4940, ClassCode(0)));
        assert!(!exact.matches(QAT, 0x8086, 0x4941, ClassCode(0)));
        assert!(!exact.matches(QAT, 0x10de, 0x4940, ClassCode(0)));

        let vendor = selector(None, Some("8086:*"), None);
        assert!(vendor.matches(QAT, 0x8086, 0x4940, ClassCode(0)));
        assert!(vendor.matches(OTHER, 0x8086, 0x0001, ClassCode(0)));
        assert!(!vendor.matches(QAT, 0x10de, 0x4940, ClassCode(0)));
        // Hex digits in either case.
        assert_eq!(
            selector(None, Some("10DE:20B5"), None).id,
            Some((0x10de, Some(0x20b5)))
        );
    }

    #[test]
    fn selector_by_class_prefix_of_2_4_6_digits() {
        let nvme = ClassCode(0x010802);
        let sata = ClassCode(0x010601);
        let base = selector(None, None, Some("0x01"));
        assert!(base.matches(QAT, 0, 0, nvme) && base.matches(QAT, 0, 0, sata));
        assert!(!base.matches(QAT, 0, 0, ClassCode(0x020000)));

        let sub = selector(None, None, Some("0x0108"));
        assert!(sub.matches(QAT, 0, 0, nvme));
        assert!(!sub.matches(QAT, 0, 0, sata));
        assert!(!sub.matches(QAT, 0, 0, ClassCode(0x080100)));

        let full = selector(None, None, Some("0x010802"));
        assert!(full.matches(QAT, 0, 0, nvme));
        assert!(!full.matches(QAT, 0, 0, ClassCode(0x010803)));

        // 0x12 as a base class is not 0x0012xx: the prefix is left-aligned in the code.
        let accel = selector(None, None, Some("0x12"));
        assert!(accel.matches(QAT, 0, 0, ClassCode(0x120000)));
        assert!(!accel.matches(QAT, 0, 0, ClassCode(0x001200)));
    }

    #[test]
    fn selector_parts_must_all_match() {
        let s = selector(Some("0000:3b:00.0"), Some("8086:*"), Some("0x12"));
        assert!(s.matches(QAT, 0x8086, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(OTHER, 0x8086, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(QAT, 0x1022, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(QAT, 0x8086, 0x4940, ClassCode(0x0b4000)));
    }

    #[test]
    fn empty_selector_matches_nothing() {
        let s = Selector {
            address: None,
            id: None,
            class: None,
        };
        assert!(!s.matches(QAT, 0x8086, 0x4940, ClassCode(0x120000)));
        assert_eq!(s.to_string(), "(empty selector)");
    }

    #[test]
    fn selector_display() {
        let s = selector(Some("0000:3b:00.0"), Some("8086:*"), Some("0x12"));
        assert_eq!(s.to_string(), "address=0000:3b:00.0 id=8086:* class=0x12");
        let s = selector(None, Some("10DE:20b5"), Some("0x030000"));
        assert_eq!(s.to_string(), "id=10de:20b5 class=0x030000");
        assert_eq!(
            selector(None, None, Some("0x0108")).to_string(),
            "class=0x0108"
        );
    }

    #[test]
    fn class_prefix_parsing() {
        assert_eq!(
            "0x0108".parse(),
            Ok(ClassPrefix {
                value: 0x0108,
                digits: 4
            })
        );
        assert_eq!(
            "0x00".parse(),
            Ok(ClassPrefix {
                value: 0,
                digits: 2
            })
        );
        for bad in [
            "",
            "0x",
            "0x1",
            "0x123",
            "0x1234567",
            "12",
            "0X12",
            "0x1g",
            "0x+1",
            " 0x12",
        ] {
            assert!(bad.parse::<ClassPrefix>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn id_parsing() {
        assert_eq!(parse_id("8086:4940"), Ok((0x8086, Some(0x4940))));
        assert_eq!(parse_id("8086:*"), Ok((0x8086, None)));
        for bad in [
            "",
            "8086",
            "8086:",
            "8086:494",
            "*:4940",
            "*:*",
            "8086:49400",
            "808g:4940",
            "8086-4940",
            "+086:4940",
        ] {
            assert!(parse_id(bad).is_err(), "{bad:?} accepted");
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
        assert_eq!(line_column("ab\ncdé".as_bytes(), 0), (1, 1));
        assert_eq!(line_column("ab\ncdé".as_bytes(), 3), (2, 1));
        assert_eq!(line_column("ab\n# é = x".as_bytes(), 8), (2, 5));
        assert_eq!(line_column(b"ab", 99), (1, 3));
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
}
