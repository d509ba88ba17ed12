//! `uprobe-trace` on real programs: a C workload whose calls are known
//! (plain, fork, every fd closed, exec, dlopen, USDT), errors a user
//! meets, Python's USDT probes, and a cross-check of the counts against
//! `bpftrace` (kernel uprobes) where it can run.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Whether an emulator (qemu-user) runs this test: it answers
/// `/proc/self/exe` for the program, but not the per-task entries. The
/// programs the tests build are the host's then, not the target's.
fn emulated() -> bool {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    std::fs::read_link("/proc/self/exe").ok()
        != std::fs::read_link(format!("/proc/self/task/{tid}/exe")).ok()
}

/// The workload, built once per test process; `None` (reason printed)
/// without a C compiler, or under an emulator.
fn workload() -> Option<PathBuf> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if emulated() {
                println!("skipped: under an emulator, the workload would be the host's");
                return None;
            }
            let dir =
                std::env::temp_dir().join(format!("uprobe-trace-test-{}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            let out = dir.join("workload");
            let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/workload.c");
            let sdt = std::path::Path::new("/usr/include/x86_64-linux-gnu/sys/sdt.h").exists()
                || std::path::Path::new("/usr/include/sys/sdt.h").exists();
            let mut cc = Command::new("cc");
            cc.args(["-O1", "-o"]).arg(&out).arg(source).arg("-ldl");
            if sdt {
                cc.arg("-DHAVE_SDT");
            }
            match cc.output() {
                Ok(o) if o.status.success() => Some(out),
                Ok(o) => {
                    println!("skipped: cc failed: {}", String::from_utf8_lossy(&o.stderr));
                    None
                }
                Err(e) => {
                    println!("skipped: no C compiler: {e}");
                    None
                }
            }
        })
        .clone()
}

fn trace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args(args)
        .output()
        .expect("run uprobe-trace")
}

/// The count the report gives for `label` (`malloc: 123 calls`).
fn calls(report: &str, label: &str) -> Option<u64> {
    let prefix = format!("{label}: ");
    report
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

fn run_workload(extra: &[&str], mode: &str, n: u64) -> (Output, String) {
    let w = workload().expect("the workload");
    let n = n.to_string();
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["--", w.to_str().unwrap(), mode, &n]);
    let out = trace(&args);
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, report)
}

#[test]
fn counts_every_malloc_and_free() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-f", "malloc,free"], "plain", 10_000);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "malloc"), Some(10_000), "{report}");
    assert_eq!(calls(&report, "free"), Some(10_000), "{report}");
}

#[test]
fn a_fork_child_that_leaves_by_exit_is_counted() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-f", "malloc"], "fork", 1000);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "malloc"), Some(2000), "{report}");
}

#[test]
fn a_program_that_closes_every_descriptor_still_reports() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-f", "free"], "closefds", 500);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "free"), Some(500), "{report}");
}

#[test]
fn an_exec_is_followed_unless_asked_not_to() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-f", "malloc"], "exec", 300);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "malloc"), Some(600), "{report}");
    assert!(report.contains("2 processes traced"), "{report}");
    let (_, report) = run_workload(&["--no-follow", "-f", "malloc"], "exec", 300);
    assert_eq!(calls(&report, "malloc"), Some(300), "{report}");
}

#[test]
fn a_library_loaded_later_is_probed_when_it_loads() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-f", "libz.so.1:zlibVersion"], "dlopen", 250);
    assert!(out.status.success(), "{report}");
    assert_eq!(
        calls(&report, "libz.so.1:zlibVersion"),
        Some(250),
        "{report}"
    );
}

#[test]
fn latency_histograms_and_print_lines() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-l", "-f", "malloc"], "plain", 2000);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "malloc"), Some(2000), "{report}");
    assert!(report.contains("latency (ns), 2000 returns"), "{report}");
    assert!(report.contains('@'), "{report}");
    let (_, report) = run_workload(&["-p", "-f", "malloc"], "plain", 3);
    let lines = report.lines().filter(|l| l.contains(" malloc 0x")).count();
    assert_eq!(lines, 3, "{report}");
}

#[test]
fn usdt_probes_with_their_arguments() {
    let Some(w) = workload() else { return };
    if !std::process::Command::new("readelf")
        .args(["-n"])
        .arg(&w)
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("tick"))
    {
        println!("skipped: the workload was built without <sys/sdt.h>");
        return;
    }
    let (out, report) = run_workload(&["-p", "-u", "workload:tick(int,str)"], "usdt", 5);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "workload:tick"), Some(5), "{report}");
    assert!(report.contains("workload:tick 4 \"tick\""), "{report}");
}

#[test]
fn what_cannot_be_traced_is_said() {
    // A function that exists nowhere: the program still runs, the report
    // says why the probe is not attached.
    let Some(w) = workload() else { return };
    let out = trace(&[
        "-f",
        "no_such_function_anywhere",
        "--",
        w.to_str().unwrap(),
        "plain",
        "1",
    ]);
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{report}");
    assert!(report.contains("not attached: no function"), "{report}");
    // Nothing to trace, no program: usage errors.
    assert_eq!(trace(&["--", "/bin/true"]).status.code(), Some(2));
    assert_eq!(
        trace(&["-f", "malloc", "--", "/no/such/program"])
            .status
            .code(),
        Some(2)
    );
    // A setuid program.
    let dir = std::env::temp_dir().join(format!("uprobe-trace-suid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let suid = dir.join("suid");
    std::fs::copy(&w, &suid).unwrap();
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let out = trace(&["-f", "malloc", "--", suid.to_str().unwrap(), "plain", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("setuid"));
    // A statically linked program, where the toolchain can make one.
    let stat = dir.join("static");
    let built = Command::new("cc")
        .args(["-static", "-O1", "-o"])
        .arg(&stat)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/workload.c"
        ))
        .output();
    if built.is_ok_and(|o| o.status.success()) {
        let out = trace(&["-f", "malloc", "--", stat.to_str().unwrap(), "plain", "1"]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("statically linked"));
    }
}

/// Python's USDT probes (Debian's python3 has them; the semaphore makes
/// it fire them only while a probe is attached): `gc__start` fires once
/// per collection, so a script that collects 100 times more than another
/// counts exactly 100 more (the interpreter collects a few times itself).
#[test]
fn python_garbage_collections() {
    let python = "/usr/bin/python3";
    if emulated() || !std::path::Path::new(python).exists() {
        println!("skipped: no {python}");
        return;
    }
    let collections = |n: u32| {
        let script = format!("import gc\ngc.disable()\nfor i in range({n}):\n    gc.collect()\n");
        let out = trace(&["-u", "python:gc__start", "--", python, "-c", &script]);
        let report = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{report}");
        (calls(&report, "python:gc__start"), report)
    };
    let (base, report) = collections(0);
    if report.contains("not attached") {
        println!("skipped: this python3 has no USDT probes: {report}");
        return;
    }
    let (more, report) = collections(100);
    assert_eq!(more.zip(base).map(|(m, b)| m - b), Some(100), "{report}");
    // The site is a 1-byte `nop`: a jump punned over it, no trap.
    assert!(!report.contains("on breakpoints"), "{report}");
}

/// The same counts as `bpftrace` (kernel uprobes) on the same workload,
/// where `bpftrace` can run (root, uprobes in the kernel). The workload
/// runs on a private copy of libc for both: a kernel uprobe patches every
/// process that maps the file it is placed on, and on the system's libc it
/// would meet the other tests' in-process probes (and the kernel's
/// restoring its byte at detach would corrupt their jumps).
#[test]
fn counts_equal_bpftraces() {
    let Some(w) = workload() else { return };
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    let Some(libc) = libc else {
        println!("skipped: libc not found");
        return;
    };
    let dir = w.parent().unwrap().join("private-libc");
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("libc.so.6");
    std::fs::copy(libc, &copy).unwrap();
    let program = format!(
        "uprobe:{}:malloc /pid == cpid/ {{ @m = count(); }} uprobe:{}:free /pid == cpid/ {{ @f = count(); }}",
        copy.display(),
        copy.display()
    );
    let cmd = format!("{} plain 20000", w.display());
    let Ok(out) = Command::new("bpftrace")
        .args(["-q", "-e", &program, "-c", &cmd])
        .env("LD_LIBRARY_PATH", &dir)
        .output()
    else {
        println!("skipped: no bpftrace");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let count = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("@{name}: ")))
            .and_then(|n| n.trim().parse::<u64>().ok())
    };
    let (Some(m), Some(f)) = (count("m"), count("f")) else {
        println!(
            "skipped: bpftrace could not count here: {} {}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args([
            "-f",
            "malloc,free",
            "--",
            w.to_str().unwrap(),
            "plain",
            "20000",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .expect("run uprobe-trace");
    let report = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        calls(&report, "malloc"),
        Some(m),
        "bpftrace: {text}\nuprobe-trace: {report}"
    );
    assert_eq!(
        calls(&report, "free"),
        Some(f),
        "bpftrace: {text}\nuprobe-trace: {report}"
    );
    println!("malloc {m}, free {f}: bpftrace and uprobe-trace agree");
}
