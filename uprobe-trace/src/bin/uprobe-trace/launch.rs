//! `uprobe-trace [...] -- PROGRAM`: runs the program with the agent
//! preloaded and reports when it exits (or when tracing is stopped
//! earlier: the agents detach, the report is printed, and the program
//! runs on untraced until it exits).

use std::io::{BufRead as _, Write as _};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use uprobe_trace::shared::Report;
use uprobe_trace::spec::{self, Plan};

use crate::report::Session;
use crate::{Args, End, Failure, program};

/// Runs the program under the agent (`agent`: its path, or why there is
/// none) and prints the report.
pub fn trace(
    args: &Args,
    plan: &Plan,
    agent: Result<PathBuf, Failure>,
) -> Result<ExitCode, Failure> {
    let program = program::find(&args.command[0])
        .ok_or_else(|| Failure::Usage(format!("{}: no such program", args.command[0])))?;
    program::refuse_unpreloadable(&program).map_err(Failure::Usage)?;
    let agent = agent?;
    let session = Session::create(plan)?;
    let result = run(args, plan, &program, &agent, &session);
    session.remove();
    result
}

fn run(
    args: &Args,
    plan: &Plan,
    program: &Path,
    agent: &Path,
    session: &Session,
) -> Result<ExitCode, Failure> {
    let mut command = std::process::Command::new(program);
    command.args(&args.command[1..]);
    let preload = match std::env::var(uprobe_trace::env::PRELOAD) {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", agent.display()),
        _ => agent.display().to_string(),
    };
    command
        .env(uprobe_trace::env::PRELOAD, preload)
        .env(uprobe_trace::env::REPORT, &session.path)
        .env(uprobe_trace::env::PROBES, spec::encode(plan));
    if args.no_follow {
        command.env(uprobe_trace::env::FOLLOW, "0");
    }
    if session.flow.is_some() {
        command.env(uprobe_trace::env::FLOW, session.dir.join("flow"));
    }
    let lines = if args.print {
        let (read, write) = pipe().map_err(|e| Failure::Run(format!("pipe: {e}")))?;
        command.env(uprobe_trace::env::PRINT_FD, write.to_string());
        Some((read, write))
    } else {
        None
    };
    if let Some(addr) = &args.metrics {
        crate::metrics::serve(addr, &session.path, plan)?;
    }
    crate::catch_stop_signals();
    let mut child = command
        .spawn()
        .map_err(|e| Failure::Run(format!("cannot run {}: {e}", program.display())))?;
    let printer = lines.map(|(read, write)| {
        // SAFETY: our copy of the write end (the child has its own).
        unsafe { libc::close(write) };
        std::thread::spawn(move || forward_lines(read))
    });
    let mut status = None;
    let end = crate::wait_for_end(
        args,
        || {
            status = status.take().or_else(|| child.try_wait().ok().flatten());
            status.is_some()
        },
        || session.print(plan, None),
    );
    if end != End::Exited {
        stop_agents(&session.report, || {
            child.try_wait().ok().flatten().is_some()
        });
        session.finish(args, plan, Some(end))?;
    }
    let status = match status {
        Some(s) => s,
        None => child
            .wait()
            .map_err(|e| Failure::Run(format!("wait: {e}")))?,
    };
    if let Some(p) = printer {
        let _ = p.join();
    }
    if end == End::Exited {
        session.finish(args, plan, None)?;
    }
    // A run that traced nothing says so, unless the program's own failure
    // says more.
    if plan.list {
        return Ok(if status.success() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if session.nothing_attached(plan) && status.success() {
        eprintln!("uprobe-trace: not one probe attached");
        return Ok(ExitCode::FAILURE);
    }
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        (None, Some(sig)) => {
            eprintln!("uprobe-trace: the program died of signal {sig}");
            ExitCode::from(u8::try_from(128 + sig).unwrap_or(1))
        }
        _ => ExitCode::FAILURE,
    })
}

/// Asks every agent to detach, and waits (at most 5 s) until those that
/// can have (a fork child has no agent thread: it keeps its probes);
/// returns whether one confirmed it (or the program is gone).
pub fn stop_agents(report: &Report, mut gone: impl FnMut() -> bool) -> bool {
    let header = report.header();
    header.stop.store(1, Relaxed);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if header.stopped.load(Relaxed) >= 1 || gone() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
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
pub fn forward_lines(read: i32) {
    use std::os::fd::FromRawFd as _;
    // SAFETY: the read end is ours alone.
    let file = unsafe { std::fs::File::from_raw_fd(read) };
    let stderr = std::io::stderr();
    for line in std::io::BufReader::new(file).lines() {
        let Ok(line) = line else { break };
        let _ = writeln!(stderr.lock(), "uprobe-trace: {line}");
    }
}
