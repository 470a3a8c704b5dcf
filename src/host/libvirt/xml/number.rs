//! Numbers in domain XML attributes, read the way libvirt reads them: `virStrToLong_uip` with
//! base 0, that is C's `strtoul` with three refusals of its own (a minus sign, trailing
//! characters, a value beyond `unsigned int`).

/// Why a text is not a number libvirt accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NumberError {
    /// No digits, a digit of the wrong base (`08`), a sign `-`, or characters after the digits.
    NotANumber,
    /// More than `u32::MAX` (libvirt's `unsigned int`).
    TooLarge,
}

/// `0x3b` and `0X3B` are hex, `073` octal (a leading 0), `59` decimal. Leading white space (C's
/// `isspace`) and one `+` are skipped, as `strtoul` does; `-` is refused, even in `-0` (libvirt
/// refuses any minus sign). A `0x` with no hex digit after it is refused: `strtoul` reads the
/// `0` and stops at the `x`, which libvirt then finds trailing.
pub(super) fn parse_unsigned(text: &str) -> Result<u32, NumberError> {
    let s = text.trim_start_matches(is_c_space);
    let s = match s.as_bytes().first() {
        Some(b'+') => &s[1..],
        Some(b'-') => return Err(NumberError::NotANumber),
        _ => s,
    };
    let bytes = s.as_bytes();
    let (radix, digits) = match bytes {
        [b'0', b'x' | b'X', d, ..] if d.is_ascii_hexdigit() => (16, &s[2..]),
        [b'0', ..] => (8, s),
        _ => (10, s),
    };
    if digits.is_empty() {
        return Err(NumberError::NotANumber);
    }
    let mut value: u32 = 0;
    let mut too_large = false;
    for c in digits.chars() {
        let d = c.to_digit(radix).ok_or(NumberError::NotANumber)?;
        match value.checked_mul(radix).and_then(|v| v.checked_add(d)) {
            Some(v) => value = v,
            // Keep reading: trailing junk after a huge number is still "not a number".
            None => too_large = true,
        }
    }
    if too_large {
        return Err(NumberError::TooLarge);
    }
    Ok(value)
}

/// C's `isspace` in the C locale (and glib's `g_ascii_isspace`): space, \t, \n, \v, \f, \r.
pub(super) fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_read_like_libvirt_reads_them() {
        use NumberError::*;
        // Each row checked against libvirt 9.0 (`virsh define` of a hostdev with bus=TEXT).
        for (text, expect) in [
            ("0x3b", Ok(0x3b)),
            (" 0x3b", Ok(0x3b)),
            ("0X1F", Ok(0x1f)),
            ("010", Ok(8)),
            ("0", Ok(0)),
            ("00", Ok(0)),
            ("59", Ok(59)),
            ("+5", Ok(5)),
            ("\t\n 7", Ok(7)),
            ("4294967295", Ok(u32::MAX)),
            ("0xffffffff", Ok(u32::MAX)),
            ("037777777777", Ok(u32::MAX)),
            ("08", Err(NotANumber)),
            ("-0", Err(NotANumber)),
            ("-1", Err(NotANumber)),
            ("+-1", Err(NotANumber)),
            ("++1", Err(NotANumber)),
            ("0x", Err(NotANumber)),
            ("0xg", Err(NotANumber)),
            ("5 ", Err(NotANumber)),
            ("", Err(NotANumber)),
            ("   ", Err(NotANumber)),
            ("+", Err(NotANumber)),
            ("x", Err(NotANumber)),
            ("1e3", Err(NotANumber)),
            ("١", Err(NotANumber)),
            ("4294967296", Err(TooLarge)),
            ("0x100000000", Err(TooLarge)),
            ("99999999999999999999999999", Err(TooLarge)),
            ("99999999999999999999999999x", Err(NotANumber)),
        ] {
            assert_eq!(parse_unsigned(text), expect, "{text:?}");
        }
    }
}
