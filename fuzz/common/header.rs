//! What the FPGA header targets check, for either parser: never a panic, errors stay short,
//! ids come out as 32 lowercase hex digits; with the file's length either the data's or one the
//! input chooses.

use vfiod::fpga::image::{parse, Header, HeaderError};

type Parser = fn(&[u8], u64) -> Result<Header, HeaderError>;

fn check(r: &Result<Header, HeaderError>) {
    match r {
        Ok(h) => {
            for id in h.interface_id.iter().chain(&h.afu_ids) {
                assert_eq!(id.len(), 32, "{id}");
                assert!(id.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)), "{id}");
            }
        }
        Err(e) => {
            let m = e.to_string();
            assert!(m.len() < 600, "error of {} bytes: {m}", m.len());
        }
    }
}

/// `parser` (and `parse`, which sniffs the format) on `data`.
pub fn run(parser: Parser, data: &[u8]) {
    let len = data.len() as u64;
    check(&parser(data, len));
    check(&parse(None, data, len));
    // A file longer than what was read, by an amount the input picks from its last bytes.
    if data.len() >= 8 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&data[data.len() - 8..]);
        check(&parser(data, u64::from_le_bytes(tail)));
    }
}
