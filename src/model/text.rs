//! Enums stored and sent as text (`"gpu"`, `"split"`, `"error"`): one macro gives each its
//! `as_str`, `Display` and `FromStr`, so the database, the D-Bus API and the CLI spell every
//! value the same way and an unknown word is an error that lists the known ones. [`quote`] is
//! how any error quotes a caller's text back.

/// `text_enum!(Type, Variant => "text", ...)`: `as_str`, `Display` and `FromStr` for a field-less
/// enum; `text_enum!(Type as "name", ...)` names the type in errors. The parse error names the
/// type and every accepted word.
macro_rules! text_enum {
    ($t:ty, $($v:ident => $s:literal),+ $(,)?) => {
        $crate::model::text::text_enum!($t as stringify!($t), $($v => $s),+);
    };
    ($t:ty as $name:expr, $($v:ident => $s:literal),+ $(,)?) => {
        impl $t {
            /// Every value, in declaration order.
            pub const ALL: &'static [$t] = &[$(<$t>::$v),+];

            pub fn as_str(self) -> &'static str {
                match self { $(<$t>::$v => $s),+ }
            }
        }
        impl ::std::fmt::Display for $t {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
        // Lets a caller (a test, a filter) compare with the text it read: `kind == "split"`.
        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
        impl PartialEq<str> for $t {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }
        impl ::std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($s => Ok(<$t>::$v),)+
                    // Quoted as every error quotes a caller's text: at most 64 characters.
                    other => Err(format!(
                        "unknown {} {} (expected one of: {})",
                        $name.to_lowercase(),
                        $crate::model::text::quote(other),
                        [$($s),+].join(", ")
                    )),
                }
            }
        }
    };
}
pub(crate) use text_enum;

/// How many characters of a caller's text an error quotes back (docs/dbus.md promises it).
pub const QUOTE_MAX: usize = 64;

/// A caller's text as an error quotes it: Rust-escaped in double quotes, at most
/// [`QUOTE_MAX`] characters, and how long it was when longer, so that a 1 MB argument is never
/// sent back whole.
pub fn quote(text: &str) -> String {
    let n = text.chars().count();
    if n <= QUOTE_MAX {
        format!("{text:?}")
    } else {
        let head: String = text.chars().take(QUOTE_MAX).collect();
        format!("{head:?}... ({n} characters)")
    }
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn quotes_at_most_64_characters() {
        assert_eq!(quote("nlb"), "\"nlb\"");
        assert_eq!(quote(&"x".repeat(64)), format!("\"{}\"", "x".repeat(64)));
        assert_eq!(
            quote(&"é".repeat(1000)),
            format!("\"{}\"... (1000 characters)", "é".repeat(64))
        );
        assert_eq!(quote("a\nb"), "\"a\\nb\"");
    }
}
