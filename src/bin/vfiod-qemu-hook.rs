//! libvirt's qemu hook, as libvirt runs it: `/etc/libvirt/hooks/qemu.d/vfiod` is a symlink to
//! this binary, which libvirt runs as `vfiod DOMAIN OPERATION SUB-OPERATION EXTRA` with the
//! domain XML on stdin, and waits for on every VM start, stop and migration.
//!
//! It is its own small binary, not a shell shim that execs `vfioctl hook qemu` (what it was),
//! because libvirt waits for it: `/bin/sh` cost a process start of its own, and vfioctl's
//! command-line tree and size (relocations, page faults) another; together they made the hook
//! 3.6x `/bin/true` (`cargo bench --bench hooks`). The logic is the same function
//! (`vfiod::client::hook::process`), so `vfioctl hook qemu` by hand behaves as this does.

use std::process::ExitCode;
use vfiod::client::hook::{self, HookArgs};

fn main() -> ExitCode {
    let mut argv = std::env::args().skip(1);
    let mut next = || argv.next().unwrap_or_default();
    let args = HookArgs {
        domain: next(),
        operation: next(),
        sub_operation: next(),
        extra: next(),
    };
    // One thread: the hook makes one call and exits; a worker pool would cost more to start
    // than the call takes.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            // No runtime, no call: a notification must still pass (see client::hook).
            eprintln!("vfiod: cannot start the hook's runtime: {e}");
            return ExitCode::from(u8::from(
                vfiod::hook::Operation::parse(&args.operation).may_fail(),
            ));
        }
    };
    let code = runtime.block_on(hook::process(&hook::bus_from_env(), &args));
    ExitCode::from(code)
}
