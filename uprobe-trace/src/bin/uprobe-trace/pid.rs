//! `uprobe-trace --pid PID`: loads the agent into a running process,
//! traces until Ctrl-C, SIGTERM, `--duration` or the program's exit, then
//! has the agent detach every probe and prints the report.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use uprobe_trace::spec::{self, Plan};

use crate::report::Session;
use crate::{Args, End, Failure};

/// Traces process `pid` with the agent at `agent`.
pub fn trace(args: &Args, plan: &Plan, agent: &Path, pid: i32) -> Result<ExitCode, Failure> {
    if pid <= 0 || !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(Failure::Usage(format!("no process {pid}")));
    }
    if pid == std::process::id() as i32 {
        return Err(Failure::Usage("uprobe-trace cannot trace itself".into()));
    }
    let session = Session::create(plan)?;
    let fifo = args.print.then(|| session.dir.join("lines"));
    let result = run(args, plan, agent, pid, &session, fifo.as_deref());
    session.remove();
    result
}

fn run(
    args: &Args,
    plan: &Plan,
    agent: &Path,
    pid: i32,
    session: &Session,
    fifo: Option<&Path>,
) -> Result<ExitCode, Failure> {
    let lines = fifo.map(open_fifo).transpose()?;
    // Root tracing another user's process: the agent runs as that user.
    if let Some(uid) = owner(pid)
        // SAFETY: geteuid has no preconditions.
        && uid != unsafe { libc::geteuid() }
    {
        session.give_to(uid)?;
    }
    let settings = [
        session.path.display().to_string(),
        std::process::id().to_string(),
        fifo.map(|f| f.display().to_string()).unwrap_or_default(),
        session
            .flow
            .as_ref()
            .map(|_| session.dir.join("flow").display().to_string())
            .unwrap_or_default(),
        spec::encode(plan),
    ]
    .join(&uprobe_trace::ATTACH_FIELD.to_string());
    if let Some(addr) = &args.metrics {
        crate::metrics::serve(addr, &session.path, plan)?;
    }
    crate::catch_stop_signals();
    load(pid, agent, &settings)?;
    let printer = lines.map(|fd| std::thread::spawn(move || crate::launch::forward_lines(fd)));
    let header = session.report.header();
    // The first round of attaches, in the process.
    let alive = || Path::new(&format!("/proc/{pid}/task")).exists() && !is_zombie(pid);
    while header.ready.load(Relaxed) == 0 && alive() {
        std::thread::sleep(Duration::from_millis(10));
    }
    if plan.list {
        // Listed in the first round: the agent stops, having attached
        // nothing.
        crate::launch::stop_agents(&session.report, || !alive());
        drop(printer);
        session.finish(args, plan, None)?;
        return Ok(ExitCode::SUCCESS);
    }
    if alive() {
        eprintln!("uprobe-trace: tracing process {pid}; Ctrl-C to stop");
    }
    let end = crate::wait_for_end(args, || !alive(), || session.print(plan, None));
    if end != End::Exited && !crate::launch::stop_agents(&session.report, || !alive()) {
        eprintln!("uprobe-trace: the agent in process {pid} did not confirm its detach in 5 s");
    }
    drop(printer); // it ends with the process's last writer, or with us
    session.finish(args, plan, Some(end))?;
    if session.nothing_attached(plan) {
        return Err(Failure::Run("not one probe attached".into()));
    }
    Ok(ExitCode::SUCCESS)
}

/// Loads the agent, saying what went wrong in terms a user can act on.
fn load(pid: i32, agent: &Path, settings: &str) -> Result<(), Failure> {
    #[cfg(target_arch = "x86_64")]
    {
        crate::inject::load_agent(pid, agent, settings).map_err(|e| match e {
            crate::inject::Error::Gone => Failure::Run(format!("process {pid} exited")),
            e @ crate::inject::Error::NotPermitted(_) => Failure::Usage(e.to_string()),
            other => Failure::Run(other.to_string()),
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (agent, settings);
        Err(Failure::Usage(format!(
            "--pid is implemented on x86-64 only so far; start the program under uprobe-trace instead (-- PROGRAM) to trace process {pid}'s program"
        )))
    }
}

/// The user process `pid` opens files as (its file-system uid).
fn owner(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// Whether process `pid` is a zombie (exited, not yet reaped).
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// Makes the FIFO `--print` lines come through and opens it for reading
/// (read and write, so that opening does not wait for the agent, and the
/// agent's exit is not an end of file: the reader ends with the tool).
fn open_fifo(path: &Path) -> Result<i32, Failure> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Failure::Run(format!("{}: not a path", path.display())))?;
    // SAFETY: mkfifo and open on a path of ours.
    let fd = unsafe {
        if libc::mkfifo(c.as_ptr(), 0o600) != 0 {
            return Err(Failure::Run(format!(
                "mkfifo {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            )));
        }
        libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC)
    };
    if fd < 0 {
        return Err(Failure::Run(format!(
            "open {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(fd)
}
