//! `--flow FILE`: each thread's calls and returns of the probed
//! functions, nested, with durations, in `uftrace replay`'s layout:
//!
//! ```text
//! # DURATION     TID     FUNCTION
//!             [ 4242] | parse() {
//!    0.350 us [ 4242] |   header();
//!    1.120 us [ 4242] | } /* parse */
//! ```
//!
//! A call whose return comes next on its thread is one line (`f();`); a
//! return with no call seen (the call was before tracing began) closes
//! nothing; calls never returned (a `longjmp`, an exit, the end of
//! tracing) are closed at their thread's end without a duration.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use uprobe_trace::shared::{Event, Flow, Report, split_key};

use crate::Failure;

/// A duration as `uftrace` prints it: `  0.350 us`, `  12.004 ms`.
fn duration(ns: u64) -> String {
    let (unit, name) = match ns {
        0..1_000_000 => (1_000, "us"),
        1_000_000..1_000_000_000 => (1_000_000, "ms"),
        _ => (1_000_000_000, " s"),
    };
    format!("{:>4}.{:03} {name}", ns / unit, ns % unit * 1_000 / unit)
}

/// The replay of `events` (by time) for the function names `name`.
#[must_use]
pub fn replay(events: &[Event], name: impl Fn(u32) -> String) -> String {
    let mut by_thread: BTreeMap<u32, Vec<&Event>> = BTreeMap::new();
    for e in events {
        by_thread.entry(e.tid).or_default().push(e);
    }
    let mut out = String::from("# DURATION     TID     FUNCTION\n");
    let blank = " ".repeat(11);
    for (tid, events) in by_thread {
        // The calls open on this thread: (slot, time).
        let mut open: Vec<(u32, u64)> = Vec::new();
        let mut k = 0;
        while k < events.len() {
            let e = events[k];
            let indent = "  ".repeat(open.len());
            if !e.ret {
                match events.get(k + 1) {
                    Some(next) if next.ret && next.slot == e.slot => {
                        let _ = writeln!(
                            out,
                            "{} [{tid:>6}] | {indent}{}();",
                            duration(next.time - e.time),
                            name(e.slot)
                        );
                        k += 2;
                        continue;
                    }
                    _ => {
                        let _ = writeln!(out, "{blank} [{tid:>6}] | {indent}{}() {{", name(e.slot));
                        open.push((e.slot, e.time));
                    }
                }
            } else if let Some(depth) = open.iter().rposition(|&(slot, _)| slot == e.slot) {
                // Calls opened inside it and never returned close with it.
                while open.len() > depth + 1 {
                    let (slot, _) = open.pop().expect("deeper");
                    let indent = "  ".repeat(open.len());
                    let _ = writeln!(out, "{blank} [{tid:>6}] | {indent}}} /* {} */", name(slot));
                }
                let (slot, start) = open.pop().expect("found");
                let indent = "  ".repeat(open.len());
                let _ = writeln!(
                    out,
                    "{} [{tid:>6}] | {indent}}} /* {} */",
                    duration(e.time - start),
                    name(slot)
                );
            }
            k += 1;
        }
        while let Some((slot, _)) = open.pop() {
            let indent = "  ".repeat(open.len());
            let _ = writeln!(out, "{blank} [{tid:>6}] | {indent}}} /* {} */", name(slot));
        }
    }
    out
}

/// Writes the replay of `flow` to `path` (`-`: standard output), the
/// functions named as the report labels them (without their object).
pub fn write(report: &Report, flow: &Flow, path: &Path) -> Result<(), Failure> {
    let name = |slot: u32| {
        let label = report
            .slot(slot as usize)
            .map(uprobe_trace::shared::Slot::label)
            .unwrap_or_default();
        let (label, _) = split_key(&label);
        // `libc.so.6:malloc` -> `malloc`; a C++ name keeps its `::`.
        let name = uprobe_trace::spec::split_object(label).map_or(label, |(_, name)| name);
        // `ns::work(int)` -> `ns::work`: the replay adds `()`.
        uprobe_trace::names::without_params(name).to_string()
    };
    let mut text = replay(&flow.events(), name);
    let lost = flow.lost();
    if lost > 0 {
        let _ = writeln!(
            text,
            "# {lost} calls and returns not recorded: the flow file was full"
        );
    }
    crate::write_output(path, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(time: u64, tid: u32, slot: u32, ret: bool) -> Event {
        Event {
            time,
            tid,
            slot,
            ret,
        }
    }

    #[test]
    fn calls_nest_per_thread_with_durations() {
        let names = ["main", "parse", "header"];
        let events = [
            ev(1_000, 7, 1, false),
            ev(1_100, 7, 2, false),
            ev(1_450, 7, 2, true),
            ev(1_500, 8, 2, false),
            ev(2_120, 7, 1, true),
            ev(3_000, 8, 2, true),
            ev(4_000, 7, 0, false),
        ];
        let text = replay(&events, |s| names[s as usize].to_string());
        let expected = [
            "# DURATION     TID     FUNCTION",
            "            [     7] | parse() {",
            "   0.350 us [     7] |   header();",
            "   1.120 us [     7] | } /* parse */",
            "            [     7] | main() {",
            "            [     7] | } /* main */",
            "   1.500 us [     8] | header();",
        ];
        assert_eq!(text, expected.join("\n") + "\n");
    }
}
