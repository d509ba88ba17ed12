//! What a hit does beyond counting, checked against a program whose calls
//! are known: filters (`if ...`) on `f(x)`, called with x = 0..1000 on the
//! main thread and with x = 5000..5300 on a second thread, returning 2x;
//! and `--flow` on `outer`, which calls `inner` twice, called three times
//! on the main thread after `inner` ran once on the second thread.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The program, built once per test process (the tests run at once: one
/// rebuilding it would change the file under another's traced process);
/// `None` (reason printed) without a C compiler or under an emulator.
fn program() -> Option<PathBuf> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT.get_or_init(build).clone()
}

fn build() -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("uprobe-trace-filters-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let source = dir.join("calls.c");
    std::fs::write(
        &source,
        "#include <pthread.h>\n\
         __attribute__((noinline)) long f(long x) { __asm__ volatile(\"\"); return 2 * x; }\n\
         __attribute__((noinline)) long inner(long x) { __asm__ volatile(\"\"); return x + 1; }\n\
         __attribute__((noinline)) long outer(long x) { return inner(x) + inner(x + 1); }\n\
         static void *other(void *arg) { long s = inner(7); for (long x = 5000; x < 5300; x++) s += f(x); return (void *)s; }\n\
         int main(void) {\n\
           pthread_t t; pthread_create(&t, 0, other, 0); pthread_join(t, 0);\n\
           long s = 0; for (long x = 0; x < 1000; x++) s += f(x);\n\
           for (long x = 0; x < 3; x++) s += outer(x);\n\
           return s == 42;\n\
         }\n",
    )
    .ok()?;
    let out = dir.join("calls");
    common::compile(
        "cc",
        &["-O1", "-pthread", "-o", out.to_str()?, source.to_str()?],
    )?;
    Some(out)
}

/// The calls each `-f` spec counts (in order), and the report.
fn counts(program: &PathBuf, specs: &[&str]) -> (Vec<u64>, String) {
    let mut args = Vec::new();
    for s in specs {
        args.extend(["-f", s]);
    }
    let out = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args(&args)
        .arg("--")
        .arg(program)
        .output()
        .expect("run uprobe-trace");
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{report}");
    let n = report
        .lines()
        .filter_map(|l| l.strip_prefix("f: "))
        .map(|rest| rest.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    (n, report)
}

#[test]
fn filters_count_the_calls_they_select() {
    let Some(program) = program() else { return };
    let (n, report) = counts(
        &program,
        &[
            "f",
            "f if arg0 >= 5000",
            "f if arg0 < 10 || arg0 == 5299",
            "f if ret < 20",
            "f if ret >= 10000 && ret != 10002",
            "f if tid == pid",
            "f if tid != pid && arg0 > 5200",
        ],
    );
    assert_eq!(n, [1300, 300, 11, 10, 299, 1000, 99], "{report}");
}

#[test]
fn filters_that_cannot_apply_are_refused_at_start() {
    let Some(program) = program() else { return };
    for (spec, why) in [
        ("f(long) if arg1 > 0", "reads arg1, but f has 1 argument"),
        ("f if arg6 > 0", "arg0 to arg5"),
        ("f if size > 0", "not argN, ret, pid, tid or an integer"),
        ("f if ret > 0 && arg0 > 0", "the arguments are gone"),
        ("f if", "not a function name"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
            .args(["-f", spec, "--"])
            .arg(&program)
            .output()
            .expect("run uprobe-trace");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{spec}: {err}");
        assert!(err.contains(why), "{spec}: {err}");
    }
}

#[test]
fn flow_nests_each_thread_s_calls() {
    let Some(program) = program() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args(["--flow", "-", "-f", "outer,inner", "--"])
        .arg(&program)
        .output()
        .expect("run uprobe-trace");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{report}");
    let flow = String::from_utf8_lossy(&out.stdout);
    let mut lines = flow.lines();
    assert_eq!(
        lines.next(),
        Some("# DURATION     TID     FUNCTION"),
        "{flow}"
    );
    // Each line: the duration (blank on an opening line), the thread,
    // then the call, indented.
    let body: Vec<(String, String)> = lines
        .map(|l| {
            let (head, call) = l.split_once(" | ").expect("a flow line");
            let tid = head[head.find('[').unwrap() + 1..head.find(']').unwrap()].trim();
            (tid.to_string(), call.to_string())
        })
        .collect();
    let pid_tid = body
        .iter()
        .find(|(_, c)| c == "outer() {")
        .expect("outer")
        .0
        .clone();
    let main: Vec<&str> = body
        .iter()
        .filter(|(t, _)| *t == pid_tid)
        .map(|(_, c)| c.as_str())
        .collect();
    let one = ["outer() {", "  inner();", "  inner();", "} /* outer */"];
    assert_eq!(main, [one, one, one].concat(), "{flow}");
    let other: Vec<&str> = body
        .iter()
        .filter(|(t, _)| *t != pid_tid)
        .map(|(_, c)| c.as_str())
        .collect();
    assert_eq!(other, ["inner();"], "{flow}");
    // Every line that closes a call has a duration.
    assert!(
        flow.lines()
            .filter(|l| l.contains("inner();") || l.contains("} /*"))
            .all(|l| l.trim_start().split(' ').nth(1) == Some("us")
                || l.trim_start().split(' ').nth(1) == Some("ms")),
        "{flow}"
    );
}

/// `inner`'s calls by `--by` key, from the JSON report.
fn inner_by(program: &PathBuf, key: &str) -> std::collections::BTreeMap<String, u64> {
    let json =
        std::env::temp_dir().join(format!("uprobe-trace-by-{key}-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args(["--by", key, "-f", "inner", "--json"])
        .arg(&json)
        .arg("--")
        .arg(program)
        .output()
        .expect("run uprobe-trace");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{report}");
    let text = std::fs::read_to_string(&json).unwrap();
    let _ = std::fs::remove_file(&json);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["probes"][0]["calls"], 7, "{text}");
    v["probes"][0]["by"]
        .as_object()
        .expect("a breakdown")
        .iter()
        .map(|(k, n)| (k.clone(), n.as_u64().unwrap()))
        .collect()
}

#[test]
fn counts_break_down_by_keys_read_in_the_hit() {
    let Some(program) = program() else { return };
    let pairs = |p: &[(&str, u64)]| p.iter().map(|(k, n)| ((*k).to_string(), *n)).collect();
    // outer(x) calls inner(x) and inner(x + 1), x = 0, 1, 2; the second
    // thread calls inner(7); inner returns its argument plus one.
    assert_eq!(
        inner_by(&program, "caller"),
        pairs(&[("outer", 6), ("other", 1)])
    );
    assert_eq!(
        inner_by(&program, "arg0"),
        pairs(&[("0", 1), ("1", 2), ("2", 2), ("3", 1), ("7", 1)])
    );
    assert_eq!(
        inner_by(&program, "ret"),
        pairs(&[("1", 1), ("2", 2), ("3", 2), ("4", 1), ("8", 1)])
    );
    let mut by_tid: Vec<u64> = inner_by(&program, "tid").into_values().collect();
    by_tid.sort_unstable();
    assert_eq!(by_tid, [1, 6]);
}
