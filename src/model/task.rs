//! What a task does, as the store records it and the D-Bus API shows it (`Task.Kind`).

use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

/// The kind of a task: the job it runs. A mode job learns its kind while it prepares (a request
/// for VF mode on a device that is already split is a `check`); the other jobs know theirs from
/// the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// A mode job with nothing to change: it looked, and the device was already as asked.
    Check,
    /// PF -> VF: enable VFs and bind them.
    Split,
    /// VF -> PF: unbind and remove the VFs, the PF back on its own driver.
    Restore,
    /// A different VF count: through zero, as the kernel requires.
    Resplit,
    /// The VFs onto another driver.
    Rebind,
    /// A whole IOMMU group (a GPU and its audio function) onto one driver, e.g. vfio-pci.
    Bind,
    /// A group back on the drivers it had before vfiod bound it.
    Unbind,
    /// Write an FPGA image (the FPGA issue).
    Program,
    /// Check what an FPGA reports against an image (the FPGA issue).
    Verify,
    /// Carry a device's work through a live migration (the migration issues).
    Migrate,
    /// A claim's functions onto vfio-pci, then into a libvirt domain as hostdevs.
    Attach,
    /// A claim's hostdevs out of their libvirt domain, waiting for the guest to let go.
    Detach,
    /// Clean a device between tenants: reset, health check, the operator's command.
    Clean,
    /// The test suite's own job (phases that sleep, told to fail); the daemon never creates one.
    Test,
}

text_enum!(TaskKind as "task kind",
    Check => "check", Split => "split", Restore => "restore", Resplit => "resplit",
    Rebind => "rebind", Bind => "bind", Unbind => "unbind", Program => "program",
    Verify => "verify", Migrate => "migrate", Attach => "attach", Detach => "detach",
    Clean => "clean", Test => "test");
