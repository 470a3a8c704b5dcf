//! Values that remember where they were written, and the generic rule for scalar keys: the
//! building blocks every section's validator uses.
//!
//! A validator never sees a file: the pipeline hands it its section's values from every file
//! (see `merge`), each [`Located`] in its file, so it reports `file:line:column` without knowing
//! the file struct. That keeps sections below `raw`, which names their raw structs.

use super::error::{ConfigError, Key};
use super::position::{Origin, Source};
use toml::Spanned;

/// Checks every value of a scalar key and keeps the last (later files win). A bad value is an
/// error even where a later file overrides it: nothing of a file with an error is used.
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
    source: &'a Source,
    offset: usize,
}

impl<T> Clone for Located<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Located<'_, T> {}

impl<'a, T> Located<'a, T> {
    pub fn new(source: &'a Source, spanned: &'a Spanned<T>) -> Self {
        Located {
            value: spanned.get_ref(),
            source,
            offset: spanned.span().start,
        }
    }

    /// A key inside this value (a table or an entry), located in the same file.
    pub fn field<U>(
        &self,
        get: impl FnOnce(&'a T) -> Option<&'a Spanned<U>>,
    ) -> Option<Located<'a, U>> {
        get(self.value).map(|spanned| Located::new(self.source, spanned))
    }

    pub fn origin(&self) -> Origin {
        self.source.origin_at(self.offset)
    }

    /// An error at this value.
    pub fn error(&self, message: String) -> ConfigError {
        self.source.error_at(self.offset, message)
    }

    /// Turns a validation result into an error at this value, naming its key.
    pub fn check<U>(&self, key: Key<'_>, result: Result<U, String>) -> Result<U, ConfigError> {
        result.map_err(|reason| self.error(format!("{key}: {reason}")))
    }
}

impl<'a, U> Located<'a, Vec<Spanned<U>>> {
    /// The items of an array value, each located where it was written.
    pub fn items(&self) -> impl Iterator<Item = Located<'a, U>> + 'a {
        let source = self.source;
        self.value.iter().map(move |s| Located::new(source, s))
    }
}

/// One entry of an array of tables.
#[derive(Debug)]
pub(crate) struct Entry<'a, T> {
    /// 0-based index of the entry within its own file.
    pub index: usize,
    pub item: Located<'a, T>,
}
