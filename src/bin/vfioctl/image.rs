//! FPGA images: `image add|list|show|activate|deactivate|remove|cancel`, and `fpga program|verify`.

use super::*;

/// The images commands (`main` dispatches only those here).
pub(crate) async fn run(conn: &zbus::Connection, command: Command) -> Result<(), Failure> {
    match command {
        Command::Image(command) => image(conn, command).await?,
        Command::Fpga(FpgaCommand::Program {
            device,
            image,
            wait,
            json,
        }) => {
            let d = client::device(conn, &device).await.map_err(describe)?;
            let path = d
                .program(&image, Default::default())
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(conn, path, wait, json).await?;
        }
        Command::Fpga(FpgaCommand::Verify {
            device,
            image,
            wait,
            json,
        }) => {
            let d = client::device(conn, &device).await.map_err(describe)?;
            let path = d
                .verify(&image, Default::default())
                .await
                .map_err(|e| describe(e.into()))?;
            start_and_follow(conn, path, wait, json).await?;
        }
        _ => unreachable!("main dispatches only the images commands here"),
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
pub(crate) enum FpgaCommand {
    /// Write catalog image IMAGE into the FPGA at DEVICE, as a task (needs authorization).
    Program {
        #[arg(value_parser = spelling)]
        device: String,
        image: String,
        /// Show progress until the task ends; exit non-zero if it fails.
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check what the FPGA at DEVICE runs against IMAGE, as a task (needs authorization).
    Verify {
        #[arg(value_parser = spelling)]
        device: String,
        image: String,
        #[arg(long)]
        wait: bool,
        /// Print the task (at its end with --wait) as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub(crate) enum ImageCommand {
    /// Add an image (needs authorization). vfioctl opens FILE as you and passes the open file
    /// to vfiod; with --from-path (root only) vfiod opens FILE itself; with --url vfiod
    /// downloads it (progress on a terminal) and the command returns once it is kept.
    Add {
        /// The image's name in the catalog (1-64 of A-Z a-z 0-9 . _ -).
        name: String,
        /// The image file ("-": standard input).
        #[arg(required_unless_present = "url", conflicts_with = "url")]
        file: Option<String>,
        /// Have vfiod download the image from this https URL (plain http only to a loopback
        /// host unless its [images] allow_http).
        #[arg(long, conflicts_with = "from_path")]
        url: Option<String>,
        /// The SHA-256 the content must have (64 hex digits).
        #[arg(long)]
        sha256: String,
        /// gbs, xclbin or opaque (default: as its header says).
        #[arg(long)]
        format: Option<String>,
        /// The interface id of the static region it fits (for an opaque image).
        #[arg(long)]
        interface_id: Option<String>,
        /// The AFU id it provides (for an opaque image).
        #[arg(long)]
        afu_id: Option<String>,
        /// vfiod opens FILE (an absolute path on this host) instead: root only.
        #[arg(long)]
        from_path: bool,
        #[arg(long)]
        json: bool,
    },
    /// Every image.
    List {
        #[arg(long)]
        json: bool,
    },
    /// One image by name (or id).
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Keep an image but refuse it for program and verify (needs authorization).
    Deactivate {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Undo deactivate (needs authorization).
    Activate {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove an image and its file (needs authorization).
    Remove {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop the download of image NAME under way (`image add --url` in another terminal; needs
    /// authorization): nothing is kept.
    Cancel {
        name: String,
        #[arg(long)]
        json: bool,
    },
}

/// `Images.AddFromUrl`, showing the download's progress on a terminal while the call runs;
/// Ctrl-C cancels the download.
pub(crate) async fn add_from_url(
    proxy: &vfiod::client::image::ImagesProxy<'static>,
    name: &str,
    url: &str,
    sha256: &str,
    options: vfiod::dbus::wire::Dict,
) -> zbus::Result<vfiod::dbus::wire::Dict> {
    use std::io::IsTerminal;
    use vfiod::dbus::wire::Entry;
    let call = proxy.add_from_url(name, url, sha256, options);
    tokio::pin!(call);
    let terminal = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
    let bar = vfiod::client::progress::DownloadProgress::new(name);
    let mut interrupted = false;
    // One registration for the whole call: a Ctrl-C between two turns of the loop is kept.
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| zbus::Error::Failure(format!("cannot catch Ctrl-C: {e}")))?;
    let result = loop {
        tokio::select! {
            r = &mut call => break r,
            // Ctrl-C stops the download in vfiod too (nothing is kept), then the call's
            // Cancelled error ends the command.
            _ = sigint.recv(), if !interrupted => {
                interrupted = true;
                if let Err(e) = proxy.cancel_download(name).await {
                    bar.finish();
                    eprintln!("cannot cancel the download: {e}");
                }
            }
            _ = tick.tick(), if terminal => {
                let Ok(all) = proxy.downloads().await else { continue };
                let Some(d) = all.iter().find(|d| Entry(d).str("name") == name) else {
                    continue;
                };
                let get = |k: &str| d.get(k).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                bar.update(get("received"), get("total"));
            }
        }
    };
    bar.finish();
    result
}

pub(crate) async fn image(conn: &zbus::Connection, command: ImageCommand) -> Result<(), Failure> {
    use vfiod::client::image::{self, ImageEntry};
    let proxy = image::images(conn).await.map_err(describe)?;
    let call = |e: zbus::Error| describe(e.into());
    match command {
        ImageCommand::Add {
            name,
            file,
            sha256,
            format,
            interface_id,
            afu_id,
            from_path,
            url,
            json,
        } => {
            let options = client::query(vec![
                ("format", format.map(zbus::Variant::from)),
                ("interface_id", interface_id.map(zbus::Variant::from)),
                ("afu_id", afu_id.map(zbus::Variant::from)),
            ]);
            let file = file.unwrap_or_default();
            let added = if let Some(url) = url {
                add_from_url(&proxy, &name, &url, &sha256, options)
                    .await
                    .map_err(call)?
            } else if from_path {
                let path = std::path::absolute(&file).map_err(|e| format!("{file}: {e}"))?;
                proxy
                    .add_from_path(&name, &path.to_string_lossy(), &sha256, options)
                    .await
                    .map_err(call)?
            } else {
                use std::os::fd::AsFd;
                let opened;
                let fd = if file == "-" {
                    std::io::stdin().as_fd().try_clone_to_owned()
                } else {
                    opened = std::fs::File::open(&file).map_err(|e| format!("{file}: {e}"))?;
                    opened.as_fd().try_clone_to_owned()
                }
                .map_err(|e| format!("{file}: {e}"))?;
                proxy
                    .add(&name, zbus::Fd::from(&fd), &sha256, options)
                    .await
                    .map_err(call)?
            };
            let entry = ImageEntry::from_dict(&added);
            if json {
                print_json(&entry)?;
            } else {
                println!(
                    "image {} {}: {}, {} bytes, interface {}",
                    entry.name,
                    if entry.source_url.is_empty() {
                        "added".to_string()
                    } else {
                        format!("downloaded from {}", entry.source_url)
                    },
                    entry.format,
                    entry.size,
                    if entry.interface_id.is_empty() {
                        "-"
                    } else {
                        &entry.interface_id
                    }
                );
            }
        }
        ImageCommand::List { json } => {
            let all: Vec<ImageEntry> = proxy
                .list()
                .await
                .map_err(call)?
                .iter()
                .map(ImageEntry::from_dict)
                .collect();
            if json {
                print_json(&all)?;
            } else {
                print!("{}", image::render_table(&all));
            }
        }
        ImageCommand::Show { name, json } => {
            let entry = ImageEntry::from_dict(&proxy.get(&name).await.map_err(call)?);
            if json {
                print_json(&entry)?;
            } else {
                print!("{}", image::render_details(&entry));
            }
        }
        ImageCommand::Deactivate { name, json } => {
            proxy.deactivate(&name).await.map_err(call)?;
            if json {
                print_json(&ImageEntry::from_dict(
                    &proxy.get(&name).await.map_err(call)?,
                ))?;
            } else {
                println!("image {name} deactivated");
            }
        }
        ImageCommand::Activate { name, json } => {
            proxy.activate(&name).await.map_err(call)?;
            if json {
                print_json(&ImageEntry::from_dict(
                    &proxy.get(&name).await.map_err(call)?,
                ))?;
            } else {
                println!("image {name} activated");
            }
        }
        ImageCommand::Remove { name, json } => {
            proxy.remove(&name).await.map_err(call)?;
            if json {
                print_json(&serde_json::json!({ "name": name, "state": "removed" }))?;
            } else {
                println!("image {name} removed");
            }
        }
        ImageCommand::Cancel { name, json } => {
            proxy.cancel_download(&name).await.map_err(call)?;
            if json {
                print_json(&serde_json::json!({ "name": name, "state": "cancelled" }))?;
            } else {
                println!("download of image {name} cancelled");
            }
        }
    }
    Ok(())
}
