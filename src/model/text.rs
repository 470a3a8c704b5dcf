//! Enums stored and sent as text (`"gpu"`, `"split"`, `"error"`): one macro gives each its
//! `as_str`, `Display` and `FromStr`, so the database, the D-Bus API and the CLI spell every
//! value the same way and an unknown word is an error that lists the known ones.

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
                    other => Err(format!(
                        "unknown {} {other:?} (expected one of: {})",
                        $name.to_lowercase(),
                        [$($s),+].join(", ")
                    )),
                }
            }
        }
    };
}
pub(crate) use text_enum;
