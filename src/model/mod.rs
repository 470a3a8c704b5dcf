//! The model: what vfiod knows of a PCI function, as plain values with no I/O. [`pci`] holds
//! the identifiers (addresses, class codes); [`device`] the device record and its text enums
//! (kind, role, mode, state), which the store, the engine and the D-Bus API all speak.

pub mod device;
pub mod pci;
