//! The FPGA jobs: `program` writes a catalog image into a card, `verify` checks what the card
//! reports against an image's metadata. Both are refused in prepare, before any change, when
//! the image is not legal for the device (`fpga::program::legality`: format known or declared,
//! active, checksum still matching the stored file, interface id the device's).
//!
//! Backends, per device from the `[[fpga]]` configuration:
//! - `dfl`: partial reconfiguration through the FME (`Backend::fpga_port_pr`), then the port's
//!   `afu_id` read back. A card in VF mode has given its port to a VF: the job refuses when a
//!   VF (or the PF) is claimed, else restores the card to PF mode, programs it and splits it
//!   again into as many VFs on the same driver.
//! - `exec`: the operator's command with `{address}` and `{image}` replaced, bounded by its
//!   timeout; its exit status is the verdict and its output goes into the task's result.

use super::guard;
use super::kill_point;
use crate::config::FpgaBackend;
use crate::engine::context::JobContext;
use crate::engine::job::{Admission, Job, JobError, JobFailure, Phase, Progress};
use crate::fpga::image::Format;
use crate::fpga::program::{self, ImageFacts};
use crate::host::download::{self, Downloader};
use crate::host::exec;
use crate::host::sysfs::dfl;
use crate::mode::convert;
use crate::mode::plan::{Plan, Snapshot};
use crate::mode::planner;
use crate::mode::policy::Target;
use crate::model::device::Device;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::image::sha256_of;
use crate::store::{ImageRecord, ImageState};
use std::io::Read;
use std::time::{Duration, Instant};

/// Program or verify `image` on `address`.
pub struct FpgaJob {
    address: PciAddress,
    kind: TaskKind,
    image: String,
    backend: Option<FpgaBackend>,
    prepared: Option<Prepared>,
    /// Set once a card in VF mode was restored: a failure after it splits the card again.
    restored: Option<Resplit>,
}

struct Prepared {
    image: ImageRecord,
    /// The stored file, opened in prepare: a removal of the image meanwhile does not matter.
    file: Option<std::fs::File>,
    /// The local copy is gone: the URL to download it from again, in the download phase.
    fetch: Option<String>,
    /// A card in VF mode: the restore before and the split after programming.
    resplit: Option<Resplit>,
}

#[derive(Clone)]
struct Resplit {
    restore: Plan,
    before: Snapshot,
    num_vfs: u32,
    vf_driver: String,
}

impl FpgaJob {
    pub fn program(address: PciAddress, image: &str) -> FpgaJob {
        FpgaJob::new(address, TaskKind::Program, image)
    }

    pub fn verify(address: PciAddress, image: &str) -> FpgaJob {
        FpgaJob::new(address, TaskKind::Verify, image)
    }

    fn new(address: PciAddress, kind: TaskKind, image: &str) -> FpgaJob {
        FpgaJob {
            address,
            kind,
            image: image.to_string(),
            backend: None,
            prepared: None,
            restored: None,
        }
    }

    fn invalid(&self, reason: impl Into<String>) -> JobError {
        JobError::Invalid {
            address: self.address,
            reason: reason.into(),
        }
    }

    fn image_record(&self, cx: &JobContext) -> Result<ImageRecord, JobError> {
        use crate::store::ImageError;
        cx.store.image(&self.image).map_err(|e| match e {
            ImageError::Store(s) => JobError::Store(s),
            other => self.invalid(crate::error_chain(&other)),
        })
    }

    fn device(&self, cx: &JobContext) -> Result<Device, JobError> {
        cx.store
            .device(self.address)?
            .ok_or(JobError::NoSuchDevice(self.address))
    }
}

fn hardware(address: PciAddress, e: impl std::fmt::Display) -> JobError {
    JobError::Unavailable {
        address,
        reason: format!("cannot read the FPGA's state: {e}"),
    }
}

impl Job for FpgaJob {
    fn device(&self) -> PciAddress {
        self.address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        let address = self.address;
        let device = self.device(cx)?;
        JobError::unless_usable(cx, &device)?;
        if device.parent_pf.is_some() {
            return Err(self.invalid("a VF is programmed through its PF"));
        }
        if !device.managed {
            return Err(JobError::NotManaged(address));
        }
        // Known before the task exists: a request for an image the catalog lacks is refused
        // without a task.
        self.image_record(cx)?;
        let backend =
            cx.settings
                .fpga_backend(address, device.vendor_id, device.device_id, device.class);
        let scope = match device.iommu_group {
            Some(g) => cx
                .store
                .devices()?
                .into_iter()
                .filter(|d| d.iommu_group == Some(g) && !d.class.is_bridge())
                .map(|d| d.address)
                .collect(),
            None => Vec::new(),
        };
        let params = serde_json::json!({"image": self.image, "backend": backend.name()});
        self.backend = Some(backend);
        Ok(Admission {
            kind: self.kind,
            scope,
            params,
        })
    }

    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError> {
        let address = self.address;
        let image = self.image_record(cx)?;
        let backend = self
            .backend
            .clone()
            .ok_or_else(|| JobError::Internal("FPGA job prepared before it was admitted".into()))?;
        // The checksum of what is stored now, not of what was added.
        let (file, fetch, checksum_ok) = match std::fs::File::open(&image.path) {
            Ok(mut file) => {
                let (digest, _) = sha256_of(&mut file, u64::MAX, &mut |_| Ok(()))
                    .map_err(|e| self.invalid(crate::error_chain(&e)))?;
                use std::io::Seek;
                file.rewind()
                    .map_err(|e| self.invalid(format!("image {}: {e}", image.name)))?;
                (Some(file), None, digest == image.sha256)
            }
            // Downloaded again in the run; the recorded SHA-256 decides there.
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && self.kind == TaskKind::Program
                    && image.source_url.is_some() =>
            {
                (None, image.source_url.clone(), true)
            }
            Err(e) => {
                return Err(self.invalid(format!(
                    "image {}: cannot open {}: {e}",
                    image.name,
                    image.path.display()
                )))
            }
        };
        let card = dfl::read_card(&cx.sysfs, address).map_err(|e| hardware(address, e))?;
        let num_vfs: u32 = match cx
            .sysfs
            .read_text(&cx.sysfs.device_attr(address, "sriov_numvfs"))
        {
            Ok(t) => t.trim().parse().unwrap_or(0),
            Err(_) => 0,
        };
        // In VF mode the FME is still there, and it tells the static region's interface.
        program::legality(
            &ImageFacts {
                name: &image.name,
                format: image.format,
                active: image.state == ImageState::Active,
                checksum_ok,
                interface_id: image.interface_id.as_deref(),
            },
            card.as_ref().and_then(|c| c.interface_id.as_deref()),
        )
        .map_err(|reason| self.invalid(reason))?;
        let mut resplit = None;
        if backend == FpgaBackend::Dfl {
            if card.is_none() {
                return Err(self.invalid(
                    "no DFL FME: not a DFL FPGA, or not on dfl-pci (configure an exec backend \
                     for it in [[fpga]])",
                ));
            }
            if self.kind == TaskKind::Program {
                if image.format == Format::Xclbin {
                    return Err(
                        self.invalid(program::dfl_bitstream(Format::Xclbin, &[]).unwrap_err())
                    );
                }
                if num_vfs > 0 {
                    resplit = Some(self.plan_resplit(cx, num_vfs)?);
                }
            }
        }
        self.prepared = Some(Prepared {
            image,
            file,
            fetch,
            resplit,
        });
        Ok(self.kind)
    }

    fn guard(&self, cx: &JobContext) -> Result<(), JobError> {
        let Some(Prepared {
            resplit: Some(r), ..
        }) = &self.prepared
        else {
            return Ok(());
        };
        // The restore takes the VFs away: nobody may hold one, nor the PF.
        let mut touched = vec![self.address];
        touched.extend(r.before.vfs.iter().map(|v| v.address));
        guard::refuse_if_used(cx, self.address, &touched, guard::Allowed::default())
    }

    fn phases(&self) -> Vec<Phase> {
        match self.kind {
            TaskKind::Verify => vec![Phase::new("verify", 100)],
            _ => vec![
                Phase::new("download", 10),
                Phase::new("write", 80),
                Phase::new("verify", 10),
            ],
        }
    }

    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        let address = self.address;
        let backend = self.backend.clone().unwrap_or(FpgaBackend::Dfl);
        let Some(mut prepared) = self.prepared.take() else {
            return Err(JobFailure::new("FPGA job run before it was prepared"));
        };
        let prepared = &mut prepared;
        let image = prepared.image.clone();
        if self.kind == TaskKind::Verify {
            progress.phase("verify");
            return verify_now(cx, address, &image, &backend);
        }
        progress.phase("download");
        if let Some(url) = prepared.fetch.take() {
            prepared.file = Some(download_again(cx, &image, &url, progress)?);
        } else {
            progress.step(0, 1, &format!("reading image {}", image.name));
        }
        let mut bytes = Vec::new();
        if let Some(mut f) = prepared.file.take() {
            f.read_to_end(&mut bytes)
                .map_err(|e| JobFailure::new(format!("cannot read image {}: {e}", image.name)))?;
        }
        progress.phase("write");
        let mut notes = Vec::new();
        if let Some(r) = &prepared.resplit {
            progress.step(0, 3, "restore to PF mode");
            convert::run(&cx.sysfs, &r.restore, &mut |_, _, _| {}).map_err(|e| {
                JobFailure::new(format!(
                    "restore to PF mode before programming: {}",
                    crate::error_chain(&e)
                ))
            })?;
            let _ = cx.store.forget_original_driver(address);
            self.restored = Some(r.clone());
            notes.push(format!("restored to PF mode (from {} VFs)", r.num_vfs));
        }
        progress.step(1, 3, &format!("programming {}", image.name));
        kill_point("program:writing");
        let output = match &backend {
            FpgaBackend::Dfl => {
                let card = dfl::read_card(&cx.sysfs, address)
                    .map_err(|e| JobFailure::from_error(&e))?
                    .ok_or_else(|| JobFailure::new("the DFL FME is gone"))?;
                let bitstream =
                    program::dfl_bitstream(image.format, &bytes).map_err(JobFailure::new)?;
                cx.sysfs
                    .backend()
                    .fpga_port_pr(
                        &card.fme_node,
                        0,
                        bitstream,
                        image.afu_ids.first().map(String::as_str),
                    )
                    .map_err(|e| {
                        JobFailure::new(format!(
                            "partial reconfiguration through {} failed: {e}",
                            card.fme_node.display()
                        ))
                    })?;
                format!(
                    "{} bytes written through {}",
                    bitstream.len(),
                    card.fme_node.display()
                )
            }
            FpgaBackend::Exec {
                argv,
                timeout_seconds,
            } => exec::run_command(
                &program::command(argv, &address.to_string(), &image.path.to_string_lossy()),
                Duration::from_secs(u64::from(*timeout_seconds)),
            )
            .map_err(JobFailure::new)?,
        };
        notes.push(output);
        if let Some(r) = &prepared.resplit {
            progress.step(2, 3, "split into VFs again");
            self.split_again(cx, r)?;
            self.restored = None;
            notes.push(format!(
                "split again into {} VFs on {}",
                r.num_vfs, r.vf_driver
            ));
        }
        progress.phase("verify");
        let verdict = verify_now(cx, address, &image, &backend)?;
        Ok(format!(
            "programmed image {} into {address}: {}; {verdict}",
            image.name,
            notes.join("; ")
        ))
    }

    fn rollback(&mut self, cx: &JobContext) -> Result<String, JobFailure> {
        // A partial reconfiguration cannot be undone: what the port holds after a failed write
        // is for an operator to look at (the task stays in error until reset). A card this job
        // restored from VF mode is split again, as a failed mode change is put back.
        match self.restored.take() {
            Some(r) => {
                self.split_again(cx, &r)?;
                Ok(format!(
                    "split again into {} VFs on {}; the port is as the failed step left it",
                    r.num_vfs, r.vf_driver
                ))
            }
            None => Ok("nothing to roll back: the card is as the failed step left it".into()),
        }
    }
}

impl FpgaJob {
    fn plan_resplit(&self, cx: &JobContext, num_vfs: u32) -> Result<Resplit, JobError> {
        let address = self.address;
        let device = self.device(cx)?;
        let (_, plan, before) =
            planner::plan_to(&cx.sysfs, &cx.store, &device, &Target::Pf { driver: None })
                .map_err(|e| hardware(address, e))?;
        let restore =
            plan.ok_or_else(|| JobError::Internal("a card with VFs needs no restore".into()))?;
        let vf_driver = before
            .vfs
            .iter()
            .find_map(|v| v.driver_override.clone().or_else(|| v.driver.clone()))
            .unwrap_or_else(|| crate::mode::policy::VFIO_PCI.to_string());
        Ok(Resplit {
            restore,
            before,
            num_vfs,
            vf_driver,
        })
    }

    fn split_again(&self, cx: &JobContext, r: &Resplit) -> Result<(), JobFailure> {
        let device = self.device(cx).map_err(|e| JobFailure::from_error(&e))?;
        let target = Target::Vf {
            num_vfs: r.num_vfs,
            vf_driver: r.vf_driver.clone(),
        };
        let (_, plan, now) = planner::plan_to(&cx.sysfs, &cx.store, &device, &target)
            .map_err(|e| JobFailure::from_error(&e))?;
        let _ = cx
            .store
            .remember_original_driver(self.address, now.pf.driver.as_deref());
        if let Some(plan) = plan {
            convert::run(&cx.sysfs, &plan, &mut |_, _, _| {}).map_err(|e| {
                JobFailure::new(format!(
                    "split again after programming: {}",
                    crate::error_chain(&e)
                ))
            })?;
        }
        Ok(())
    }
}

/// Downloads `image` again from `url` (its recorded source) as step `downloading`, keeps it
/// as its local copy when its SHA-256 is the recorded one, and opens it.
fn download_again(
    cx: &JobContext,
    image: &ImageRecord,
    url: &str,
    progress: &mut Progress<'_>,
) -> Result<std::fs::File, JobFailure> {
    let fail = |e: &dyn std::error::Error| {
        JobFailure::new(format!(
            "cannot download image {} again: {}",
            image.name,
            crate::error_chain(e)
        ))
    };
    progress.step(0, 1, DOWNLOADING);
    let settings = &cx.settings.images;
    let url = download::check_url(url, settings.allow_http).map_err(|e| fail(&e))?;
    let tmp = cx
        .store
        .image_temp_file(".downloading-")
        .map_err(|e| fail(&e))?;
    // The runner records every report: at most a few a second.
    let mut last: Option<Instant> = None;
    let mut report = |received: u64, total: Option<u64>| {
        if last.is_some_and(|t| t.elapsed() < Duration::from_millis(250)) {
            return;
        }
        last = Some(Instant::now());
        match total {
            Some(t) if t > 0 => progress.step(received as usize, t as usize, DOWNLOADING),
            _ => progress.step(0, 1, DOWNLOADING),
        }
    };
    kill_point("program:downloading");
    let fetched =
        Downloader::fetch_blocking(settings, &url, tmp, &mut report).map_err(|e| fail(&e))?;
    cx.store
        .restore_image_file(image, fetched.file, &fetched.sha256)
        .map_err(|e| fail(&e))?;
    std::fs::File::open(&image.path).map_err(|e| fail(&e))
}

/// The task's step while an image is downloaded.
pub const DOWNLOADING: &str = "downloading";

/// Reads what the device reports now and compares it with the image. A device with no DFL
/// port (an exec backend's card) has nothing vfiod can read: the backend's verdict stands.
fn verify_now(
    cx: &JobContext,
    address: PciAddress,
    image: &ImageRecord,
    backend: &FpgaBackend,
) -> Result<String, JobFailure> {
    let card = dfl::read_card(&cx.sysfs, address).map_err(|e| JobFailure::from_error(&e))?;
    match card.and_then(|c| c.afu_id) {
        Some(afu) => {
            program::verify(&image.name, &image.afu_ids, Some(&afu)).map_err(JobFailure::new)
        }
        None if matches!(backend, FpgaBackend::Exec { .. }) => Ok(
            "not verified: the device reports no AFU id (the command's exit status is the verdict)"
                .into(),
        ),
        None => program::verify(&image.name, &image.afu_ids, None).map_err(JobFailure::new),
    }
}
