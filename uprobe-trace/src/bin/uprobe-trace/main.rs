//! `uprobe-trace`: runs a program with the agent preloaded and prints
//! what its probes counted (see the crate's docs).

use std::fmt::Write as _;
use std::io::{BufRead as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use clap::Parser;

use uprobe_trace::shared::{BUCKETS, Report};
use uprobe_trace::spec::{self, ProbeSpec};

/// Trace an unmodified program in its own process: call counts and
/// latency histograms of functions and USDT probes, no root, no ptrace.
///
/// The program runs with uprobe-trace's agent preloaded (`LD_PRELOAD`); the
/// agent attaches the probes before main, trap-free where the code
/// allows. The report goes to standard error when the program exits.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Functions to count, comma-separated: `malloc,free`, or with their
    /// object: `libz.so.1:deflate`. Repeatable.
    #[arg(short = 'f', long = "function", value_name = "LIST")]
    functions: Vec<String>,
    /// A USDT probe to count: `[object:]provider:name`, with argument
    /// types for --print: `python:function__entry(str,str,int)`.
    /// Repeatable.
    #[arg(short = 'u', long = "usdt", value_name = "PROBE")]
    usdt: Vec<String>,
    /// Also probe the functions' returns: a latency histogram per function.
    #[arg(short = 'l', long)]
    latency: bool,
    /// A line per hit (thread, probe, arguments) on standard error.
    #[arg(short = 'p', long)]
    print: bool,
    /// Print the report every this many seconds too.
    #[arg(short = 'i', long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    interval: Option<u64>,
    /// Do not trace the programs the traced program runs.
    #[arg(long)]
    no_follow: bool,
    /// The agent library (default: `libuprobe_trace.so` next to this
    /// executable).
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    command: Vec<String>,
}

/// A usage error (exit code 2) or a failure to run (exit code 1).
enum Failure {
    Usage(String),
    Run(String),
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(Failure::Usage(e)) => {
            eprintln!("uprobe-trace: {e}");
            ExitCode::from(2)
        }
        Err(Failure::Run(e)) => {
            eprintln!("uprobe-trace: {e}");
            ExitCode::from(1)
        }
    }
}

fn probes(args: &Args) -> Result<Vec<ProbeSpec>, Failure> {
    let mut probes = Vec::new();
    for list in &args.functions {
        for f in list.split(',').filter(|f| !f.is_empty()) {
            probes.push(ProbeSpec {
                target: spec::parse_function(f).map_err(Failure::Usage)?,
                latency: args.latency,
                print: args.print,
            });
        }
    }
    for u in &args.usdt {
        probes.push(ProbeSpec {
            target: spec::parse_usdt(u).map_err(Failure::Usage)?,
            latency: false,
            print: args.print,
        });
    }
    if probes.is_empty() {
        return Err(Failure::Usage(
            "nothing to trace: give -f FUNCTIONS or -u PROBE".into(),
        ));
    }
    Ok(probes)
}

fn run(args: &Args) -> Result<ExitCode, Failure> {
    let probes = probes(args)?;
    let program = find_program(&args.command[0])
        .ok_or_else(|| Failure::Usage(format!("{}: no such program", args.command[0])))?;
    refuse_unpreloadable(&program).map_err(Failure::Usage)?;
    let agent = agent_path(args).map_err(Failure::Run)?;
    let report_path = std::env::temp_dir().join(format!(
        "uprobe-trace-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let report = Report::create(&report_path, probes.len())
        .map_err(|e| Failure::Run(format!("cannot create {}: {e}", report_path.display())))?;
    let result = trace(args, &program, &agent, &probes, &report, &report_path);
    let _ = std::fs::remove_file(&report_path);
    result
}

/// Runs the program under the agent and prints the report.
fn trace(
    args: &Args,
    program: &Path,
    agent: &Path,
    probes: &[ProbeSpec],
    report: &Report,
    report_path: &Path,
) -> Result<ExitCode, Failure> {
    let mut command = std::process::Command::new(program);
    command.args(&args.command[1..]);
    let preload = match std::env::var(uprobe_trace::env::PRELOAD) {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", agent.display()),
        _ => agent.display().to_string(),
    };
    command
        .env(uprobe_trace::env::PRELOAD, preload)
        .env(uprobe_trace::env::REPORT, report_path)
        .env(uprobe_trace::env::PROBES, spec::encode(probes));
    if args.no_follow {
        command.env(uprobe_trace::env::FOLLOW, "0");
    }
    let lines = if args.print {
        let (read, write) = pipe().map_err(|e| Failure::Run(format!("pipe: {e}")))?;
        command.env(uprobe_trace::env::PRINT_FD, write.to_string());
        Some((read, write))
    } else {
        None
    };
    let mut child = command
        .spawn()
        .map_err(|e| Failure::Run(format!("cannot run {}: {e}", program.display())))?;
    let printer = lines.map(|(read, write)| {
        // SAFETY: our copy of the write end (the child has its own).
        unsafe { libc::close(write) };
        std::thread::spawn(move || forward_lines(read))
    });
    let labels: Arc<Vec<String>> = Arc::new(probes.iter().map(ProbeSpec::label).collect());
    let status = if let Some(secs) = args.interval {
        loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) => {}
                Err(e) => return Err(Failure::Run(format!("wait: {e}"))),
            }
            std::thread::sleep(Duration::from_secs(secs));
            if child.try_wait().ok().flatten().is_none() {
                print_report(report, &labels, probes);
            }
        }
    } else {
        child
            .wait()
            .map_err(|e| Failure::Run(format!("wait: {e}")))?
    };
    if let Some(p) = printer {
        let _ = p.join();
    }
    print_report(report, &labels, probes);
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        (None, Some(sig)) => {
            eprintln!("uprobe-trace: the program died of signal {sig}");
            ExitCode::from(u8::try_from(128 + sig).unwrap_or(1))
        }
        _ => ExitCode::FAILURE,
    })
}

/// A pipe whose write end the child inherits: (read, write).
fn pipe() -> std::io::Result<(i32, i32)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills `fds`; the read end is close-on-exec, the write
    // end is inherited by the child.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: setting close-on-exec on our own descriptor.
    unsafe { libc::fcntl(fds[0], libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok((fds[0], fds[1]))
}

/// Copies the agent's `--print` lines to standard error until every
/// writer is gone.
fn forward_lines(read: i32) {
    use std::os::fd::FromRawFd as _;
    // SAFETY: the read end is ours alone.
    let file = unsafe { std::fs::File::from_raw_fd(read) };
    let stderr = std::io::stderr();
    for line in std::io::BufReader::new(file).lines() {
        let Ok(line) = line else { break };
        let _ = writeln!(stderr.lock(), "uprobe-trace: {line}");
    }
}

fn print_report(report: &Report, labels: &[String], probes: &[ProbeSpec]) {
    let header = report.header();
    let mut out = String::new();
    let agents = header.agents.load(Relaxed);
    let _ = writeln!(
        out,
        "uprobe-trace: {agents} process{} traced",
        if agents == 1 { "" } else { "es" }
    );
    if agents == 0 {
        out.push_str("  the agent never started (is the program dynamically linked?)\n");
    }
    if let Some(e) = header.error() {
        let _ = writeln!(out, "  error: {e}");
    }
    for (i, label) in labels.iter().enumerate() {
        let Some(slot) = report.slot(i) else { continue };
        let sites = slot.sites.load(Relaxed);
        let hits = slot.hits.load(Relaxed);
        let traps = slot.trap_sites.load(Relaxed);
        let _ = write!(out, "{label}: {hits} calls");
        if sites > 1 || traps > 0 {
            let _ = write!(out, " ({sites} sites, {traps} on breakpoints)");
        }
        out.push('\n');
        if let Some(e) = slot.error() {
            let _ = writeln!(out, "  not attached: {e}");
        }
        if probes[i].latency {
            out.push_str(&histogram(slot));
        }
    }
    let lost = header.lost_lines.load(Relaxed);
    if lost > 0 {
        let _ = writeln!(out, "{lost} --print lines lost");
    }
    eprint!("{out}");
}

/// A log2 histogram in `bpftrace`'s `hist()` style.
fn histogram(slot: &uprobe_trace::shared::Slot) -> String {
    let counts: Vec<u64> = slot.histogram.iter().map(|c| c.load(Relaxed)).collect();
    let Some(first) = counts.iter().position(|&c| c > 0) else {
        return "  latency: no returns seen\n".into();
    };
    let last = counts.iter().rposition(|&c| c > 0).unwrap_or(first);
    let max = counts.iter().copied().max().unwrap_or(1).max(1);
    let mut out = format!("  latency (ns), {} returns:\n", slot.returns.load(Relaxed));
    for (k, &c) in counts.iter().enumerate().take(last + 1).skip(first) {
        let (lo, hi) = if k == 0 {
            (0, 1)
        } else {
            (1u64 << (k - 1), 1u64 << k.min(BUCKETS - 1))
        };
        let bar = "@".repeat(usize::try_from(c * 50 / max).unwrap_or(50));
        let _ = writeln!(out, "  [{lo}, {hi}) {c:>12} |{bar:<50}|");
    }
    out
}

/// `name` as `execvp` would find it.
fn find_program(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Programs the dynamic linker will not preload into: statically linked
/// ones (no dynamic linker at all) and setuid/setgid ones (secure mode
/// ignores `LD_PRELOAD` paths).
fn refuse_unpreloadable(program: &Path) -> Result<(), String> {
    let meta = program
        .metadata()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    if meta.permissions().mode() & 0o6000 != 0 {
        return Err(format!(
            "{} is setuid or setgid: the dynamic linker does not preload the agent into it",
            program.display()
        ));
    }
    let data = std::fs::read(program).map_err(|e| format!("{}: {e}", program.display()))?;
    if data.starts_with(b"#!") {
        return Ok(()); // a script: its interpreter is what runs
    }
    if !has_interpreter(&data) {
        return Err(format!(
            "{} is statically linked (or not an ELF program): nothing can be preloaded into it",
            program.display()
        ));
    }
    Ok(())
}

/// Whether an ELF file has a `PT_INTERP` program header (a dynamic
/// linker).
fn has_interpreter(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        return false; // not a 64-bit little-endian ELF file
    }
    let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&elf[at..at + 8]);
        u64::from_le_bytes(b) as usize
    };
    let (phoff, phentsize, phnum) = (u64_at(32), u16_at(54), u16_at(56));
    (0..phnum).any(|i| {
        let at = phoff + i * phentsize;
        at + 4 <= elf.len()
            && u32::from_le_bytes([elf[at], elf[at + 1], elf[at + 2], elf[at + 3]]) == PT_INTERP
    })
}

/// The agent library: `--agent`, or `libuprobe_trace.so` next to this
/// executable (where `cargo build` puts both), or in its `deps` folder
/// (where a build of the tests alone leaves it).
fn agent_path(args: &Args) -> Result<PathBuf, String> {
    let path = if let Some(p) = &args.agent {
        p.clone()
    } else {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let next_to = exe.with_file_name("libuprobe_trace.so");
        // A build of the tests only leaves it among the dependencies.
        let in_deps = exe.with_file_name("deps").join("libuprobe_trace.so");
        if !next_to.is_file() && in_deps.is_file() {
            in_deps
        } else {
            next_to
        }
    };
    if !path.is_file() {
        return Err(format!(
            "the agent library {} is missing (build it with `cargo build --release -p uprobe-trace`, or give --agent)",
            path.display()
        ));
    }
    std::fs::canonicalize(&path).map_err(|e| format!("{}: {e}", path.display()))
}
