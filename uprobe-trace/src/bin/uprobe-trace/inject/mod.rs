//! Loading the agent into a running process, as `gdb`'s `call` and
//! `frida-inject` do it: stop one of its threads with ptrace, make it call
//! `dlopen` on the agent and then [`uprobe_trace_attach`] with the
//! session's settings, and let it go on where it was. Only that thread
//! stops, only for those two calls; the others run on.
//!
//! **Where a thread may be borrowed.** `dlopen` allocates and takes the
//! loader's locks: a thread stopped while it holds one of those (in the
//! middle of `malloc`) would wait for itself. So a thread is borrowed only
//! where it holds none of libc's locks: running code outside libc and the
//! dynamic linker, or waiting in a system call that blocks (`read`,
//! `poll`, `nanosleep`, `epoll_wait`, ...; `futex` only after a second of
//! finding nothing better). Threads are tried in turn until one is at
//! such a point; a program busy in libc is caught between two calls.
//!
//! **What the thread finds when it goes on.** Its registers, vector
//! state included, are saved before the calls and restored after; the
//! calls run below its stack pointer and its red zone; a system call it
//! was waiting in is restarted as if a signal had interrupted it; a
//! signal that arrived meanwhile is delivered.
//!
//! [`uprobe_trace_attach`]: ../../uprobe_trace/index.html

#[cfg(target_arch = "x86_64")]
mod x86_64;
#[cfg(target_arch = "x86_64")]
use x86_64 as arch;

use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Why the agent could not be loaded.
#[derive(Debug)]
pub enum Error {
    /// No such process, or it exited meanwhile.
    Gone,
    /// The kernel refused to let us trace it; says why and what to change.
    NotPermitted(String),
    /// Anything else, said.
    Other(String),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Gone => f.write_str("the process exited"),
            Self::NotPermitted(why) | Self::Other(why) => f.write_str(why),
        }
    }
}

/// `dlopen`'s `RTLD_NOW`.
const RTLD_NOW: u64 = 2;

/// Loads the agent at `agent` into process `pid` and starts a session
/// there with `settings` (see `uprobe_trace_attach`). Returns once the
/// session started (its attaches go on in the process).
pub fn load_agent(pid: i32, agent: &Path, settings: &str) -> Result<(), Error> {
    // Whatever failed, a process that is gone is the reason.
    load(pid, agent, settings).map_err(|e| match e {
        Error::Other(why) => gone_or(pid, Error::Other(why)),
        Error::NotPermitted(why) => gone_or(pid, Error::NotPermitted(why)),
        Error::Gone => Error::Gone,
    })
}

fn load(pid: i32, agent: &Path, settings: &str) -> Result<(), Error> {
    check_traceable(pid)?;
    let maps = Maps::read(pid)?;
    let libc = maps.object(|name| name.starts_with("libc.so") || name.starts_with("libc-"))
        .ok_or_else(|| {
            Error::Other(format!(
                "process {pid} has no libc loaded (a statically linked program?): the agent cannot be loaded into it"
            ))
        })?;
    let dlopen = libc.symbol(pid, "dlopen")?;
    let dlerror = libc.symbol(pid, "dlerror")?;
    let mem = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .map_err(|e| Error::Other(format!("cannot open /proc/{pid}/mem: {e}")))?;
    let mut thread = borrow_thread(pid, &maps)?;
    let result = (|| {
        let path = c_string(agent.as_os_str().as_encoded_bytes());
        let handle = thread.call(&mem, dlopen, &[RTLD_NOW], &path)?;
        if handle == 0 {
            let message = thread.call(&mem, dlerror, &[], &[])?;
            return Err(Error::Other(format!(
                "the process could not load the agent: {}",
                read_c_string(&mem, message).unwrap_or_else(|| "dlopen failed".into())
            )));
        }
        let maps = Maps::read(pid)?;
        let own = std::fs::canonicalize(agent).unwrap_or_else(|_| agent.to_path_buf());
        let loaded = maps
            .object_at(&own)
            .ok_or_else(|| Error::Other("the agent is not mapped after dlopen".into()))?;
        let attach = loaded.symbol(pid, "uprobe_trace_attach")?;
        let rc = thread.call(&mem, attach, &[], &c_string(settings.as_bytes()))?;
        match rc as i32 {
            0 => Ok(()),
            libc::EBUSY => Err(Error::Other(format!(
                "process {pid} is already traced by another uprobe-trace"
            ))),
            libc::EPROTO => Err(Error::Other(format!(
                "the agent {} loaded in process {pid} is another build than this tool (rebuild both, or give --agent)",
                agent.display()
            ))),
            libc::ENOENT => Err(Error::Other(format!(
                "process {pid} cannot open the report in {} (a private /tmp, another user?): set TMPDIR to a directory both can reach",
                std::env::temp_dir().display()
            ))),
            other => Err(Error::Other(format!(
                "the agent could not start in process {pid}: {}",
                std::io::Error::from_raw_os_error(other)
            ))),
        }
    })();
    thread.release();
    result
}

/// A C string's bytes.
fn c_string(bytes: &[u8]) -> Vec<u8> {
    let mut v = bytes.to_vec();
    v.push(0);
    v
}

/// The C string at `addr` in the process (at most 4 KiB).
fn read_c_string(mem: &std::fs::File, addr: u64) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    let n = mem.read_at(&mut buf, addr).ok()?;
    let end = buf[..n].iter().position(|&b| b == 0)?;
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// `Gone` if the process is gone, a zombie, or exiting (its memory map
/// already empty: ptrace refuses it, its libc is unmapped), else `error`.
fn gone_or(pid: i32, error: Error) -> Error {
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    }) && std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .is_ok_and(|m| !m.is_empty());
    if alive { error } else { Error::Gone }
}

/// Refuses early, and clearly, what ptrace would refuse.
fn check_traceable(pid: i32) -> Result<(), Error> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| Error::Gone)?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or("", str::trim)
            .to_string()
    };
    let tracer = field("TracerPid:");
    if !tracer.is_empty() && tracer != "0" {
        return Err(Error::NotPermitted(format!(
            "process {pid} is already traced by process {tracer} (a debugger, strace?): a process has one tracer at a time"
        )));
    }
    if field("State:").starts_with('Z') {
        return Err(Error::Gone);
    }
    Ok(())
}

/// The message for a refused `PTRACE_SEIZE`.
fn not_permitted(pid: i32) -> Error {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    let why = match scope {
        Some(1) => "kernel.yama.ptrace_scope is 1: only a process's ancestors may trace it. Run as root (or with CAP_SYS_PTRACE), or allow it with `sudo sysctl kernel.yama.ptrace_scope=0`, or start the program under uprobe-trace (-- PROGRAM)".to_string(),
        Some(2) => "kernel.yama.ptrace_scope is 2: only root (CAP_SYS_PTRACE) may trace. Run as root, or set it to 0 or 1 with sysctl".to_string(),
        Some(3) => "kernel.yama.ptrace_scope is 3: tracing is disabled until reboot. Start the program under uprobe-trace instead (-- PROGRAM)".to_string(),
        _ => "it belongs to another user, or is setuid, or not dumpable: run as its user or as root (CAP_SYS_PTRACE)".to_string(),
    };
    Error::NotPermitted(format!("not permitted to trace process {pid}: {why}"))
}

/// A process's memory map, as far as loading the agent needs it.
struct Maps {
    /// `(start, end, offset, path)` of every file mapping.
    files: Vec<(u64, u64, u64, PathBuf)>,
}

/// An object file mapped in the process.
struct Mapped {
    /// Where its file offset 0 is mapped.
    base: u64,
    path: PathBuf,
}

impl Maps {
    fn read(pid: i32) -> Result<Self, Error> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|_| Error::Gone)?;
        let mut files = Vec::new();
        for line in text.lines() {
            let mut f = line.split_whitespace();
            let (Some(range), Some(_perms), Some(offset), Some(_dev), Some(_inode)) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                continue;
            };
            let path: Vec<&str> = f.collect();
            let path = path.join(" ");
            if !path.starts_with('/') {
                continue;
            }
            let Some((start, end)) = range.split_once('-') else {
                continue;
            };
            let hex = |s: &str| u64::from_str_radix(s, 16).ok();
            if let (Some(start), Some(end), Some(offset)) = (hex(start), hex(end), hex(offset)) {
                files.push((start, end, offset, PathBuf::from(path)));
            }
        }
        Ok(Self { files })
    }

    /// The first object whose file name `name` accepts.
    fn object(&self, mut name: impl FnMut(&str) -> bool) -> Option<Mapped> {
        let path = self
            .files
            .iter()
            .map(|f| &f.3)
            .find(|p| p.file_name().is_some_and(|n| name(&n.to_string_lossy())))?;
        self.object_at(path)
    }

    /// The object mapped from `path`.
    fn object_at(&self, path: &Path) -> Option<Mapped> {
        self.files
            .iter()
            .filter(|f| f.3 == path)
            .map(|f| f.0 - f.2)
            .min()
            .map(|base| Mapped {
                base,
                path: path.to_path_buf(),
            })
    }

    /// Whether `pc` is in libc or the dynamic linker, whose locks a thread
    /// may hold there.
    fn in_libc(&self, pc: u64) -> bool {
        self.files.iter().any(|(start, end, _, path)| {
            (*start..*end).contains(&pc)
                && path.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    ["libc.so", "libc-", "ld-linux", "ld-", "libpthread", "libdl"]
                        .iter()
                        .any(|p| n.starts_with(p))
                })
        })
    }
}

impl Mapped {
    /// The address of dynamic symbol `name` in the process (the object's
    /// file read as the process sees it, through `/proc/PID/root`).
    fn symbol(&self, pid: i32, name: &str) -> Result<u64, Error> {
        use object::{Object as _, ObjectSymbol as _};
        let seen = Path::new(&format!("/proc/{pid}/root"))
            .join(self.path.strip_prefix("/").unwrap_or(&self.path));
        let data = std::fs::read(&seen)
            .or_else(|_| std::fs::read(&self.path))
            .map_err(|e| Error::Other(format!("cannot read {}: {e}", self.path.display())))?;
        let file = object::File::parse(&*data)
            .map_err(|e| Error::Other(format!("{}: {e}", self.path.display())))?;
        file.dynamic_symbols()
            .find(|s| s.name() == Ok(name) && !s.is_undefined() && s.address() != 0)
            .map(|s| self.base + s.address())
            .ok_or_else(|| {
                Error::Other(format!(
                    "{} has no {name} (a libc older than 2.34 keeps dlopen in libdl, which this tool does not look in)",
                    self.path.display()
                ))
            })
    }
}

/// A thread of the process, stopped by us at a point where it may be
/// borrowed.
struct Borrowed {
    tid: i32,
    regs: arch::Regs,
    vector: Vec<u8>,
    /// A signal that arrived as we stopped it, delivered when it goes on.
    signal: i32,
}

/// The process's threads.
fn threads(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|t| t.parse().ok()))
                .collect()
        })
        .unwrap_or_default()
}

/// Stops threads of `pid` in turn until one is at a point where it may be
/// borrowed (see the module's docs); gives up after 10 s.
fn borrow_thread(pid: i32, maps: &Maps) -> Result<Borrowed, Error> {
    let start = Instant::now();
    loop {
        let tids = threads(pid);
        if tids.is_empty() {
            return Err(Error::Gone);
        }
        let patient = start.elapsed() > Duration::from_secs(1);
        for tid in tids {
            let Some((regs, signal)) = stop(pid, tid)? else {
                continue; // it exited meanwhile
            };
            let safe = !maps.in_libc(arch::pc(&regs))
                || arch::interrupted_syscall(&regs).is_some_and(|nr| {
                    arch::blocks_without_locks(nr) || (patient && nr == arch::FUTEX)
                });
            if safe {
                let vector = arch::vector_state(tid)?;
                return Ok(Borrowed {
                    tid,
                    regs,
                    vector,
                    signal,
                });
            }
            detach(tid, signal);
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(Error::Other(format!(
                "no thread of process {pid} reached a point where it holds none of libc's locks in 10 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Seizes and stops thread `tid`: its registers, and a signal that
/// arrived as it stopped (0: none). `None` if it exited meanwhile.
fn stop(pid: i32, tid: i32) -> Result<Option<(arch::Regs, i32)>, Error> {
    // SAFETY: ptrace requests on a thread id; no memory of ours is passed.
    if unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) } != 0 {
        let err = std::io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ESRCH) => Ok(None),
            Some(libc::EPERM) => Err(not_permitted(pid)),
            _ => Err(Error::Other(format!("ptrace(SEIZE, {tid}): {err}"))),
        };
    }
    // SAFETY: as above.
    unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) };
    let mut signal = 0;
    loop {
        match wait(tid)? {
            Stop::Exited => return Ok(None),
            Stop::Event => break,
            Stop::Signal(sig) => {
                // Delivered when it goes on; wait for the interrupt's stop.
                signal = sig;
                // SAFETY: resuming without the signal (kept for later).
                unsafe { libc::ptrace(libc::PTRACE_CONT, tid, 0, 0) };
                // SAFETY: as above.
                unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) };
            }
        }
    }
    match arch::regs(tid) {
        Ok(regs) => Ok(Some((regs, signal))),
        Err(e) => {
            detach(tid, signal);
            Err(e)
        }
    }
}

/// Lets thread `tid` go, delivering `signal` (0: none).
fn detach(tid: i32, signal: i32) {
    // SAFETY: ptrace on a thread we seized.
    unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, libc::c_long::from(signal)) };
}

/// How a traced thread stopped.
enum Stop {
    /// It exited (or was killed).
    Exited,
    /// A ptrace event stop (our interrupt, a group stop).
    Event,
    /// A signal is about to be delivered.
    Signal(i32),
}

/// Waits for thread `tid` to stop.
fn wait(tid: i32) -> Result<Stop, Error> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes `status`.
        let r = unsafe { libc::waitpid(tid, &raw mut status, libc::__WALL) };
        if r == tid {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Other(format!("waitpid({tid}): {err}")));
        }
    }
    if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
        return Ok(Stop::Exited);
    }
    let sig = libc::WSTOPSIG(status);
    // An event stop carries the event in bits 16 and up.
    if status >> 16 != 0 {
        return Ok(Stop::Event);
    }
    Ok(Stop::Signal(sig))
}

impl Borrowed {
    /// Calls `func(data, args...)` on the thread: `data` (if not empty) is
    /// copied below its stack and its address passed as the first
    /// argument. Returns what the function returned.
    fn call(
        &mut self,
        mem: &std::fs::File,
        func: u64,
        args: &[u64],
        data: &[u8],
    ) -> Result<u64, Error> {
        let below = arch::stack_below(&self.regs);
        let data_at = (below - data.len() as u64) & !15;
        if !data.is_empty() {
            mem.write_all_at(data, data_at)
                .map_err(|e| Error::Other(format!("writing the process's stack: {e}")))?;
        }
        let mut all: Vec<u64> = Vec::new();
        if !data.is_empty() {
            all.push(data_at);
        }
        all.extend_from_slice(args);
        let regs = arch::call_regs(&self.regs, func, &all, data_at, mem)?;
        arch::set_regs(self.tid, &regs)?;
        // SAFETY: resuming the thread we stopped.
        unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) };
        loop {
            match wait(self.tid)? {
                Stop::Exited => return Err(Error::Gone),
                Stop::Signal(libc::SIGSEGV) => {
                    let now = arch::regs(self.tid)?;
                    if arch::pc(&now) == arch::RETURN_TO {
                        return Ok(arch::result(&now));
                    }
                    return Err(Error::Other(format!(
                        "the process crashed in a call the agent's loading made (at {:#x})",
                        arch::pc(&now)
                    )));
                }
                // A signal for the thread: delivered (its handler runs on
                // the stack below the call's).
                Stop::Signal(sig) => {
                    // SAFETY: resuming with the signal.
                    unsafe {
                        libc::ptrace(libc::PTRACE_CONT, self.tid, 0, libc::c_long::from(sig))
                    };
                }
                Stop::Event => {
                    // SAFETY: resuming.
                    unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0, 0) };
                }
            }
        }
    }

    /// Restores the thread as it was and lets it go.
    fn release(self) {
        let _ = arch::set_vector_state(self.tid, &self.vector);
        let _ = arch::set_regs(self.tid, &self.regs);
        detach(self.tid, self.signal);
    }
}
