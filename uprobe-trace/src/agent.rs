//! The agent: runs inside the traced program, from its constructor
//! (before `main`), when the tool preloads this crate's shared library.
//!
//! It reads what to probe and where the report is from the environment,
//! attaches what it can, and keeps a thread that attaches the rest when
//! new objects are loaded (`dlopen`). Every handler is async-signal-safe:
//! atomic adds into the shared report, `clock_gettime` (vDSO), and for
//! `--print` a line formatted on the stack and `write(2)`n.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::AtomicI32;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, PoisonError};

use uprobe_core::{AttachError, EntryContext, Probe, Uprobe};

use crate::shared::{Report, Slot};
use crate::spec::{ArgType, ProbeSpec, Target};

/// The threads the agent itself runs on (the program's thread while the
/// constructor runs, then the agent's own): their calls to probed
/// functions (`malloc` in an attach, `free` as their thread-local state
/// is released at exit) are not the program's and are not counted. Kept
/// by thread id, not in thread-local storage, which the runtime tears
/// down before the thread's last frees.
/// The third: a program thread attaching after its `dlopen`.
static AGENT_THREADS: [AtomicI32; 3] = [const { AtomicI32::new(0) }; 3];

/// The agent, once started (for the `dlopen` wrapper).
static AGENT: core::sync::atomic::AtomicPtr<Agent> =
    core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

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
    let tid = gettid();
    for slot in &ENGINE_THREADS {
        if slot.compare_exchange(0, tid, Relaxed, Relaxed).is_ok() {
            break;
        }
    }
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
static MAIN_THREAD: AtomicI32 = AtomicI32::new(0);

/// The calling thread's id (a system call: for the agent's own threads).
fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

// Run `init` when the dynamic linker loads the agent (before `main`).
#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

/// Everything the agent keeps for the life of the process.
struct Agent {
    report: Report,
    specs: Vec<ProbeSpec>,
    print_fd: Option<i32>,
    /// Per probe: the addresses attached so far (USDT probes may gain
    /// sites as objects load), and whether it is done.
    state: Mutex<Vec<(HashSet<usize>, bool)>>,
    /// The attached probes (never detached: they go with the process).
    probes: Mutex<Vec<Probe>>,
    /// Set once the first round of attaches is done (the program waits).
    ready: core::sync::atomic::AtomicBool,
    /// One program thread at a time attaches after a `dlopen`.
    dlopens: Mutex<()>,
}

extern "C" fn init() {
    if std::env::var_os(crate::env::REPORT).is_none() || !in_shared_object() {
        return; // not traced, or linked into the tool itself
    }
    // Everything the agent allocates and frees on the program's thread
    // (reading the environment, starting its own thread) is not counted.
    let main = gettid();
    AGENT_THREADS[0].store(main, Relaxed);
    MAIN_THREAD.store(main, Relaxed);
    start();
    AGENT_THREADS[0].store(0, Relaxed);
}

/// Reads the settings, then attaches on the agent's own thread (whatever
/// thread-local state the runtime sets up for the attach is that
/// thread's, not the program's) while the program waits.
fn start() {
    let Some(path) = std::env::var_os(crate::env::REPORT) else {
        return;
    };
    let Ok(report) = Report::open(Path::new(&path)) else {
        return;
    };
    report.header().agents.fetch_add(1, Relaxed);
    let specs = match crate::spec::decode(&std::env::var(crate::env::PROBES).unwrap_or_default()) {
        Ok(specs) => specs,
        Err(e) => {
            report.header().set_error(&e);
            return;
        }
    };
    let print_fd = std::env::var(crate::env::PRINT_FD)
        .ok()
        .and_then(|fd| fd.parse().ok());
    if std::env::var(crate::env::FOLLOW).as_deref() == Ok("0") {
        forget_environment();
    }
    let agent: &'static Agent = Box::leak(Box::new(Agent {
        state: Mutex::new(vec![(HashSet::new(), false); specs.len()]),
        report,
        specs,
        print_fd,
        probes: Mutex::new(Vec::new()),
        ready: core::sync::atomic::AtomicBool::new(false),
        dlopens: Mutex::new(()),
    }));
    // A plain pthread, waited for with an atomic: `std::thread` and
    // channels would set up thread-local state on the program's thread,
    // freed (and counted) when it exits.
    AGENT.store(
        core::ptr::from_ref(agent).cast_mut(),
        core::sync::atomic::Ordering::Release,
    );
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
        return;
    }
    while !agent.ready.load(core::sync::atomic::Ordering::Acquire) {
        // SAFETY: sleeping 100 us.
        unsafe { libc::usleep(100) };
    }
}

/// The agent's thread: the first round of attaches, then the watch for
/// objects loaded later. Never returns.
extern "C" fn agent_thread(agent: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: the leaked agent `start` passes.
    let agent: &'static Agent = unsafe { &*agent.cast::<Agent>() };
    // The thread never exits: its id is never another thread's.
    AGENT_THREADS[1].store(gettid(), Relaxed);
    agent.attach_pending();
    // The engine's fork handlers (registered by the attaches) run on the
    // program's forking thread: not the program's calls. Prepare handlers
    // run last registered first, the others first registered first, so
    // these bracket the engine's.
    // SAFETY: plain functions that store atomics.
    unsafe { libc::pthread_atfork(Some(forking), Some(forked), Some(forked)) };
    agent
        .ready
        .store(true, core::sync::atomic::Ordering::Release);
    agent.watch_loads()
}

extern "C" fn forking() {
    AGENT_THREADS[2].store(gettid(), Relaxed);
    // SAFETY: getpid has no preconditions.
    FORKING.store(unsafe { libc::getpid() }, Relaxed);
}

extern "C" fn forked() {
    AGENT_THREADS[2].store(0, Relaxed);
    FORKING.store(0, Relaxed);
}

/// Whether this code runs from the preloaded shared library (the tool's
/// own executable links the same code).
fn in_shared_object() -> bool {
    let mut info: libc::Dl_info = unsafe {
        // SAFETY: an all-zero Dl_info is valid; dladdr fills it.
        core::mem::zeroed()
    };
    // SAFETY: dladdr only reads the address and writes `info`.
    let found = unsafe { libc::dladdr(init as *const libc::c_void, &raw mut info) } != 0;
    found && !info.dli_fname.is_null() && {
        // SAFETY: a C string owned by the dynamic linker.
        let name = unsafe { core::ffi::CStr::from_ptr(info.dli_fname) };
        name.to_bytes().windows(3).any(|w| w == b".so")
    }
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
        ] {
            std::env::remove_var(var);
        }
    }
}

/// The number of loaded objects (changes when one is loaded or unloaded).
fn loaded_objects() -> usize {
    unsafe extern "C" fn count(
        _info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the counter passed below.
        unsafe { *data.cast::<usize>() += 1 };
        0
    }
    let mut n = 0usize;
    // SAFETY: the callback only counts.
    unsafe { libc::dl_iterate_phdr(Some(count), (&raw mut n).cast()) };
    n
}

/// Monotonic nanoseconds. Async-signal-safe (vDSO).
fn now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

impl Agent {
    fn slot(&self, i: usize) -> &Slot {
        self.report.slot(i).expect("the tool made a slot per probe")
    }

    /// Attaches every probe not attached yet; returns whether some are
    /// still waiting for an object to load.
    fn attach_pending(&'static self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut waiting = false;
        for (i, spec) in self.specs.iter().enumerate() {
            let (attached, done) = &mut state[i];
            if *done {
                continue;
            }
            match self.attach(i, spec, attached) {
                Ok(()) => {
                    self.slot(i).set_error("");
                    // A function is one site; a USDT probe may gain sites
                    // in objects loaded later.
                    *done = matches!(spec.target, Target::Function { .. });
                    waiting |= !*done;
                }
                Err((why, later)) => {
                    self.slot(i).set_error(&why);
                    *done = !later;
                    waiting |= later;
                }
            }
        }
        waiting
    }

    /// After the program loaded an object: attach what waits for one, on
    /// the program's thread (not counted meanwhile).
    fn after_dlopen(&'static self) {
        if !self.ready.load(core::sync::atomic::Ordering::Acquire) {
            return; // the first round (the watcher catches up after it)
        }
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.iter().all(|(_, done)| *done) {
            return;
        }
        drop(state);
        let _serial = self.dlopens.lock().unwrap_or_else(PoisonError::into_inner);
        AGENT_THREADS[2].store(gettid(), Relaxed);
        self.attach_pending();
        AGENT_THREADS[2].store(0, Relaxed);
    }

    /// The watcher thread: attaches waiting probes whenever the set of
    /// loaded objects changes.
    fn watch_loads(&'static self) -> ! {
        let mut seen = loaded_objects();
        let mut waiting = true;
        loop {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let now = loaded_objects();
            if now != seen && waiting {
                seen = now;
                waiting = self.attach_pending();
            }
        }
    }

    /// Attaches probe `i`. `Err((why, whether it may work later))`.
    fn attach(
        &'static self,
        i: usize,
        spec: &ProbeSpec,
        attached: &mut HashSet<usize>,
    ) -> Result<(), (String, bool)> {
        let later = |e: &AttachError| {
            matches!(
                e,
                AttachError::NoSuchObject { .. }
                    | AttachError::SymbolNotFound { .. }
                    | AttachError::UsdtNotFound { .. }
            )
        };
        let builders: Vec<Uprobe> = match &spec.target {
            Target::Function { object, name } => {
                let found = match object {
                    Some(o) => Uprobe::in_object(o, name),
                    None => Uprobe::function(name),
                };
                vec![found.map_err(|e| (e.to_string(), later(&e)))?]
            }
            Target::Usdt {
                object,
                provider,
                name,
                ..
            } => {
                let sites = match object {
                    Some(o) => {
                        uprobe_core::usdt::probes(o).map_err(|e| (e.to_string(), later(&e)))?
                    }
                    None => uprobe_core::usdt::loaded_probes(),
                };
                let sites: Vec<_> = sites
                    .into_iter()
                    .filter(|p| &p.provider == provider && &p.name == name)
                    .filter(|p| !attached.contains(&p.addr))
                    .collect();
                if sites.is_empty() && attached.is_empty() {
                    return Err((
                        format!("no USDT probe {provider}:{name} in the loaded objects"),
                        true,
                    ));
                }
                sites
                    .iter()
                    .map(uprobe_core::usdt::UsdtProbe::uprobe)
                    .collect::<Result<_, _>>()
                    .map_err(|e| (e.to_string(), false))?
            }
        };
        for builder in builders {
            let addr = builder.addr();
            let probe = self.with_handlers(i, spec, builder).attach();
            let probe = match probe {
                Err(AttachError::SignalsBlocked { .. }) => self.attach_blocked(i, spec, addr)?,
                other => other.map_err(|e| (e.to_string(), false))?,
            };
            self.count_site(i, &probe);
            attached.insert(addr);
            self.probes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(probe);
        }
        Ok(())
    }

    /// A function glibc runs with every signal blocked (`free`) where the
    /// engine's one-byte jump does not fit: safe to probe only through a
    /// jump over whole instructions (a breakpoint there kills the process
    /// at the next thread exit or spawn), written behind a breakpoint. The
    /// attach happens before `main`, while no other thread runs that path.
    fn attach_blocked(
        &'static self,
        i: usize,
        spec: &ProbeSpec,
        addr: usize,
    ) -> Result<Probe, (String, bool)> {
        let builder = Uprobe::at(addr).map_err(|e| (e.to_string(), false))?;
        let probe = self
            .with_handlers(i, spec, builder.allow_blocked_signal_paths())
            .attach()
            .map_err(|e| (e.to_string(), false))?;
        match probe.mode() {
            uprobe_core::Mode::Jump(_) => Ok(probe),
            uprobe_core::Mode::Trap(why) => {
                drop(probe);
                Err((
                    format!(
                        "glibc runs it with every signal blocked, and it cannot take a jump ({why}): a breakpoint there would kill the program"
                    ),
                    false,
                ))
            }
        }
    }

    fn count_site(&self, i: usize, probe: &Probe) {
        let slot = self.slot(i);
        slot.sites.fetch_add(1, Relaxed);
        if !probe.mode().is_jump() {
            slot.trap_sites.fetch_add(1, Relaxed);
        }
    }

    /// `builder` with the handlers probe `i` needs.
    fn with_handlers(&'static self, i: usize, spec: &ProbeSpec, builder: Uprobe) -> Uprobe {
        let slot: &'static Slot = self.slot(i);
        let (latency, print) = (spec.latency, spec.print);
        let types: &'static [ArgType] = match &spec.target {
            Target::Usdt { types, .. } => Box::leak(types.clone().into_boxed_slice()),
            Target::Function { .. } => &[],
        };
        let label: &'static str = Box::leak(spec.label().into_boxed_str());
        let builder = builder.on_entry(move |cx| {
            if is_agent(cx.tid()) {
                cx.skip_return();
                return;
            }
            slot.hits.fetch_add(1, Relaxed);
            if latency {
                cx.set_cookie(now());
            }
            if print {
                self.print(label, cx, types);
            }
        });
        if latency {
            builder.on_return(move |cx| slot.record_latency(now().wrapping_sub(cx.cookie())))
        } else {
            builder
        }
    }

    /// `--print`: one line for a hit. Async-signal-safe.
    fn print(&self, label: &str, cx: &EntryContext<'_>, types: &[ArgType]) {
        use core::fmt::Write as _;
        let Some(fd) = self.print_fd else { return };
        let mut line = Line::default();
        let _ = write!(line, "{} {label}", cx.tid());
        if cx.usdt_arg_count() > 0 {
            for n in 0..cx.usdt_arg_count() {
                let value = cx.usdt_arg(n).unwrap_or(0);
                if types.get(n) == Some(&ArgType::Str) {
                    let _ = line.write_str(" \"");
                    line.c_string(value as usize);
                    let _ = line.write_str("\"");
                } else {
                    let _ = write!(line, " {value}");
                }
            }
        } else {
            for n in 0..3 {
                let _ = write!(line, " {:#x}", cx.arg(n).unwrap_or(0));
            }
        }
        let _ = line.write_str("\n");
        // SAFETY: writing our buffer to the tool's pipe.
        let written = unsafe { libc::write(fd, line.buf.as_ptr().cast(), line.len) };
        if written != line.len as isize {
            self.report.header().lost_lines.fetch_add(1, Relaxed);
        }
    }
}

/// A line formatted on the stack (no allocation: usable in a handler).
struct Line {
    buf: [u8; 512],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Self {
            buf: [0; 512],
            len: 0,
        }
    }
}

impl core::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let room = self.buf.len() - 1 - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

impl Line {
    /// Appends the C string at `addr` (at most 128 bytes), read with
    /// `process_vm_readv` so that a bad pointer is an error, not a crash.
    fn c_string(&mut self, addr: usize) {
        let mut text = [0u8; 128];
        let local = libc::iovec {
            iov_base: text.as_mut_ptr().cast(),
            iov_len: text.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: text.len(),
        };
        // SAFETY: reading our own memory into our buffer; a bad address
        // fails with EFAULT. (A string near the end of a mapping reads
        // short: read again byte by byte is not worth it here.)
        let n = unsafe {
            libc::process_vm_readv(libc::getpid(), &raw const local, 1, &raw const remote, 1, 0)
        };
        let n = usize::try_from(n).unwrap_or(0);
        let end = text[..n].iter().position(|&b| b == 0).unwrap_or(n);
        for &b in &text[..end] {
            let c = if b.is_ascii_graphic() || b == b' ' {
                b
            } else {
                b'?'
            };
            if self.len < self.buf.len() - 1 {
                self.buf[self.len] = c;
                self.len += 1;
            }
        }
    }
}
