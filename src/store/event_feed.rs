//! The one door to the store's connection, [`Guard`], and what it does when the connection is
//! let go, after any transaction borrowed from it committed or rolled back:
//!
//! - **The integrity checks** ([`super::integrity`]): the write-ahead log watch, and, after a
//!   use that changed rows, the acknowledged mark, written before the caller can reply.
//! - **A wake-up for whoever follows the history** (`Manager.Event`, `vfioctl events
//!   --follow`): a guard that inserted a row (SQLite's last insert rowid moved while it was
//!   held) bumps a counter. A wake-up says "read the events after the last one you saw": an
//!   insert into another table, or one rolled back, only wakes a watcher for nothing.
//!
//! Every use of the connection goes through a guard, so none can forget either. (SQLite's
//! update and commit hooks would say exactly which rows, but rusqlite's hooks need SQLite 3.44,
//! newer than the 3.40 of the distributions vfiod targets.)

use super::integrity::Tracker;
use rusqlite::Connection;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard, PoisonError};
use tokio::sync::watch;

/// The connection, held; see the module's text.
pub(super) struct Guard<'a> {
    conn: MutexGuard<'a, Connection>,
    rowid: i64,
    /// SQLite's count of rows changed on this connection when the guard was taken.
    changes: u64,
    feed: &'a watch::Sender<u64>,
    integrity: &'a Mutex<Tracker>,
}

impl<'a> Guard<'a> {
    pub(super) fn new(
        conn: MutexGuard<'a, Connection>,
        feed: &'a watch::Sender<u64>,
        integrity: &'a Mutex<Tracker>,
    ) -> Self {
        let rowid = conn.last_insert_rowid();
        let changes = conn.total_changes();
        Guard {
            conn,
            rowid,
            changes,
            feed,
            integrity,
        }
    }
}

impl Deref for Guard<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.conn
    }
}

impl DerefMut for Guard<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        // Any transaction borrowed from the guard has ended by now (it borrowed the guard);
        // one left open (a bug unwinding) is not checked until it ends.
        if self.conn.is_autocommit() {
            // Rows changed: a commit, or a rollback (whose mark is unchanged, so nothing is
            // written). Still under the connection's lock: one check at a time.
            let wrote = self.conn.total_changes() != self.changes;
            self.integrity
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .after_use(&self.conn, wrote);
        }
        if self.conn.last_insert_rowid() != self.rowid {
            self.feed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}
