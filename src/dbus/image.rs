//! `org.vfiod.Vfiod1.Images` on the root object: the FPGA image catalog. Reads are open; adding,
//! deactivating, activating and removing ask `org.vfiod.vfiod1.program` (with the image's name).
//!
//! An unprivileged caller passes the image as a file descriptor it opened itself (`Add`): the
//! daemon reads the descriptor and never opens a path such a caller chose. Only root may name a
//! local file for the daemon to read (`AddFromPath`). `AddFromUrl` has the daemon download the
//! image (`host::download`: https, plain http only to loopback unless configured, deadlines, a
//! size cap) into its state directory and records the URL with it; `Downloads` tells how far
//! the downloads under way are, for a client showing progress; `CancelDownload` stops one.
//!
//! Adds from a descriptor or a path read on a blocking thread, at most [`MAX_LOCAL_ADDS`] at
//! once (one more is refused as Busy, "try again"), each within the `[images]` deadlines
//! (`read_timeout_seconds` between reads, `timeout_seconds` in total), and stopped when its
//! caller leaves the bus: a caller cannot hold the daemon's threads or descriptors with pipes
//! that never close (issue 24).

use super::auth::{Check, Detail, ACTION_PROGRAM};
use super::error::Error;
use super::variant as v;
use super::wire::{Dict, Query};
use super::Objects;
use crate::fpga::image::Format;
use crate::host::download::{check_url, Downloader};
use crate::host::image_source::{open_regular, Deadlines, Source};
use crate::store::{ImageRecord, ImageState, NewImage};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use zbus::message::Header;
use zbus::{interface, Connection};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Images";

/// How many adds from a descriptor or a path may read at once. Each holds a blocking thread and
/// a descriptor until its source ends or a deadline passes; a handful is far more than an
/// operator adds at once, and far below the blocking pool (512) and the descriptor limit.
pub const MAX_LOCAL_ADDS: usize = 4;

pub struct Images {
    pub objects: Objects,
    /// The downloads under way, by image name: a second add of that name waits for none of
    /// them, it is refused as Busy.
    pub downloads: Arc<Mutex<HashMap<String, Download>>>,
    /// One permit per add from a descriptor or a path under way ([`MAX_LOCAL_ADDS`]).
    pub local_adds: Arc<tokio::sync::Semaphore>,
}

impl Images {
    pub fn new(objects: Objects) -> Images {
        Images {
            objects,
            downloads: Arc::default(),
            local_adds: Arc::new(tokio::sync::Semaphore::new(MAX_LOCAL_ADDS)),
        }
    }
}

/// Sets the stop flag of a read however the call ends (an error, a dropped future): the
/// blocking thread gives up within 100 ms instead of reading for a caller nobody answers.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Returns when `sender` has left the bus (at once when it already has); never when it cannot
/// tell (no sender: a peer-to-peer connection; the bus refused the match).
async fn gone(conn: &Connection, sender: Option<zbus::names::UniqueName<'static>>) {
    use futures_util::StreamExt;
    let watch = async {
        let sender = sender?;
        let dbus = zbus::fdo::DBusProxy::new(conn).await.ok()?;
        let mut changes = dbus
            .receive_name_owner_changed_with_args(&[(0, sender.as_str())])
            .await
            .ok()?;
        // Subscribed first, then asked: a caller that left in between is not missed.
        if !dbus
            .name_has_owner(sender.clone().into())
            .await
            .unwrap_or(true)
        {
            return Some(());
        }
        while let Some(signal) = changes.next().await {
            if signal.args().ok()?.new_owner().is_none() {
                return Some(());
            }
        }
        None
    };
    if watch.await.is_none() {
        std::future::pending::<()>().await;
    }
}

/// One download under way, as `Downloads` shows it.
#[derive(Clone, Debug)]
pub struct Download {
    pub url: String,
    pub received: u64,
    /// The announced size (0: not announced).
    pub total: u64,
    /// Told by `CancelDownload` (a permit is kept when the download is not waiting yet).
    cancel: Arc<tokio::sync::Notify>,
}

/// Removes a download from the map however the call ends (an error, a dropped future).
struct Reservation {
    downloads: Arc<Mutex<HashMap<String, Download>>>,
    name: String,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.downloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.name);
    }
}

/// One catalog entry on the wire: `{id: x, name, format, sha256: s, size: t, path, interface_id,
/// afu_ids: as, metadata: s (JSON), state: s (active, inactive), added_by: s, added: x,
/// source_url: s ("" unless downloaded)}`.
pub fn image(r: &ImageRecord) -> Dict {
    Dict::from([
        ("id".into(), v(r.id)),
        ("name".into(), v(r.name.as_str())),
        ("format".into(), v(r.format.as_str())),
        ("sha256".into(), v(r.sha256.as_str())),
        ("size".into(), v(r.size)),
        ("path".into(), v(r.path.display().to_string())),
        (
            "interface_id".into(),
            v(r.interface_id.clone().unwrap_or_default()),
        ),
        ("afu_ids".into(), v(r.afu_ids.clone())),
        ("metadata".into(), v(r.metadata.as_str())),
        ("state".into(), v(r.state.as_str())),
        ("added_by".into(), v(r.added_by.as_str())),
        ("added".into(), v(r.added_ms)),
        (
            "source_url".into(),
            v(r.source_url.clone().unwrap_or_default()),
        ),
    ])
}

/// The request from `Add`'s or `AddFromPath`'s arguments. Options: `format` s (gbs, xclbin,
/// opaque; default: as the header says), `interface_id` s, `afu_id` s (declared ids, for an
/// opaque image; for a parsed one they must agree with its header).
fn request(name: String, sha256: String, options: Dict, who: String) -> Result<NewImage, Error> {
    let q = Query::new(options, &["format", "interface_id", "afu_id"])?;
    let format = match q.str("format")?.filter(|f| !f.is_empty()) {
        Some(f) => Some(f.parse::<Format>().map_err(Error::InvalidArgument)?),
        None => None,
    };
    Ok(NewImage {
        name,
        format,
        sha256,
        interface_id: q.str("interface_id")?,
        afu_ids: q.str("afu_id")?.into_iter().collect(),
        added_by: who,
        source_url: None,
    })
}

impl Images {
    /// A place among the [`MAX_LOCAL_ADDS`] adds that may read at once, or Busy. Taken before
    /// anything that waits (authorization asks the bus): a flood of adds is refused while each
    /// refused message still holds its descriptor for microseconds, not for a round trip.
    fn admit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        Arc::clone(&self.local_adds)
            .try_acquire_owned()
            .map_err(|_| {
                Error::Busy(format!(
                    "{MAX_LOCAL_ADDS} image adds from descriptors or paths are under way: busy, \
                     try again later"
                ))
            })
    }

    /// Reads the image from what `open` gives (on a blocking thread) while `permit` is held,
    /// keeps it when it is `new`, and stops reading when the caller leaves the bus.
    async fn add_from<F>(
        &self,
        permit: tokio::sync::OwnedSemaphorePermit,
        new: NewImage,
        open: F,
        header: &Header<'_>,
        conn: &Connection,
    ) -> Result<Dict, Error>
    where
        F: FnOnce() -> Result<std::fs::File, Error> + Send + 'static,
    {
        let settings = self.objects.engine.settings().images.clone();
        let deadlines = Deadlines {
            idle: settings.read_timeout,
            total: settings.timeout,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
        let flag = Arc::clone(&stop);
        let work = self.objects.engine.read(move |core| {
            // Held until the thread is done reading, even when the call's future is gone.
            let _permit = permit;
            let file = open()?;
            let mut source = Source::new(file, deadlines, flag)
                .map_err(|e| Error::Failed(format!("cannot read the image: {e}")))?;
            Ok::<_, Error>(core.store().add_image(&new, &mut source)?)
        });
        tokio::pin!(work);
        let sender = header.sender().map(|s| s.to_owned());
        let r = tokio::select! {
            r = &mut work => r,
            () = gone(conn, sender) => {
                tracing::info!("the caller of an image add left the bus: stopping its read");
                stop.store(true, Ordering::Release);
                work.await
            }
        };
        let r = r??;
        self.objects.engine.flush().await;
        Ok(image(&r))
    }

    async fn authorize(
        &self,
        verb: &str,
        name: &str,
        header: &Header<'_>,
        conn: &Connection,
    ) -> Result<String, Error> {
        let o = &self.objects;
        let check = Check::new(ACTION_PROGRAM, verb).with(Detail::Image, name);
        o.authorizer.check(conn, header, &check).await?;
        Ok(o.requesters.of(conn, header).await)
    }

    async fn set_state(
        &self,
        verb: &str,
        name: String,
        state: ImageState,
        header: &Header<'_>,
        conn: &Connection,
    ) -> Result<(), Error> {
        let who = self.authorize(verb, &name, header, conn).await?;
        self.objects
            .engine
            .read(move |core| core.store().set_image_state(&name, state, &who))
            .await??;
        Ok(())
    }
}

#[interface(name = "org.vfiod.Vfiod1.Images")]
impl Images {
    /// Adds an image read from `image`, a file descriptor the caller opened (a file or a pipe,
    /// read to its end), kept as `name` when its SHA-256 is `sha256` and its header parses.
    /// Returns the entry as `Get` gives it. Errors besides those of `AddFromUrl`: Busy (as many
    /// adds from descriptors or paths as vfiod reads at once are under way: try again),
    /// TimedOut (the descriptor sent nothing for `[images] read_timeout_seconds`, or not all
    /// of it within `timeout_seconds`), Cancelled (the caller left the bus).
    async fn add(
        &self,
        name: String,
        image: zbus::OwnedFd,
        sha256: String,
        options: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<Dict, Error> {
        let permit = self.admit()?;
        let who = self.authorize("AddImage", &name, &header, conn).await?;
        let new = request(name, sha256, options, who)?;
        let fd: std::os::fd::OwnedFd = image.into();
        let file = std::fs::File::from(fd);
        self.add_from(permit, new, move || Ok(file), &header, conn)
            .await
    }

    /// As `Add`, from a file on this host that the daemon opens: root only. Anything but a
    /// regular file (a FIFO, a device) is refused before a byte is read.
    async fn add_from_path(
        &self,
        name: String,
        path: String,
        sha256: String,
        options: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<Dict, Error> {
        let permit = self.admit()?;
        let o = &self.objects;
        o.authorizer
            .require_root(conn, &header, "Images.AddFromPath")
            .await?;
        let who = o.requesters.of(conn, &header).await;
        let new = request(name, sha256, options, who)?;
        if !path.starts_with('/') {
            return Err(Error::InvalidArgument(format!(
                "{} is not an absolute path",
                super::error::quote(&path)
            )));
        }
        // Opened on the blocking thread: even a stat can wait (a hung NFS mount), and a FIFO
        // is refused before it is read.
        let open = move || {
            open_regular(std::path::Path::new(&path), &super::error::quote(&path))
                .map_err(|e| Error::InvalidArgument(crate::error_chain(&e)))
        };
        self.add_from(permit, new, open, &header, conn).await
    }

    /// As `Add`, from `url`, which the daemon downloads into its state directory: https (plain
    /// http only to a loopback host unless `[images] allow_http`), within the `[images]`
    /// deadlines, at most 4 GiB. Replies when the image is kept (the SHA-256 matched, the header
    /// parsed), with the entry as `Get` gives it (its `source_url` is `url`); nothing is kept
    /// otherwise. Errors: InvalidArgument (a refused URL, a digest that does not match, too
    /// large, a malformed header), DownloadFailed (HTTP status, deadline, connection), Busy
    /// (an image of that name is being downloaded).
    async fn add_from_url(
        &self,
        name: String,
        url: String,
        sha256: String,
        options: Dict,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<Dict, Error> {
        let who = self
            .authorize("AddImageFromUrl", &name, &header, conn)
            .await?;
        let mut new = request(name, sha256, options, who)?;
        let settings = self.objects.engine.settings().images.clone();
        // Refused before any connection: a URL vfiod may not fetch, a request it could not keep.
        let url = check_url(&url, settings.allow_http)?;
        new.source_url = Some(url.to_string());
        let check = new.clone();
        self.objects
            .engine
            .read(move |core| core.store().check_new_image(&check))
            .await??;
        let (_reservation, cancel) = {
            let mut map = self
                .downloads
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if map.contains_key(&new.name) {
                return Err(Error::Busy(format!(
                    "image {} is being downloaded already",
                    new.name
                )));
            }
            let cancel = Arc::new(tokio::sync::Notify::new());
            map.insert(
                new.name.clone(),
                Download {
                    url: url.to_string(),
                    received: 0,
                    total: 0,
                    cancel: Arc::clone(&cancel),
                },
            );
            (
                Reservation {
                    downloads: Arc::clone(&self.downloads),
                    name: new.name.clone(),
                },
                cancel,
            )
        };
        let downloader = Downloader::new(&settings)?;
        let tmp = self
            .objects
            .engine
            .read(|core| core.store().image_temp_file(".downloading-"))
            .await??;
        let downloads = Arc::clone(&self.downloads);
        let key = new.name.clone();
        let mut progress = move |received: u64, total: Option<u64>| {
            let mut map = downloads.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(d) = map.get_mut(&key) {
                d.received = received;
                d.total = total.unwrap_or(0);
            }
        };
        tracing::info!(image = %new.name, %url, "downloading an image");
        // A cancel drops the download, and with it the temporary file.
        let fetched = tokio::select! {
            r = downloader.fetch(&url, tmp, &mut progress) => r.inspect_err(|e| {
                tracing::warn!(image = %new.name, "{}", crate::error_chain(e));
            })?,
            _ = cancel.notified() => {
                tracing::info!(image = %new.name, %url, "download cancelled");
                return Err(Error::Cancelled(format!(
                    "{url}: the download of image {} was cancelled",
                    new.name
                )));
            }
        };
        let r = self
            .objects
            .engine
            .read(move |core| {
                core.store()
                    .keep_image(&new, fetched.file, &fetched.sha256, fetched.size)
            })
            .await?
            .map_err(|e| {
                // The URL in the message: the digest refused is that of what it served.
                let mut err = Error::from(e);
                if let Error::InvalidArgument(m) = &mut err {
                    *m = format!("{url}: {m}");
                }
                err
            })?;
        self.objects.engine.flush().await;
        Ok(image(&r))
    }

    /// Stops the download of image `name` under way: its `AddFromUrl` fails with `Cancelled`,
    /// keeping nothing.
    async fn cancel_download(
        &self,
        name: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        self.authorize("CancelDownload", &name, &header, conn)
            .await?;
        let map = self
            .downloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match map.get(&name) {
            Some(d) => {
                d.cancel.notify_one();
                Ok(())
            }
            None => Err(Error::NoSuchImage(format!(
                "no download of image {} is under way",
                super::error::quote(&name)
            ))),
        }
    }

    /// The downloads under way (`AddFromUrl`), each `{name: s, url: s, received: t, total: t
    /// (0: the server did not say)}`.
    async fn downloads(&self) -> Vec<Dict> {
        let map = self
            .downloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<&String> = map.keys().collect();
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let d = &map[name];
                Dict::from([
                    ("name".into(), v(name.as_str())),
                    ("url".into(), v(d.url.as_str())),
                    ("received".into(), v(d.received)),
                    ("total".into(), v(d.total)),
                ])
            })
            .collect()
    }

    /// Every image, oldest first, each as `Get` gives it.
    async fn list(&self) -> Result<Vec<Dict>, Error> {
        let all = self
            .objects
            .engine
            .read(|core| core.store().images())
            .await??;
        Ok(all.iter().map(image).collect())
    }

    /// One image by name (or id).
    async fn get(&self, name: String) -> Result<Dict, Error> {
        let r = self
            .objects
            .engine
            .read(move |core| core.store().image(&name))
            .await??;
        Ok(image(&r))
    }

    /// Keeps the image but refuses it for program and verify.
    async fn deactivate(
        &self,
        name: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        self.set_state("DeactivateImage", name, ImageState::Inactive, &header, conn)
            .await
    }

    /// Undoes `Deactivate`.
    async fn activate(
        &self,
        name: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        self.set_state("ActivateImage", name, ImageState::Active, &header, conn)
            .await
    }

    /// Removes the image and its file.
    async fn remove(
        &self,
        name: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Error> {
        let who = self.authorize("RemoveImage", &name, &header, conn).await?;
        self.objects
            .engine
            .read(move |core| core.store().remove_image(&name, &who))
            .await??;
        Ok(())
    }
}
