//! Every table vfioctl prints, through comfy-table: columns as wide as their widest cell, two
//! spaces between them, no borders (like `virsh list` and `systemctl list-units`), a header
//! row, nothing cut (a script reading a pipe gets whole names).

use comfy_table::{presets::NOTHING, ContentArrangement, Table};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether tables get their header row: `vfioctl --no-legend` (as systemctl's) turns it off
/// for the whole process, once, before anything is printed.
static LEGEND: AtomicBool = AtomicBool::new(true);

pub fn set_legend(on: bool) {
    LEGEND.store(on, Ordering::Relaxed);
}

/// Whether header rows are printed (see [`set_legend`]).
pub fn legend() -> bool {
    LEGEND.load(Ordering::Relaxed)
}

/// The table with `header` over `rows`, each line ended by a newline and without trailing
/// blanks; no lines at all for no rows.
pub fn render<R: IntoIterator<Item = String>>(
    header: &[&str],
    rows: impl IntoIterator<Item = R>,
) -> String {
    let mut t = Table::new();
    t.load_preset(NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.to_vec());
    let mut any = false;
    for r in rows {
        t.add_row(r.into_iter().collect::<Vec<String>>());
        any = true;
    }
    if !any {
        return String::new();
    }
    let last = header.len().saturating_sub(1);
    for (i, c) in t.column_iter_mut().enumerate() {
        c.set_padding((0, if i == last { 0 } else { 2 }));
    }
    let mut out = String::new();
    let skip = usize::from(!LEGEND.load(Ordering::Relaxed));
    for line in t.trim_fmt().lines().skip(skip) {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_fit_their_widest_cell_with_two_spaces_between() {
        let out = render(
            &["ID", "NAME", "STATE"],
            [
                vec!["1".to_string(), "a long device name".into(), "ok".into()],
                vec!["12".to_string(), "x".into(), "claimed by web1".into()],
            ],
        );
        assert_eq!(
            out,
            "ID  NAME                STATE\n\
             1   a long device name  ok\n\
             12  x                   claimed by web1\n"
        );
        assert_eq!(render(&["A"], Vec::<Vec<String>>::new()), "");
    }
}
