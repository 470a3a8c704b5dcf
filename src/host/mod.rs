//! The host's edges: everything vfiod reads from or does to the machine it runs on. [`sysfs`]
//! is the only way to the kernel's device tree (every path under one configurable root, every
//! write bounded in time); [`uevent`] brings the kernel's hot-plug events; [`libvirt`] is one
//! worker thread that owns the libvirt connection (which running domains use which functions,
//! domain XML, hostdev attach and detach, domain lifecycle events), bounded and reconnecting;
//! [`modules`] tells which driver names a loaded driver, a module or the kernel provides;
//! [`exec`] runs an operator's command (no shell, bounded, output kept); [`download`] fetches FPGA images over HTTP(S) (async, unlike the others); [`image_source`]
//! reads an image from a descriptor a caller passed or a path root named, within deadlines and
//! never blocked by a FIFO or a pipe that stays open; [`record`] reads what vfiod reads of the
//! host into a recording for a bug report (`vfioctl record`); [`clock`] reads the monotonic clock
//! the hook and vfiod compare deadlines on. Each is small, blocking, and tested for
//! real (the simulated kernel, a real libvirtd, real pipes and FIFOs).

pub mod clock;
pub mod download;
pub mod exec;
pub mod image_source;
pub mod libvirt;
pub mod modules;
pub mod record;
pub mod sysfs;
pub mod uevent;
