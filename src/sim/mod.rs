//! The simulation: a kernel that renders a real sysfs tree in a directory and reacts to writes
//! as Linux does ([`kernel`]), and a private `dbus-daemon` ([`bus`]). `vfiod --simulate` and the
//! tests run the whole daemon on them, with no hardware and nothing written to the real `/sys`.

pub mod bus;
pub mod kernel;
