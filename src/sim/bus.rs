//! A private `dbus-daemon` for `--simulate` and for tests: a real bus, started as a child
//! process on a unix socket in a directory we own, stopped when dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum PrivateBusError {
    #[error("cannot write the bus configuration in {dir}")]
    Setup {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start dbus-daemon (is the dbus-daemon package installed?)")]
    Spawn(#[source] std::io::Error),
    #[error("dbus-daemon exited before printing its address")]
    NoAddress,
}

/// A running private bus.
pub struct PrivateBus {
    child: Child,
    address: String,
    _dir: PathBuf,
}

impl PrivateBus {
    /// Starts `dbus-daemon` with a permissive session-style policy on a socket under `dir`.
    /// `extra_policy` is inserted into the config (e.g. a `<policy>` that restricts owners, or
    /// `<servicedir>` entries).
    pub fn start(dir: &Path, extra_policy: &str) -> Result<PrivateBus, PrivateBusError> {
        let body = format!(
            r#"  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
    <allow user="*"/>
  </policy>
  {extra_policy}
"#
        );
        Self::launch(dir, "session", &body)
    }

    /// Starts `dbus-daemon` as a private *system* bus: `<type>system</type>` and the policy of
    /// Debian's system bus (anyone may connect, owning names and calling methods are denied
    /// unless a policy file punches a hole), plus the `<include>`d policy files, e.g. the
    /// service's own `dbus-1/system.d/*.conf`. No service directories: nothing is ever
    /// activated on it, so a service is only there if the caller started it.
    pub fn start_system(dir: &Path, policy_files: &[&Path]) -> Result<PrivateBus, PrivateBusError> {
        let includes: String = policy_files
            .iter()
            .map(|p| format!("  <include>{}</include>\n", p.display()))
            .collect();
        let body = format!(
            r#"  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus" send_member="UpdateActivationEnvironment"/>
  </policy>
{includes}"#
        );
        Self::launch(dir, "system", &body)
    }

    /// Writes `dir/bus.conf` (bus type, a socket in `dir`, `body` for the policy) and starts
    /// `dbus-daemon` on it.
    fn launch(dir: &Path, bus_type: &str, body: &str) -> Result<PrivateBus, PrivateBusError> {
        let setup = |source| PrivateBusError::Setup {
            dir: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(setup)?;
        let config = dir.join("bus.conf");
        let text = format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>{bus_type}</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
{body}</busconfig>
"#,
            dir.join("bus.sock").display()
        );
        std::fs::write(&config, text).map_err(setup)?;
        // Its warnings (e.g. that it cannot raise the fd limit) go to a log beside the socket.
        let log = std::fs::File::create(dir.join("bus.log")).map_err(setup)?;
        let mut child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .arg("--nofork")
            .arg("--print-address=1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(PrivateBusError::Spawn)?;
        let stdout = child.stdout.take().ok_or(PrivateBusError::NoAddress)?;
        let mut line = String::new();
        // dbus-daemon prints the address once it listens, so the bus is ready when we return.
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|_| PrivateBusError::NoAddress)?;
        let address = line.trim().to_string();
        if address.is_empty() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(PrivateBusError::NoAddress);
        }
        Ok(PrivateBus {
            child,
            address,
            _dir: dir.to_path_buf(),
        })
    }

    /// The bus address, e.g. `unix:path=/tmp/x/bus.sock,guid=...`.
    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
