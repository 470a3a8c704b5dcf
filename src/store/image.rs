//! The FPGA image catalog: the `images` rows and the files they describe, under
//! `<state_dir>/images/<name>`.
//!
//! An image is taken from a reader (a file descriptor a D-Bus caller passed, or a file root
//! named), copied into the state directory while its SHA-256 is computed, and kept only when the
//! digest is the one the caller gave and its header (where the format has one) parses. The file
//! is written under a temporary name and renamed into place before its row is committed, so a
//! crash leaves at most a stray temporary file, never a row without its file.

use super::{insert_event, now_ms, NewEvent, Store, StoreError};
use crate::fpga::image::{self, Format, HeaderError};
use crate::model::event::EventKind;
use crate::model::image_source::SourceError;
use crate::model::text::quote;
use rusqlite::{params, OptionalExtension, Row};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The prefixes of the temporary files under the images directory: an image copied in from a
/// descriptor or path, and one being downloaded. Image names cannot start with a dot.
pub const TEMP_PREFIXES: [&str; 2] = [".adding-", ".downloading-"];

/// Makes a rename in `dir` durable (best effort: the image's row is what counts, and a
/// missing file is found by the checksum check before any use).
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The largest image vfiod copies (the biggest FPGA images are a few hundred MiB).
pub const MAX_IMAGE_SIZE: u64 = 4 << 30;

/// Whether an image may be programmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageState {
    Active,
    /// Kept in the catalog but refused by program and verify.
    Inactive,
}

impl ImageState {
    pub fn as_str(self) -> &'static str {
        match self {
            ImageState::Active => "active",
            ImageState::Inactive => "inactive",
        }
    }
}

/// One catalog entry.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ImageRecord {
    pub id: i64,
    /// Unique; also the file's name under `<state_dir>/images`.
    pub name: String,
    pub format: Format,
    /// 64 lowercase hex digits.
    pub sha256: String,
    pub size: u64,
    pub path: PathBuf,
    /// The static region's id the image fits, 32 hex digits (header or declared).
    pub interface_id: Option<String>,
    /// The AFU ids it provides (gbs), or the xclbin's UUID; 32 hex digits each.
    pub afu_ids: Vec<String>,
    /// What the header says, as a JSON object.
    pub metadata: String,
    pub state: ImageState,
    /// A uid or a D-Bus sender.
    pub added_by: String,
    pub added_ms: i64,
    /// The URL it was downloaded from (`None`: passed by descriptor or path).
    pub source_url: Option<String>,
}

/// A request to add an image.
#[derive(Clone, Debug, Default)]
pub struct NewImage {
    pub name: String,
    /// Declared by the caller; `None`: as the header says.
    pub format: Option<Format>,
    /// The digest the content must have, 64 hex digits.
    pub sha256: String,
    /// Declared ids, for an opaque image; for a parsed one they must agree with the header.
    pub interface_id: Option<String>,
    pub afu_ids: Vec<String>,
    pub added_by: String,
    /// The URL the content was downloaded from, recorded with the image.
    pub source_url: Option<String>,
}

/// Why an image was not added, found, or changed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Each `String` of these four is the caller's text as [`quote`] gives it (64 characters
    /// at most).
    #[error(
        "image name {0} is not allowed: 1 to 64 of A-Z a-z 0-9 . _ -, not starting with a dot"
    )]
    InvalidName(String),
    #[error("an image named {0} already exists")]
    Exists(String),
    #[error("no image {0}")]
    NoSuchImage(String),
    #[error("sha256 {0} is not 64 hex digits")]
    BadDigest(String),
    #[error("the image's SHA-256 is {actual}, not the {expected} given")]
    Checksum { expected: String, actual: String },
    #[error("the image is larger than {MAX_IMAGE_SIZE} bytes")]
    TooLarge,
    #[error("malformed image header")]
    Header(#[from] HeaderError),
    #[error("{0}")]
    Declared(String),
    /// A read of a passed descriptor or a named file that was stopped: a deadline, or its
    /// caller went away.
    #[error("cannot read the image: {0}")]
    Source(SourceError),
    #[error("cannot {action}")]
    Io {
        action: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let action = action.into();
    move |source| ImageError::Io { action, source }
}

/// 1 to 64 of `[A-Za-z0-9._-]`, not starting with a dot: a file name that cannot climb out of
/// the images directory or hide in it.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A digest as 64 lowercase hex digits.
pub fn normalize_digest(s: &str) -> Result<String, ImageError> {
    let t = s.trim();
    if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(t.to_ascii_lowercase())
    } else {
        Err(ImageError::BadDigest(quote(t)))
    }
}

/// The SHA-256 of everything `r` yields, and its length; refuses more than `limit` bytes. Each
/// chunk read is also passed to `sink`.
pub fn sha256_of(
    r: &mut dyn Read,
    limit: u64,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<(String, u64), ImageError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut size = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(match SourceError::of(&e) {
                    Some(stopped) => ImageError::Source(stopped),
                    None => io("read the image")(e),
                })
            }
        };
        size += n as u64;
        if size > limit {
            return Err(ImageError::TooLarge);
        }
        hasher.update(&buf[..n]);
        sink(&buf[..n]).map_err(io("write the image"))?;
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok((digest, size))
}

fn declared_ids(new: &NewImage) -> Result<(Option<String>, Vec<String>), ImageError> {
    let bad = |e: HeaderError| ImageError::Declared(format!("declared id: {e}"));
    let interface = match new.interface_id.as_deref().filter(|s| !s.is_empty()) {
        Some(s) => Some(image::normalize_uuid(s).map_err(bad)?),
        None => None,
    };
    let afus = new
        .afu_ids
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| image::normalize_uuid(s).map_err(bad))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((interface, afus))
}

const COLUMNS: &str = "id, name, format, sha256, size, path, interface_id, afu_ids, metadata, \
                       state, added_by, added_ms, source_url";

fn decode(row: &Row<'_>) -> rusqlite::Result<ImageRecord> {
    let bad = |i: usize, e: String| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into())
    };
    let format: String = row.get(2)?;
    let format = match format.as_str() {
        "unknown" => Format::Unknown,
        f => f.parse().map_err(|e: String| bad(2, e))?,
    };
    let afu_ids: String = row.get(7)?;
    let afu_ids: Vec<String> = serde_json::from_str(&afu_ids).map_err(|e| bad(7, e.to_string()))?;
    let state: String = row.get(9)?;
    let state = match state.as_str() {
        "active" => ImageState::Active,
        "inactive" => ImageState::Inactive,
        s => return Err(bad(9, format!("unknown image state {s:?}"))),
    };
    let path: String = row.get(5)?;
    Ok(ImageRecord {
        id: row.get(0)?,
        name: row.get(1)?,
        format,
        sha256: row.get(3)?,
        size: row.get::<_, i64>(4)? as u64,
        path: PathBuf::from(path),
        interface_id: row.get(6)?,
        afu_ids,
        metadata: row.get(8)?,
        state,
        added_by: row.get(10)?,
        added_ms: row.get(11)?,
        source_url: row.get(12)?,
    })
}

impl Store {
    /// Where image files live: `<state_dir>/images`.
    pub fn images_dir(&self) -> PathBuf {
        self.path.parent().unwrap_or(Path::new(".")).join("images")
    }

    /// Copies an image from `source` into the catalog, checking its digest and header; returns
    /// its record. Nothing is kept when anything fails.
    pub fn add_image(
        &self,
        new: &NewImage,
        source: &mut dyn Read,
    ) -> Result<ImageRecord, ImageError> {
        self.check_new_image(new)?;
        let mut tmp = self.image_temp_file(".adding-")?;
        let (actual, size) = {
            let file = tmp.as_file_mut();
            let mut sink = |b: &[u8]| file.write_all(b);
            sha256_of(source, MAX_IMAGE_SIZE, &mut sink)?
        };
        self.keep_image(new, tmp, &actual, size)
    }

    /// Refuses a request that cannot be kept whatever its content (a bad name or digest, bad
    /// declared ids, a name in use), before any byte is read or downloaded.
    pub fn check_new_image(&self, new: &NewImage) -> Result<(), ImageError> {
        if !valid_name(&new.name) {
            return Err(ImageError::InvalidName(quote(&new.name)));
        }
        normalize_digest(&new.sha256)?;
        declared_ids(new)?;
        if self.image_by_name(&new.name)?.is_some() {
            return Err(ImageError::Exists(quote(&new.name)));
        }
        Ok(())
    }

    /// A new temporary file in the images directory (created 0700 if missing), named
    /// `<prefix>XXXXXX`, removed when dropped unless kept. Prefixes start with a dot:
    /// [`Store::remove_image_leftovers`] removes what a crash left.
    pub fn image_temp_file(&self, prefix: &str) -> Result<tempfile::NamedTempFile, ImageError> {
        let dir = self.images_dir();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io(format!("create {}", dir.display())))?;
        tempfile::Builder::new()
            .prefix(prefix)
            .tempfile_in(&dir)
            .map_err(io(format!("create a file in {}", dir.display())))
    }

    /// Keeps `tmp` (written under the images directory, `size` bytes whose SHA-256 is
    /// `actual`) as the image `new` asks for, when the digest is the one asked for and the
    /// header parses; returns its record. Nothing is kept when anything fails.
    pub fn keep_image(
        &self,
        new: &NewImage,
        mut tmp: tempfile::NamedTempFile,
        actual: &str,
        size: u64,
    ) -> Result<ImageRecord, ImageError> {
        let expected = normalize_digest(&new.sha256)?;
        let (declared_interface, declared_afus) = declared_ids(new)?;
        if actual != expected {
            return Err(ImageError::Checksum {
                expected,
                actual: actual.to_string(),
            });
        }
        let file = tmp.as_file_mut();
        file.sync_all().map_err(io("sync the image"))?;
        file.rewind().map_err(io("read the image back"))?;
        let mut prefix = Vec::new();
        file.take(image::HEADER_READ_LIMIT as u64)
            .read_to_end(&mut prefix)
            .map_err(io("read the image's header"))?;
        let header = image::parse(new.format, &prefix, size)?;
        let interface_id = match (header.interface_id, declared_interface) {
            (Some(h), Some(d)) if h != d => {
                return Err(ImageError::Declared(format!(
                    "the declared interface id {d} is not the header's {h}"
                )))
            }
            (h, d) => h.or(d),
        };
        let afu_ids = if header.afu_ids.is_empty() {
            declared_afus
        } else if declared_afus.is_empty() || declared_afus == header.afu_ids {
            header.afu_ids
        } else {
            return Err(ImageError::Declared(format!(
                "the declared AFU ids {declared_afus:?} are not the header's {:?}",
                header.afu_ids
            )));
        };
        // The name may have been taken while the content was read or downloaded.
        if self.image_by_name(&new.name)?.is_some() {
            return Err(ImageError::Exists(quote(&new.name)));
        }
        let path = self.images_dir().join(&new.name);
        tmp.persist_noclobber(&path).map_err(|e| ImageError::Io {
            action: format!("store the image as {}", path.display()),
            source: e.error,
        })?;
        sync_dir(&self.images_dir());
        let record = ImageRecord {
            id: 0,
            name: new.name.clone(),
            format: header.format,
            sha256: actual.to_string(),
            size,
            path: path.clone(),
            interface_id,
            afu_ids,
            metadata: header.metadata.to_string(),
            state: ImageState::Active,
            added_by: new.added_by.clone(),
            added_ms: now_ms(),
            source_url: new.source_url.clone(),
        };
        match self.insert_image(&record) {
            Ok(r) => Ok(r),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e.into())
            }
        }
    }

    /// Puts back the local copy of `image` from `tmp` (`actual` its SHA-256), downloaded again
    /// from its source URL: only the content the image was registered with is accepted.
    pub fn restore_image_file(
        &self,
        image: &ImageRecord,
        mut tmp: tempfile::NamedTempFile,
        actual: &str,
    ) -> Result<(), ImageError> {
        if actual != image.sha256 {
            return Err(ImageError::Checksum {
                expected: image.sha256.clone(),
                actual: actual.to_string(),
            });
        }
        tmp.as_file_mut().sync_all().map_err(io("sync the image"))?;
        tmp.persist(&image.path).map_err(|e| ImageError::Io {
            action: format!("store the image as {}", image.path.display()),
            source: e.error,
        })?;
        sync_dir(&self.images_dir());
        Ok(())
    }

    /// Removes the temporary files a crash or a kill left in the images directory (an add or
    /// a download that never finished); returns their names. Called at start, before any add.
    pub fn remove_image_leftovers(&self) -> Vec<String> {
        let mut removed = Vec::new();
        let Ok(dir) = std::fs::read_dir(self.images_dir()) else {
            return removed;
        };
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if TEMP_PREFIXES.iter().any(|p| name.starts_with(p))
                && std::fs::remove_file(entry.path()).is_ok()
            {
                removed.push(name);
            }
        }
        removed
    }

    fn insert_image(&self, r: &ImageRecord) -> Result<ImageRecord, StoreError> {
        let action = "add an image";
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(|e| self.sqlite(action, e))?;
        tx.execute(
            "INSERT INTO images (name, format, sha256, size, path, interface_id, afu_ids, \
             metadata, state, added_by, added_ms, source_url) VALUES (?1, ?2, ?3, ?4, ?5, ?6, \
             ?7, ?8, ?9, ?10, ?11, ?12)",
            params![
                r.name,
                r.format.as_str(),
                r.sha256,
                r.size as i64,
                r.path.to_string_lossy(),
                r.interface_id,
                serde_json::to_string(&r.afu_ids).unwrap_or_else(|_| "[]".into()),
                r.metadata,
                r.state.as_str(),
                r.added_by,
                r.added_ms,
                r.source_url,
            ],
        )
        .map_err(|e| self.sqlite(action, e))?;
        let id = tx.last_insert_rowid();
        insert_event(
            &tx,
            &NewEvent::new(
                None,
                EventKind::Image,
                match &r.source_url {
                    None => format!(
                        "image {} added ({}, {} bytes, sha256 {}) by {}",
                        r.name, r.format, r.size, r.sha256, r.added_by
                    ),
                    Some(url) => format!(
                        "image {} downloaded from {url} ({}, {} bytes, sha256 {}) by {}",
                        r.name, r.format, r.size, r.sha256, r.added_by
                    ),
                },
            ),
            now_ms(),
        )
        .map_err(|e| self.sqlite(action, e))?;
        tx.commit().map_err(|e| self.sqlite(action, e))?;
        Ok(ImageRecord { id, ..r.clone() })
    }

    fn image_by_name(&self, name: &str) -> Result<Option<ImageRecord>, StoreError> {
        let conn = self.lock();
        conn.prepare_cached(&format!("SELECT {COLUMNS} FROM images WHERE name = ?1"))
            .and_then(|mut s| s.query_row([name], decode).optional())
            .map_err(|e| self.sqlite("read an image", e))
    }

    /// The image named `key` (or, when no name matches and `key` is a number, with that id).
    pub fn image(&self, key: &str) -> Result<ImageRecord, ImageError> {
        if let Some(r) = self.image_by_name(key)? {
            return Ok(r);
        }
        if let Ok(id) = key.parse::<i64>() {
            let conn = self.lock();
            let found = conn
                .prepare_cached(&format!("SELECT {COLUMNS} FROM images WHERE id = ?1"))
                .and_then(|mut s| s.query_row([id], decode).optional())
                .map_err(|e| self.sqlite("read an image", e))?;
            if let Some(r) = found {
                return Ok(r);
            }
        }
        Err(ImageError::NoSuchImage(quote(key)))
    }

    /// Every image, oldest first.
    pub fn images(&self) -> Result<Vec<ImageRecord>, StoreError> {
        let conn = self.lock();
        conn.prepare_cached(&format!("SELECT {COLUMNS} FROM images ORDER BY id"))
            .and_then(|mut s| s.query_map([], decode)?.collect())
            .map_err(|e| self.sqlite("list images", e))
    }

    /// Marks an image active or inactive; returns it. Setting the state it has is no change.
    pub fn set_image_state(
        &self,
        key: &str,
        state: ImageState,
        by: &str,
    ) -> Result<ImageRecord, ImageError> {
        let image = self.image(key)?;
        if image.state == state {
            return Ok(image);
        }
        let action = "change an image's state";
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(|e| self.sqlite(action, e))?;
        tx.execute(
            "UPDATE images SET state = ?1 WHERE id = ?2",
            params![state.as_str(), image.id],
        )
        .map_err(|e| self.sqlite(action, e))?;
        let verb = match state {
            ImageState::Active => "activated",
            ImageState::Inactive => "deactivated",
        };
        insert_event(
            &tx,
            &NewEvent::new(
                None,
                EventKind::Image,
                format!("image {} {verb} by {by}", image.name),
            ),
            now_ms(),
        )
        .map_err(|e| self.sqlite(action, e))?;
        tx.commit().map_err(|e| self.sqlite(action, e))?;
        Ok(ImageRecord { state, ..image })
    }

    /// Removes an image and its file. A job that opened the file already keeps reading it.
    pub fn remove_image(&self, key: &str, by: &str) -> Result<ImageRecord, ImageError> {
        let image = self.image(key)?;
        let action = "remove an image";
        {
            let mut conn = self.lock();
            let tx = conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(|e| self.sqlite(action, e))?;
            tx.execute("DELETE FROM images WHERE id = ?1", [image.id])
                .map_err(|e| self.sqlite(action, e))?;
            insert_event(
                &tx,
                &NewEvent::new(
                    None,
                    EventKind::Image,
                    format!("image {} removed by {by}", image.name),
                ),
                now_ms(),
            )
            .map_err(|e| self.sqlite(action, e))?;
            tx.commit().map_err(|e| self.sqlite(action, e))?;
        }
        match std::fs::remove_file(&image.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %image.path.display(), "cannot remove the image file: {e}")
            }
        }
        Ok(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(b: &[u8]) -> String {
        sha256_of(&mut &b[..], u64::MAX, &mut |_| Ok(())).unwrap().0
    }

    #[test]
    fn names_and_digests() {
        for ok in ["a", "nlb-400.gbs", "A_1.xclbin", &"x".repeat(64)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", ".hidden", "../x", "a/b", "a b", &"x".repeat(65), "é"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert_eq!(
            digest(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(normalize_digest(&"A".repeat(64)).is_ok());
        assert!(normalize_digest("abc").is_err());
    }

    /// Issue 24 (13): names and digests were quoted 80 characters back; the README promises 64.
    #[test]
    fn long_names_and_digests_are_quoted_64_characters_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let long = "n".repeat(1000);
        let quoted = format!("\"{}\"... (1000 characters)", "n".repeat(64));
        let new = NewImage {
            name: long.clone(),
            sha256: "0".repeat(64),
            ..NewImage::default()
        };
        let e = store.check_new_image(&new).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "image name {quoted} is not allowed: 1 to 64 of A-Z a-z 0-9 . _ -, not \
                 starting with a dot"
            )
        );
        let e = normalize_digest(&long).unwrap_err().to_string();
        assert_eq!(e, format!("sha256 {quoted} is not 64 hex digits"));
        let e = store.image(&long).unwrap_err().to_string();
        assert_eq!(e, format!("no image {quoted}"));
    }

    #[test]
    fn add_list_deactivate_remove() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let iface = "3a00972e7aac41debbd13901124e8cda";
        let gbs = image::build::gbs(iface, &["d8424dc4a4a3c413f89e433683f9040b"], b"bits");
        let new = NewImage {
            name: "nlb.gbs".into(),
            sha256: digest(&gbs),
            added_by: "uid 0".into(),
            ..NewImage::default()
        };
        let r = store.add_image(&new, &mut &gbs[..]).unwrap();
        assert_eq!(r.format, Format::Gbs);
        assert_eq!(r.interface_id.as_deref(), Some(iface));
        assert_eq!(std::fs::read(&r.path).unwrap(), gbs);
        assert!(r.path.starts_with(dir.path().join("images")));
        assert!(matches!(
            store.add_image(&new, &mut &gbs[..]),
            Err(ImageError::Exists(_))
        ));
        assert_eq!(store.image("nlb.gbs").unwrap(), r);
        assert_eq!(store.image(&r.id.to_string()).unwrap(), r);
        assert_eq!(store.images().unwrap(), vec![r.clone()]);

        let off = store
            .set_image_state("nlb.gbs", ImageState::Inactive, "me")
            .unwrap();
        assert_eq!(off.state, ImageState::Inactive);
        assert_eq!(store.image("nlb.gbs").unwrap().state, ImageState::Inactive);

        store.remove_image("nlb.gbs", "me").unwrap();
        assert!(!r.path.exists());
        assert!(matches!(
            store.image("nlb.gbs"),
            Err(ImageError::NoSuchImage(_))
        ));
    }

    #[test]
    fn refusals_keep_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let gbs = image::build::gbs("3a00972e7aac41debbd13901124e8cda", &[], b"bits");
        let mut bad_header = gbs.clone();
        bad_header[20] = b'!';
        let base = NewImage {
            name: "x".into(),
            sha256: digest(&gbs),
            ..NewImage::default()
        };
        let cases: Vec<(&str, NewImage, Vec<u8>, &str)> = vec![
            (
                "wrong digest",
                NewImage {
                    sha256: digest(b"other"),
                    ..base.clone()
                },
                gbs.clone(),
                "SHA-256",
            ),
            (
                "bad digest",
                NewImage {
                    sha256: "xyz".into(),
                    ..base.clone()
                },
                gbs.clone(),
                "64 hex",
            ),
            (
                "bad name",
                NewImage {
                    name: "../x".into(),
                    ..base.clone()
                },
                gbs.clone(),
                "not allowed",
            ),
            (
                "bad header",
                NewImage {
                    sha256: digest(&bad_header),
                    ..base.clone()
                },
                bad_header,
                "malformed",
            ),
            (
                "declared interface differs",
                NewImage {
                    interface_id: Some("00".repeat(16)),
                    ..base.clone()
                },
                gbs.clone(),
                "not the header",
            ),
            (
                "declared id bad",
                NewImage {
                    interface_id: Some("nope".into()),
                    ..base.clone()
                },
                gbs.clone(),
                "declared id",
            ),
        ];
        for (name, new, bytes, want) in cases {
            let e = store.add_image(&new, &mut &bytes[..]).unwrap_err();
            let text = crate::error_chain(&e);
            assert!(text.contains(want), "{name}: {text}");
        }
        assert!(store.images().unwrap().is_empty());
        let left: Vec<_> = std::fs::read_dir(store.images_dir())
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{left:?}");

        // An opaque image: declared format and ids; undeclared and headerless: unknown.
        let opaque = NewImage {
            name: "o".into(),
            format: Some(Format::Opaque),
            sha256: digest(b"raw"),
            interface_id: Some("AB".repeat(16)),
            ..NewImage::default()
        };
        let r = store.add_image(&opaque, &mut &b"raw"[..]).unwrap();
        assert_eq!(
            (r.format, r.interface_id),
            (Format::Opaque, Some("ab".repeat(16)))
        );
        let unknown = NewImage {
            name: "u".into(),
            format: None,
            ..opaque
        };
        assert_eq!(
            store.add_image(&unknown, &mut &b"raw"[..]).unwrap().format,
            Format::Unknown
        );
    }
}
