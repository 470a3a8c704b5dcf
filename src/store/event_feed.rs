//! A wake-up for whoever follows the history (`Manager.Event`, `vfioctl events --follow`): the
//! store's one connection is only reached through [`Guard`], and a guard that inserted a row
//! (SQLite's last insert rowid moved while it was held) bumps a counter when it lets the
//! connection go, after its transaction committed or rolled back. Every writer of events goes
//! through it, so none can forget to tell. A wake-up says "read the events after the last one
//! you saw": an insert into another table, or one rolled back, only wakes a watcher for nothing.
//! (SQLite's update and commit hooks would say exactly which rows, but rusqlite's hooks need
//! SQLite 3.44, newer than the 3.40 of the distributions vfiod targets.)

use rusqlite::Connection;
use std::ops::{Deref, DerefMut};
use std::sync::MutexGuard;
use tokio::sync::watch;

/// The connection, held; see the module's text.
pub(super) struct Guard<'a> {
    conn: MutexGuard<'a, Connection>,
    rowid: i64,
    feed: &'a watch::Sender<u64>,
}

impl<'a> Guard<'a> {
    pub(super) fn new(conn: MutexGuard<'a, Connection>, feed: &'a watch::Sender<u64>) -> Self {
        let rowid = conn.last_insert_rowid();
        Guard { conn, rowid, feed }
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
        // Any transaction borrowed from the guard has ended by now (it borrowed the guard).
        if self.conn.last_insert_rowid() != self.rowid {
            self.feed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}
