//! The host's monotonic clock as a number two processes can compare: the hook process stamps a
//! run with it and vfiod checks the stamp (`hook::deadline`). std's `Instant` reads the same
//! clock but cannot leave its process.

/// Now on `CLOCK_MONOTONIC`, in milliseconds.
pub fn monotonic_ms() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(t) => {
            let ms = i128::from(t.tv_sec()) * 1000 + i128::from(t.tv_nsec()) / 1_000_000;
            u64::try_from(ms).unwrap_or(0)
        }
        // Linux always has it; were it missing, every stamp reads 0 and nothing is dropped
        // for lateness (the hook's own timer still bounds its wait).
        Err(_) => 0,
    }
}
