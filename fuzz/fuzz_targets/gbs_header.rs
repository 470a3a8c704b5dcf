//! `fpga::image::parse_gbs` (and `parse`, which sniffs the format) on arbitrary bytes, with
//! the file's length either the data's or one the input chooses: never a panic, errors stay
//! short, ids come out as 32 lowercase hex digits.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vfiod::fpga::image::{parse, parse_gbs, Header, HeaderError};

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

fuzz_target!(|data: &[u8]| {
    let len = data.len() as u64;
    check(&parse_gbs(data, len));
    check(&parse(None, data, len));
    // A file longer than what was read, by an amount the input picks from its last bytes.
    if data.len() >= 8 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&data[data.len() - 8..]);
        check(&parse_gbs(data, u64::from_le_bytes(tail)));
    }
});
