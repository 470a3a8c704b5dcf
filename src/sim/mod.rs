//! The simulation: a kernel that renders a real sysfs tree in a directory and reacts to writes
//! as Linux does ([`kernel`]), a private `dbus-daemon` ([`bus`]), and a recorded host served back
//! ([`replay`], `vfiod --simulate --replay`). `vfiod --simulate` and the tests run the whole daemon
//! on them, with no hardware and nothing written to the real `/sys`.

pub mod bus;
pub mod kernel;
pub mod replay;
