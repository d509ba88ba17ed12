//! The report: the shared file the agents count into, read back as rows
//! (a probe asked for, with the functions its pattern matched under it),
//! printed as text in `bpftrace`'s style and written as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;

use serde_json::{Value as Json, json};
use uprobe_trace::shared::{BUCKETS, Report, Slot, bucket_bounds};
use uprobe_trace::spec::{Drawn, Plan, ProbeSpec};

use crate::{Args, End, Failure};

/// A report file and its path, in a directory of the session's own.
pub struct Session {
    pub report: Report,
    pub path: PathBuf,
    /// The session's directory (mode 0700: no other user reaches the
    /// report or the `--print` FIFO in it).
    pub dir: PathBuf,
}

impl Session {
    /// A fresh report for `plan`, in a new private directory of the
    /// temporary directory.
    pub fn create(plan: &Plan) -> Result<Self, Failure> {
        let dir = private_dir()?;
        let path = dir.join("report");
        let labels: Vec<String> = plan.probes.iter().map(ProbeSpec::label).collect();
        let report = Report::create(&path, &labels).map_err(|e| {
            let _ = std::fs::remove_dir(&dir);
            Failure::Run(format!("cannot create {}: {e}", path.display()))
        })?;
        Ok(Self { report, path, dir })
    }

    /// Hands the directory and what is in it to user `uid` (a process of
    /// another user traced by root must open them).
    pub fn give_to(&self, uid: u32) -> Result<(), Failure> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| Failure::Run(format!("{}: {e}", self.dir.display())))?;
        for p in entries
            .flatten()
            .map(|e| e.path())
            .chain([self.dir.clone()])
        {
            std::os::unix::fs::chown(&p, Some(uid), None)
                .map_err(|e| Failure::Run(format!("chown {}: {e}", p.display())))?;
        }
        Ok(())
    }

    /// Removes the directory and what is in it (the mappings stay).
    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Prints the report to standard error.
    pub fn print(&self, plan: &Plan, end: Option<End>) {
        eprint!("{}", text(&self.report, plan, end));
    }

    /// Whether not one probe attached a site, in any process.
    pub fn nothing_attached(&self, plan: &Plan) -> bool {
        rows(&self.report, plan)
            .iter()
            .all(|r| r.sites == 0 && r.matched.values().all(|m| m.sites == 0))
    }

    /// The final report: printed, and written as JSON where asked; with
    /// `--list`, the listing, on standard output.
    pub fn finish(&self, args: &Args, plan: &Plan, end: Option<End>) -> Result<(), Failure> {
        if plan.list {
            print!("{}", listing(&self.report, plan));
            return Ok(());
        }
        self.print(plan, end);
        if let Some(path) = &args.stacks {
            crate::stacks::write(&self.report, path)?;
        }
        let Some(path) = &args.json else {
            return Ok(());
        };
        let text = serde_json::to_string_pretty(&json(&self.report, plan))
            .map_err(|e| Failure::Run(format!("json: {e}")))?;
        if path.as_os_str() == "-" {
            println!("{text}");
            Ok(())
        } else {
            std::fs::write(path, text + "\n")
                .map_err(|e| Failure::Run(format!("cannot write {}: {e}", path.display())))
        }
    }
}

/// A new directory `uprobe-trace-XXXXXX` of the temporary directory, mode
/// 0700, its name chosen by `mkdtemp`.
fn private_dir() -> Result<PathBuf, Failure> {
    let template = std::env::temp_dir().join("uprobe-trace-XXXXXX");
    let mut bytes = template.into_os_string().into_encoded_bytes();
    bytes.push(0);
    // SAFETY: a NUL-terminated template that mkdtemp rewrites in place.
    let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(Failure::Run(format!(
            "cannot make a directory in {}: {}",
            std::env::temp_dir().display(),
            std::io::Error::last_os_error()
        )));
    }
    bytes.pop();
    // SAFETY: the bytes came from an OsString and mkdtemp only replaced
    // the X's with ASCII.
    Ok(PathBuf::from(unsafe {
        std::ffi::OsString::from_encoded_bytes_unchecked(bytes)
    }))
}

/// One probe asked for, or one function its pattern matched, summed over
/// every slot (every process) that counted it.
#[derive(Default)]
struct Row {
    label: String,
    sites: u64,
    trap_sites: u64,
    hits: u64,
    returns: u64,
    latency: Vec<u64>,
    values: Vec<u64>,
    negative: u64,
    error: Option<String>,
    /// Why a site stays on a breakpoint.
    trap_why: Option<String>,
    /// The functions a pattern matched, by label.
    matched: BTreeMap<String, Row>,
}

impl Row {
    /// Adds slot `slot`, which has `calls` calls and `latencies` (returns,
    /// their histogram).
    fn add(&mut self, slot: &Slot, calls: u64, latencies: &(u64, [u64; BUCKETS])) {
        self.sites += slot.sites.load(Relaxed);
        self.trap_sites += slot.trap_sites.load(Relaxed);
        self.hits += calls;
        self.returns += latencies.0;
        self.negative += slot.negative.load(Relaxed);
        self.latency.resize(BUCKETS, 0);
        for (a, b) in self.latency.iter_mut().zip(&latencies.1) {
            *a += b;
        }
        self.values.resize(BUCKETS, 0);
        for (a, b) in self.values.iter_mut().zip(&slot.values) {
            *a += b.load(Relaxed);
        }
        if let Some(why) = slot.trap_why() {
            self.trap_why = Some(why);
        }
        // An error from one process, unless another attached it.
        match slot.error() {
            Some(e) if self.error.is_none() && self.sites == 0 => self.error = Some(e),
            None if self.sites > 0 => self.error = None,
            _ => {}
        }
    }
}

/// The rows of the report, one per probe asked for.
fn rows(report: &Report, plan: &Plan) -> Vec<Row> {
    let mut rows: Vec<Row> = plan
        .probes
        .iter()
        .map(|p| Row {
            label: p.label(),
            ..Row::default()
        })
        .collect();
    for (i, slot) in report.slots() {
        let probe = slot.probe.load(Relaxed) as usize;
        let Some(row) = rows.get_mut(probe) else {
            continue;
        };
        let (calls, latencies) = (report.calls(i), report.latencies(i));
        if i == probe {
            row.add(slot, calls, &latencies);
        } else {
            row.matched
                .entry(slot.label())
                .or_insert_with(|| Row {
                    label: slot.label(),
                    ..Row::default()
                })
                .add(slot, calls, &latencies);
        }
    }
    rows
}

/// `--list`: each probe, then what it matches (one line each, sorted),
/// or why nothing.
fn listing(report: &Report, plan: &Plan) -> String {
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
fn text(report: &Report, plan: &Plan, end: Option<End>) -> String {
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
            pattern_text(&mut out, row, spec);
        } else {
            row_text(&mut out, row, spec, "");
        }
    }
    let lost = header.lost_lines.load(Relaxed);
    if lost > 0 {
        let _ = writeln!(out, "{lost} --print lines lost");
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

fn row_text(out: &mut String, row: &Row, spec: &ProbeSpec, indent: &str) {
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

fn pattern_text(out: &mut String, row: &Row, spec: &ProbeSpec) {
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
        row_text(out, r, spec, "  ");
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

/// The report as JSON.
fn json(report: &Report, plan: &Plan) -> Json {
    let header = report.header();
    let probes: Vec<Json> = rows(report, plan)
        .iter()
        .zip(&plan.probes)
        .map(|(row, spec)| {
            let mut v = row_json(row, spec);
            if spec.target.is_pattern() {
                v["functions"] = row.matched.values().map(|r| row_json(r, spec)).collect();
            }
            v
        })
        .collect();
    json!({
        "processes": header.agents.load(Relaxed),
        "error": header.error(),
        "lost_print_lines": header.lost_lines.load(Relaxed),
        "lost_functions": header.lost_slots.load(Relaxed),
        "probes": probes,
    })
}

fn row_json(row: &Row, spec: &ProbeSpec) -> Json {
    let buckets = |counts: &[u64]| -> Json {
        counts
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(k, c)| {
                let (lo, hi) = bucket_bounds(k);
                json!({ "from": lo, "below": hi, "count": c })
            })
            .collect()
    };
    let mut v = json!({
        "probe": row.label,
        "calls": row.hits,
        "sites": row.sites,
        "trap_sites": row.trap_sites,
        "trap_why": row.trap_why,
        "not_attached": row.error,
    });
    if spec.latency {
        v["latency_ns"] = json!({ "returns": row.returns, "buckets": buckets(&row.latency) });
    }
    if let Some(drawn) = spec.hist {
        let of = match drawn {
            Drawn::Arg(n) => format!("arg{n}"),
            Drawn::Ret => "ret".into(),
        };
        v["hist"] = json!({ "of": of, "negative": row.negative, "buckets": buckets(&row.values) });
    }
    v
}

/// The report in the `OpenMetrics` text format (what Prometheus scrapes):
/// per probe (and per function a pattern matched) a counter of calls, and
/// the latency and `--hist` histograms with cumulative buckets.
pub fn openmetrics(report: &Report, plan: &Plan) -> String {
    let mut calls = String::new();
    let mut latency = String::new();
    let mut values = String::new();
    for (row, spec) in rows(report, plan).iter().zip(&plan.probes) {
        let leaves: Vec<&Row> = if spec.target.is_pattern() {
            row.matched.values().collect()
        } else {
            vec![row]
        };
        for r in leaves {
            let probe = label_value(&r.label);
            let _ = writeln!(
                calls,
                "uprobe_trace_calls_total{{probe=\"{probe}\"}} {}",
                r.hits
            );
            if spec.latency {
                // Bucket k holds [2^(k-1), 2^k) ns: at most 2^k ns.
                cumulative(
                    &mut latency,
                    "uprobe_trace_latency_seconds",
                    &format!("probe=\"{probe}\""),
                    0,
                    &r.latency,
                    |k| format!("{:e}", 2f64.powi(k as i32) / 1e9),
                );
            }
            if let Some(drawn) = spec.hist {
                let of = match drawn {
                    Drawn::Arg(n) => format!("arg{n}"),
                    Drawn::Ret => "ret".into(),
                };
                // Bucket k holds integers up to 2^k - 1; negative values
                // lie below every bound.
                cumulative(
                    &mut values,
                    "uprobe_trace_value",
                    &format!("probe=\"{probe}\",of=\"{of}\""),
                    r.negative,
                    &r.values,
                    |k| (bucket_bounds(k).1 - 1).to_string(),
                );
            }
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "# TYPE uprobe_trace_processes gauge");
    let _ = writeln!(out, "# HELP uprobe_trace_processes Processes traced.");
    let _ = writeln!(
        out,
        "uprobe_trace_processes {}",
        report.header().agents.load(Relaxed)
    );
    out.push_str("# TYPE uprobe_trace_calls counter\n# HELP uprobe_trace_calls Calls of each probed function or USDT probe.\n");
    out.push_str(&calls);
    if !latency.is_empty() {
        out.push_str("# TYPE uprobe_trace_latency_seconds histogram\n# HELP uprobe_trace_latency_seconds Time from a function's entry to its return.\n");
        out.push_str(&latency);
    }
    if !values.is_empty() {
        out.push_str("# TYPE uprobe_trace_value histogram\n# HELP uprobe_trace_value Values of an argument or of the return value (--hist).\n");
        out.push_str(&values);
    }
    out.push_str("# EOF\n");
    out
}

/// A histogram's cumulative buckets, `+Inf` and count (no sum: the report
/// keeps none).
fn cumulative(
    out: &mut String,
    name: &str,
    labels: &str,
    below_all: u64,
    counts: &[u64],
    bound: impl Fn(usize) -> String,
) {
    let mut total = below_all;
    let last = counts.iter().rposition(|&c| c > 0);
    for (k, &c) in counts.iter().enumerate() {
        if last.is_none_or(|l| k > l) {
            break;
        }
        total += c;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{}\"}} {total}", bound(k));
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {total}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {total}");
}

/// A label value with `\`, `"` and newlines escaped.
fn label_value(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
