//! SVG charts of a seed's table: throughput against threads, one panel
//! per scenario, one line per implementation (plotters' SVG backend only:
//! no font library is needed, the viewer renders the text).

use std::path::Path;

use plotters::prelude::*;

use crate::seeds::SeedResult;

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

/// Draws `result` into an SVG file at `path`; `cpus` is the machine's CPU
/// count (for the title).
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
    for ((_, rows, _), area) in result.parts.iter().zip(root.split_evenly((panels, 1))) {
        let Some(first) = rows.first() else { continue };
        let max_threads = rows.iter().map(|r| r.threads).max().unwrap_or(1);
        let max_mops = rows.iter().map(|r| r.mops).fold(0.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&area)
            .caption(&first.scenario, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(70)
            .build_cartesian_2d(0.8f64..max_threads as f64 + 0.2, 0f64..max_mops.max(1e-6))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("threads (one per CPU, pinned)")
            .y_desc("throughput (million ops/s)")
            .x_labels(max_threads.min(16))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(|e| err(&e))?;
        let mut impls: Vec<&str> = Vec::new();
        for r in rows {
            if !impls.contains(&r.imp.as_str()) {
                impls.push(&r.imp);
            }
        }
        for (i, imp) in impls.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.imp == *imp)
                .map(|r| (r.threads as f64, r.mops))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(*imp)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 3, color.filled())),
                )
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn today_is_a_date() {
        let d = super::today();
        assert_eq!(d.len(), 10);
        assert_eq!((&d[4..5], &d[7..8]), ("-", "-"));
        assert!(d.starts_with("20"));
    }
}
