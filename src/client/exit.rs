//! vfioctl's exit statuses and how a failure is reported: one code per kind of refusal a script
//! may act on, taken from the daemon's named D-Bus error (`org.vfiod.Vfiod1.Error.*`), so that
//! `vfioctl claim ... || case $? in 5) retry;; 6) wait;; esac` needs no parsing of messages.

use serde::Serialize;

/// The command did what it was asked.
pub const OK: u8 = 0;
/// A failure none of the codes below names (the daemon's Failed, a task that failed, vfiod not
/// running, a bad argument the daemon refused).
pub const FAILURE: u8 = 1;
/// Bad usage: clap's own code for an unknown option or a missing argument.
pub const USAGE: u8 = 2;
/// The device, claim, image or task named does not exist.
pub const NOT_FOUND: u8 = 3;
/// The device or claim is busy (a task holds it) or in use (a domain has it).
pub const BUSY: u8 = 4;
/// polkit (or the lack of it) refused the caller.
pub const NOT_AUTHORIZED: u8 = 5;
/// No device matches the requirements, or every one that does is taken.
pub const NO_DEVICE: u8 = 6;
/// The policy refuses: the device is protected, or the configuration does not manage it, or
/// the host has no IOMMU.
pub const REFUSED: u8 = 7;
/// `vfioctl doctor`: the worst check warns (passthrough can work; something is unknown or
/// will bite later), none fails.
pub const DOCTOR_WARN: u8 = 8;
/// `vfioctl doctor`: a check fails (passthrough cannot work, or not safely, until its fix).
pub const DOCTOR_FAIL: u8 = 9;

/// Every code with its meaning, as README and the man page list them.
pub const TABLE: &[(u8, &str)] = &[
    (OK, "success"),
    (FAILURE, "a failure not listed below"),
    (
        USAGE,
        "usage: an unknown option, a missing or malformed argument",
    ),
    (NOT_FOUND, "no such device, claim, image or task"),
    (
        BUSY,
        "busy or in use: a task holds the device, or a domain has it",
    ),
    (NOT_AUTHORIZED, "not authorized (polkit)"),
    (NO_DEVICE, "no device available that matches"),
    (
        REFUSED,
        "refused by policy: the device is protected or not managed, or the host has no IOMMU",
    ),
    (DOCTOR_WARN, "doctor: a check warns, none fails"),
    (DOCTOR_FAIL, "doctor: a check fails"),
];

/// The exit code for a failure named `error` (a D-Bus error name); anything unnamed here is
/// [`FAILURE`].
pub fn code_for(error: &str) -> u8 {
    let short = error.strip_prefix("org.vfiod.Vfiod1.Error.");
    match short {
        Some("NoSuchDevice" | "NoSuchClaim" | "NoSuchImage") => NOT_FOUND,
        Some("Busy" | "InUse") => BUSY,
        Some("NotAuthorized") => NOT_AUTHORIZED,
        Some("NoDeviceAvailable") => NO_DEVICE,
        Some("Protected" | "NotManaged" | "NoIommu") => REFUSED,
        Some(_) => FAILURE,
        // A task's or claim's object that is gone: the bus says so, not vfiod.
        None if error == "org.freedesktop.DBus.Error.UnknownObject" => NOT_FOUND,
        None if error == "org.freedesktop.DBus.Error.AccessDenied" => NOT_AUTHORIZED,
        None => FAILURE,
    }
}

/// A failed command: the D-Bus error's name when there is one, and what to tell the user.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Failure {
    /// A D-Bus error name (`org.vfiod.Vfiod1.Error.Busy`); null for vfioctl's own failures.
    pub error: Option<String>,
    pub message: String,
    /// Nothing more to print: the command has said what there was to say (an empty `find`'s
    /// note is for a terminal only, and its status says the rest).
    #[serde(skip)]
    pub quiet: bool,
}

impl Failure {
    pub fn named(error: &str, message: impl Into<String>) -> Failure {
        Failure {
            error: Some(error.to_string()),
            message: message.into(),
            quiet: false,
        }
    }

    /// The same failure, with nothing printed for it.
    pub fn quiet(self) -> Failure {
        Failure {
            quiet: true,
            ..self
        }
    }

    pub fn code(&self) -> u8 {
        self.error.as_deref().map_or(FAILURE, code_for)
    }

    /// The line `vfioctl: ...` that stderr gets without --json.
    pub fn text(&self) -> String {
        match &self.error {
            // The bus's UnknownObject and ServiceUnknown tell a user nothing the message
            // (written for it) does not.
            Some(name)
                if !self.message.contains(name.as_str())
                    && name != "org.freedesktop.DBus.Error.UnknownObject"
                    && name != "org.freedesktop.DBus.Error.ServiceUnknown" =>
            {
                format!("{} ({name})", self.message)
            }
            _ => self.message.clone(),
        }
    }

    /// The one JSON object stderr gets with --json.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| r#"{"error":null,"message":""}"#.to_string())
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure {
            error: None,
            message,
            quiet: false,
        }
    }
}

impl From<super::ClientError> for Failure {
    fn from(e: super::ClientError) -> Failure {
        use super::ClientError;
        use zbus::DBusError;
        match e {
            ClientError::Call(zbus::Error::MethodError(name, msg, _)) => {
                Failure::named(name.as_str(), msg.unwrap_or_else(|| name.to_string()))
            }
            ClientError::Call(zbus::Error::FDO(f)) => Failure::named(
                f.name().as_str(),
                f.description().unwrap_or_default().to_string(),
            ),
            e @ ClientError::NotRunning => Failure::named(
                "org.freedesktop.DBus.Error.ServiceUnknown",
                crate::error_chain(&e),
            ),
            other => Failure::from(crate::error_chain(&other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_named_error_has_its_code() {
        let table = [
            ("org.vfiod.Vfiod1.Error.NoSuchDevice", NOT_FOUND),
            ("org.vfiod.Vfiod1.Error.NoSuchClaim", NOT_FOUND),
            ("org.vfiod.Vfiod1.Error.NoSuchImage", NOT_FOUND),
            ("org.freedesktop.DBus.Error.UnknownObject", NOT_FOUND),
            ("org.vfiod.Vfiod1.Error.Busy", BUSY),
            ("org.vfiod.Vfiod1.Error.InUse", BUSY),
            ("org.vfiod.Vfiod1.Error.NotAuthorized", NOT_AUTHORIZED),
            ("org.freedesktop.DBus.Error.AccessDenied", NOT_AUTHORIZED),
            ("org.vfiod.Vfiod1.Error.NoDeviceAvailable", NO_DEVICE),
            ("org.vfiod.Vfiod1.Error.Protected", REFUSED),
            ("org.vfiod.Vfiod1.Error.NotManaged", REFUSED),
            ("org.vfiod.Vfiod1.Error.NoIommu", REFUSED),
            ("org.vfiod.Vfiod1.Error.Failed", FAILURE),
            ("org.vfiod.Vfiod1.Error.InvalidArgument", FAILURE),
            ("org.vfiod.Vfiod1.Error.AttachFailed", FAILURE),
            ("org.vfiod.Vfiod1.Error.SomethingNew", FAILURE),
            ("org.freedesktop.DBus.Error.ServiceUnknown", FAILURE),
            ("org.vfiod.Vfiod1.ErrorBusy", FAILURE),
            ("", FAILURE),
        ];
        for (name, code) in table {
            assert_eq!(code_for(name), code, "{name}");
        }
    }

    #[test]
    fn the_codes_are_distinct_and_documented_once() {
        let mut codes: Vec<u8> = TABLE.iter().map(|(c, _)| *c).collect();
        codes.dedup();
        assert_eq!(codes, (0..=9).collect::<Vec<u8>>());
    }

    #[test]
    fn a_failure_prints_as_text_and_as_one_json_object() {
        let f = Failure::named("org.vfiod.Vfiod1.Error.Busy", "task 3 holds 0000:3b:00.0");
        assert_eq!(f.code(), BUSY);
        assert_eq!(
            f.text(),
            "task 3 holds 0000:3b:00.0 (org.vfiod.Vfiod1.Error.Busy)"
        );
        let v: serde_json::Value = serde_json::from_str(&f.json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": "org.vfiod.Vfiod1.Error.Busy",
                               "message": "task 3 holds 0000:3b:00.0"})
        );
        let own = Failure::from("bad".to_string());
        assert_eq!((own.code(), own.text()), (FAILURE, "bad".to_string()));
    }
}
