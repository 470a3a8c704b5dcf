//! The hidden `hook qemu` subcommand: libvirt's qemu hook by hand (what `vfiod-qemu-hook` runs).

use super::*;

#[derive(Subcommand, Debug)]
pub(crate) enum HookCommand {
    /// The qemu driver's hook: DOMAIN OPERATION SUB-OPERATION EXTRA, the XML on stdin.
    Qemu {
        domain: String,
        operation: String,
        sub_operation: String,
        /// libvirt passes "-" when it has nothing to say; absent is accepted too.
        #[arg(default_value = "-")]
        extra: String,
    },
}

/// `vfioctl hook qemu`: never fails for its own reasons where libvirt would suffer from it;
/// see `vfiod::client::hook`.
pub(crate) async fn hook(target: BusTarget, command: HookCommand) -> ExitCode {
    let HookCommand::Qemu {
        domain,
        operation,
        sub_operation,
        extra,
    } = command;
    let args = client::hook::HookArgs {
        domain,
        operation,
        sub_operation,
        extra,
    };
    ExitCode::from(client::hook::process(&target, &args).await)
}
