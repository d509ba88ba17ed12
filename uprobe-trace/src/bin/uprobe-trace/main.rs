//! `uprobe-trace`: traces a program it starts (with the agent preloaded)
//! or one already running (the agent loaded into it), and prints what its
//! probes counted (see the crate's docs).
//!
//! - [`launch`]: `uprobe-trace [...] -- PROGRAM`;
//! - [`pid`] and [`inject`]: `uprobe-trace --pid PID`;
//! - [`report`]: the report, as text and as JSON;
//! - [`stacks`]: `--stacks`, symbolized and folded;
//! - [`metrics`]: `--metrics`, the live report for Prometheus;
//! - [`program`]: finding the program and the agent, and what cannot be
//!   preloaded.

mod flow;
#[cfg(target_arch = "x86_64")]
mod inject;
mod launch;
mod lines;
mod metrics;
mod pid;
mod program;
mod report;
mod stacks;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;

use uprobe_trace::spec::{self, Plan, ProbeSpec};

/// Trace an unmodified program, and every process it starts, in their own
/// processes: call counts, latency and value histograms, arguments and
/// return values of functions and USDT probes, one report for the whole
/// process tree, C++ and Rust names demangled. No root; ptrace only to
/// join a running process (`--pid`).
///
/// Give the program after `--` to start it with the agent preloaded, or
/// `--pid PID` to load the agent into a running process (it detaches and
/// leaves the process as it was on Ctrl-C, SIGTERM, `--duration` or the
/// program's exit). The report goes to standard error.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
#[allow(clippy::struct_excessive_bools)] // command-line switches
struct Args {
    /// Functions to count, comma-separated: `malloc,free`; with their
    /// object: `libz.so.1:deflate`; patterns: `libsqlite3.so.0:sqlite3_*`,
    /// `str*`; C++ and Rust names as written: `ns::Widget::draw`,
    /// `std::vector<*>::push_back`, `myapp::parse*`; with argument types
    /// for --print: `open(str,int)`; with a filter: `malloc if arg0 >=
    /// 4096`, `read if ret < 0`, `f if tid == 12 || arg1 != 0` (argN, ret,
    /// pid, tid, integers; == != < <= > >=; && ||). Repeatable.
    #[arg(short = 'f', long = "function", value_name = "LIST")]
    functions: Vec<String>,
    /// Function names patterns leave out (`*_internal`), comma-separated.
    /// Repeatable.
    #[arg(short = 'x', long = "exclude", value_name = "PATTERNS")]
    exclude: Vec<String>,
    /// A USDT probe to count: `[object:]provider:name`, with argument
    /// types for --print: `python:function__entry(str,str,int)`.
    /// Repeatable.
    #[arg(short = 'u', long = "usdt", value_name = "PROBE")]
    usdt: Vec<String>,
    /// Also probe the functions' returns: a latency histogram per function.
    #[arg(short = 'l', long)]
    latency: bool,
    /// A histogram of a function's argument or return value, as
    /// `bpftrace`'s `hist()`: `malloc:arg0`, `read:ret`. Repeatable.
    #[arg(long = "hist", value_name = "FUNCTION:VALUE")]
    hist: Vec<String>,
    /// A line per hit (thread, probe, arguments) and, for functions, per
    /// return (the value returned), on standard error.
    #[arg(long)]
    print: bool,
    /// Trace the running process PID instead of starting a program.
    #[arg(short = 'p', long = "pid", value_name = "PID", conflicts_with_all = ["command", "no_follow"])]
    pid: Option<i32>,
    /// Stop tracing after this many seconds (and report); fractions
    /// allowed (`0.5`).
    #[arg(short = 'd', long, value_name = "SECONDS", value_parser = positive_seconds)]
    duration: Option<f64>,
    /// Print the report every this many seconds too.
    #[arg(short = 'i', long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    interval: Option<u64>,
    /// Also write the final report as JSON to FILE (`-`: standard output).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Serve the live counts and histograms at ADDR (`127.0.0.1:9464`)
    /// in the `OpenMetrics` text format, for Prometheus to scrape.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Count the user stack of every hit and write them folded to FILE
    /// (`-`: standard output), for `flamegraph.pl` or `inferno`.
    #[arg(long, value_name = "FILE")]
    stacks: Option<PathBuf>,
    /// Probe with breakpoints only, never jumps (slower: to compare, or
    /// to rule the jumps out).
    #[arg(long)]
    breakpoints: bool,
    /// Do not trace the programs the traced program runs.
    #[arg(long)]
    no_follow: bool,
    /// Record each thread's calls and returns of the probed functions and
    /// write them nested, with durations, to FILE (`-`: standard output),
    /// as `uftrace replay` shows them.
    #[arg(long, value_name = "FILE")]
    flow: Option<PathBuf>,
    /// Break the counts down by KEY: `pid` or `comm` (each process counts
    /// under its key, at no cost a call; a fork child that does not exec
    /// counts under its parent's), or `tid`, `caller`, `arg0`..`arg5`,
    /// `ret` (read in every hit by a handler).
    #[arg(long, value_name = "KEY", value_parser = spec::parse_by)]
    by: Option<spec::By>,
    /// List the functions and USDT probes the specs match, with their
    /// objects, and attach nothing: in the objects a program loads at its
    /// start (it does not run), or those a running process has loaded
    /// (`--pid`).
    #[arg(long, conflicts_with_all = ["latency", "print", "hist", "stacks", "json", "metrics", "interval", "duration"])]
    list: bool,
    /// The agent library (default: `libuprobe_trace.so` next to this
    /// executable).
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, value_name = "PROGRAM")]
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

fn run(args: &Args) -> Result<ExitCode, Failure> {
    let plan = plan(args).map_err(Failure::Usage)?;
    let agent = program::agent_path(args.agent.as_deref()).map_err(Failure::Run);
    match (args.pid, args.command.is_empty()) {
        (Some(pid), _) => pid::trace(args, &plan, &agent?, pid),
        (None, false) => launch::trace(args, &plan, agent),
        (None, true) => Err(Failure::Usage(
            "nothing to run: give the program after --, or --pid PID".into(),
        )),
    }
}

/// The probes the command line asks for.
fn plan(args: &Args) -> Result<Plan, String> {
    let mut plan = Plan::default();
    for list in &args.functions {
        for f in split_list(list) {
            let (target, types) = spec::parse_function(f)?;
            plan.probes.push(with_filter(
                f,
                ProbeSpec {
                    args: types,
                    latency: args.latency,
                    print: args.print,
                    stacks: args.stacks.is_some(),
                    trap_only: args.breakpoints,
                    flow: args.flow.is_some(),
                    ..ProbeSpec::counting(target)
                },
            )?);
        }
    }
    for u in &args.usdt {
        let (target, types) = spec::parse_usdt(u)?;
        plan.probes.push(with_filter(
            u,
            ProbeSpec {
                args: types,
                print: args.print,
                stacks: args.stacks.is_some(),
                trap_only: args.breakpoints,
                ..ProbeSpec::counting(target)
            },
        )?);
    }
    for h in &args.hist {
        let (target, drawn) = spec::parse_hist(h)?;
        // Drawn by the probe the function already has, or a new one.
        match plan
            .probes
            .iter_mut()
            .find(|p| p.target == target && p.hist.is_none())
        {
            Some(p) => p.hist = Some(drawn),
            None => plan.probes.push(ProbeSpec {
                hist: Some(drawn),
                trap_only: args.breakpoints,
                ..ProbeSpec::counting(target)
            }),
        }
    }
    plan.exclude = args
        .exclude
        .iter()
        .flat_map(|x| split_list(x))
        .map(spec::parse_exclude)
        .collect::<Result<_, _>>()?;
    plan.list = args.list;
    plan.by = args.by;
    if args.by == Some(spec::By::Ret)
        && let Some(p) = plan
            .probes
            .iter()
            .find(|p| matches!(p.target, spec::Target::Usdt { .. }))
    {
        return Err(format!(
            "--by ret: {} is a USDT probe, which has no return value",
            p.label()
        ));
    }
    if let Some(by) = args.by.filter(|b| b.in_hit() && *b != spec::By::Ret)
        && let Some(p) = plan.probes.iter().find(|p| {
            p.filter
                .as_ref()
                .is_some_and(uprobe_trace::filter::Filter::uses_ret)
        })
    {
        return Err(format!(
            "--by {}: {} counts at the return (its filter tests ret), where the {} is not read",
            by.name(),
            p.label(),
            by.name()
        ));
    }
    if plan.probes.is_empty() {
        return Err("nothing to trace: give -f FUNCTIONS, -u PROBE or --hist".into());
    }
    if plan.probes.len() > uprobe_trace::shared::MAX_PROBES {
        return Err(format!(
            "{} probes: at most {}",
            plan.probes.len(),
            uprobe_trace::shared::MAX_PROBES
        ));
    }
    Ok(plan)
}

/// `probe` with the filter after ` if ` in its spec `text`, if any,
/// refused where it cannot apply: an argument the probe does not have (of
/// those its types name), a return value a USDT probe does not have, or
/// one whose call is known only at the return while `--print`, an
/// argument's `--hist` or `--stacks` act at the entry.
fn with_filter(text: &str, mut probe: ProbeSpec) -> Result<ProbeSpec, String> {
    let (_, filter) = spec::split_filter(text)?;
    let Some(filter) = filter else {
        return Ok(probe);
    };
    let label = probe.label();
    if let Some(n) = filter.max_arg()
        && !probe.args.is_empty()
        && usize::from(n) >= probe.args.len()
    {
        return Err(format!(
            "{text:?}: the filter reads arg{n}, but {label} has {} argument{}",
            probe.args.len(),
            if probe.args.len() == 1 { "" } else { "s" }
        ));
    }
    if filter.uses_ret() {
        if matches!(probe.target, spec::Target::Usdt { .. }) {
            return Err(format!("{text:?}: a USDT probe has no return value"));
        }
        if filter.max_arg().is_some() {
            return Err(format!(
                "{text:?}: a filter on ret decides at the return, where the arguments are gone: test ret, pid and tid"
            ));
        }
        if probe.print || probe.stacks || probe.flow {
            return Err(format!(
                "{text:?}: a filter on ret decides at the return: --print, --stacks and --flow act at the entry"
            ));
        }
    }
    probe.filter = Some(filter);
    Ok(probe)
}

/// Writes an output the user asked for to `path` (`-`: standard output).
fn write_output(path: &std::path::Path, text: &str) -> Result<(), Failure> {
    if path.as_os_str() == "-" {
        print!("{text}");
        Ok(())
    } else {
        std::fs::write(path, text)
            .map_err(|e| Failure::Run(format!("cannot write {}: {e}", path.display())))
    }
}

/// A positive number of seconds, for `--duration`.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() && s < 1e9 => Ok(s),
        _ => Err(format!("{text:?} is not a positive number of seconds")),
    }
}

/// The items of a comma-separated list, where commas inside parentheses
/// (argument types) do not separate.
fn split_list(list: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    items.into_iter().filter(|s| !s.is_empty()).collect()
}

/// The signal that asked the tool to stop (SIGINT, SIGTERM), or 0.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(sig: i32) {
    STOP_SIGNAL.store(sig, Ordering::Relaxed);
    // A second Ctrl-C ends the tool at once.
    // SAFETY: restoring the default disposition is async-signal-safe.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// Makes SIGINT and SIGTERM ask the tool to stop tracing and report.
fn catch_stop_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores an atomic and resets itself.
        unsafe { libc::signal(sig, on_stop_signal as *const () as libc::sighandler_t) };
    }
}

/// Why tracing ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The program exited (or every traced process did).
    Exited,
    /// SIGINT or SIGTERM.
    Signal(i32),
    /// `--duration` passed.
    Duration,
}

/// Waits for the end of tracing, printing the report every `--interval`:
/// `exited` says whether the program is gone; checked every 20 ms.
fn wait_for_end(args: &Args, mut exited: impl FnMut() -> bool, mut tick: impl FnMut()) -> End {
    let start = Instant::now();
    let mut next_report = args.interval.map(|s| start + Duration::from_secs(s));
    loop {
        if exited() {
            return End::Exited;
        }
        let sig = STOP_SIGNAL.load(Ordering::Relaxed);
        if sig != 0 {
            return End::Signal(sig);
        }
        if args
            .duration
            .is_some_and(|d| start.elapsed() >= Duration::from_secs_f64(d))
        {
            return End::Duration;
        }
        if let (Some(at), Some(every)) = (next_report, args.interval)
            && Instant::now() >= at
        {
            tick();
            next_report = Some(at + Duration::from_secs(every));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
