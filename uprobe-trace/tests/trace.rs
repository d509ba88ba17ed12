//! `uprobe-trace` on real programs: a C workload whose calls are known
//! (plain, fork, every fd closed, exec, dlopen, USDT), errors a user
//! meets, Python's USDT probes, and a cross-check of the counts against
//! `bpftrace` (kernel uprobes) where it can run.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The workload, built once per test process; `None` (reason printed)
/// without a C compiler, or under an emulator.
fn workload() -> Option<PathBuf> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if common::emulated() {
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
    let (_, report) = run_workload(&["--print", "-f", "malloc"], "plain", 3);
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
    let (out, report) = run_workload(&["--print", "-u", "workload:tick(int,str)"], "usdt", 5);
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
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(report.contains("not attached: no function"), "{report}");
    assert!(report.contains("not one probe attached"), "{report}");
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
    if common::emulated() || !std::path::Path::new(python).exists() {
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
    // The site is a 1-byte `nop`: a jump punned over it, no trap. The
    // four bytes after it fix where that jump lands; in the runs where the
    // program's heap (placed at random, up to 1 GiB past the executable)
    // covers that page, the site stays on its breakpoint, and says so.
    assert!(
        !report.contains("on breakpoints")
            || report.contains("on breakpoints: 1 bytes: shorter than a jump")
                && report.contains("could only land where nothing can be mapped"),
        "{report}"
    );
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

/// A workload running in the background (`--pid` targets), killed when
/// dropped.
#[cfg(target_arch = "x86_64")]
struct Running(std::process::Child);

#[cfg(target_arch = "x86_64")]
impl Running {
    /// Starts `workload MODE N` and waits for its "ready"; `None` (reason
    /// printed) where the tests cannot build it, or ptrace is reserved to
    /// root (`kernel.yama.ptrace_scope` 2 or 3; at 1 the workload allows
    /// any process of its user).
    fn start(mode: &str, n: u64) -> Option<Self> {
        use std::io::BufRead as _;
        let w = workload()?;
        let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .unwrap_or(0);
        // SAFETY: geteuid has no preconditions.
        if scope >= 3 || (scope == 2 && unsafe { libc::geteuid() } != 0) {
            println!("skipped: kernel.yama.ptrace_scope is {scope}");
            return None;
        }
        let mut child = Command::new(w)
            .args([mode, &n.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the workload");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        Some(Self(child))
    }

    fn pid(&self) -> String {
        self.0.id().to_string()
    }

    fn is_running(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }

    /// The bytes of every executable mapping of its libc.
    fn libc_code(&self) -> Vec<u8> {
        use std::os::unix::fs::FileExt as _;
        let pid = self.0.id();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
        let mut code = Vec::new();
        for line in maps
            .lines()
            .filter(|l| l.contains("libc.so") && l.contains("r-xp"))
        {
            let range = line.split_whitespace().next().unwrap();
            let (start, end) = range.split_once('-').unwrap();
            let start = u64::from_str_radix(start, 16).unwrap();
            let end = u64::from_str_radix(end, 16).unwrap();
            let mut buf = vec![0u8; (end - start) as usize];
            mem.read_exact_at(&mut buf, start).unwrap();
            code.extend(buf);
        }
        assert!(!code.is_empty(), "no libc code in {maps}");
        code
    }

    /// Its threads' names once they are `threads` again, or after 10 s:
    /// the agent's thread ends just after it reports the session stopped,
    /// and the engine's service threads once their last lease is gone.
    fn threads_back_to(&self, threads: &[String]) -> Vec<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let now = self.threads();
            if now == threads || std::time::Instant::now() > deadline {
                return now;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Its threads' names.
    fn threads(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", self.0.id()))
            .unwrap()
            .flatten()
            .map(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default())
            .map(|c| c.trim().to_string())
            .collect();
        names.sort();
        names
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A multi-threaded program under load is traced while it runs and left
/// as it was: every byte of libc's code back, no thread of the agent's
/// left, and it runs on; tracing it again works (the agent already
/// loaded is reused).
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn attaches_to_a_running_process_and_leaves_it_as_it_was() {
    let Some(mut target) = Running::start("loop", 3) else {
        return;
    };
    let (code, threads) = (target.libc_code(), target.threads());
    for round in 0..2 {
        let out = trace(&["-p", &target.pid(), "-f", "malloc,free", "-d", "1"]);
        let report = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "round {round}: {report}");
        assert!(report.contains("stopped after --duration"), "{report}");
        assert!(calls(&report, "malloc").is_some_and(|n| n > 0), "{report}");
        assert!(calls(&report, "free").is_some_and(|n| n > 0), "{report}");
        assert!(target.is_running(), "round {round}: {report}");
        assert!(
            target.libc_code() == code,
            "round {round}: libc's code changed"
        );
        assert_eq!(target.threads_back_to(&threads), threads, "round {round}");
    }
}

/// Latency probes in a running process: their returns are counted, and
/// the detach leaves no handler armed (the program runs on) and, once the
/// last lease is gone, none of the engine's service threads.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn latency_of_a_running_process() {
    let Some(mut target) = Running::start("loop", 2) else {
        return;
    };
    let (code, threads) = (target.libc_code(), target.threads());
    let out = trace(&["-p", &target.pid(), "-l", "-f", "malloc", "-d", "1"]);
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{report}");
    assert!(report.contains("latency (ns)"), "{report}");
    assert_eq!(target.threads_back_to(&threads), threads, "{report}");
    assert!(target.is_running(), "{report}");
    assert!(target.libc_code() == code, "libc's code changed");
}

/// A program that exits while traced: the report comes when it exits.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn a_running_process_that_exits_while_traced() {
    let Some(target) = Running::start("briefly", 1500) else {
        return;
    };
    let out = trace(&["-p", &target.pid(), "-f", "malloc"]);
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{report}");
    assert!(report.contains("until the program exited"), "{report}");
    assert!(calls(&report, "malloc").is_some_and(|n| n > 0), "{report}");
}

/// A program that forks while traced: its children count into the report
/// while they live (they keep the probes: only the process the agent was
/// loaded into is detached), and the parent is left as it was.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn a_running_process_that_forks_while_traced() {
    let Some(mut target) = Running::start("forkloop", 0) else {
        return;
    };
    let code = target.libc_code();
    let out = trace(&["-p", &target.pid(), "-f", "malloc", "-d", "1"]);
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{report}");
    // Each child makes 1000 pairs; the parent at least as many between
    // forks.
    assert!(
        calls(&report, "malloc").is_some_and(|n| n > 1000),
        "{report}"
    );
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(target.is_running(), "{report}");
    assert!(target.libc_code() == code, "libc's code changed");
}

#[test]
fn pid_errors_say_what_to_do() {
    if common::emulated() {
        println!("skipped: under an emulator, the tool cannot be run from a test");
        return;
    }
    let out = trace(&["-p", "999999999", "-f", "malloc"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no process"));
    // Where `--pid` is not implemented, it says so.
    if cfg!(not(target_arch = "x86_64")) {
        let me = std::process::id().to_string();
        let out = trace(&["-p", &me, "-f", "malloc"]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("x86-64 only"));
    }
    // A process and a program at once.
    assert_eq!(
        trace(&["-p", "1", "-f", "malloc", "--", "/bin/true"])
            .status
            .code(),
        Some(2)
    );
}

/// The agent has static TLS (uprobe-core's anchor: an initial-exec
/// relocation, which the dynamic linker resolves by placing the library's
/// TLS block in every thread's static TLS): loaded into a running process,
/// none of its thread-locals is allocated at a probe hit.
#[test]
fn the_agent_has_static_tls() {
    use object::{Object as _, RelocationFlags};
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_uprobe-trace"));
    let agent = [
        exe.with_file_name("libuprobe_trace.so"),
        exe.with_file_name("deps").join("libuprobe_trace.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("the agent is built with the tool");
    let data = std::fs::read(&agent).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let initial_exec = file
        .dynamic_relocations()
        .into_iter()
        .flatten()
        .any(|(_, r)| match r.flags() {
            RelocationFlags::Elf { r_type } => {
                r_type == object::elf::R_X86_64_TPOFF64
                    || r_type == object::elf::R_AARCH64_TLS_TPREL
            }
            _ => false,
        });
    assert!(
        initial_exec,
        "no initial-exec TLS relocation in {}",
        agent.display()
    );
}

/// Patterns with exclusions, argument types, values and return values,
/// a histogram of an argument, and the JSON report.
#[test]
fn patterns_arguments_histograms_and_json() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["-f", "libc.so.6:mall*", "-x", "malloc_*"], "plain", 1000);
    assert!(out.status.success(), "{report}");
    let line = |label: &str| {
        report
            .lines()
            .find_map(|l| l.trim_start().strip_prefix(&format!("{label}: ")))
            .map(str::to_string)
    };
    assert_eq!(
        line("libc.so.6:malloc").and_then(|l| l.split(' ').next()?.parse::<u64>().ok()),
        Some(1000),
        "{report}"
    );
    assert!(line("libc.so.6:malloc_stats").is_none(), "{report}");
    assert!(line("libc.so.6:mall*").is_some(), "{report}");

    let (_, report) = run_workload(&["--print", "-f", "malloc(size_t)"], "plain", 3);
    for size in 16..19 {
        assert!(report.contains(&format!(" malloc({size})")), "{report}");
    }
    assert_eq!(report.matches(" malloc = 0x").count(), 3, "{report}");

    let json = std::env::temp_dir().join(format!("uprobe-trace-json-{}", std::process::id()));
    let (out, report) = run_workload(
        &["--hist", "malloc:arg0", "--json", json.to_str().unwrap()],
        "plain",
        1000,
    );
    assert!(out.status.success(), "{report}");
    assert!(report.contains("arg0:"), "{report}");
    let text = std::fs::read_to_string(&json).unwrap();
    let _ = std::fs::remove_file(&json);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["probes"][0]["probe"], "malloc");
    assert_eq!(v["probes"][0]["calls"], 1000);
    let buckets = v["probes"][0]["hist"]["buckets"].as_array().unwrap();
    let total: u64 = buckets.iter().map(|b| b["count"].as_u64().unwrap()).sum();
    assert_eq!(total, 1000, "{text}");
    // Sizes 16..80: buckets [16, 32), [32, 64), [64, 128).
    assert_eq!(buckets[0]["from"], 16, "{text}");
}

/// Ctrl-C (SIGINT) and SIGTERM end tracing a running process with the
/// report, and the process is left as it was.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn a_signal_ends_tracing_with_the_report() {
    let Some(mut target) = Running::start("loop", 1) else {
        return;
    };
    let code = target.libc_code();
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let mut tool = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
            .args(["-p", &target.pid(), "-f", "malloc"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run uprobe-trace");
        // Once it traces (its first line), stop it.
        let mut err = std::io::BufReader::new(tool.stderr.take().unwrap());
        let mut first = String::new();
        std::io::BufRead::read_line(&mut err, &mut first).unwrap();
        assert!(first.contains("tracing process"), "{first}");
        // SAFETY: signalling the tool we started.
        unsafe { libc::kill(tool.id() as i32, sig) };
        let mut report = String::new();
        std::io::Read::read_to_string(&mut err, &mut report).unwrap();
        assert!(tool.wait().unwrap().success(), "{report}");
        assert!(
            report.contains(&format!("stopped by signal {sig}")),
            "{report}"
        );
        assert!(calls(&report, "malloc").is_some_and(|n| n > 0), "{report}");
        assert!(target.is_running(), "{report}");
        assert!(target.libc_code() == code, "libc's code changed");
    }
}

/// A process that exits while the agent is being loaded, or right after:
/// the tool says so, or reports what it counted, and never hangs.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn a_process_that_exits_mid_attach() {
    for ms in [1, 5, 20, 50] {
        let Some(target) = Running::start("briefly", ms) else {
            return;
        };
        let out = trace(&["-p", &target.pid(), "-f", "malloc,free", "-d", "5"]);
        let report = String::from_utf8_lossy(&out.stderr).into_owned();
        let exited_first = out.status.code() == Some(1) && report.contains("exited");
        let traced = out.status.success() && report.contains("until the program exited");
        assert!(exited_first || traced, "{ms} ms: {report}");
    }
}

/// `--stacks`: the user stack of every hit, unwound with the objects'
/// call-frame information (the workload is built without frame
/// pointers), symbolized and folded.
#[test]
fn stacks_are_folded_for_flame_graphs() {
    if workload().is_none() {
        return;
    }
    let folded = std::env::temp_dir().join(format!("uprobe-trace-stacks-{}", std::process::id()));
    let (out, report) = run_workload(
        &["-f", "malloc", "--stacks", folded.to_str().unwrap()],
        "plain",
        1000,
    );
    assert!(out.status.success(), "{report}");
    let text = std::fs::read_to_string(&folded).unwrap();
    let _ = std::fs::remove_file(&folded);
    // Every hit in one stack: from the program's start through `main`
    // to `malloc`.
    let (stack, count) = text
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(s, _)| s.contains(";main;"))
        .unwrap_or_else(|| panic!("no stack through main: {text}"));
    assert_eq!(count, "1000", "{text}");
    assert!(stack.starts_with("_start;"), "{text}");
    assert!(stack.ends_with(";malloc"), "{text}");
}

/// `--metrics`: the live counts in the `OpenMetrics` text format, over
/// HTTP, while tracing runs.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn metrics_are_served_while_tracing() {
    use std::io::{BufRead as _, Read as _, Write as _};
    let Some(target) = Running::start("loop", 1) else {
        return;
    };
    let mut tool = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
        .args(["-p", &target.pid(), "-f", "malloc", "-l"])
        .args(["--metrics", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run uprobe-trace");
    let mut err = std::io::BufReader::new(tool.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("uprobe-trace: metrics at http://")
        .and_then(|a| a.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("{line}"))
        .to_string();
    line.clear();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("tracing process"), "{line}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    // SAFETY: signalling the tool we started.
    unsafe { libc::kill(tool.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert!(tool.wait().unwrap().success(), "{rest}");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.contains("application/openmetrics-text"), "{answer}");
    let calls = answer
        .lines()
        .find_map(|l| l.strip_prefix("uprobe_trace_calls_total{probe=\"malloc\"} "))
        .and_then(|n| n.parse::<u64>().ok());
    assert!(calls.is_some_and(|n| n > 0), "{answer}");
    assert!(
        answer.contains("uprobe_trace_latency_seconds_bucket{probe=\"malloc\",le=\"+Inf\"}"),
        "{answer}"
    );
    assert!(answer.trim_end().ends_with("# EOF"), "{answer}");
}

/// A site left on a breakpoint (`--breakpoints`) hit by a thread that
/// blocks every signal: the agent keeps SIGTRAP out of the masks the
/// program sets, so the thread is counted instead of killed.
#[test]
fn a_thread_that_blocks_every_signal_survives_a_breakpoint() {
    if workload().is_none() {
        return;
    }
    let (out, report) = run_workload(&["--breakpoints", "-f", "tick"], "blocked", 1000);
    assert!(out.status.success(), "{report}");
    assert_eq!(calls(&report, "tick"), Some(1000), "{report}");
    assert!(report.contains("1 on breakpoints"), "{report}");
}

/// xz's worker threads block every signal: with its CRC on a breakpoint
/// it runs to the end, and writes what it writes untraced.
#[test]
fn xz_with_breakpoints_in_its_workers() {
    if common::emulated() || Command::new("xz").arg("--version").output().is_err() {
        println!("skipped: no xz (or under an emulator)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("uprobe-trace-xz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("input");
    // Incompressible bytes, enough for blocks on both workers.
    let bytes: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&input, bytes).unwrap();
    let script = format!(
        "xz -T2 -6 --block-size=500000 -c {} | md5sum",
        input.display()
    );
    let plain = Command::new("sh").args(["-c", &script]).output().unwrap();
    let out = trace(&[
        "--breakpoints",
        "-f",
        "liblzma.so.5:lzma_crc64",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{report}");
    assert_eq!(out.stdout, plain.stdout, "{report}");
    assert!(
        calls(&report, "liblzma.so.5:lzma_crc64").is_some_and(|n| n > 0),
        "{report}"
    );
}

/// Folded stacks of three known paths to one function, with exact counts,
/// in a program built at `-O2 -fomit-frame-pointer`: through a jump,
/// through breakpoints, and through return probes' stubs (the paths'
/// own return addresses hijacked by `-l`).
#[test]
fn stacks_of_three_paths() {
    let Some(w) = workload() else { return };
    let dir = w.parent().unwrap().join("o2");
    std::fs::create_dir_all(&dir).unwrap();
    let o2 = dir.join("workload");
    let built = Command::new("cc")
        .args(["-O2", "-fomit-frame-pointer", "-o"])
        .arg(&o2)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/workload.c"
        ))
        .arg("-ldl")
        .status()
        .unwrap();
    assert!(built.success());
    for extra in [
        &[][..],
        &["--breakpoints"],
        &["-l", "-f", "path_a,path_b,path_c"],
    ] {
        let folded = dir.join("folded");
        let mut args: Vec<&str> = vec!["-f", "leaf", "--stacks", folded.to_str().unwrap()];
        args.extend(extra);
        args.extend(["--", o2.to_str().unwrap(), "paths", "100"]);
        let out = trace(&args);
        let report = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{extra:?}: {report}");
        let text = std::fs::read_to_string(&folded).unwrap();
        for (path, n) in [("path_a", 100), ("path_b", 200), ("path_c", 300)] {
            let line = format!(";main;{path};leaf {n}");
            assert!(
                text.lines()
                    .any(|l| l.starts_with("_start;") && l.ends_with(&line)),
                "{extra:?}: no {line:?} in\n{text}"
            );
        }
    }
}

/// The workload in `oncue` mode: it calls `tick` as many times as it is
/// told on its standard input, and says `done N` after each batch.
#[cfg(target_arch = "x86_64")]
struct OnCue {
    target: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

#[cfg(target_arch = "x86_64")]
impl OnCue {
    /// Starts it and waits for its "ready"; `None` without the workload.
    fn start() -> Option<Self> {
        use std::io::BufRead as _;
        let w = workload()?;
        let mut target = Command::new(w)
            .args(["oncue", "0"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let input = target.stdin.take().unwrap();
        let mut output = std::io::BufReader::new(target.stdout.take().unwrap());
        let mut line = String::new();
        output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        Some(Self {
            target,
            input,
            output,
        })
    }

    /// Has it call `tick` `n` times, and waits until it did.
    fn ticks(&mut self, n: u64) {
        use std::io::{BufRead as _, Write as _};
        writeln!(self.input, "{n}").unwrap();
        let mut line = String::new();
        self.output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), format!("done {n}"));
    }

    /// Starts the tool on it with `args`; the tool, its standard error,
    /// and the first line it wrote there.
    fn trace(
        &self,
        args: &[&str],
    ) -> (
        std::process::Child,
        std::io::BufReader<std::process::ChildStderr>,
        String,
    ) {
        use std::io::BufRead as _;
        let mut tool = Command::new(env!("CARGO_BIN_EXE_uprobe-trace"))
            .args(["-p", &self.target.id().to_string()])
            .args(args)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = std::io::BufReader::new(tool.stderr.take().unwrap());
        let mut first = String::new();
        err.read_line(&mut first).unwrap();
        (tool, err, first)
    }

    /// Ends it (its input closed).
    fn end(self) {
        let Self {
            mut target, input, ..
        } = self;
        drop(input);
        let _ = target.wait();
    }
}

/// Stops the tool with Ctrl-C; its report.
#[cfg(target_arch = "x86_64")]
fn interrupt(
    mut tool: std::process::Child,
    mut err: std::io::BufReader<std::process::ChildStderr>,
) -> String {
    // SAFETY: signalling the tool we started.
    unsafe { libc::kill(tool.id() as i32, libc::SIGINT) };
    let mut report = String::new();
    std::io::Read::read_to_string(&mut err, &mut report).unwrap();
    assert!(tool.wait().unwrap().success(), "{report}");
    report
}

/// Exact counts over a window the test controls, in a running process:
/// the program calls `tick` as many times as asked, while traced.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn exact_counts_in_a_running_process() {
    let Some(mut program) = OnCue::start() else {
        return;
    };
    // Calls before the trace are not counted.
    program.ticks(500);
    let (tool, err, first) = program.trace(&["--print", "-f", "tick(long)"]);
    assert!(first.contains("tracing process"), "{first}");
    for k in [1000, 234] {
        program.ticks(k);
    }
    let report = interrupt(tool, err);
    assert_eq!(calls(&report, "tick"), Some(1234), "{report}");
    // The arguments and return values the program computed: tick(i)
    // returns 2i + 1.
    assert!(report.contains(" tick(999)"), "{report}");
    assert!(report.contains(" tick = 1999"), "{report}");
    program.end();
}

/// 100 attach/detach cycles on one process: every cycle counts, and at
/// the end libc's code, the threads and the open descriptors are what
/// they were.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn a_hundred_attach_detach_cycles() {
    let Some(mut target) = Running::start("loop", 2) else {
        return;
    };
    let pid = target.0.id();
    let fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let (code, threads, open) = (target.libc_code(), target.threads(), fds());
    for cycle in 0..100 {
        let out = trace(&["-p", &target.pid(), "-f", "malloc", "-d", "0.05"]);
        let report = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "cycle {cycle}: {report}");
        assert!(
            calls(&report, "malloc").is_some_and(|n| n > 0),
            "cycle {cycle}: {report}"
        );
    }
    assert!(target.is_running());
    assert!(target.libc_code() == code, "libc's code changed");
    assert_eq!(target.threads_back_to(&threads), threads);
    assert_eq!(fds(), open);
}

/// `--flow` on a running process: the calls made while traced, each
/// closed with its duration, on the program's thread.
#[test]
#[cfg(target_arch = "x86_64")] // `--pid` is x86-64 only so far
fn flow_of_a_running_process() {
    let Some(mut program) = OnCue::start() else {
        return;
    };
    let flow = std::env::temp_dir().join(format!("uprobe-trace-pflow-{}", std::process::id()));
    let (mut tool, err, first) = program.trace(&["-f", "tick", "--flow", flow.to_str().unwrap()]);
    if first.contains("ptrace") || !first.contains("tracing process") {
        println!("skipped: {first}");
        let _ = tool.wait();
        program.end();
        return;
    }
    program.ticks(3);
    let report = interrupt(tool, err);
    let text = std::fs::read_to_string(&flow).unwrap_or_default();
    let _ = std::fs::remove_file(&flow);
    program.end();
    let calls: Vec<&str> = text.lines().filter(|l| l.ends_with("| tick();")).collect();
    assert_eq!(calls.len(), 3, "{text}\n{report}");
    // Each with its duration (`0.711 us`, `1.814 ms`).
    assert!(
        calls
            .iter()
            .all(|l| matches!(l.split_whitespace().nth(1), Some("us" | "ms" | "s"))),
        "{text}"
    );
}
