//! The `[[protect]]` section: devices vfiod must never touch, on top of those the host is
//! detected to use. An entry is a selector and nothing else (its raw form is
//! [`RawSelector`]).

use super::error::ConfigError;
use super::located::Entry;
use super::selector::{self, RawSelector, Selector};

/// Every `[[protect]]` entry of every file, in order.
pub(crate) fn validate<'a>(
    entries: impl Iterator<Item = Entry<'a, RawSelector>>,
) -> Result<Vec<Selector>, ConfigError> {
    entries
        .map(|Entry { index, item }| {
            selector::validate(
                item,
                "protect",
                index,
                [
                    item.field(|s| s.address.as_ref()),
                    item.field(|s| s.id.as_ref()),
                    item.field(|s| s.class.as_ref()),
                ],
            )
        })
        .collect()
}
