//! The man pages of vfiod's tools, printed by hidden options of the binaries and installed by
//! `make install`: vfioctl(1) and vfiod(8) from each tool's clap definition ([`command_page`],
//! from the `vfiod-man` crate, which vfiod-pool(1) uses too), and vfiod.toml(5) rendered here
//! from `docs/config.md`, which is compiled in, so the page and the document cannot say
//! different things.

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};
use roff::{bold, italic, roman, Inline, Roff};

/// `docs/config.md`, the one source of vfiod.toml(5).
pub const CONFIG_MD: &str = include_str!("../../docs/config.md");

pub use vfiod_man::command_page;
use vfiod_man::{see_also, MANUAL};

/// vfioctl(1)'s EXIT STATUS section, from the table vfioctl exits by.
pub fn exit_status_section() -> String {
    let mut s = String::from(".SH \"EXIT STATUS\"\n");
    for (code, meaning) in super::exit::TABLE {
        s.push_str(&format!(".TP\n\\fB{code}\\fR\n{meaning}\n"));
    }
    s.push_str(
        ".PP\nWith \\fB\\-\\-json\\fR, a failure is one JSON object on stderr: \
         {\"error\": \"org.vfiod.Vfiod1.Error.Busy\", \"message\": \"...\"}.\n",
    );
    s
}

/// vfiod.toml(5): [`CONFIG_MD`] as a man page, with `version` in its header.
pub fn config_page(version: &str) -> String {
    markdown_page("vfiod.toml", "5", version, CONFIG_MD)
}

/// A man page from a markdown document: its `#` title is the NAME line, what precedes the
/// first `##` the DESCRIPTION, each `##` a section (`###` a subsection).
///
/// The subset docs/*.md use: headings, paragraphs, lists, code blocks (shown unfilled,
/// indented), tables (a tagged paragraph per row: the first cell as the tag, each other cell
/// under its column's name, which reads better on an 80-column terminal than a tbl table whose
/// last column is a paragraph), inline code and strong (bold), emphasis (italic), links (their
/// text; an absolute URL follows it in angle brackets, a relative one means nothing outside
/// the source tree).
pub fn markdown_page(name: &str, section: &str, version: &str, markdown: &str) -> String {
    let mut r = Renderer::default();
    for event in Parser::new_ext(markdown, Options::ENABLE_TABLES) {
        r.event(event);
    }
    r.flush();
    let mut page = control_with(
        "TH",
        &[name, section, "", &format!("{MANUAL} {version}"), MANUAL],
    );
    page.control("SH", ["NAME"]);
    page.text([roman(format!("{name} - {}", r.title))]);
    page.extend([r.out]);
    let mut text = page.render();
    text.push_str(&see_also(&format!("{name}({section})")));
    text
}

/// Markdown events to roff lines.
#[derive(Default)]
struct Renderer {
    out: Roff,
    /// The `#` heading's text.
    title: String,
    /// The inline content of the block being read.
    inlines: Vec<Inline>,
    /// Open strong/code (bold) and emphasis (italic) spans.
    bold: usize,
    italic: usize,
    /// The destination of the link being read.
    link: Option<String>,
    heading: Option<HeadingLevel>,
    /// The `1.` of each open ordered list (None: bulleted), and its next number.
    lists: Vec<Option<u64>>,
    /// Paragraphs of the current list item so far (the first one shares the bullet's line).
    item_paragraphs: usize,
    code: Option<Vec<String>>,
    table: Option<Table>,
    /// Whether the DESCRIPTION heading has been written (before the first `##`).
    described: bool,
}

#[derive(Default)]
struct Table {
    header: Vec<String>,
    in_header: bool,
    row: Vec<Vec<Inline>>,
}

impl Renderer {
    fn event(&mut self, event: Event) {
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Text(t) => {
                if let Some(lines) = &mut self.code {
                    lines.extend(t.lines().map(str::to_string));
                } else {
                    self.push(&t);
                }
            }
            Event::Code(t) => self.inlines.push(bold(t.to_string())),
            Event::SoftBreak => self.push(" "),
            Event::HardBreak => self.inlines.push(Inline::LineBreak),
            Event::Html(t) | Event::InlineHtml(t) => self.push(&t),
            Event::Rule => self.out.extend([control("PP")]),
            _ => {}
        }
    }

    fn push(&mut self, text: &str) {
        let text = text.to_string();
        self.inlines.push(if self.bold > 0 {
            bold(text)
        } else if self.italic > 0 {
            italic(text)
        } else {
            roman(text)
        });
    }

    fn start(&mut self, tag: Tag) {
        match tag {
            Tag::Heading { level, .. } => {
                self.flush();
                self.heading = Some(level);
            }
            Tag::Paragraph => {
                self.flush();
                if self.lists.is_empty() {
                    self.line("PP", &[]);
                } else {
                    self.item_paragraphs += 1;
                    if self.item_paragraphs > 1 {
                        let indent = self.indent();
                        self.line("IP", &["", &indent]);
                    }
                }
            }
            Tag::List(first) => {
                self.flush();
                self.lists.push(first);
            }
            Tag::Item => {
                self.flush();
                self.item_paragraphs = 1;
                let indent = self.indent();
                let mark = match self.lists.last_mut() {
                    Some(Some(n)) => {
                        *n += 1;
                        format!("{}.", *n - 1)
                    }
                    _ => "\\(bu".to_string(),
                };
                self.line("IP", &[&mark, &indent]);
            }
            Tag::CodeBlock(_) => {
                self.flush();
                self.code = Some(Vec::new());
            }
            Tag::Table(_) => {
                self.flush();
                self.table = Some(Table::default());
            }
            Tag::TableHead => {
                if let Some(t) = &mut self.table {
                    t.in_header = true;
                }
            }
            Tag::TableRow => {}
            Tag::TableCell => self.inlines.clear(),
            Tag::Strong => self.bold += 1,
            Tag::Emphasis => self.italic += 1,
            Tag::Link { dest_url, .. } => self.link = Some(dest_url.to_string()),
            _ => {}
        }
    }

    fn end(&mut self, tag: TagEnd) {
        match tag {
            TagEnd::Heading(_) => {
                let text = plain(&std::mem::take(&mut self.inlines));
                match self.heading.take() {
                    Some(HeadingLevel::H1) => {
                        self.title = text;
                        self.line("SH", &["DESCRIPTION"]);
                        self.described = true;
                    }
                    Some(HeadingLevel::H2) => self.line("SH", &[&text]),
                    _ => self.line("SS", &[&text]),
                }
            }
            TagEnd::Paragraph | TagEnd::Item => self.flush(),
            TagEnd::List(_) => {
                self.flush();
                self.lists.pop();
            }
            TagEnd::CodeBlock => {
                let lines = self.code.take().unwrap_or_default();
                self.line("PP", &[]);
                self.line("RS", &["4"]);
                self.line("nf", &[]);
                for l in lines {
                    // In no-fill mode an empty line is a blank line, as in the source.
                    self.out.text([roman(l)]);
                }
                self.line("fi", &[]);
                self.line("RE", &[]);
            }
            TagEnd::TableCell => {
                let cell = std::mem::take(&mut self.inlines);
                if let Some(t) = &mut self.table {
                    if t.in_header {
                        t.header.push(plain(&cell));
                    } else {
                        t.row.push(cell);
                    }
                }
            }
            TagEnd::TableHead => {
                if let Some(t) = &mut self.table {
                    t.in_header = false;
                }
            }
            TagEnd::TableRow => {
                let Some(t) = &mut self.table else { return };
                let mut cells = std::mem::take(&mut t.row).into_iter();
                let tag = cells.next().unwrap_or_default();
                let mut body = Vec::new();
                for (header, cell) in t.header.iter().skip(1).zip(cells) {
                    if plain(&cell).trim().is_empty() {
                        continue;
                    }
                    if !body.is_empty() {
                        body.push(Inline::LineBreak);
                    }
                    if !header.is_empty() {
                        body.push(italic(header.clone()));
                        body.push(roman(": "));
                    }
                    body.extend(cell);
                }
                self.line("TP", &[]);
                self.out.text(tag);
                if !body.is_empty() {
                    self.out.text(body);
                }
            }
            TagEnd::Table => self.table = None,
            TagEnd::Strong => self.bold = self.bold.saturating_sub(1),
            TagEnd::Emphasis => self.italic = self.italic.saturating_sub(1),
            TagEnd::Link => {
                if let Some(dest) = self.link.take() {
                    if dest.starts_with("https://") || dest.starts_with("http://") {
                        self.inlines.push(roman(format!(" <{dest}>")));
                    }
                }
            }
            _ => {}
        }
    }

    /// The inline content read so far as one text line (a paragraph; roff fills it).
    fn flush(&mut self) {
        if self.table.is_some() || self.heading.is_some() {
            return;
        }
        let inlines = std::mem::take(&mut self.inlines);
        if !plain(&inlines).trim().is_empty() {
            if !self.described {
                // Text before any heading.
                self.line("SH", &["DESCRIPTION"]);
                self.described = true;
            }
            self.out.text(inlines);
        }
    }

    fn indent(&self) -> String {
        (self.lists.len() * 4).to_string()
    }

    fn line(&mut self, name: &str, args: &[&str]) {
        self.out.extend([control_with(name, args)]);
    }
}

fn control(name: &str) -> Roff {
    control_with(name, &[])
}

/// A request or macro line; its arguments escaped (the roff crate only quotes those with
/// spaces): a backslash doubled, a double quote as `\(dq`, a hyphen as `\-`.
fn control_with(name: &str, args: &[&str]) -> Roff {
    let escaped: Vec<String> = args
        .iter()
        .map(|a| {
            if a.is_empty() {
                "\"\"".to_string()
            } else if a.starts_with("\\(") {
                // Already a roff glyph (the list bullet).
                a.to_string()
            } else {
                a.replace('\\', "\\\\")
                    .replace('"', "\\(dq")
                    .replace('-', "\\-")
            }
        })
        .collect();
    let mut r = Roff::new();
    r.control(name, escaped.iter().map(String::as_str));
    r
}

/// The text of inline elements, without their fonts.
fn plain(inlines: &[Inline]) -> String {
    inlines
        .iter()
        .map(|i| match i {
            Inline::Roman(t) | Inline::Italic(t) | Inline::Bold(t) => t.as_str(),
            Inline::LineBreak => " ",
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(md: &str) -> String {
        let page = markdown_page("x.conf", "5", "1.0", md);
        // After the preamble, TH and NAME lines.
        let start = page.find(".SH DESCRIPTION").expect("a DESCRIPTION section");
        let end = page.find(".SH \"SEE ALSO\"").expect("a SEE ALSO section");
        page[start..end].to_string()
    }

    #[test]
    fn markdown_to_roff() {
        let cases: &[(&str, &str)] = &[
            (
                "# x configuration\n\nIntro `key` text.\n",
                ".SH DESCRIPTION\n.PP\nIntro \\fBkey\\fR text.\n",
            ),
            (
                "# T\n\n## `[claims]`: how\n\nA *b* **c**.\n",
                ".SH DESCRIPTION\n.SH \"[claims]: how\"\n.PP\nA \\fIb\\fR \\fBc\\fR.\n",
            ),
            (
                "# T\n\n### Sub-part\n",
                ".SH DESCRIPTION\n.SS Sub\\-part\n",
            ),
            // A line of text starting with a dot is not a request.
            (
                "# T\n\n.hidden file\n",
                ".SH DESCRIPTION\n.PP\n\\&.hidden file\n",
            ),
            (
                "# T\n\n- one\n- two `a`\n",
                ".SH DESCRIPTION\n.IP \\(bu 4\none\n.IP \\(bu 4\ntwo \\fBa\\fR\n",
            ),
            (
                "# T\n\n1. one\n2. two\n",
                ".SH DESCRIPTION\n.IP 1. 4\none\n.IP 2. 4\ntwo\n",
            ),
            (
                "# T\n\n```toml\n[a]\nb = \"c-d\"\n\n.x\n```\n",
                ".SH DESCRIPTION\n.PP\n.RS 4\n.nf\n[a]\nb = \"c\\-d\"\n\n\\&.x\n.fi\n.RE\n",
            ),
            (
                "# T\n\n| Key | Default | |\n|---|---|---|\n| `a` | 1 | the a |\n| `b` | | the b |\n",
                ".SH DESCRIPTION\n.TP\n\\fBa\\fR\n\\fIDefault\\fR: 1\n.br\nthe a\n.TP\n\\fBb\\fR\nthe b\n",
            ),
            (
                "# T\n\nSee [fleet.md](fleet.md) and [x](https://e.org/).\n",
                ".SH DESCRIPTION\n.PP\nSee fleet.md and x <https://e.org/>.\n",
            ),
        ];
        for (md, want) in cases {
            assert_eq!(body(md), *want, "markdown:\n{md}");
        }
    }

    #[test]
    fn title_is_the_name_line() {
        let page = markdown_page("vfiod.toml", "5", "0.1.0", "# vfiod configuration\n\nx\n");
        assert!(
            page.contains(".TH vfiod.toml 5 \"\" \"vfiod 0.1.0\" vfiod\n.SH NAME\nvfiod.toml \\- vfiod configuration\n"),
            "{page}"
        );
        assert!(page.ends_with(
            ".SH \"SEE ALSO\"\n\\fBvfioctl\\fR(1), \\fBvfiod\\-pool\\fR(1), \\fBvfiod\\fR(8)\n"
        ));
    }

    #[test]
    fn config_page_has_every_section_of_config_md() {
        let page = config_page("0.1.0");
        for line in CONFIG_MD.lines().filter(|l| l.starts_with("## ")) {
            let heading = line[3..].replace('`', "").replace('-', "\\-");
            assert!(
                page.contains(&format!(".SH \"{heading}\""))
                    || page.contains(&format!(".SH {heading}\n")),
                "no section {heading}"
            );
        }
    }
}
