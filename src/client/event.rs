//! Following the daemon's history (`vfioctl events --follow`): `Manager.Event` signals as
//! wake-ups, and the end of the daemon (its bus name lost an owner) as the end of the stream.

use super::ManagerProxy;
use futures_util::StreamExt;

/// The Event signals of one daemon, from the moment of [`EventFollower::subscribe`].
pub struct EventFollower {
    events: super::EventStream,
    owner: zbus::proxy::OwnerChangedStream<'static>,
}

impl EventFollower {
    /// Subscribes (adds the match rules) now: a signal sent after this returns is seen.
    pub async fn subscribe(m: &ManagerProxy<'static>) -> zbus::Result<EventFollower> {
        let owner = m.inner().receive_owner_changed().await?;
        let events = m.receive_event().await?;
        Ok(EventFollower { events, owner })
    }

    /// The id of the next event signalled; `None` when the daemon has left the bus (or the
    /// bus connection ended).
    pub async fn next(&mut self) -> zbus::Result<Option<i64>> {
        loop {
            tokio::select! {
                signal = self.events.next() => {
                    let Some(signal) = signal else { return Ok(None) };
                    let args = signal.args()?;
                    return Ok(Some(super::EventEntry::from_dict(args.entry()).id));
                }
                owner = self.owner.next() => match owner {
                    // The daemon left (stopped, crashed): nothing more will come from it.
                    None | Some(None) => return Ok(None),
                    // A new owner: a restarted daemon; its events carry on from the store.
                    Some(Some(_)) => continue,
                },
            }
        }
    }
}
