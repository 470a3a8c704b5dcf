//! FPGA image headers, read as pure code from the first bytes of a file: what an image says it
//! is for (the interface id of the static region it fits, the AFU/accelerator ids it provides).
//!
//! - Intel `.gbs` (OPAE "green bitstream"): a 16-byte GUID (`58656F6E-4650-4741-B747-425376303031`,
//!   "XeonFPGA·GBSv001"), a little-endian u32 length, then that many bytes of JSON metadata
//!   (`afu-image.interface-uuid`, `afu-image.accelerator-clusters[].accelerator-type-uuid`), then
//!   the bitstream.
//! - Xilinx `.xclbin` (XRT "axlf"): magic `xclbin2\0`, a signature block, then the `axlf_header`
//!   with the file's length, the interface UUID, the platform VBNV, the xclbin's own UUID and its
//!   section headers.
//! - Anything else is opaque: accepted with the metadata the operator declares.
//!
//! Every id is normalised to 32 lowercase hex digits without dashes, the form the Linux DFL
//! driver prints (`pr/interface_id`, `afu_id`: `%016llx%016llx`), so ids compare as strings.
//! A malformed header is an error naming what is wrong, never a panic.

use serde::{Deserialize, Serialize};

/// The GBS file GUID as it is stored (uuid_parse order).
pub const GBS_GUID: [u8; 16] = *b"XeonFPGA\xb7GBSv001";
/// The axlf magic.
pub const XCLBIN_MAGIC: [u8; 8] = *b"xclbin2\0";
/// Metadata longer than this is refused rather than read (OPAE's own tools write a few KiB).
pub const GBS_MAX_METADATA: usize = 1 << 20;
/// Section headers beyond this are refused (XRT's images have tens).
pub const XCLBIN_MAX_SECTIONS: u32 = 4096;

/// Offsets in `struct axlf` (xclbin.h, packed as a C compiler lays it out on x86-64).
const AXLF_LENGTH: usize = 304;
const AXLF_VERSION_PATCH: usize = 328;
const AXLF_VERSION_MAJOR: usize = 330;
const AXLF_VERSION_MINOR: usize = 331;
const AXLF_INTERFACE_UUID: usize = 336;
const AXLF_VBNV: usize = 352;
const AXLF_UUID: usize = 416;
const AXLF_NUM_SECTIONS: usize = 448;
const AXLF_SECTIONS: usize = 456;
const AXLF_SECTION_SIZE: usize = 40;

/// How many bytes of a file [`parse`] may need: read at most this much before parsing.
pub const HEADER_READ_LIMIT: usize =
    20 + GBS_MAX_METADATA + AXLF_SECTIONS + AXLF_SECTION_SIZE * XCLBIN_MAX_SECTIONS as usize;

/// An image's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Gbs,
    Xclbin,
    /// No header vfiod reads, declared so by the operator: the declared metadata is all there is.
    Opaque,
    /// No header vfiod knows and no format declared: kept, but never legal to program.
    Unknown,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Gbs => "gbs",
            Format::Xclbin => "xclbin",
            Format::Opaque => "opaque",
            Format::Unknown => "unknown",
        }
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "gbs" => Ok(Format::Gbs),
            "xclbin" => Ok(Format::Xclbin),
            "opaque" => Ok(Format::Opaque),
            _ => Err(format!("unknown image format {s:?} (gbs, xclbin, opaque)")),
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a header says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format: Format,
    /// The static region's id the image fits (32 hex digits), where the header names one.
    pub interface_id: Option<String>,
    /// The AFU/accelerator ids (gbs) or the xclbin's own UUID, 32 hex digits each.
    pub afu_ids: Vec<String>,
    /// The rest of what the header says, for `vfioctl image show`.
    pub metadata: serde_json::Value,
}

/// Why a header is not what its format requires. Messages quote at most a short piece.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("{format} image too short: {needed} bytes of header needed, {have} present")]
    Truncated {
        format: Format,
        needed: usize,
        have: usize,
    },
    #[error("not a {format} image: bad magic")]
    BadMagic { format: Format },
    #[error("gbs metadata length {0} is over the limit of {GBS_MAX_METADATA} bytes")]
    MetadataTooLong(u64),
    #[error("gbs metadata is not JSON: {0}")]
    MetadataJson(String),
    #[error("gbs metadata: {0}")]
    Metadata(String),
    #[error("xclbin: {0}")]
    Xclbin(String),
    #[error("bad UUID {0:?}: 32 hex digits expected (dashes allowed)")]
    BadUuid(String),
}

/// The format a file's first bytes announce, if any.
pub fn sniff(bytes: &[u8]) -> Option<Format> {
    if bytes.starts_with(&GBS_GUID) {
        Some(Format::Gbs)
    } else if bytes.starts_with(&XCLBIN_MAGIC) {
        Some(Format::Xclbin)
    } else {
        None
    }
}

/// Parses the header of an image of `format` (`None`: as its magic says, unknown without one).
/// `bytes` is the start of the file (at least what [`HEADER_READ_LIMIT`] covers, or the whole
/// file when shorter); `file_len` its full length.
pub fn parse(format: Option<Format>, bytes: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    match format.or_else(|| sniff(bytes)).unwrap_or(Format::Unknown) {
        Format::Gbs => parse_gbs(bytes, file_len),
        Format::Xclbin => parse_xclbin(bytes, file_len),
        f @ (Format::Opaque | Format::Unknown) => Ok(Header {
            format: f,
            interface_id: None,
            afu_ids: Vec::new(),
            metadata: serde_json::json!({}),
        }),
    }
}

/// A UUID in any common spelling ("58656f6e-4650-...", "58656F6E4650...") as 32 lowercase hex
/// digits.
pub fn normalize_uuid(s: &str) -> Result<String, HeaderError> {
    let hex: String = s.trim().chars().filter(|c| *c != '-').collect();
    if hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()) {
        Ok(hex.to_ascii_lowercase())
    } else {
        Err(HeaderError::BadUuid(short(s)))
    }
}

fn short(s: &str) -> String {
    s.chars().take(64).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Intel `.gbs`.
pub fn parse_gbs(bytes: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    let truncated = |needed: usize| HeaderError::Truncated {
        format: Format::Gbs,
        needed,
        have: bytes.len(),
    };
    if bytes.len() < 16 {
        return Err(if GBS_GUID.starts_with(bytes) {
            truncated(20)
        } else {
            HeaderError::BadMagic {
                format: Format::Gbs,
            }
        });
    }
    if bytes[..16] != GBS_GUID {
        return Err(HeaderError::BadMagic {
            format: Format::Gbs,
        });
    }
    let len_bytes: [u8; 4] = bytes
        .get(16..20)
        .ok_or(truncated(20))?
        .try_into()
        .unwrap_or([0; 4]);
    let len = u32::from_le_bytes(len_bytes) as usize;
    if len > GBS_MAX_METADATA {
        return Err(HeaderError::MetadataTooLong(len as u64));
    }
    let end = 20 + len;
    if (file_len as u128) < end as u128 {
        return Err(HeaderError::Metadata(format!(
            "{len} bytes of metadata announced, the file has {file_len} bytes"
        )));
    }
    let json = bytes.get(20..end).ok_or(truncated(end))?;
    let metadata: serde_json::Value = serde_json::from_slice(json)
        .map_err(|e| HeaderError::MetadataJson(short(&e.to_string())))?;
    let image = metadata
        .get("afu-image")
        .and_then(|v| v.as_object())
        .ok_or_else(|| HeaderError::Metadata("no \"afu-image\" object".into()))?;
    let interface_id = match image.get("interface-uuid") {
        Some(serde_json::Value::String(s)) => Some(normalize_uuid(s)?),
        Some(_) => {
            return Err(HeaderError::Metadata(
                "\"interface-uuid\" is not a string".into(),
            ))
        }
        None => {
            return Err(HeaderError::Metadata(
                "no \"afu-image.interface-uuid\"".into(),
            ))
        }
    };
    let mut afu_ids = Vec::new();
    if let Some(clusters) = image.get("accelerator-clusters") {
        let clusters = clusters.as_array().ok_or_else(|| {
            HeaderError::Metadata("\"accelerator-clusters\" is not an array".into())
        })?;
        for c in clusters {
            match c.get("accelerator-type-uuid") {
                Some(serde_json::Value::String(s)) => afu_ids.push(normalize_uuid(s)?),
                _ => {
                    return Err(HeaderError::Metadata(
                        "an accelerator cluster without a string \"accelerator-type-uuid\"".into(),
                    ))
                }
            }
        }
    }
    Ok(Header {
        format: Format::Gbs,
        interface_id,
        afu_ids,
        metadata,
    })
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// A NUL-terminated C string in a fixed field, as text (lossy: a bad byte is no reason to
/// refuse an image whose ids are fine).
fn c_string(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// Xilinx `.xclbin` (axlf).
pub fn parse_xclbin(bytes: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    let fixed = AXLF_SECTIONS + AXLF_SECTION_SIZE;
    if !bytes.starts_with(&XCLBIN_MAGIC) {
        let prefix = &bytes[..bytes.len().min(8)];
        return Err(if XCLBIN_MAGIC.starts_with(prefix) && bytes.len() < 8 {
            HeaderError::Truncated {
                format: Format::Xclbin,
                needed: fixed,
                have: bytes.len(),
            }
        } else {
            HeaderError::BadMagic {
                format: Format::Xclbin,
            }
        });
    }
    if bytes.len() < fixed {
        return Err(HeaderError::Truncated {
            format: Format::Xclbin,
            needed: fixed,
            have: bytes.len(),
        });
    }
    let length = le_u64(bytes, AXLF_LENGTH);
    if length != file_len {
        return Err(HeaderError::Xclbin(format!(
            "the header says {length} bytes, the file has {file_len}"
        )));
    }
    let sections = le_u32(bytes, AXLF_NUM_SECTIONS);
    if sections == 0 || sections > XCLBIN_MAX_SECTIONS {
        return Err(HeaderError::Xclbin(format!(
            "{sections} sections (1..={XCLBIN_MAX_SECTIONS} expected)"
        )));
    }
    let headers_end = AXLF_SECTIONS + AXLF_SECTION_SIZE * sections as usize;
    if bytes.len() < headers_end {
        return Err(HeaderError::Truncated {
            format: Format::Xclbin,
            needed: headers_end,
            have: bytes.len(),
        });
    }
    let mut listed = Vec::new();
    for i in 0..sections as usize {
        let at = AXLF_SECTIONS + i * AXLF_SECTION_SIZE;
        let kind = le_u32(bytes, at);
        let name = c_string(&bytes[at + 4..at + 20]);
        let offset = le_u64(bytes, at + 24);
        let size = le_u64(bytes, at + 32);
        if offset.checked_add(size).is_none_or(|end| end > length) {
            return Err(HeaderError::Xclbin(format!(
                "section {i} ({}) at {offset}+{size} ends beyond the file's {length} bytes",
                short(&name)
            )));
        }
        listed
            .push(serde_json::json!({"kind": kind, "name": name, "offset": offset, "size": size}));
    }
    let interface = &bytes[AXLF_INTERFACE_UUID..AXLF_INTERFACE_UUID + 16];
    let uuid = &bytes[AXLF_UUID..AXLF_UUID + 16];
    // An all-zero interface UUID is "none" (XRT's legacy, pre-interface images).
    let interface_id = interface.iter().any(|&b| b != 0).then(|| hex(interface));
    let platform = c_string(&bytes[AXLF_VBNV..AXLF_VBNV + 64]);
    let metadata = serde_json::json!({
        "platform-vbnv": platform,
        "version": format!(
            "{}.{}.{}",
            bytes[AXLF_VERSION_MAJOR],
            bytes[AXLF_VERSION_MINOR],
            u16::from_le_bytes([bytes[AXLF_VERSION_PATCH], bytes[AXLF_VERSION_PATCH + 1]])
        ),
        "uuid": hex(uuid),
        "sections": listed,
    });
    Ok(Header {
        format: Format::Xclbin,
        interface_id,
        afu_ids: vec![hex(uuid)],
        metadata,
    })
}

/// Builders of well-formed images, for tests, the simulated host and the fuzz seeds.
pub mod build {
    use super::*;

    /// A `.gbs` with `interface` and `afus` (any UUID spelling) and `payload` as its bitstream.
    pub fn gbs(interface: &str, afus: &[&str], payload: &[u8]) -> Vec<u8> {
        let clusters: Vec<_> = afus
            .iter()
            .map(|a| serde_json::json!({"name": "afu", "total-contexts": 1, "accelerator-type-uuid": a}))
            .collect();
        let meta = serde_json::json!({
            "version": 640,
            "platform-name": "simulated",
            "afu-image": {
                "magic-no": 488605312,
                "interface-uuid": interface,
                "accelerator-clusters": clusters,
            }
        })
        .to_string();
        let mut out = GBS_GUID.to_vec();
        out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        out.extend_from_slice(meta.as_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// An `.xclbin` with one section holding `payload`.
    pub fn xclbin(interface: [u8; 16], uuid: [u8; 16], payload: &[u8]) -> Vec<u8> {
        let header = AXLF_SECTIONS + AXLF_SECTION_SIZE;
        let total = header + payload.len();
        let mut out = vec![0u8; header];
        out[..8].copy_from_slice(&XCLBIN_MAGIC);
        out[8..12].copy_from_slice(&(-1i32).to_le_bytes());
        out[AXLF_LENGTH..AXLF_LENGTH + 8].copy_from_slice(&(total as u64).to_le_bytes());
        out[AXLF_VERSION_MAJOR] = 2;
        out[AXLF_VERSION_MINOR] = 1;
        out[AXLF_INTERFACE_UUID..AXLF_INTERFACE_UUID + 16].copy_from_slice(&interface);
        out[AXLF_VBNV..AXLF_VBNV + 9].copy_from_slice(b"xilinx:u2");
        out[AXLF_UUID..AXLF_UUID + 16].copy_from_slice(&uuid);
        out[AXLF_NUM_SECTIONS..AXLF_NUM_SECTIONS + 4].copy_from_slice(&1u32.to_le_bytes());
        let s = AXLF_SECTIONS;
        out[s..s + 4].copy_from_slice(&0u32.to_le_bytes()); // BITSTREAM
        out[s + 4..s + 10].copy_from_slice(b"stage2");
        out[s + 24..s + 32].copy_from_slice(&(header as u64).to_le_bytes());
        out[s + 32..s + 40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(payload);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IFACE: &str = "3a00972e-7aac-41de-bbd1-3901124e8cda";
    const AFU: &str = "D8424DC4-A4A3-C413-F89E-433683F9040B";

    fn p(bytes: &[u8]) -> Result<Header, HeaderError> {
        parse(None, bytes, bytes.len() as u64)
    }

    #[test]
    fn well_formed_images() {
        let g = p(&build::gbs(IFACE, &[AFU], b"bits")).unwrap();
        assert_eq!(g.format, Format::Gbs);
        assert_eq!(
            g.interface_id.as_deref(),
            Some("3a00972e7aac41debbd13901124e8cda")
        );
        assert_eq!(
            g.afu_ids,
            vec!["d8424dc4a4a3c413f89e433683f9040b".to_string()]
        );
        assert_eq!(g.metadata["platform-name"], "simulated");

        let x = p(&build::xclbin([0xab; 16], [0x01; 16], b"payload")).unwrap();
        assert_eq!(x.format, Format::Xclbin);
        assert_eq!(x.interface_id.as_deref(), Some("ab".repeat(16).as_str()));
        assert_eq!(x.afu_ids, vec!["01".repeat(16)]);
        assert_eq!(x.metadata["platform-vbnv"], "xilinx:u2");
        assert_eq!(x.metadata["version"], "2.1.0");
        // No interface UUID: none recorded.
        let x = p(&build::xclbin([0; 16], [0x01; 16], b"")).unwrap();
        assert_eq!(x.interface_id, None);

        let o = p(b"just some bytes").unwrap();
        assert_eq!(o.format, Format::Unknown);
        assert_eq!(p(b"").unwrap().format, Format::Unknown);
        let o = parse(Some(Format::Opaque), b"XeonFPGA", 8).unwrap();
        assert_eq!(o.format, Format::Opaque);
        assert!(
            "unknown".parse::<Format>().is_err(),
            "unknown is never declared"
        );
    }

    #[test]
    fn malformed_headers_are_errors() {
        let good_gbs = build::gbs(IFACE, &[AFU], b"bits");
        let good_x = build::xclbin([0xab; 16], [0x01; 16], b"payload");
        let with_meta = |meta: &str| {
            let mut v = GBS_GUID.to_vec();
            v.extend_from_slice(&(meta.len() as u32).to_le_bytes());
            v.extend_from_slice(meta.as_bytes());
            v
        };
        let mut long_len = good_gbs.clone();
        long_len[16..20].copy_from_slice(&(u32::MAX).to_le_bytes());
        let mut past_end = good_gbs.clone();
        past_end[16..20].copy_from_slice(&5000u32.to_le_bytes());
        let mut x_len = good_x.clone();
        x_len[AXLF_LENGTH] ^= 1;
        let mut x_zero = good_x.clone();
        x_zero[AXLF_NUM_SECTIONS..AXLF_NUM_SECTIONS + 4].copy_from_slice(&0u32.to_le_bytes());
        let mut x_many = good_x.clone();
        x_many[AXLF_NUM_SECTIONS..AXLF_NUM_SECTIONS + 4].copy_from_slice(&3u32.to_le_bytes());
        let mut x_section = good_x.clone();
        let s = AXLF_SECTIONS + 32;
        x_section[s..s + 8].copy_from_slice(&u64::MAX.to_le_bytes());

        let cases: Vec<(&str, Option<Format>, Vec<u8>, &str)> = vec![
            ("gbs: magic only", None, GBS_GUID.to_vec(), "too short"),
            (
                "gbs: a prefix of the magic",
                Some(Format::Gbs),
                GBS_GUID[..5].to_vec(),
                "too short",
            ),
            (
                "gbs declared, other bytes",
                Some(Format::Gbs),
                b"0123456789abcdefghij".to_vec(),
                "bad magic",
            ),
            (
                "gbs: length over the limit",
                None,
                long_len,
                "over the limit",
            ),
            ("gbs: length past the end", None, past_end, "announced"),
            ("gbs: not JSON", None, with_meta("{not json"), "not JSON"),
            (
                "gbs: JSON not an object",
                None,
                with_meta("[1,2]"),
                "afu-image",
            ),
            ("gbs: no afu-image", None, with_meta("{}"), "afu-image"),
            (
                "gbs: no interface",
                None,
                with_meta(r#"{"afu-image":{}}"#),
                "interface-uuid",
            ),
            (
                "gbs: interface a number",
                None,
                with_meta(r#"{"afu-image":{"interface-uuid":7}}"#),
                "not a string",
            ),
            (
                "gbs: bad interface",
                None,
                with_meta(r#"{"afu-image":{"interface-uuid":"xyz"}}"#),
                "bad UUID",
            ),
            (
                "gbs: clusters not array",
                None,
                with_meta(&format!(
                    r#"{{"afu-image":{{"interface-uuid":"{IFACE}","accelerator-clusters":1}}}}"#
                )),
                "not an array",
            ),
            (
                "gbs: cluster without id",
                None,
                with_meta(&format!(
                    r#"{{"afu-image":{{"interface-uuid":"{IFACE}","accelerator-clusters":[{{}}]}}}}"#
                )),
                "accelerator-type-uuid",
            ),
            (
                "gbs: bad afu id",
                None,
                with_meta(&format!(
                    r#"{{"afu-image":{{"interface-uuid":"{IFACE}","accelerator-clusters":[{{"accelerator-type-uuid":"12-34"}}]}}}}"#
                )),
                "bad UUID",
            ),
            (
                "xclbin: magic only",
                None,
                XCLBIN_MAGIC.to_vec(),
                "too short",
            ),
            (
                "xclbin: a prefix of the magic",
                Some(Format::Xclbin),
                b"xcl".to_vec(),
                "too short",
            ),
            (
                "xclbin declared, other bytes",
                Some(Format::Xclbin),
                vec![0; 600],
                "bad magic",
            ),
            (
                "xclbin: truncated header",
                None,
                good_x[..400].to_vec(),
                "too short",
            ),
            ("xclbin: wrong length", None, x_len, "the header says"),
            ("xclbin: no sections", None, x_zero, "0 sections"),
            (
                "xclbin: section headers past the data",
                None,
                x_many,
                "too short",
            ),
            ("xclbin: section beyond the file", None, x_section, "beyond"),
        ];
        for (name, format, bytes, want) in cases {
            let got = parse(format, &bytes, bytes.len() as u64);
            match got {
                Err(e) => assert!(
                    e.to_string().contains(want),
                    "{name}: {e} does not say {want:?}"
                ),
                Ok(h) => panic!("{name}: parsed as {h:?}"),
            }
        }
    }

    #[test]
    fn uuids_normalise() {
        assert_eq!(
            normalize_uuid(" 3A00972E-7AAC-41DE-BBD1-3901124E8CDA\n").unwrap(),
            "3a00972e7aac41debbd13901124e8cda"
        );
        assert!(normalize_uuid("3a00972e7aac41debbd13901124e8cd").is_err());
        assert!(normalize_uuid("3a00972e7aac41debbd13901124e8cdg").is_err());
        assert!(normalize_uuid("").is_err());
        // A long garbage id is quoted short.
        let e = normalize_uuid(&"z".repeat(10_000)).unwrap_err().to_string();
        assert!(e.len() < 200);
    }

    #[test]
    fn every_prefix_of_a_good_image_is_an_error_or_opaque_never_a_panic() {
        for image in [
            build::gbs(IFACE, &[AFU], b"bits"),
            build::xclbin([0xab; 16], [0x01; 16], b"payload"),
        ] {
            for n in 0..image.len() {
                let _ = parse(None, &image[..n], image.len() as u64);
                let _ = parse(None, &image[..n], n as u64);
                let _ = parse(Some(Format::Gbs), &image[..n], n as u64);
                let _ = parse(Some(Format::Xclbin), &image[..n], n as u64);
            }
        }
    }
}
