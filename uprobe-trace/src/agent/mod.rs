//! The agent: runs inside the traced program. It gets there in one of two
//! ways:
//!
//! - **preloaded** (`uprobe-trace -- PROGRAM`): the dynamic linker loads
//!   it with the program, and its constructor runs before `main`, reading
//!   what to probe and where the report is from the environment;
//! - **loaded into a running process** (`uprobe-trace --pid PID`): the
//!   tool makes one of the program's threads call `dlopen` and then
//!   [`uprobe_trace_attach`] with the same settings in a string.
//!
//! Either way it attaches what it can on a thread of its own, keeps
//! attaching as objects are loaded (`dlopen`), and when the tool asks
//! (or, loaded into a running process, when the tool is gone) detaches
//! every probe and stops its thread. Every handler is async-signal-safe:
//! atomic adds into the shared report, `clock_gettime` (vDSO), and for
//! `--print` a line formatted on the stack and `write(2)`n.
//!
//! - [`threads`]: which threads are the agent's (their calls are not the
//!   program's), and the `dlopen` and `pthread_create` it interposes;
//! - [`attach`]: attaching probes, patterns and objects loaded later;
//! - [`list`]: `--list`, what probes would attach, attaching nothing;
//! - [`handlers`]: what a hit does;
//! - [`signals`]: SIGTRAP kept deliverable in every thread (preloaded);
//! - [`text`]: the agent's code pages given back when a session in a
//!   running process ends.

mod attach;
mod handlers;
mod list;
mod signals;
mod text;
mod threads;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicPtr};
use std::sync::{Mutex, PoisonError};

use uprobe_core::Probe;

use crate::shared::{Flow, KEY_SEP, Report};
use crate::spec::{By, Plan};
use threads::{MAIN_THREAD, gettid};

// Run `init` when the dynamic linker loads the agent.
#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

/// The agent, while a session runs (for the `dlopen` wrapper).
static AGENT: AtomicPtr<Agent> = AtomicPtr::new(core::ptr::null_mut());

/// Whether a session runs in this process (one at a time).
static SESSION: AtomicBool = AtomicBool::new(false);

/// One tracing session: everything the agent keeps from the first attach
/// to the last detach.
struct Agent {
    report: Report,
    plan: Plan,
    print_fd: Option<i32>,
    /// Per probe asked for: the addresses attached so far (USDT probes and
    /// patterns may gain sites as objects load), and whether it is done.
    state: Mutex<Vec<(HashSet<usize>, bool)>>,
    /// The attached probes, detached when the session stops.
    probes: Mutex<Vec<Probe>>,
    /// Set once the first round of attaches is done.
    ready: AtomicBool,
    /// Set once the session stops: nothing more is attached.
    stopping: AtomicBool,
    /// One program thread at a time attaches after a `dlopen`; the stop
    /// waits for it.
    dlopens: Mutex<()>,
    /// The tool, for an agent loaded into a running process: when it is
    /// gone, the session stops (a pidfd, or its pid where the kernel has
    /// no pidfds).
    tool: Option<Tool>,
    /// The agent's own file: patterns never probe the agent.
    own_object: Option<PathBuf>,
    /// This agent's number in the report (its objects and stacks).
    id: u32,
    /// `--by`: the key this process counts under.
    key: Option<String>,
    /// `--flow`: where calls and returns are recorded.
    flow: Option<Flow>,
    /// Whether some probe counts stacks.
    stacks: bool,
    /// The objects listed in the report so far (path, bias).
    listed: Mutex<HashSet<(PathBuf, usize)>>,
}

/// The tool's process, watched by an agent loaded into a running one.
#[derive(Clone, Copy)]
enum Tool {
    Pidfd(i32),
    Pid(i32),
}

impl Tool {
    fn watch(pid: i32) -> Self {
        // SAFETY: pidfd_open only creates a descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd >= 0 {
            Self::Pidfd(fd as i32)
        } else {
            Self::Pid(pid)
        }
    }

    fn is_gone(self) -> bool {
        match self {
            Self::Pidfd(fd) => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: polling one descriptor of ours, without waiting.
                unsafe { libc::poll(&raw mut p, 1, 0) == 1 }
            }
            // SAFETY: kill with signal 0 only checks.
            Self::Pid(pid) => unsafe { libc::kill(pid, 0) != 0 },
        }
    }

    fn close(self) {
        if let Self::Pidfd(fd) = self {
            // SAFETY: our descriptor.
            unsafe { libc::close(fd) };
        }
    }
}

extern "C" fn init() {
    if std::env::var_os(crate::env::REPORT).is_none() || !in_shared_object() {
        return; // not traced, or linked into the tool itself, or --pid
    }
    // Everything the agent allocates and frees on the program's thread
    // (reading the environment, starting its own thread) is not counted.
    let observed = threads::mark_self(0);
    MAIN_THREAD.store(gettid(), Relaxed);
    preloaded();
    threads::unmark_self(0, observed);
}

/// Preloaded: reads the settings from the environment, then attaches on
/// the agent's own thread (whatever thread-local state the runtime sets
/// up for the attach is that thread's, not the program's) while the
/// program waits.
fn preloaded() {
    let Some(path) = std::env::var_os(crate::env::REPORT) else {
        return;
    };
    signals::prepare();
    let report = match Report::open(Path::new(&path)) {
        Ok(report) => report,
        Err(e) => {
            // The tool's report cannot say it: the program's standard
            // error does.
            eprintln!(
                "uprobe-trace agent: cannot use the report {}: {e}",
                Path::new(&path).display()
            );
            return;
        }
    };
    let plan = std::env::var(crate::env::PROBES).unwrap_or_default();
    let print_fd = std::env::var(crate::env::PRINT_FD)
        .ok()
        .and_then(|fd| fd.parse().ok());
    if std::env::var(crate::env::FOLLOW).as_deref() == Ok("0") {
        forget_environment();
    }
    let flow = std::env::var_os(crate::env::FLOW).and_then(|p| Flow::open(Path::new(&p)).ok());
    let Some(agent) = begin(report, &plan, print_fd, None, flow) else {
        return;
    };
    while !agent.ready.load(Acquire) {
        // SAFETY: sleeping 100 us.
        unsafe { libc::usleep(100) };
    }
    if agent.plan.list {
        // Listed: the program does not run.
        // SAFETY: ending the process before `main`; the report is in
        // shared memory already.
        unsafe { libc::_exit(0) };
    }
}

/// Starts a session in a running process, into which the tool loaded
/// this library: `settings` is `REPORT GS TOOL_PID GS PRINT_PATH GS
/// FLOW_PATH GS PLAN` (`GS` is [`ATTACH_FIELD`](crate::ATTACH_FIELD);
/// `PRINT_PATH` a FIFO the tool reads, or empty; `FLOW_PATH` the `--flow`
/// file, or empty; `PLAN` as [`spec::encode`](crate::spec::encode) writes
/// it).
/// Returns at once (the attaches run on the agent's thread): 0, or
/// `EBUSY` while another session runs, `EINVAL` for settings it cannot
/// read, `ENOENT` when the report cannot be opened, `EPROTO` when another
/// build of the tool made it, or `pthread_create`'s error.
///
/// # Safety
/// `settings` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn uprobe_trace_attach(settings: *const libc::c_char) -> libc::c_int {
    if settings.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a C string.
    let settings = unsafe { core::ffi::CStr::from_ptr(settings) }.to_string_lossy();
    let fields: Vec<&str> = settings.splitn(5, crate::ATTACH_FIELD).collect();
    let [report, tool, print, flow, plan] = fields.as_slice() else {
        return libc::EINVAL;
    };
    let Ok(tool) = tool.parse::<i32>() else {
        return libc::EINVAL;
    };
    let report = match Report::open(Path::new(report)) {
        Ok(report) => report,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return libc::EPROTO,
        Err(_) => return libc::ENOENT,
    };
    if SESSION.swap(true, Acquire) {
        return libc::EBUSY;
    }
    let print_fd = (!print.is_empty())
        .then(|| {
            let path = std::ffi::CString::new(*print).ok()?;
            // SAFETY: opening the tool's FIFO for writing; it has it open
            // for reading, so this does not wait.
            let fd = unsafe {
                libc::open(
                    path.as_ptr(),
                    libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
                )
            };
            (fd >= 0).then_some(fd)
        })
        .flatten();
    let flow = (!flow.is_empty())
        .then(|| Flow::open(Path::new(flow)).ok())
        .flatten();
    match begin(report, plan, print_fd, Some(Tool::watch(tool)), flow) {
        Some(_) => 0,
        None => libc::EAGAIN,
    }
}

/// Starts a session: reads the plan, starts the agent's thread. `None`
/// (the error in the report) when it cannot.
fn begin(
    report: Report,
    plan: &str,
    print_fd: Option<i32>,
    tool: Option<Tool>,
    flow: Option<Flow>,
) -> Option<&'static Agent> {
    SESSION.store(true, Relaxed);
    let id = report.header().agents.fetch_add(1, Relaxed) as u32 + 1;
    let plan = match crate::spec::decode(plan) {
        Ok(plan) => plan,
        Err(e) => {
            report.header().set_error(&e);
            SESSION.store(false, Release);
            return None;
        }
    };
    // Stacks and callers are symbolized in the objects the agent lists.
    let stacks = plan.probes.iter().any(|p| p.stacks) || plan.by == Some(By::Caller);
    let key = match plan.by {
        Some(By::Pid) => Some(std::process::id().to_string()),
        Some(By::Comm) => Some(
            std::fs::read_to_string("/proc/self/comm")
                .map_or_else(|_| "?".into(), |c| c.trim_end().replace(KEY_SEP, "?")),
        ),
        _ => None,
    };
    let agent: &'static Agent = Box::leak(Box::new(Agent {
        state: Mutex::new(vec![(HashSet::new(), false); plan.probes.len()]),
        report,
        plan,
        print_fd,
        probes: Mutex::new(Vec::new()),
        ready: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        dlopens: Mutex::new(()),
        tool,
        own_object: own_object(),
        id,
        stacks,
        listed: Mutex::new(HashSet::new()),
        key,
        flow,
    }));
    AGENT.store(core::ptr::from_ref(agent).cast_mut(), Release);
    // A plain pthread: `std::thread` would set up thread-local state on
    // the program's thread, freed (and counted) when it exits.
    let mut thread: libc::pthread_t = 0;
    // SAFETY: a new thread running `agent_thread` on the leaked agent.
    let rc = unsafe {
        libc::pthread_create(
            &raw mut thread,
            core::ptr::null(),
            agent_thread,
            core::ptr::from_ref(agent).cast_mut().cast(),
        )
    };
    if rc != 0 {
        agent.report.header().set_error(&format!(
            "cannot start the agent's thread: {}",
            std::io::Error::from_raw_os_error(rc)
        ));
        AGENT.store(core::ptr::null_mut(), Release);
        SESSION.store(false, Release);
        return None;
    }
    // SAFETY: the thread is never joined.
    unsafe { libc::pthread_detach(thread) };
    Some(agent)
}

/// The agent's thread: the first round of attaches, then the watch for
/// objects loaded later, until the session stops.
extern "C" fn agent_thread(agent: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: the leaked agent `begin` passes.
    let agent: &'static Agent = unsafe { &*agent.cast::<Agent>() };
    let observed = threads::mark_self(1);
    if agent.stacks {
        uprobe_core::unwind::refresh();
        agent.list_objects();
    }
    agent.attach_pending();
    threads::watch_forks();
    threads::adopt_engine_threads();
    agent.report.header().ready.fetch_add(1, Release);
    agent.ready.store(true, Release);
    agent.watch();
    agent.stop();
    // Its id may now be another thread's.
    threads::unmark_self(1, observed);
    core::ptr::null_mut()
}

impl Agent {
    /// Whether the session is asked to stop: by the tool, or (loaded into
    /// a running process) because the tool is gone.
    fn stop_asked(&self) -> bool {
        self.report.header().stop.load(Relaxed) != 0 || self.tool.is_some_and(Tool::is_gone)
    }

    /// Detaches every probe (their handlers have all returned when it
    /// returns), says so in the report, and lets another session start.
    fn stop(&'static self) {
        let serial = self.dlopens.lock().unwrap_or_else(PoisonError::into_inner);
        self.stopping.store(true, Relaxed);
        AGENT.store(core::ptr::null_mut(), Release);
        drop(serial);
        let probes =
            std::mem::take(&mut *self.probes.lock().unwrap_or_else(PoisonError::into_inner));
        if let Err(e) = Probe::detach_all(probes) {
            self.report.header().set_error(&format!("detaching: {e}"));
        }
        if let Some(fd) = self.print_fd
            && self.tool.is_some()
        {
            // SAFETY: the FIFO this session opened.
            unsafe { libc::close(fd) };
        }
        if let Some(tool) = self.tool {
            tool.close();
            // Loaded into a running process: give back what the session
            // allocated (the engine's caches, the heap the agent's thread
            // grew), so that the process is left as it was found.
            uprobe_core::release_caches();
            // SAFETY: malloc_trim only returns free heap memory.
            unsafe { libc::malloc_trim(0) };
        }
        self.report.header().stopped.fetch_add(1, Release);
        if self.tool.is_some() {
            // Nothing of the session reads it any more: the handlers are
            // detached (none runs or will run), the `dlopen` wrapper
            // no longer finds the agent, and this thread is done with it.
            // SAFETY: as said.
            unsafe { self.report.unmap() };
            // Last: what runs from here on reads its pages back.
            if let Some(own) = &self.own_object {
                text::give_back(own);
            }
        }
        SESSION.store(false, Release);
    }
}

/// The file this library was loaded from, if the dynamic linker says.
fn own_object() -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe {
        // SAFETY: an all-zero Dl_info is valid; dladdr fills it.
        core::mem::zeroed()
    };
    // SAFETY: dladdr only reads the address and writes `info`.
    let found = unsafe { libc::dladdr(init as *const libc::c_void, &raw mut info) } != 0;
    (found && !info.dli_fname.is_null()).then(|| {
        // SAFETY: a C string owned by the dynamic linker.
        let name = unsafe { core::ffi::CStr::from_ptr(info.dli_fname) };
        let path = PathBuf::from(name.to_string_lossy().into_owned());
        std::fs::canonicalize(&path).unwrap_or(path)
    })
}

/// Whether this code runs from the shared library (the tool's own
/// executable links the same code).
fn in_shared_object() -> bool {
    own_object().is_some_and(|p| {
        p.file_name()
            .is_some_and(|f| f.as_encoded_bytes().windows(3).any(|w| w == b".so"))
    })
}

/// `--no-follow`: what the program runs next gets neither the agent nor
/// its settings. Runs in the constructor, before any thread of the
/// program exists.
fn forget_environment() {
    let preload = std::env::var(crate::env::PRELOAD).unwrap_or_default();
    let kept: Vec<&str> = preload
        .split([' ', ':'])
        .filter(|p| !p.is_empty() && !p.contains("uprobe_trace"))
        .collect();
    // SAFETY: the process is single-threaded while constructors run (no
    // thread reads the environment concurrently).
    unsafe {
        if kept.is_empty() {
            std::env::remove_var(crate::env::PRELOAD);
        } else {
            std::env::set_var(crate::env::PRELOAD, kept.join(":"));
        }
        for var in [
            crate::env::REPORT,
            crate::env::PROBES,
            crate::env::PRINT_FD,
            crate::env::FOLLOW,
            crate::env::FLOW,
        ] {
            std::env::remove_var(var);
        }
    }
}
