//! The report as JSON (`--json`) and in the `OpenMetrics` text format
//! (`--metrics`).

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;

use serde_json::{Value as Json, json};
use uprobe_trace::shared::{Report, bucket_bounds};
use uprobe_trace::spec::{By, Drawn, Plan, ProbeSpec};

use super::{Row, rows};

/// The report as JSON.
pub(super) fn json(report: &Report, plan: &Plan) -> Json {
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
        "by": plan.by.map(By::name),
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
    if !row.by.is_empty() {
        // `--by`: every key's calls (they sum to `calls`).
        v["by"] = row.by.iter().map(|(k, c)| (k.clone(), json!(c))).collect();
    }
    v
}

/// The report in the `OpenMetrics` text format (what Prometheus scrapes):
/// per probe (and per function a pattern matched) a counter of calls, and
/// the latency and `--hist` histograms with cumulative buckets.
pub fn openmetrics(report: &Report, plan: &Plan) -> String {
    let mut calls = String::new();
    let mut by_key = String::new();
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
            if let Some(by) = plan.by {
                for (key, n) in &r.by {
                    let _ = writeln!(
                        by_key,
                        "uprobe_trace_calls_by_{}_total{{probe=\"{probe}\",{}=\"{}\"}} {n}",
                        by.name(),
                        by.name(),
                        label_value(key)
                    );
                }
            }
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
    if let Some(by) = plan.by.filter(|_| !by_key.is_empty()) {
        let name = by.name();
        let _ = writeln!(
            out,
            "# TYPE uprobe_trace_calls_by_{name} counter\n# HELP uprobe_trace_calls_by_{name} Calls of each probe by {name} (--by)."
        );
        out.push_str(&by_key);
    }
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
