//! `uprobe-trace` on a process tree (a script running dozens of programs:
//! one report row per function, whatever the number of processes), and on
//! C++ and Rust programs (patterns on demangled names; stacks demangled,
//! with `file:line`).
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("uprobe-trace-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn trace(args: &[&str]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args(args)
        .output()
        .expect("run uprobe-trace");
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, report)
}

/// Traces `program` with `specs` and `--stacks`; the output, the report
/// and the folded stacks. Removes `dir` (where the program was built).
fn trace_with_stacks(dir: &Path, specs: &[&str], program: &Path) -> (Output, String, String) {
    let stacks = dir.join("stacks");
    let mut args = specs.to_vec();
    args.extend([
        "--stacks",
        stacks.to_str().unwrap(),
        "--",
        program.to_str().unwrap(),
    ]);
    let (out, report) = trace(&args);
    let folded = std::fs::read_to_string(&stacks).unwrap_or_default();
    let _ = std::fs::remove_dir_all(dir);
    (out, report, folded)
}

/// The count the report gives for `label` (`  malloc: 123 calls`).
fn calls(report: &str, label: &str) -> Option<u64> {
    let prefix = format!("{label}: ");
    report
        .lines()
        .find_map(|l| l.trim_start().strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// A C program that calls `malloc` exactly `argv[1]` times (besides its
/// start-up's), and a script that runs it 40 times, then once more.
fn tree(dir: &Path) -> Option<PathBuf> {
    let source = dir.join("allocs.c");
    std::fs::write(
        &source,
        "#include <stdlib.h>\n\
         int main(int argc, char **argv) {\n\
           int n = argc > 1 ? atoi(argv[1]) : 0;\n\
           for (int i = 0; i < n; i++) free(malloc(16 + i % 64));\n\
           return 0;\n\
         }\n",
    )
    .unwrap();
    let program = dir.join("allocs");
    // -O0: an optimizer may drop a `free(malloc(n))`.
    common::compile("cc", &["-O0", "-o", program.to_str()?, source.to_str()?])?;
    let script = dir.join("tree.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ni=0\nwhile [ $i -lt 40 ]; do {p} 10; i=$((i + 1)); done\n{p} 5000\n",
            p = program.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    Some(script)
}

#[test]
fn a_process_tree_is_counted_whole_in_one_row_per_function() {
    let dir = scratch("tree");
    let Some(script) = tree(&dir) else { return };
    let script = script.to_str().unwrap();
    let (out, one) = trace(&["-f", "malloc", "--", script]);
    assert!(out.status.success(), "{one}");
    let (out, pattern) = trace(&["-f", "libc.so.6:mall*,libc.so.6:free", "--", script]);
    assert!(out.status.success(), "{pattern}");
    // The shell and 41 programs, each with its agent.
    assert!(pattern.contains("42 processes traced"), "{pattern}");
    let total = calls(&one, "malloc").expect("malloc's row");
    assert!(total >= 40 * 10 + 5000, "{one}");
    // The same calls, counted through the pattern's rows: one row for
    // libc's malloc, whichever process made the call.
    assert_eq!(
        calls(&pattern, "libc.so.6:malloc"),
        Some(total),
        "{pattern}\n{one}"
    );
    assert_eq!(pattern.matches("libc.so.6:malloc:").count(), 1, "{pattern}");
    assert!(!pattern.contains("not traced"), "{pattern}");

    // `--by`: the same calls, by process and by name, summing to them.
    let json = dir.join("by.json");
    for by in ["pid", "comm"] {
        let (out, report) = trace(&[
            "--by",
            by,
            "-f",
            "malloc",
            "--json",
            json.to_str().unwrap(),
            "--",
            script,
        ]);
        assert!(out.status.success(), "{report}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let probe = &v["probes"][0];
        let keys = probe["by"].as_object().expect("a breakdown");
        let sum: u64 = keys.values().map(|n| n.as_u64().unwrap()).sum();
        assert_eq!(probe["calls"].as_u64(), Some(sum), "{report}");
        assert_eq!(v["by"], by);
        if by == "pid" {
            // The shell and each of the 41 programs.
            assert_eq!(keys.len(), 42, "{report}");
            assert!(keys.values().any(|n| n.as_u64() >= Some(5000)), "{report}");
        } else {
            assert!(keys["allocs"].as_u64() >= Some(40 * 10 + 5000), "{report}");
            assert!(report.contains("    comm allocs: "), "{report}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpp_names_are_matched_and_shown_demangled_with_lines() {
    let dir = scratch("cpp");
    let source = dir.join("widget.cpp");
    std::fs::write(
        &source,
        "#include <vector>\n\
         namespace ns {\n\
         struct Widget {\n\
           int v;\n\
           __attribute__((noinline)) int draw(int k) const { return v + k; }\n\
         };\n\
         __attribute__((noinline)) long work(int n) {\n\
           std::vector<int> xs;\n\
           long s = 0;\n\
           Widget w{3};\n\
           for (int i = 0; i < n; i++) { xs.push_back(i); s += w.draw(i); }\n\
           return s + (long)xs.size();\n\
         }\n\
         }\n\
         int main() { return ns::work(300) > 0 ? 0 : 1; }\n",
    )
    .unwrap();
    let program = dir.join("widget");
    let built = common::compile(
        "c++",
        &[
            "-O0",
            "-g",
            "-o",
            program.to_str().unwrap(),
            source.to_str().unwrap(),
        ],
    );
    if built.is_none() {
        return;
    }
    // `--list`: what would be attached, on standard output; the program
    // does not run.
    let (out, _) = trace(&[
        "--list",
        "-f",
        "ns::*",
        "-f",
        "std::vector<*>::pop_back",
        "--",
        program.to_str().unwrap(),
    ]);
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{listed}");
    assert_eq!(
        listed,
        "ns::*: 2 matches\n  widget:ns::Widget::draw(int) const\n  widget:ns::work(int)\n\
         std::vector<*>::pop_back: 0 matches\n  \
         nothing matches std::vector<*>::pop_back in the loaded objects\n"
    );
    let (out, report, folded) = trace_with_stacks(
        &dir,
        &[
            "-f",
            "ns::*",
            "-f",
            "std::vector<*>::push_back",
            "-f",
            "ns::Widget::draw",
        ],
        &program,
    );
    assert!(out.status.success(), "{report}");
    assert_eq!(
        calls(&report, "widget:ns::Widget::draw(int) const"),
        Some(300),
        "{report}"
    );
    assert_eq!(calls(&report, "widget:ns::work(int)"), Some(1), "{report}");
    assert_eq!(
        calls(
            &report,
            "widget:std::vector<int, std::allocator<int> >::push_back(int const&)"
        ),
        Some(300),
        "{report}"
    );
    // A demangled name given whole is one probe of its own.
    assert_eq!(calls(&report, "ns::Widget::draw"), Some(300), "{report}");
    assert!(!report.contains("_ZN"), "{report}");
    assert!(
        folded
            .contains("ns::work(int) (widget.cpp:11);ns::Widget::draw(int) const (widget.cpp:5) "),
        "{folded}"
    );
    assert!(folded.contains("main (widget.cpp:15);"), "{folded}");
}

#[test]
fn rust_names_are_matched_and_shown_demangled_with_lines() {
    let dir = scratch("rust");
    let source = dir.join("app.rs");
    std::fs::write(
        &source,
        "mod parse {\n\
             #[inline(never)]\n\
             pub fn header(x: u64) -> u64 { std::hint::black_box(x * 3 + 1) }\n\
             #[inline(never)]\n\
             pub fn body(x: u64) -> u64 { std::hint::black_box(x ^ 7) }\n\
         }\n\
         fn main() {\n\
             let mut s = 0;\n\
             for i in 0..200 { s += parse::header(i) + parse::body(i); }\n\
             std::process::exit(i32::from(s == 0));\n\
         }\n",
    )
    .unwrap();
    let program = dir.join("app");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let built = common::compile(
        &rustc,
        &[
            "-g",
            "-C",
            "opt-level=1",
            "-o",
            program.to_str().unwrap(),
            source.to_str().unwrap(),
        ],
    );
    if built.is_none() {
        return;
    }
    let (out, report, folded) = trace_with_stacks(&dir, &["-f", "app::parse::*"], &program);
    assert!(out.status.success(), "{report}");
    assert_eq!(
        calls(&report, "app:app::parse::header"),
        Some(200),
        "{report}"
    );
    assert_eq!(
        calls(&report, "app:app::parse::body"),
        Some(200),
        "{report}"
    );
    assert!(
        folded.contains("app::main (app.rs:9);app::parse::header (app.rs:3) 200"),
        "{folded}"
    );
    assert!(!folded.contains("_ZN"), "{folded}");
}
