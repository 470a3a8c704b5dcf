//! Authorization of mutating calls: polkit, with the message sender as the subject. Reads never
//! ask.

use super::error::Error;
use zbus::message::Header;
use zbus_polkit::policykit1::{AuthorityProxy, CheckAuthorizationFlags, Subject};

/// polkit action that covers configuration and mode changes.
pub const ACTION_MANAGE: &str = "org.vfiod.vfiod1.manage";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authorizer {
    /// Ask polkitd on the system bus (the default).
    Polkit,
    /// Allow every caller. Only for the simulation on a private bus, where it is announced.
    AllowAll,
}

impl Authorizer {
    /// Succeeds when the sender of `header` may perform `action`; otherwise `NotAuthorized`,
    /// and nothing has been changed.
    pub async fn check(
        &self,
        conn: &zbus::Connection,
        header: &Header<'_>,
        action: &str,
    ) -> Result<(), Error> {
        if *self == Authorizer::AllowAll {
            return Ok(());
        }
        let subject = Subject::new_for_message_header(header)
            .map_err(|e| Error::NotAuthorized(format!("cannot identify the caller: {e}")))?;
        // The subject is a unique name on vfiod's own bus, so polkitd must be asked on that bus
        // (the system bus in production, a private "system" bus in tests).
        let authority = AuthorityProxy::new(conn)
            .await
            .map_err(|e| Error::NotAuthorized(format!("polkit unreachable: {e}")))?;
        let result = authority
            .check_authorization(
                &subject,
                action,
                &std::collections::HashMap::new(),
                CheckAuthorizationFlags::ALLOW_USER_INTERACTION,
                "",
            )
            .await
            .map_err(|e| {
                if polkit_absent(&e) {
                    Error::NotAuthorized(format!("polkit unreachable, {action} refused: {e}"))
                } else {
                    Error::NotAuthorized(format!("polkit check for {action} failed: {e}"))
                }
            })?;
        if result.is_authorized {
            Ok(())
        } else if result.is_challenge {
            Err(Error::NotAuthorized(format!(
                "{action} needs authentication (run vfioctl through an agent, e.g. pkexec, or as root)"
            )))
        } else {
            Err(Error::NotAuthorized(format!(
                "{action} is not allowed for this caller"
            )))
        }
    }
}

/// True when the error says no polkitd answered (not running, or gone while asked), as opposed
/// to an error polkitd itself returned. zbus reports these bus errors as `Error::FDO`.
fn polkit_absent(e: &zbus::Error) -> bool {
    use zbus::fdo::Error as Fdo;
    matches!(e, zbus::Error::FDO(f)
        if matches!(**f, Fdo::ServiceUnknown(_) | Fdo::NameHasNoOwner(_) | Fdo::NoReply(_)))
}

/// Who asked, for the task record: the caller's uid when the bus tells it, else its name.
pub async fn requester(conn: &zbus::Connection, header: &Header<'_>) -> String {
    let Some(sender) = header.sender() else {
        return "unknown".into();
    };
    let uid = match zbus::fdo::DBusProxy::new(conn).await {
        Ok(p) => p.get_connection_unix_user(sender.clone().into()).await.ok(),
        Err(_) => None,
    };
    match uid {
        Some(u) => format!("uid {u} ({sender})"),
        None => sender.to_string(),
    }
}
