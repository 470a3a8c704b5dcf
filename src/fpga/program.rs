//! What makes an image legal for a device, what part of it a DFL card is given, and what a
//! verify concludes: decided here once, as pure functions, for every backend and for the real
//! and the simulated card alike.

use super::image::{Format, GBS_GUID};

/// What the catalog knows of an image, as far as legality goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageFacts<'a> {
    pub name: &'a str,
    pub format: Format,
    pub active: bool,
    /// Whether the stored file's SHA-256 is still the recorded one.
    pub checksum_ok: bool,
    pub interface_id: Option<&'a str>,
}

/// Why an image may not be programmed into (or verified against) a device. Each message says
/// what to do.
pub fn legality(image: &ImageFacts<'_>, device_interface: Option<&str>) -> Result<(), String> {
    let name = image.name;
    if image.format == Format::Unknown {
        return Err(format!(
            "image {name} has no header vfiod knows and no declared format (add it again with \
             --format opaque and its ids)"
        ));
    }
    if !image.active {
        return Err(format!(
            "image {name} is deactivated (vfioctl image activate {name})"
        ));
    }
    if !image.checksum_ok {
        return Err(format!(
            "image {name}: the stored file no longer has its recorded SHA-256 (remove it and \
             add it again)"
        ));
    }
    match (image.interface_id, device_interface) {
        (Some(wanted), Some(has)) if wanted != has => Err(format!(
            "image {name} is built for interface {wanted}, the device's static region is {has}"
        )),
        _ => Ok(()),
    }
}

/// The bytes the DFL partial reconfiguration takes: a `.gbs` without its GBS header (as
/// OPAE's `fpgaReconfigureSlot` passes it), an opaque image whole. An `.xclbin` is XRT's, not
/// DFL's.
pub fn dfl_bitstream(format: Format, image: &[u8]) -> Result<&[u8], String> {
    match format {
        Format::Gbs => {
            if image.len() < 20 || image[..16] != GBS_GUID {
                return Err("the stored .gbs has lost its header".into());
            }
            let len = u32::from_le_bytes([image[16], image[17], image[18], image[19]]) as usize;
            let start = 20usize.saturating_add(len);
            image
                .get(start..)
                .filter(|b| !b.is_empty())
                .ok_or_else(|| "the .gbs has no bitstream after its metadata".to_string())
        }
        Format::Opaque => Ok(image),
        Format::Xclbin => Err(
            "an .xclbin is for Xilinx XRT, not a DFL card: configure an exec backend \
             (xbmgmt) for this device"
                .into(),
        ),
        Format::Unknown => Err("the image's format is unknown".into()),
    }
}

/// What a verify concludes from the AFU id the device reports.
pub fn verify(
    image_name: &str,
    afu_ids: &[String],
    reported: Option<&str>,
) -> Result<String, String> {
    match reported {
        None => Err("the device reports no AFU id to check".into()),
        Some(id) if afu_ids.is_empty() => Err(format!(
            "image {image_name} names no AFU id to compare the device's {id} with"
        )),
        Some(id) if afu_ids.iter().any(|a| a == id) => {
            Ok(format!("the device runs image {image_name}: AFU {id}"))
        }
        Some(id) => Err(format!(
            "the device reports AFU {id}, image {image_name} provides {}",
            afu_ids.join(", ")
        )),
    }
}

/// The exec backend's command: each word with `{address}` and `{image}` replaced.
pub fn command(argv: &[String], address: &str, image: &str) -> Vec<String> {
    argv.iter()
        .map(|w| w.replace("{address}", address).replace("{image}", image))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fpga::image::build;

    const IF: &str = "3a00972e7aac41debbd13901124e8cda";

    #[test]
    fn legality_table() {
        let ok = ImageFacts {
            name: "nlb",
            format: Format::Gbs,
            active: true,
            checksum_ok: true,
            interface_id: Some(IF),
        };
        let other = "00".repeat(16);
        let cases: Vec<(ImageFacts<'_>, Option<&str>, Option<&str>)> = vec![
            (ok.clone(), Some(IF), None),
            (ok.clone(), None, None),
            (
                ImageFacts {
                    interface_id: None,
                    ..ok.clone()
                },
                Some(IF),
                None,
            ),
            (ok.clone(), Some(&other), Some("built for interface")),
            (
                ImageFacts {
                    active: false,
                    ..ok.clone()
                },
                Some(IF),
                Some("deactivated"),
            ),
            (
                ImageFacts {
                    checksum_ok: false,
                    ..ok.clone()
                },
                Some(IF),
                Some("SHA-256"),
            ),
            (
                ImageFacts {
                    format: Format::Unknown,
                    ..ok.clone()
                },
                Some(IF),
                Some("no declared format"),
            ),
            (
                ImageFacts {
                    format: Format::Opaque,
                    ..ok.clone()
                },
                Some(IF),
                None,
            ),
        ];
        for (facts, device, want) in cases {
            match (legality(&facts, device), want) {
                (Ok(()), None) => {}
                (Err(e), Some(w)) => assert!(e.contains(w), "{facts:?}: {e}"),
                (got, want) => panic!("{facts:?} on {device:?}: {got:?}, wanted {want:?}"),
            }
        }
    }

    #[test]
    fn bitstreams_and_verdicts() {
        let gbs = build::gbs(IF, &[], b"BITS");
        assert_eq!(dfl_bitstream(Format::Gbs, &gbs).unwrap(), b"BITS");
        assert!(dfl_bitstream(Format::Gbs, &build::gbs(IF, &[], b"")).is_err());
        assert!(dfl_bitstream(Format::Gbs, b"short").is_err());
        assert_eq!(dfl_bitstream(Format::Opaque, b"raw").unwrap(), b"raw");
        assert!(dfl_bitstream(Format::Xclbin, b"x")
            .unwrap_err()
            .contains("exec"));
        let afus = vec!["aa".repeat(16)];
        assert!(verify("i", &afus, Some(&"aa".repeat(16))).is_ok());
        assert!(verify("i", &afus, Some(&"bb".repeat(16)))
            .unwrap_err()
            .contains("reports AFU"));
        assert!(verify("i", &afus, None).is_err());
        assert!(verify("i", &[], Some("x")).is_err());
        assert_eq!(
            command(
                &["/bin/p".into(), "--dev={address}".into(), "{image}".into()],
                "0000:af:00.0",
                "/s/i"
            ),
            ["/bin/p", "--dev=0000:af:00.0", "/s/i"]
        );
    }
}
