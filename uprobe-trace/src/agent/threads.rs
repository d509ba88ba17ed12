//! Which threads are the agent's: their calls to probed functions are not
//! the program's and are not counted. The agent's own threads, the
//! engine's service threads (marked as they start, through the
//! `pthread_create` the agent interposes when preloaded, or found by name
//! when loaded into a running process), and a program thread while it
//! attaches after its `dlopen` (interposed too) or runs the engine's fork
//! handlers. Each makes itself not observed by the engine
//! ([`mark_self`]; the engine's own threads do so as they start), so no
//! handler runs and nothing counts there; the ids kept here let the
//! interposed `dlopen` and `pthread_create` tell the agent's calls from
//! the program's.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicI32};

use super::AGENT;

/// The threads the agent itself runs on (the program's thread while the
/// constructor runs, then the agent's own): their calls to probed
/// functions (`malloc` in an attach, `free` as their thread-local state
/// is released at exit) are not the program's and are not counted. Kept
/// by thread id, not in thread-local storage, which the runtime tears
/// down before the thread's last frees.
/// The third: a program thread attaching after its `dlopen`.
pub(super) static AGENT_THREADS: [AtomicI32; 3] = [const { AtomicI32::new(0) }; 3];

/// The program's `dlopen`, through the agent: probes waiting for an object
/// are attached as soon as it is loaded, before `dlopen` returns.
///
/// # Safety
/// As `dlopen(3)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlopen(file: *const libc::c_char, mode: libc::c_int) -> *mut libc::c_void {
    type Dlopen = unsafe extern "C" fn(*const libc::c_char, libc::c_int) -> *mut libc::c_void;
    static NEXT: core::sync::atomic::AtomicUsize = core::sync::atomic::AtomicUsize::new(0);
    let mut next = NEXT.load(Relaxed);
    if next == 0 {
        // SAFETY: looking up the next `dlopen` (libc's) by name.
        next = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlopen".as_ptr()) } as usize;
        NEXT.store(next, Relaxed);
    }
    if next == 0 {
        return core::ptr::null_mut();
    }
    // SAFETY: libc's dlopen, with the caller's arguments.
    let handle = unsafe { core::mem::transmute::<usize, Dlopen>(next)(file, mode) };
    let agent = AGENT.load(core::sync::atomic::Ordering::Acquire);
    // The agent's own look-ups (`dlopen(RTLD_NOLOAD)` while it attaches)
    // are not the program's loads.
    if !handle.is_null() && !agent.is_null() && !is_agent(gettid()) {
        // SAFETY: the agent is leaked once started.
        unsafe { &*agent }.after_dlopen();
    }
    handle
}

/// Marks the calling thread as the agent's in `AGENT_THREADS[k]` and
/// its probe hits as not observed (counting probes count nothing for it,
/// handlers do not run); returns what [`unmark_self`] restores.
/// Async-signal-safe.
pub(super) fn mark_self(k: usize) -> bool {
    AGENT_THREADS[k].store(gettid(), Relaxed);
    uprobe_core::set_thread_observed(false)
}

/// Undoes [`mark_self`]`(k)`, given what it returned. Async-signal-safe.
pub(super) fn unmark_self(k: usize, observed: bool) {
    uprobe_core::set_thread_observed(observed);
    AGENT_THREADS[k].store(0, Relaxed);
}

/// The process that is forking (0: none): in its child, until the
/// engine's fork handlers are done, every call is theirs (the child has
/// one thread, whose id is not the parent's).
static FORKING: AtomicI32 = AtomicI32::new(0);

/// Whether thread `tid` is the agent's. Async-signal-safe.
fn is_agent(tid: i32) -> bool {
    let forking = FORKING.load(Relaxed);
    // SAFETY: getpid has no preconditions (asked only during a fork).
    (forking != 0 && forking != unsafe { libc::getpid() })
        || AGENT_THREADS.iter().any(|t| t.load(Relaxed) == tid)
        // Filled in order: the scan stops at the first free slot.
        || ENGINE_THREADS
            .iter()
            .map(|t| t.load(Relaxed))
            .take_while(|&t| t != 0)
            .any(|t| t == tid)
}

/// The threads the agent's own code started (the engine's service
/// threads, through [`pthread_create`]): their calls are not the
/// program's.
static ENGINE_THREADS: [AtomicI32; 16] = [const { AtomicI32::new(0) }; 16];

/// A thread the agent's code started: marks itself as the agent's, then
/// runs what it was started for.
extern "C" fn engine_thread(p: *mut libc::c_void) -> *mut libc::c_void {
    mark_engine_thread(gettid());
    let _ = uprobe_core::set_thread_observed(false);
    // SAFETY: boxed below, taken once.
    let (start, arg) = *unsafe {
        Box::from_raw(p.cast::<(extern "C" fn(*mut libc::c_void) -> *mut libc::c_void, usize)>())
    };
    start(arg as *mut libc::c_void)
}

/// The program's `pthread_create`, through the agent: a thread started
/// from the agent's own code (the engine starting a service thread while
/// it attaches) is marked as the agent's before it runs anything.
///
/// # Safety
/// As `pthread_create(3)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: extern "C" fn(*mut libc::c_void) -> *mut libc::c_void,
    arg: *mut libc::c_void,
) -> libc::c_int {
    type Create = unsafe extern "C" fn(
        *mut libc::pthread_t,
        *const libc::pthread_attr_t,
        extern "C" fn(*mut libc::c_void) -> *mut libc::c_void,
        *mut libc::c_void,
    ) -> libc::c_int;
    static NEXT: core::sync::atomic::AtomicUsize = core::sync::atomic::AtomicUsize::new(0);
    let mut next = NEXT.load(Relaxed);
    if next == 0 {
        // SAFETY: looking up the next `pthread_create` (libc's) by name.
        next = unsafe { libc::dlsym(libc::RTLD_NEXT, c"pthread_create".as_ptr()) } as usize;
        NEXT.store(next, Relaxed);
    }
    if next == 0 {
        return libc::ENOSYS;
    }
    // SAFETY: libc's pthread_create.
    let create = unsafe { core::mem::transmute::<usize, Create>(next) };
    if MAIN_THREAD.load(Relaxed) == 0 || !is_agent(gettid()) {
        // SAFETY: the caller's arguments, as given.
        return unsafe { create(thread, attr, start, arg) };
    }
    let boxed = Box::into_raw(Box::new((start, arg as usize)));
    // SAFETY: libc's pthread_create, starting `engine_thread` on our box.
    let rc = unsafe { create(thread, attr, engine_thread, boxed.cast()) };
    if rc != 0 {
        // SAFETY: not handed to a thread.
        drop(unsafe { Box::from_raw(boxed) });
    }
    rc
}

/// The program's thread that ran the constructor (0: not traced).
pub(super) static MAIN_THREAD: AtomicI32 = AtomicI32::new(0);

/// The calling thread's id (a raw system call, which leaves `errno`
/// alone).
pub(super) use pcpu::unstable::syscall::gettid;

/// Registers the fork handlers that mark a forking thread as the agent's
/// while the engine's fork handlers (registered by the first attaches)
/// run: not the program's calls. Prepare handlers run last registered
/// first, the others first registered first, so these bracket the
/// engine's. Once per process.
pub(super) fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: plain functions that store atomics.
    ONCE.call_once(|| unsafe {
        libc::pthread_atfork(Some(forking), Some(forked), Some(forked));
    });
}

/// The names the engine gives its service threads, as `comm` keeps them
/// (15 bytes).
const ENGINE_THREAD_NAMES: [&str; 3] = ["uprobe-returns", "srcu-reclaim", "srcu-lease-expi"];

/// Marks the engine's service threads that run now as the agent's, found
/// by name: for an agent loaded into a running process, where its
/// `pthread_create` does not come before libc's.
pub(super) fn adopt_engine_threads() {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if ENGINE_THREAD_NAMES.contains(&comm.trim_end()) && !is_agent(tid) {
            mark_engine_thread(tid);
        }
    }
}

/// Marks `tid` as one of the engine's threads.
fn mark_engine_thread(tid: i32) {
    for slot in &ENGINE_THREADS {
        if slot.compare_exchange(0, tid, Relaxed, Relaxed).is_ok() {
            break;
        }
    }
}

/// Whether the forking thread's hits were observed before the fork.
static FORK_OBSERVED: AtomicBool = AtomicBool::new(true);

extern "C" fn forking() {
    FORK_OBSERVED.store(mark_self(2), Relaxed);
    // SAFETY: getpid has no preconditions.
    FORKING.store(unsafe { libc::getpid() }, Relaxed);
}

extern "C" fn forked() {
    unmark_self(2, FORK_OBSERVED.load(Relaxed));
    FORKING.store(0, Relaxed);
}
