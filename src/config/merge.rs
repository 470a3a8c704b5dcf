//! Stage 3: the fragments combined in the order they apply (main file, then drop-ins in byte
//! order of their names): [`Inputs`].
//!
//! Combining is generic, so a new section needs nothing here:
//! - a scalar key: [`Inputs::values`] yields every value it is given, in file order, and
//!   [`last_valid`] keeps the last one after checking them all (a bad value is an error even
//!   where a later file overrides it: nothing of a file with an error is used);
//! - an array of tables (`[[select]]`): [`Inputs::entries`] appends every file's entries in
//!   order, each with its index within its file (for "`[[select]] #2`" in messages).
//!
//! Every value stays [`Located`]: it keeps its file and offset, so validation still reports
//! `file:line:column`.

use super::error::{ConfigError, Key};
use super::position::Origin;
use super::raw::{Fragment, RawFile};
use std::path::PathBuf;
use toml::Spanned;

/// Every file read, in the order it applies.
#[derive(Debug)]
pub(crate) struct Inputs {
    fragments: Vec<Fragment>,
}

impl Inputs {
    pub fn new(fragments: Vec<Fragment>) -> Inputs {
        Inputs { fragments }
    }

    /// The files, in order (for [`Settings::sources`](super::Settings::sources)).
    pub fn sources(&self) -> Vec<PathBuf> {
        self.fragments.iter().map(|f| f.origin.clone()).collect()
    }

    /// Every value a key is given, in file order; the last one is in force.
    pub fn values<'a, T: 'a>(
        &'a self,
        get: impl Fn(&'a RawFile) -> Option<&'a Spanned<T>> + 'a,
    ) -> impl Iterator<Item = Located<'a, T>> + 'a {
        self.fragments.iter().filter_map(move |fragment| {
            get(&fragment.raw).map(|spanned| Located::new(fragment, spanned))
        })
    }

    /// The entries of an array of tables from every file, appended in file order.
    pub fn entries<'a, T: 'a>(
        &'a self,
        get: impl Fn(&'a RawFile) -> &'a [Spanned<T>] + 'a,
    ) -> impl Iterator<Item = Entry<'a, T>> + 'a {
        self.fragments.iter().flat_map(move |fragment| {
            get(&fragment.raw)
                .iter()
                .enumerate()
                .map(move |(index, spanned)| Entry {
                    index,
                    item: Located::new(fragment, spanned),
                })
        })
    }
}

/// Checks every value of a scalar key and keeps the last (later files win).
pub(crate) fn last_valid<'a, T: 'a, U>(
    values: impl Iterator<Item = Located<'a, T>>,
    mut check: impl FnMut(Located<'a, T>) -> Result<U, ConfigError>,
) -> Result<Option<U>, ConfigError> {
    let mut last = None;
    for value in values {
        last = Some(check(value)?);
    }
    Ok(last)
}

/// A value and where it was written.
#[derive(Debug)]
pub(crate) struct Located<'a, T> {
    pub value: &'a T,
    fragment: &'a Fragment,
    offset: usize,
}

impl<T> Clone for Located<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Located<'_, T> {}

impl<'a, T> Located<'a, T> {
    fn new(fragment: &'a Fragment, spanned: &'a Spanned<T>) -> Self {
        Located {
            value: spanned.get_ref(),
            fragment,
            offset: spanned.span().start,
        }
    }

    /// A key inside this value (a table or an entry), located in the same file.
    pub fn field<U>(
        &self,
        get: impl FnOnce(&'a T) -> Option<&'a Spanned<U>>,
    ) -> Option<Located<'a, U>> {
        get(self.value).map(|spanned| Located::new(self.fragment, spanned))
    }

    pub fn origin(&self) -> Origin {
        self.fragment.origin_at(self.offset)
    }

    /// An error at this value.
    pub fn error(&self, message: String) -> ConfigError {
        self.fragment.error_at(self.offset, message)
    }

    /// Turns a validation result into an error at this value, naming its key.
    pub fn check<U>(&self, key: Key<'_>, result: Result<U, String>) -> Result<U, ConfigError> {
        result.map_err(|reason| self.error(format!("{key}: {reason}")))
    }
}

/// One entry of an array of tables.
#[derive(Debug)]
pub(crate) struct Entry<'a, T> {
    /// 0-based index of the entry within its own file.
    pub index: usize,
    pub item: Located<'a, T>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(files: &[&str]) -> Inputs {
        Inputs::new(
            files
                .iter()
                .enumerate()
                .map(|(i, text)| {
                    Fragment::parse_text(text.to_string(), format!("{i}.toml").into()).unwrap()
                })
                .collect(),
        )
    }

    #[test]
    fn scalars_come_in_file_order_and_the_last_wins() {
        let inputs = inputs(&[
            "poll_interval = 10\n",
            "scenario = \"public\"\n",
            "\npoll_interval = 20\n",
        ]);
        let seen: Vec<String> = inputs
            .values(|f| f.poll_interval.as_ref())
            .map(|v| format!("{:?} at {}", v.value.0, v.origin()))
            .collect();
        assert_eq!(seen, ["Some(10) at 0.toml:1:17", "Some(20) at 2.toml:2:17"]);
        let last = last_valid(inputs.values(|f| f.poll_interval.as_ref()), |v| {
            Ok(v.value.0)
        });
        assert_eq!(last.unwrap(), Some(Some(20)));
    }

    #[test]
    fn an_overridden_bad_value_is_still_an_error() {
        let inputs = inputs(&["poll_interval = 0\n", "poll_interval = 20\n"]);
        let err = last_valid(inputs.values(|f| f.poll_interval.as_ref()), |v| {
            v.check(Key::top("poll_interval"), v.value.in_range(1, 5, ""))
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("0.toml:1:17: `poll_interval`: 0 is out of range"),
            "{err}"
        );
    }

    #[test]
    fn entries_append_with_their_index_in_their_file() {
        let inputs = inputs(&[
            "[[protect]]\nid = \"8086:*\"\n[[protect]]\nclass = \"0x02\"\n",
            "[[protect]]\naddress = \"00:1f.6\"\n",
        ]);
        let seen: Vec<String> = inputs
            .entries(|f| &f.protect)
            .map(|e| format!("#{} at {}", e.index + 1, e.item.origin()))
            .collect();
        assert_eq!(
            seen,
            ["#1 at 0.toml:1:1", "#2 at 0.toml:3:1", "#1 at 1.toml:1:1"]
        );
    }
}
