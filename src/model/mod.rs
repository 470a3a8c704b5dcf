//! The model: what vfiod knows of a PCI function and of its history, as plain values with no
//! I/O. [`pci`] holds the identifiers (addresses, class codes); [`device`] the device record and
//! its text enums (kind, role, mode, state); [`task`] and [`event`] the kinds of tasks and
//! history entries; [`claim`] the states of a VM's hold on a device; [`clean`] a device held out of the pool for cleaning and its reset history; [`image_source`] why an image's read stopped; [`iommu`] whether the host has an IOMMU, decided; [`pooled`] a remote pooled device leased to a VM. The store, the engine and
//! the D-Bus API all speak these types; [`text`] is the one macro that spells them as text.

pub mod claim;
pub mod clean;
pub mod device;
pub mod event;
pub mod image_source;
pub mod iommu;
pub mod pci;
pub mod pci_name;
pub mod pool;
pub mod task;
pub mod text;
