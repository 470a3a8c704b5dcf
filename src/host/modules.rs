//! Which kernel drivers this host can provide, for warnings about configured driver names
//! (`vf_driver`, `pf_driver`) that nothing provides, such as a typo'd `vfio-pcii`.
//!
//! A driver is available when it is registered now (`sys/bus/pci/drivers/<name>`), or when a
//! module of that name is installed (`modules.dep`) or built into the kernel
//! (`modules.builtin`) for the running release. Every path is under the same root as
//! [`Settings::sysfs_root`], so tests build a fake tree. Reading happens once, in
//! [`ModuleIndex::read`]; the answers ([`ModuleIndex::availability`], [`warnings`]) are pure.
//!
//! This is advice, not validation: a module may be installed after the configuration is
//! written, and a driver's name need not be its module's. So an unknown name is a warning, and
//! where there is no module index to ask (the simulated kernel) there is no warning at all.

use crate::config::Settings;
use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::Path;

/// Largest module index file read (a distribution kernel's `modules.dep` is under 1 MiB).
const MAX_INDEX_BYTES: u64 = 16 << 20;

/// Whether something provides a driver of a given name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Availability {
    /// Registered now: `sys/bus/pci/drivers/<name>` exists.
    Loaded,
    /// Not registered, but a module of that name is installed; binding loads it.
    Module,
    /// Built into the kernel (listed in `modules.builtin`).
    Builtin,
    /// Not registered, and the module index lists no such module.
    Unknown,
    /// Not registered, and there is no module index to ask (no `modules.dep` nor
    /// `modules.builtin` for the release, as on the simulated kernel).
    CannotTell,
}

/// What the host provides: registered PCI drivers and, when found, the module index of the
/// running kernel.
#[derive(Clone, Debug, Default)]
pub struct ModuleIndex {
    loaded: BTreeSet<String>,
    /// Module names, with '-' as '_' (modprobe treats them alike).
    modules: Option<BTreeSet<String>>,
    builtin: Option<BTreeSet<String>>,
}

impl ModuleIndex {
    /// Reads the registered drivers and the module index under `root`. Read-only; whatever
    /// cannot be read counts as absent.
    pub fn read(root: &Path) -> ModuleIndex {
        let loaded = fs::read_dir(root.join("sys/bus/pci/drivers"))
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let dir = release(root).map(|r| root.join("lib/modules").join(r));
        let index = |name: &str| dir.as_ref().and_then(|d| read_index(&d.join(name)));
        ModuleIndex::from_parts(
            loaded,
            index("modules.dep").as_deref(),
            index("modules.builtin").as_deref(),
        )
    }

    /// From the names of the registered drivers and the text of `modules.dep` and
    /// `modules.builtin` (each `None` when absent).
    pub fn from_parts(
        loaded: impl IntoIterator<Item = String>,
        modules_dep: Option<&str>,
        modules_builtin: Option<&str>,
    ) -> ModuleIndex {
        // modules.dep: "kernel/drivers/vfio/pci/vfio-pci.ko.zst: kernel/drivers/vfio/vfio.ko.zst"
        // modules.builtin: "kernel/drivers/pci/pcie/portdrv.ko"
        let names = |text: &str| {
            text.lines()
                .filter_map(|line| line.split(':').next())
                .filter_map(module_name)
                .collect::<BTreeSet<_>>()
        };
        ModuleIndex {
            loaded: loaded.into_iter().collect(),
            modules: modules_dep.map(names),
            builtin: modules_builtin.map(names),
        }
    }

    pub fn availability(&self, driver: &str) -> Availability {
        if self.loaded.contains(driver) {
            return Availability::Loaded;
        }
        if self.modules.is_none() && self.builtin.is_none() {
            return Availability::CannotTell;
        }
        let name = normalize(driver);
        if self.modules.as_ref().is_some_and(|m| m.contains(&name)) {
            Availability::Module
        } else if self.builtin.as_ref().is_some_and(|b| b.contains(&name)) {
            Availability::Builtin
        } else {
            Availability::Unknown
        }
    }
}

/// One line per configured `vf_driver` / `pf_driver` that no driver, module or built-in
/// provides, with where it was written, e.g.
/// `vf_driver "vfio-pcii" (conf.d/10-x.toml:4:13) is not a loaded driver, a module or built
/// in: a task that needs it will be refused`. Reads the host under `root` (read-only).
pub fn driver_warnings(settings: &Settings, root: &Path) -> Vec<String> {
    warnings(settings, &ModuleIndex::read(root))
}

/// [`driver_warnings`] against an index already read.
pub fn warnings(settings: &Settings, index: &ModuleIndex) -> Vec<String> {
    let mut out = Vec::new();
    for (i, rule) in settings.select.iter().enumerate() {
        let origin = settings.select_origins.get(i);
        let drivers = [
            (
                "vf_driver",
                &rule.vf_driver,
                origin.and_then(|o| o.vf_driver.as_ref()),
            ),
            (
                "pf_driver",
                &rule.pf_driver,
                origin.and_then(|o| o.pf_driver.as_ref()),
            ),
        ];
        for (key, name, at) in drivers {
            let Some(name) = name else { continue };
            if index.availability(name) != Availability::Unknown {
                continue;
            }
            let at = at.map(|o| format!(" ({o})")).unwrap_or_default();
            out.push(format!(
                "{key} {name:?}{at} is not a loaded driver, a module or built in: \
                 a task that needs it will be refused"
            ));
        }
    }
    out
}

/// The running kernel's release: `proc/sys/kernel/osrelease` under the root, else, on the real
/// root, `uname`. Only a plain path component is used.
fn release(root: &Path) -> Option<String> {
    let from_proc = fs::read_to_string(root.join("proc/sys/kernel/osrelease"))
        .ok()
        .map(|s| s.trim().to_string());
    let release = match from_proc {
        Some(r) => r,
        None if root == Path::new("/") => nix::sys::utsname::uname()
            .ok()?
            .release()
            .to_str()?
            .to_string(),
        None => return None,
    };
    let plain = !release.is_empty() && release != "." && release != ".." && !release.contains('/');
    plain.then_some(release)
}

/// A regular file's text, at most [`MAX_INDEX_BYTES`]; `None` for anything else.
fn read_index(path: &Path) -> Option<String> {
    let file = fs::File::open(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    file.take(MAX_INDEX_BYTES + 1)
        .read_to_string(&mut text)
        .ok()?;
    if text.len() as u64 > MAX_INDEX_BYTES {
        tracing::debug!(path = %path.display(), "module index too large, ignored");
        return None;
    }
    Some(text)
}

/// "kernel/drivers/vfio/pci/vfio-pci.ko.zst" -> "vfio_pci".
fn module_name(path: &str) -> Option<String> {
    let file = path.trim().rsplit('/').next()?;
    let (name, _) = file.split_once(".ko")?;
    (!name.is_empty()).then(|| normalize(name))
}

fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const DEP: &str = "\
kernel/drivers/vfio/pci/vfio-pci.ko.zst: kernel/drivers/vfio/pci/vfio-pci-core.ko.zst
kernel/drivers/crypto/intel/qat/qat_4xxx/qat_4xxx.ko.xz: kernel/drivers/crypto/intel/qat/qat_common/intel_qat.ko.xz
kernel/drivers/net/ethernet/intel/ixgbevf/ixgbevf.ko:
";
    const BUILTIN: &str = "kernel/drivers/pci/pci-stub.ko\nkernel/drivers/nvme/host/nvme.ko\n";

    /// A fake host root: registered drivers, and optionally a release with a module index.
    fn tree(
        loaded: &[&str],
        release: Option<&str>,
        dep: Option<&str>,
        builtin: Option<&str>,
    ) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for d in loaded {
            fs::create_dir_all(root.join("sys/bus/pci/drivers").join(d)).unwrap();
        }
        if let Some(release) = release {
            fs::create_dir_all(root.join("proc/sys/kernel")).unwrap();
            fs::write(
                root.join("proc/sys/kernel/osrelease"),
                format!("{release}\n"),
            )
            .unwrap();
            let dir = root.join("lib/modules").join(release);
            fs::create_dir_all(&dir).unwrap();
            if let Some(dep) = dep {
                fs::write(dir.join("modules.dep"), dep).unwrap();
            }
            if let Some(builtin) = builtin {
                fs::write(dir.join("modules.builtin"), builtin).unwrap();
            }
        }
        tmp
    }

    #[test]
    fn availability_from_a_fake_root() {
        let tmp = tree(
            &["pcieport", "nvme"],
            Some("6.8.0-test"),
            Some(DEP),
            Some(BUILTIN),
        );
        let index = ModuleIndex::read(tmp.path());
        use Availability::*;
        for (name, expected) in [
            ("pcieport", Loaded),
            ("nvme", Loaded),
            ("vfio-pci", Module),
            // Dashes and underscores are the same module name.
            ("vfio_pci", Module),
            ("qat-4xxx", Module),
            ("qat_4xxx", Module),
            ("ixgbevf", Module),
            ("pci-stub", Builtin),
            ("pci_stub", Builtin),
            ("vfio-pcii", Unknown),
            ("vfio", Unknown),
            ("intel_qat_x", Unknown),
        ] {
            assert_eq!(index.availability(name), expected, "{name}");
        }
    }

    #[test]
    fn either_index_alone_is_enough_to_tell() {
        let only_builtin = tree(&[], Some("r1"), None, Some(BUILTIN));
        let index = ModuleIndex::read(only_builtin.path());
        assert_eq!(index.availability("pci-stub"), Availability::Builtin);
        assert_eq!(index.availability("vfio-pci"), Availability::Unknown);
        let only_dep = tree(&[], Some("r1"), Some(DEP), None);
        let index = ModuleIndex::read(only_dep.path());
        assert_eq!(index.availability("vfio-pci"), Availability::Module);
        assert_eq!(index.availability("pci-stub"), Availability::Unknown);
    }

    #[test]
    fn without_a_module_index_only_loaded_drivers_are_known() {
        // No release at all (the simulated kernel), and a release without an index.
        for tmp in [
            tree(&["vfio-pci"], None, None, None),
            tree(&["vfio-pci"], Some("6.8.0-test"), None, None),
        ] {
            let index = ModuleIndex::read(tmp.path());
            assert_eq!(index.availability("vfio-pci"), Availability::Loaded);
            assert_eq!(index.availability("vfio-pcii"), Availability::CannotTell);
        }
    }

    #[test]
    fn a_release_that_is_not_a_plain_name_is_not_followed() {
        let tmp = tree(&[], Some("r1"), Some(DEP), None);
        fs::write(tmp.path().join("proc/sys/kernel/osrelease"), "../r1\n").unwrap();
        assert_eq!(
            ModuleIndex::read(tmp.path()).availability("vfio-pcii"),
            Availability::CannotTell
        );
    }

    #[test]
    fn warnings_name_each_unprovided_driver_where_it_is_written() {
        let text = "\
[[select]]
id = \"8086:4940\"
vf_driver = \"vfio-pcii\"
pf_driver = \"qat_4xxx\"

[[select]]
class = \"0x03\"
pf_driver = \"nvidiaa\"
";
        let settings = Settings::from_toml_str(text, &PathBuf::from("conf.d/10-x.toml")).unwrap();
        let index = ModuleIndex::from_parts(["nvme".to_string()], Some(DEP), Some(BUILTIN));
        assert_eq!(
            warnings(&settings, &index),
            [
                "vf_driver \"vfio-pcii\" (conf.d/10-x.toml:3:13) is not a loaded driver, a module \
                 or built in: a task that needs it will be refused",
                "pf_driver \"nvidiaa\" (conf.d/10-x.toml:8:13) is not a loaded driver, a module \
                 or built in: a task that needs it will be refused",
            ]
        );
        // No index to ask: no warning.
        let index = ModuleIndex::from_parts(Vec::new(), None, None);
        assert!(warnings(&settings, &index).is_empty());
        // Settings built by hand, without origins: the warning still comes.
        let mut bare = settings.clone();
        bare.select_origins.clear();
        let index = ModuleIndex::from_parts(Vec::new(), Some(DEP), None);
        assert!(
            warnings(&bare, &index)[0]
                .starts_with("vf_driver \"vfio-pcii\" is not a loaded driver"),
            "{:?}",
            warnings(&bare, &index)
        );
    }
}
