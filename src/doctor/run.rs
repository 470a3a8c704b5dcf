//! One run of the doctor: the configuration, the host under its root, the bus; then the
//! checks decide.

use super::read::{self, Configuration};
use super::{bus, checks, ConfigFacts, Facts, PolkitFacts, Report};
use crate::config::Settings;
use crate::dbus::BusTarget;
use crate::host::sysfs::Sysfs;
use std::path::{Path, PathBuf};

/// What to examine.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The configuration (a file, or a directory laid out as `/etc/vfiod`); `None`:
    /// `$VFIOD_CONFIG`, else `/etc/vfiod`.
    pub config: Option<PathBuf>,
    /// The host's root; `None`: the configuration's `sysfs_root`.
    pub root: Option<PathBuf>,
}

/// Reads everything the checks need and decides them.
pub async fn examine(options: &Options, target: &BusTarget) -> Report {
    let (settings, sources, invalid) = match read::configuration(options.config.as_deref()) {
        Configuration::Loaded { settings, sources } => (*settings, sources, None),
        Configuration::Invalid(e) => (
            Settings::default(),
            Vec::new(),
            Some(crate::error_chain(&e)),
        ),
    };
    let root = options
        .root
        .clone()
        .unwrap_or_else(|| settings.sysfs_root.clone());
    let facts = host_facts(&root, &settings, sources, invalid);
    let (vfiod, on_bus) = bus::read(target).await;
    let facts = Facts {
        vfiod,
        polkit: PolkitFacts {
            on_bus,
            binary: facts.polkit.binary,
        },
        ..facts
    };
    Report::new(root.display().to_string(), checks(&facts))
}

/// The facts read under `root` (the bus's left as not reached): the configuration's files
/// (`sources`), or why it does not load (`invalid`; then `settings` are the defaults).
fn host_facts(
    root: &Path,
    settings: &Settings,
    sources: Vec<String>,
    invalid: Option<String>,
) -> Facts {
    let sysfs = Sysfs::host(root);
    let (loaded, devices) = read::devices(&sysfs, settings, sources);
    let config = match invalid {
        None => loaded,
        Some(error) => ConfigFacts::Invalid { error },
    };
    Facts {
        config,
        iommu: crate::host::sysfs::iommu::read_facts(&sysfs),
        iommu_units: read::iommu_units(root),
        interrupts: read::interrupts(root),
        modules: read::modules(root),
        devices,
        vfiod: super::VfiodFacts::NotRunning { bus: String::new() },
        libvirt: read::libvirt(root, settings.libvirt_uri.clone()),
        polkit: PolkitFacts {
            on_bus: None,
            binary: read::polkitd(root),
        },
    }
}

/// The checks as the daemon runs them for `vfioctl status` and its journal, at start-up and
/// after a reload: the host under the running configuration's root with that configuration
/// (already loaded: it is valid), vfiod answering (it is the caller), and the bus not asked
/// (polkitd counts as there when its binary is). Reads only.
pub fn host_report(settings: &Settings, version: &str) -> Report {
    let root = settings.sysfs_root.clone();
    let sources = settings
        .sources
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let facts = Facts {
        vfiod: super::VfiodFacts::Answers {
            bus: "bus it serves".into(),
            version: version.into(),
            iommu: String::new(),
        },
        ..host_facts(&root, settings, sources, None)
    };
    Report::new(root.display().to_string(), checks(&facts))
}
