//! Stage 3: the fragments combined in the order they apply (main file, then drop-ins in byte
//! order of their names): [`Inputs`].
//!
//! Combining is generic, so a new section needs nothing here. The pipeline picks a section's
//! field of [`RawFile`] and hands the validator what it yields:
//! - a scalar key or a table: [`Inputs::values`] yields every value it is given, in file order,
//!   and `located::last_valid` keeps the last one after checking them all (for a table, per
//!   key, through [`Located::field`]);
//! - an array of tables (`[[select]]`): [`Inputs::entries`] appends every file's entries in
//!   order, each with its index within its file (for "`[[select]] #2`" in messages).
//!
//! Every value stays [`Located`]: it keeps its file and offset, so validation still reports
//! `file:line:column`.

use super::located::{Entry, Located};
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
        self.fragments
            .iter()
            .map(|f| f.source.file.clone())
            .collect()
    }

    /// Every value a key (or table) is given, in file order; the last one is in force. Cloning
    /// the iterator starts over, so a table's validator can walk it once per key.
    pub fn values<'a, T: 'a>(
        &'a self,
        get: impl Fn(&'a RawFile) -> Option<&'a Spanned<T>> + Clone + 'a,
    ) -> impl Iterator<Item = Located<'a, T>> + Clone + 'a {
        self.fragments.iter().filter_map(move |fragment| {
            get(&fragment.raw).map(|spanned| Located::new(&fragment.source, spanned))
        })
    }

    /// The entries of an array of tables from every file, appended in file order.
    pub fn entries<'a, T: 'a>(
        &'a self,
        get: impl Fn(&'a RawFile) -> &'a [Spanned<T>] + Clone + 'a,
    ) -> impl Iterator<Item = Entry<'a, T>> + Clone + 'a {
        self.fragments.iter().flat_map(move |fragment| {
            get(&fragment.raw)
                .iter()
                .enumerate()
                .map(move |(index, spanned)| Entry {
                    index,
                    item: Located::new(&fragment.source, spanned),
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::error::Key;
    use super::super::located::last_valid;
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
