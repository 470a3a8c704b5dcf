//! The man pages of vfiod's tools from their clap definitions (clap_mangen): vfioctl(1),
//! vfiod(8) and vfiod-pool(1) are printed by hidden options of the binaries and installed by
//! `make install`. A crate of its own so that vfiod and the reference pool service (which does
//! not depend on vfiod) render their pages alike; vfiod.toml(5), rendered from markdown, is
//! vfiod's own (`vfiod::client::man`).

/// The manual every page belongs to (the centre of its header line).
pub const MANUAL: &str = "vfiod";

/// Every page of the manual, for each page's SEE ALSO.
pub const PAGES: &[&str] = &["vfioctl(1)", "vfiod-pool(1)", "vfiod.toml(5)", "vfiod(8)"];

/// A tool's page from its clap definition: clap_mangen's NAME, SYNOPSIS, DESCRIPTION and
/// OPTIONS, then a COMMANDS section with each subcommand's synopsis, description and options
/// (clap_mangen's own SUBCOMMANDS section only names a page per subcommand, `vfioctl-list(1)`,
/// that nothing installs), then `extra` (roff: further sections such as EXIT STATUS), VERSION,
/// and a SEE ALSO naming the other pages.
pub fn command_page(cmd: clap::Command, section: &str, extra: &str) -> std::io::Result<Vec<u8>> {
    let own = format!("{}({section})", cmd.get_name());
    let man = clap_mangen::Man::new(cmd.clone())
        .section(section)
        .manual(MANUAL);
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut page)?;
    }
    let mut page = without_repeated_preamble(&page);
    let mut built = cmd;
    built.build();
    let mut commands = String::new();
    subcommands(&built, &mut commands)?;
    if !commands.is_empty() {
        page.push_str(".SH COMMANDS\n");
        page.push_str(&commands);
    }
    page.push_str(extra);
    let mut version = Vec::new();
    man.render_version_section(&mut version)?;
    page.push_str(&body(&version));
    page.push_str(&see_also(&own));
    Ok(page.into_bytes())
}

/// Each visible subcommand of `cmd` (the hidden ones and `help` left out), depth first: a
/// subsection named by its full command line, its synopsis, description and options.
fn subcommands(cmd: &clap::Command, out: &mut String) -> std::io::Result<()> {
    for sub in visible(cmd) {
        // The global options (--bus) and --help are the top command's, listed once there.
        let own = sub.clone().mut_args(|a| {
            if a.is_global_set() || a.get_id() == "help" {
                a.hide(true)
            } else {
                a
            }
        });
        let man = clap_mangen::Man::new(own.clone());
        let name = sub.get_bin_name().unwrap_or(sub.get_name()).to_string();
        out.push_str(&format!(".SS \"{}\"\n", name.replace('-', "\\-")));
        let mut text = Vec::new();
        man.render_synopsis_section(&mut text)?;
        text.extend_from_slice(b".PP\n");
        man.render_description_section(&mut text)?;
        out.push_str(&body(&text));
        if own.get_arguments().any(|a| !a.is_hide_set()) {
            let mut options = Vec::new();
            man.render_options_section(&mut options)?;
            out.push_str(&body(&options));
        }
        subcommands(sub, out)?;
    }
    Ok(())
}

fn visible(cmd: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    cmd.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

/// The roff of clap_mangen's section renderers without their preamble and `.SH` lines, to be
/// placed under a heading of ours (an options list under a subcommand's `.SS`).
fn body(roff: &[u8]) -> String {
    String::from_utf8_lossy(roff)
        .lines()
        .filter(|l| !is_preamble(l) && !l.starts_with(".SH "))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The page with the roff crate's two-line preamble once, at its start (each of clap_mangen's
/// section renderers writes it).
fn without_repeated_preamble(roff: &[u8]) -> String {
    let text = String::from_utf8_lossy(roff);
    let mut out = String::new();
    let mut seen = 0;
    for l in text.lines() {
        if is_preamble(l) {
            seen += 1;
            if seen > 2 {
                continue;
            }
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

fn is_preamble(line: &str) -> bool {
    line.starts_with(".ie \\n(.g .ds Aq") || line.starts_with(".el .ds Aq")
}

/// The SEE ALSO section of page `own` (`vfiod(8)`): every other page of the manual.
pub fn see_also(own: &str) -> String {
    let others: Vec<String> = PAGES
        .iter()
        .filter(|p| **p != own)
        .map(|p| {
            let (name, section) = p.trim_end_matches(')').split_once('(').unwrap_or((p, ""));
            format!("\\fB{}\\fR({section})", name.replace('-', "\\-"))
        })
        .collect();
    format!(".SH \"SEE ALSO\"\n{}\n", others.join(", "))
}
