//! SVG charts of a seed's table: throughput against threads, one panel
//! per scenario, one line per implementation with error bars, the seed's
//! "before" dashed (plotters' SVG backend only: no font library is needed,
//! the viewer renders the text).

use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::harness::Row;
use crate::seeds::{Part, SeedResult};

/// Colours for the lines, in order (distinct on white, colour-blind safe).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

/// Today's date (UTC), `YYYY-MM-DD`, from the system clock.
#[must_use]
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Dash and gap lengths (pixels) of the seed's "before" series.
const DASH: (u32, u32) = (8, 5);

/// Half the width (pixels) of an error bar's caps.
const CAP: i32 = 4;

/// A panel: threads on x, million operations per second on y.
type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// What drawing on a panel gives.
type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Draws `result` into an SVG file at `path`; `cpus` is the number of CPUs
/// the run was allowed (for the title, and to mark where threads start
/// sharing CPUs). Each implementation is a line through its medians with
/// error bars of ± one standard deviation; the seed's "before" is dashed.
pub fn draw(result: &SeedResult, cpus: usize, path: &Path) -> Result<(), String> {
    let panels = result.parts.len().max(1);
    let height = 120 + 360 * panels as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "seed {}: {}\n{cpus} CPUs, {}",
        result.seed.id,
        result.seed.patch,
        today()
    );
    let mut lines = title.lines();
    let root = root
        .titled(lines.next().unwrap_or_default(), ("sans-serif", 20))
        .map_err(|e| err(&e))?;
    let root = root
        .titled(lines.next().unwrap_or_default(), ("sans-serif", 15))
        .map_err(|e| err(&e))?;
    for ((part, rows, _), area) in result.parts.iter().zip(root.split_evenly((panels, 1))) {
        draw_panel(&area, part, rows, cpus).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

/// One scenario's panel of the seed's chart, with its legend.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    part: &Part,
    rows: &[Row],
    cpus: usize,
) -> Drawn<DB> {
    let Some(first) = rows.first() else {
        return Ok(());
    };
    let max_threads = rows.iter().map(|r| r.threads).max().unwrap_or(1);
    let max_mops = rows.iter().map(|r| r.mops + r.stddev).fold(0.0, f64::max) * 1.15;
    let max_mops = max_mops.max(1e-6);
    let mut chart = ChartBuilder::on(area)
        .caption(&first.scenario, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(70)
        .build_cartesian_2d(0.8f64..max_threads as f64 + 0.2, 0f64..max_mops)?;
    let x_desc = if rows.iter().any(|r| r.workers > r.cpus) {
        format!("threads (pinned round-robin to the {cpus} CPUs: past {cpus}, threads share CPUs)")
    } else {
        "threads (one per CPU, pinned)".to_string()
    };
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("throughput (million ops/s)")
        .x_labels(max_threads.min(16))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    if max_threads > cpus {
        // Past this line there are more threads than CPUs.
        let x = cpus as f64 + 0.5;
        let style = BLACK.mix(0.4).stroke_width(1);
        chart.draw_series(DashedLineSeries::new(
            [(x, 0.0), (x, max_mops)],
            4,
            4,
            style,
        ))?;
    }
    let mut impls: Vec<&str> = Vec::new();
    for r in rows {
        if !impls.contains(&r.imp.as_str()) {
            impls.push(&r.imp);
        }
    }
    for (i, imp) in impls.into_iter().enumerate() {
        let series: Vec<&Row> = rows.iter().filter(|r| r.imp == imp).collect();
        draw_impl(
            &mut chart,
            &series,
            PALETTE[i % PALETTE.len()],
            imp == part.before,
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

/// One implementation's rows: a line through the medians (dashed for the
/// seed's `before`) with its legend entry, error bars, a dot per row.
fn draw_impl<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    rows: &[&Row],
    color: RGBColor,
    before: bool,
) -> Drawn<DB> {
    let Some(first) = rows.first() else {
        return Ok(());
    };
    let line = color.stroke_width(2);
    let points: Vec<(f64, f64)> = rows.iter().map(|r| (r.threads as f64, r.mops)).collect();
    if before {
        let (dash, gap) = DASH;
        chart
            .draw_series(DashedLineSeries::new(points.clone(), dash, gap, line))?
            .label(format!("{} (before)", first.imp))
            .legend(move |(x, y)| DashedPathElement::new([(x, y), (x + 18, y)], 5, 3, line));
    } else {
        chart
            .draw_series(LineSeries::new(points.clone(), line))?
            .label(&first.imp)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], line));
    }
    draw_error_bars(chart, rows, color)?;
    chart.draw_series(
        points
            .into_iter()
            .map(|p| Circle::new(p, 3, color.filled())),
    )?;
    Ok(())
}

/// Draws a vertical bar of ± one standard deviation (clipped at 0) around
/// each row's median, with caps; rows of a single run have none.
fn draw_error_bars<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    rows: &[&Row],
    color: RGBColor,
) -> Drawn<DB> {
    let style = color.stroke_width(1);
    let spans: Vec<(f64, f64, f64)> = rows
        .iter()
        .filter(|r| r.stddev > 0.0)
        .map(|r| {
            let x = r.threads as f64;
            (x, (r.mops - r.stddev).max(0.0), r.mops + r.stddev)
        })
        .collect();
    chart.draw_series(
        spans
            .iter()
            .map(|&(x, lo, hi)| PathElement::new(vec![(x, lo), (x, hi)], style)),
    )?;
    chart.draw_series(spans.iter().flat_map(|&(x, lo, hi)| {
        [lo, hi]
            .map(|y| EmptyElement::at((x, y)) + PathElement::new(vec![(-CAP, 0), (CAP, 0)], style))
    }))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use plotters::style::RGBColor;

    use super::{PALETTE, draw};
    use crate::harness::Row;
    use crate::seeds::{SEEDS, SeedResult};

    /// A row at `threads` threads on a 2-CPU machine, spread `stddev`.
    fn row(scenario: &str, imp: &str, threads: usize, mops: f64, stddev: f64) -> Row {
        Row {
            scenario: scenario.into(),
            imp: imp.into(),
            threads,
            workers: threads,
            cpus: threads.min(2),
            mops,
            stddev,
            mops_per_thread: mops / threads as f64,
            runs: 3,
            samples: vec![mops - stddev, mops, mops + stddev],
        }
    }

    /// Seed 000's first part (`taskflag-deny`, before `locked`) at 1 to 4
    /// threads on 2 CPUs; `lockfree`'s 1-thread row has no spread.
    fn result() -> SeedResult {
        let seed = &SEEDS[0];
        let part = &seed.parts[0];
        let mut rows = Vec::new();
        for (imp, base) in [("lockfree", 110.0), ("locked", 70.0)] {
            for t in 1..=4 {
                let stddev = if imp == "lockfree" && t == 1 {
                    0.0
                } else {
                    20.0
                };
                rows.push(row(part.scenario, imp, t, base * t as f64, stddev));
            }
        }
        SeedResult {
            seed,
            parts: vec![(part, rows, Vec::new())],
        }
    }

    /// Asserts that every tag of `svg` is closed, in order, and that no
    /// text holds a bare `&` or `<`.
    fn assert_well_formed(svg: &str) {
        let mut open: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(lt) = rest.find('<') {
            let text = &rest[..lt];
            assert!(
                text.split('&').skip(1).all(|t| t.contains(';')),
                "bare & in {text:?}"
            );
            let gt = rest[lt..].find('>').expect("unclosed tag") + lt;
            let tag = &rest[lt + 1..gt];
            assert!(!tag.contains('<'), "< inside tag {tag:?}");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name.trim()), "mismatched </{name}>");
            } else if !tag.starts_with('?') && !tag.starts_with('!') && !tag.ends_with('/') {
                open.push(tag.split_whitespace().next().expect("tag name"));
            }
            rest = &rest[gt + 1..];
        }
        assert!(open.is_empty(), "unclosed: {open:?}");
        assert!(svg.trim_start().starts_with("<svg"));
    }

    #[test]
    fn chart_has_error_bars_and_a_dashed_before() {
        let dir = std::env::temp_dir().join(format!("bench-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("seed-000.svg");
        draw(&result(), 2, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_well_formed(&svg);
        assert!(
            svg.contains("locked (before)"),
            "the before is not labelled"
        );
        assert!(
            svg.contains("threads share CPUs"),
            "4 threads on 2 CPUs unmarked"
        );
        let strokes = |i: usize, width: u32| {
            let RGBColor(r, g, b) = PALETTE[i];
            svg.matches(&format!(
                "stroke=\"#{r:02X}{g:02X}{b:02X}\" stroke-width=\"{width}\""
            ))
            .count()
        };
        // lockfree: one line and its legend; locked (the before): a path
        // per dash, many more than its 4 points.
        assert_eq!(strokes(0, 2), 2);
        assert!(strokes(1, 2) > 10, "before not dashed");
        // Error bars, each a bar and two caps: lockfree's 3 rows with a
        // spread (its 1-thread row has none), locked's 4.
        assert_eq!(strokes(0, 1), 3 * 3);
        assert_eq!(strokes(1, 1), 4 * 3);
    }

    #[test]
    fn today_is_a_date() {
        let d = super::today();
        assert_eq!(d.len(), 10);
        assert_eq!((&d[4..5], &d[7..8]), ("-", "-"));
        assert!(d.starts_with("20"));
    }
}
