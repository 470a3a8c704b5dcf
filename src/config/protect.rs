//! The `[[protect]]` section: devices vfiod must never touch, on top of those the host is
//! detected to use. An entry is a selector and nothing else (its raw form is
//! [`RawSelector`](super::selector::RawSelector)).

use super::error::ConfigError;
use super::merge::{Entry, Inputs};
use super::selector::{self, RawSelector, Selector};

/// Every `[[protect]]` entry of every file, in order.
pub(crate) fn validate(inputs: &Inputs) -> Result<Vec<Selector>, ConfigError> {
    inputs
        .entries(|f| &f.protect)
        .map(|Entry { index, item }: Entry<'_, RawSelector>| {
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
