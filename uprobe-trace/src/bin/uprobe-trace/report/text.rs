//! The report as text: `bpftrace`'s style (counts, log2 histograms), and
//! `--list`'s listing.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;

use uprobe_trace::shared::{Report, bucket_bounds};
use uprobe_trace::spec::{By, Drawn, Plan, ProbeSpec};

use super::{Row, rows};
use crate::End;

/// `--list`: each probe, then what it matches (one line each, sorted),
/// or why nothing.
pub(super) fn listing(report: &Report, plan: &Plan) -> String {
    let mut out = String::new();
    for (row, spec) in rows(report, plan).iter().zip(&plan.probes) {
        let n = row.matched.len();
        let _ = writeln!(
            out,
            "{}: {n} match{}",
            spec.label(),
            if n == 1 { "" } else { "es" }
        );
        for label in row.matched.keys() {
            let _ = writeln!(out, "  {label}");
        }
        if n == 0 {
            let why = row.error.as_deref().unwrap_or("the agent did not start");
            let _ = writeln!(out, "  {why}");
        }
    }
    out
}

/// The report as text.
pub(super) fn text(report: &Report, plan: &Plan, end: Option<End>) -> String {
    let header = report.header();
    let mut out = String::new();
    let agents = header.agents.load(Relaxed);
    let _ = write!(
        out,
        "uprobe-trace: {agents} process{} traced",
        if agents == 1 { "" } else { "es" }
    );
    match end {
        Some(End::Signal(sig)) => {
            let _ = write!(out, ", stopped by signal {sig}");
        }
        Some(End::Duration) => out.push_str(", stopped after --duration"),
        Some(End::Exited) => out.push_str(", until the program exited"),
        None => {}
    }
    out.push('\n');
    if agents == 0 {
        out.push_str("  the agent never started (is the program dynamically linked?)\n");
    }
    if let Some(e) = header.error() {
        let _ = writeln!(out, "  error: {e}");
    }
    for (row, spec) in rows(report, plan).iter().zip(&plan.probes) {
        if spec.target.is_pattern() {
            pattern_text(&mut out, row, spec, plan.by);
        } else {
            row_text(&mut out, row, spec, plan.by, "");
        }
    }
    let lost = header.lost_lines.load(Relaxed);
    if lost > 0 {
        let _ = writeln!(out, "{lost} --print lines lost");
    }
    let lost = header.lost_stacks.load(Relaxed);
    if lost > 0 && plan.by.is_some_and(By::in_hit) {
        let _ = writeln!(
            out,
            "{lost} hits' --by keys not kept (the report's table of keys and stacks is full)"
        );
    }
    let lost = header.lost_slots.load(Relaxed);
    if lost > 0 {
        let _ = writeln!(
            out,
            "{lost} matched functions not traced: the report could not grow (out of memory or file descriptors)"
        );
    }
    out
}

/// Keys shown under a row (the JSON has them all).
const TOP_KEYS: usize = 10;

/// `--by`: a row's calls by key, most first.
fn by_text(out: &mut String, row: &Row, by: Option<By>, indent: &str) {
    let Some(by) = by.filter(|_| !row.by.is_empty()) else {
        return;
    };
    let mut keys: Vec<(&String, &u64)> = row.by.iter().collect();
    keys.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    for (key, calls) in keys.iter().take(TOP_KEYS) {
        let _ = writeln!(out, "{indent}    {} {key}: {calls}", by.name());
    }
    if keys.len() > TOP_KEYS {
        let rest: u64 = keys[TOP_KEYS..].iter().map(|(_, c)| **c).sum();
        let _ = writeln!(
            out,
            "{indent}    ({} more {}s: {rest})",
            keys.len() - TOP_KEYS,
            by.name()
        );
    }
}

fn row_text(out: &mut String, row: &Row, spec: &ProbeSpec, by: Option<By>, indent: &str) {
    let _ = write!(
        out,
        "{indent}{}: {} call{}",
        row.label,
        row.hits,
        if row.hits == 1 { "" } else { "s" }
    );
    if row.sites > 1 || row.trap_sites > 0 {
        let _ = write!(
            out,
            " ({} site{}, {} on breakpoints",
            row.sites,
            if row.sites == 1 { "" } else { "s" },
            row.trap_sites
        );
        if let Some(why) = row.trap_why.as_ref().filter(|_| row.trap_sites > 0) {
            let _ = write!(out, ": {why}");
        }
        out.push(')');
    }
    out.push('\n');
    if let Some(e) = &row.error {
        let _ = writeln!(out, "{indent}  not attached: {e}");
        return;
    }
    by_text(out, row, by, indent);
    if spec.latency {
        out.push_str(&histogram(
            &row.latency,
            0,
            &format!("{indent}  latency (ns), {} returns", row.returns),
            indent,
        ));
    }
    if let Some(drawn) = spec.hist {
        let what = match drawn {
            Drawn::Arg(n) => format!("arg{n}"),
            Drawn::Ret => "ret".into(),
        };
        out.push_str(&histogram(
            &row.values,
            row.negative,
            &format!("{indent}  {what}"),
            indent,
        ));
    }
}

fn pattern_text(out: &mut String, row: &Row, spec: &ProbeSpec, by: Option<By>) {
    let attached = row.matched.values().filter(|r| r.error.is_none()).count();
    let _ = writeln!(
        out,
        "{}: {} functions matched, {attached} attached, {} calls",
        row.label,
        row.matched.len(),
        row.matched.values().map(|r| r.hits).sum::<u64>()
    );
    if let Some(e) = &row.error {
        let _ = writeln!(out, "  not attached: {e}");
    }
    let mut matched: Vec<&Row> = row.matched.values().collect();
    matched.sort_by(|a, b| b.hits.cmp(&a.hits).then(a.label.cmp(&b.label)));
    for r in matched {
        row_text(out, r, spec, by, "  ");
    }
}

/// A log2 histogram in `bpftrace`'s `hist()` style.
fn histogram(counts: &[u64], negative: u64, title: &str, indent: &str) -> String {
    let Some(first) = counts.iter().position(|&c| c > 0) else {
        return if negative > 0 {
            format!("{title}:\n{indent}  (..., 0) {negative:>12}\n")
        } else {
            format!("{title}: none seen\n")
        };
    };
    let last = counts.iter().rposition(|&c| c > 0).unwrap_or(first);
    let max = counts
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(negative)
        .max(1);
    let bar = |c: u64| "@".repeat(usize::try_from(c * 50 / max).unwrap_or(50));
    let mut lines: Vec<(String, u64)> = Vec::new();
    if negative > 0 {
        lines.push(("(..., 0)".into(), negative));
    }
    for (k, &c) in counts.iter().enumerate().take(last + 1).skip(first) {
        let (lo, hi) = bucket_bounds(k);
        lines.push((format!("[{}, {})", short(lo), short(hi)), c));
    }
    let width = lines.iter().map(|(r, _)| r.len()).max().unwrap_or(0);
    let mut out = format!("{title}:\n");
    for (range, c) in lines {
        let _ = writeln!(out, "{indent}  {range:<width$} {c:>10} |{:<50}|", bar(c));
    }
    out
}

/// A power of two as `bpftrace` writes bucket bounds: `512`, `1K`, `4M`.
fn short(v: u64) -> String {
    const UNITS: [(u64, &str); 6] = [
        (1 << 60, "E"),
        (1 << 50, "P"),
        (1 << 40, "T"),
        (1 << 30, "G"),
        (1 << 20, "M"),
        (1 << 10, "K"),
    ];
    UNITS
        .iter()
        .find(|(unit, _)| v >= *unit && v.is_multiple_of(*unit))
        .map_or_else(
            || v.to_string(),
            |(unit, name)| format!("{}{name}", v / unit),
        )
}
