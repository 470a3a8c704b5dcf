//! `fpga::image::parse_gbs` (and `parse`, which sniffs the format) on arbitrary bytes: the
//! checks of `fuzz/common/header.rs`.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../common/header.rs"]
mod header;

fuzz_target!(|data: &[u8]| header::run(vfiod::fpga::image::parse_gbs, data));
