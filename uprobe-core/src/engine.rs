//! The trap engine: the probe table, the SIGTRAP handler, attach and detach.
//!
//! **Table.** Probed sites live in a growable open-addressing table
//! (`table`), read by the handler inside an SRCU read section (`srcu`:
//! per-CPU counts, no lock, no allocation) and changed only by attach and
//! detach, which serialise on a mutex and free a site, a consumer list or
//! an outgrown table only after an SRCU grace period. So a handler never parks, never
//! allocates and never takes a lock the interrupted code might hold, and no
//! consumer runs after its detach returned.
//!
//! **Order of a hit**: the breakpoint traps (x86-64: `int3`, with RIP just
//! past it; aarch64: `BRK #5`, with PC at it); the handler looks the address
//! up; if a site is found it runs the consumers (unless the thread is
//! already inside the engine: then the hit is counted as missed), prepares
//! their returns, then emulates or simulates the displaced instruction on
//! the signal frame (or sends the thread to its out-of-line slot), unless
//! a consumer moved the PC. If no site is found and a breakpoint is still
//! there, the trap is someone else's and goes to the previous handler; if
//! not, a detach won the race and the thread restarts at the address.
//!
//! **Order of an attach**: analyse the instruction, publish the site in
//! the table, then write the breakpoint (so a thread that traps always
//! finds the analysis); detach restores the instruction first, then
//! unpublishes, then waits for a grace period before freeing.

use core::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};

use pcpu::PerCpuCounter;

use crate::arch::{BREAKPOINT, Emulation, analyze, apply};
use crate::context::EntryContext;
use crate::maps::{Mapping, Patch, Snapshot, write_patches};
use crate::mode::{Mode, NotOptimized};
use crate::{AttachError, error::os_error};

/// The handler of one consumer.
pub(crate) type Handler = Box<dyn Fn(&mut EntryContext<'_>) + Send + Sync>;

/// One consumer of a site: its handlers and counters.
pub(crate) struct Consumer {
    pub(crate) handler: Handler,
    /// The return handler's side, for a return probe.
    pub(crate) ret: Option<crate::returns::ReturnProbe>,
    /// Only hits of this thread run the handler (0: every thread).
    pub(crate) only_tid: i32,
    /// Hits that ran the handler, counted per CPU (no cache line shared
    /// by the threads hitting the probe).
    pub(crate) hits: PerCpuCounter,
    pub(crate) removed: AtomicBool,
    /// The function the probe was made for (start, size; size 0:
    /// unknown), which the multi-instruction jump needs.
    pub(crate) function: Option<(usize, usize)>,
    /// Keep the address on the trap path.
    pub(crate) trap_only: bool,
    /// The arguments of the USDT probe the consumer was made on.
    pub(crate) usdt_args: Option<Arc<[crate::usdt::UsdtArg]>>,
    /// That probe's semaphore, held while the consumer is attached.
    pub(crate) semaphore: Option<usize>,
}

/// How a site runs now (writer only).
pub(crate) enum SiteMode {
    /// Its breakpoint, for this reason.
    Trap(NotOptimized),
    /// Its breakpoint, with a trampoline made and the jump to write
    /// once the breakpoint is in (during an attach only).
    Ready(crate::jump::Jump),
    /// A jump into its trampoline.
    Jump(crate::jump::Jump),
}

/// A probed address: the displaced instruction and its consumers.
pub(crate) struct Site {
    addr: usize,
    /// The instruction bytes the breakpoint covers.
    original: [u8; BREAKPOINT.len()],
    map: Mapping,
    emulation: Emulation,
    consumers: AtomicPtr<Vec<Arc<Consumer>>>,
    /// Hits that ran no handler (the thread was already in the engine),
    /// per CPU.
    missed: PerCpuCounter,
    /// Whether the breakpoint is in the code (false once every probe was
    /// disarmed because the program replaced the SIGTRAP handler).
    /// Writer only.
    armed: AtomicBool,
    /// Where a trap hit continues instead of the emulation (0: none):
    /// the trampoline's relocated copy, once the site has one.
    resume_at: AtomicUsize,
    /// Where the range of a jump placed after the landing pad at `addr`
    /// (`endbr64`, `bti`, `paciasp`) starts while a breakpoint there
    /// belongs to this site (0: none).
    landing: AtomicUsize,
    /// Where a trap at that breakpoint continues, without running the
    /// consumers there: the trampoline's entry (aarch64, where the landing
    /// pad may have signed the link register, which the entry undoes);
    /// 0: the consumers run in the trap handler (x86-64).
    landing_entry: AtomicUsize,
    /// How the site runs (writer only; the handler never looks).
    mode: Mutex<SiteMode>,
}

impl Site {
    /// The probed address.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// The mapping the site was attached in.
    pub(crate) fn mapping(&self) -> Mapping {
        self.map
    }

    /// The original bytes the breakpoint covers.
    pub(crate) fn original_bytes(&self) -> &[u8] {
        &self.original
    }

    /// Makes a breakpoint at `at` (the start of a jump's range after the
    /// site's landing pad) this site's, a trap there continuing at
    /// `entry` (see `landing_entry`); `at` 0: none. Writer only.
    ///
    /// Clearing keeps the entry: a trap handler that read the landing
    /// before it was cleared must still find where to go (a trampoline is
    /// never freed, so the old entry stays valid code).
    pub(crate) fn set_landing(&self, at: usize, entry: usize) {
        if at != 0 {
            self.landing_entry.store(entry, Ordering::Release);
        }
        self.landing.store(at, Ordering::Release);
    }

    /// Sends trap hits to `at` (see `resume_at`). Writer only.
    pub(crate) fn set_resume_at(&self, at: usize) {
        self.resume_at.store(at, Ordering::Release);
    }

    fn mode(&self) -> std::sync::MutexGuard<'_, SiteMode> {
        self.mode
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the site runs through a jump now.
    fn is_jump(&self) -> bool {
        match *self.mode() {
            SiteMode::Trap(_) | SiteMode::Ready(_) => false,
            SiteMode::Jump(_) => true,
        }
    }

    /// Whether the site's breakpoint or jump is still in the code (false
    /// after an unload, when other code or nothing is there now). The
    /// address must be mapped.
    fn in_code(&self) -> bool {
        match &*self.mode() {
            SiteMode::Jump(j) => j.in_code(),
            // SAFETY: the caller's contract.
            _ => unsafe { crate::arch::is_breakpoint_at(self.addr) },
        }
    }
}
/// Guards the table and the sites' consumer lists against readers: every
/// unpublished site or list is freed only after a grace period of it.
pub(crate) static DOMAIN: srcu::Srcu = srcu::Srcu::new();
/// Serialises attach and detach (never taken by the handler). Taken
/// through [`writer`]; held across `fork()` by the forking thread (see
/// [`hold_writer_across_fork`]), so a child never inherits it locked by a
/// thread that does not exist there.
static WRITER: Mutex<()> = Mutex::new(());
/// The thread holding `WRITER` (0: none).
static WRITER_TID: AtomicI32 = AtomicI32::new(0);

/// `WRITER`, held; releases it when dropped.
struct Writer(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl Drop for Writer {
    fn drop(&mut self) {
        WRITER_TID.store(0, Ordering::Relaxed);
    }
}

/// Takes the writer lock. Not async-signal-safe.
fn writer() -> Writer {
    let guard = WRITER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    WRITER_TID.store(current_tid(), Ordering::Relaxed);
    Writer(guard)
}

/// The writer lock the forking thread holds across `fork()`.
struct ForkHold(core::cell::UnsafeCell<Option<Writer>>);
// SAFETY: touched only by the `pthread_atfork` handlers, which run on the
// forking thread (prepare, then parent or child), one fork at a time (the
// lock itself serialises forks that reach `prepare`).
unsafe impl Sync for ForkHold {}
static FORK_HOLD: ForkHold = ForkHold(core::cell::UnsafeCell::new(None));

/// Registers, once, `pthread_atfork` handlers that take the writer lock
/// before `fork()` and release it after, in the parent and in the child:
/// without them a child forked while another thread attaches inherits a
/// lock nobody will release, and its first attach or detach hangs. A
/// thread that forks while it holds the lock itself (from a probe
/// handler hit inside an attach) keeps holding it in both processes, and
/// its attach finishes there.
fn hold_writer_across_fork() {
    extern "C" fn prepare() {
        if WRITER_TID.load(Ordering::Relaxed) == current_tid() {
            return;
        }
        let held = writer();
        // SAFETY: see `ForkHold`.
        unsafe { *FORK_HOLD.0.get() = Some(held) };
    }
    extern "C" fn release() {
        // SAFETY: see `ForkHold`; in the child the forking thread is the
        // one that took the lock, so it may release it.
        drop(unsafe { (*FORK_HOLD.0.get()).take() });
    }
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain functions, run by the C library around fork();
        // child handlers run in registration order, so the thread id is
        // forgotten before anything asks for it.
        unsafe {
            libc::pthread_atfork(None, None, Some(forget_tid));
            libc::pthread_atfork(Some(prepare), Some(release), Some(release));
        }
    });
}

std::thread_local! {
    /// Set while this thread runs the engine's handler or a consumer.
    static IN_ENGINE: Cell<bool> = const { Cell::new(false) };
    /// Trap handlers of the engine active on this thread (nested when the
    /// handler's own code hits a probe).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Traps nested deeper than this mean the handler's own path calls the
/// probed function on every level (a bug: it must not copy through
/// `memcpy`, say): abort with a message instead of overflowing the stack.
/// The program's own signal handlers cannot deepen it: asynchronous
/// signals are blocked while the handler runs (see `install`).
const MAX_DEPTH: u32 = 8;

/// The site at `addr`, if any; call inside a read section (or holding
/// `WRITER`). Async-signal-safe.
fn lookup(addr: usize) -> Option<&'static Site> {
    crate::table::find(addr).map(|(_, site)| site)
}

std::thread_local! {
    /// The thread's kernel id, once asked for (0: not yet); reset in a
    /// fork child.
    static TID: Cell<i32> = const { Cell::new(0) };
}

/// The calling thread's kernel id (a system call the first time only).
/// Async-signal-safe.
pub(crate) fn current_tid() -> i32 {
    let cached = TID.get();
    if cached != 0 {
        return cached;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) as i32 };
    TID.set(tid);
    tid
}

/// Forgets the cached thread id (the forking thread's, in a fork child).
extern "C" fn forget_tid() {
    TID.set(0);
}

/// The handler that was installed for SIGTRAP before ours.
struct Previous(core::cell::UnsafeCell<core::mem::MaybeUninit<libc::sigaction>>);
// SAFETY: written once, before our handler is installed (the `sigaction`
// system call orders it before any delivery), then only read.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(core::cell::UnsafeCell::new(core::mem::MaybeUninit::zeroed()));

/// Installs the SIGTRAP handler once (and makes the SRCU domain ready for
/// use from it).
fn install() -> Result<(), AttachError> {
    static ONCE: Once = Once::new();
    static FAILED: AtomicBool = AtomicBool::new(false);
    ONCE.call_once(|| {
        DOMAIN.prepare();
        hold_writer_across_fork();
        // SAFETY: a zeroed sigaction is valid; the handler has the
        // SA_SIGINFO signature; PREVIOUS is written before our handler can
        // run (it is installed by this very call).
        unsafe {
            let mut sa: libc::sigaction = core::mem::zeroed();
            sa.sa_sigaction = on_sigtrap as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER | libc::SA_RESTART;
            // Asynchronous signals wait until the handler is done (the
            // kernel restores the thread's own mask at sigreturn), so a
            // program's signal handlers never nest inside the engine's:
            // only the engine's own recursion through probed code can
            // deepen it, which is what the depth guard looks for. The
            // synchronous ones stay open (a trap or fault raised while
            // blocked kills the process).
            libc::sigfillset(&raw mut sa.sa_mask);
            for sig in SYNCHRONOUS {
                libc::sigdelset(&raw mut sa.sa_mask, sig);
            }
            let prev = (*PREVIOUS.0.get()).as_mut_ptr();
            if libc::sigaction(libc::SIGTRAP, &raw const sa, prev) != 0 {
                FAILED.store(true, Ordering::Relaxed);
            }
        }
    });
    if FAILED.load(Ordering::Relaxed) {
        return Err(os_error("sigaction(SIGTRAP)"));
    }
    Ok(())
}

/// The synchronous signals an out-of-line instruction can raise.
const FAULTS: [libc::c_int; 4] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL];

/// The signals the kernel raises for the instruction a thread runs: never
/// blocked in the engine's handler.
const SYNCHRONOUS: [libc::c_int; 6] = [
    libc::SIGTRAP,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGSYS,
];

/// The handlers installed for [`FAULTS`] before ours, in that order.
struct PreviousFaults(core::cell::UnsafeCell<[core::mem::MaybeUninit<libc::sigaction>; 4]>);
// SAFETY: as for `Previous`.
unsafe impl Sync for PreviousFaults {}
static PREVIOUS_FAULTS: PreviousFaults = PreviousFaults(core::cell::UnsafeCell::new(
    [const { core::mem::MaybeUninit::zeroed() }; 4],
));

/// Installs, once, handlers that report a fault raised inside an
/// out-of-line slot at the probed address (as the kernel does), then pass
/// it on to the program's own handler or the default action.
pub(crate) fn install_fault_handlers() -> Result<(), AttachError> {
    static ONCE: Once = Once::new();
    static FAILED: AtomicBool = AtomicBool::new(false);
    ONCE.call_once(|| {
        for (i, &sig) in FAULTS.iter().enumerate() {
            // SAFETY: as in `install`; each previous disposition is stored
            // before our handler for that signal exists.
            unsafe {
                let mut sa: libc::sigaction = core::mem::zeroed();
                sa.sa_sigaction = on_fault as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
                libc::sigemptyset(&raw mut sa.sa_mask);
                let prev = (*PREVIOUS_FAULTS.0.get())[i].as_mut_ptr();
                if libc::sigaction(sig, &raw const sa, prev) != 0 {
                    FAILED.store(true, Ordering::Relaxed);
                }
            }
        }
    });
    if FAILED.load(Ordering::Relaxed) {
        return Err(os_error("sigaction(SIGSEGV/SIGBUS/SIGFPE/SIGILL)"));
    }
    Ok(())
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid ucontext (SA_SIGINFO).
    let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
    if let Some(addr) = crate::xol::origin_of(crate::arch::pc(uc)) {
        crate::arch::set_pc(uc, addr);
        // A trap-ended slot deferred the thread's signals: give them back
        // before the program's handler (or the default action) runs.
        crate::deferral::restore(uc);
    }
    if let Some((addr, copy)) = crate::jump::relocated_origin(crate::arch::pc(uc)) {
        // The program's handler sees the original instruction; if it
        // returns to retry it (a handler that maps the page, say), the
        // retry happens in the trampoline: the original bytes may be
        // covered by the jump.
        crate::arch::set_pc(uc, addr);
        let i = FAULTS.iter().position(|&s| s == sig).unwrap_or(0);
        // SAFETY: written before our handler was installed, read-only since.
        let prev = unsafe { (*PREVIOUS_FAULTS.0.get())[i].assume_init_ref() };
        if prev.sa_sigaction != libc::SIG_IGN {
            pass_on(prev, sig, info, ctx);
            // SAFETY: as above.
            let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
            if crate::arch::pc(uc) == addr {
                crate::arch::set_pc(uc, copy);
            }
            return;
        }
    }
    let i = FAULTS.iter().position(|&s| s == sig).unwrap_or(0);
    // SAFETY: written before our handler was installed, read-only since.
    let prev = unsafe { (*PREVIOUS_FAULTS.0.get())[i].assume_init_ref() };
    if prev.sa_sigaction == libc::SIG_IGN {
        // The kernel never lets a fault be ignored (returning would run
        // the faulting instruction again forever): the default action.
        // SAFETY: resetting a disposition and re-raising are
        // async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
        return;
    }
    pass_on(prev, sig, info, ctx);
}

/// Aborts (with a message) if a consumer panics: unwinding through the
/// signal frame is undefined behaviour. Remembers whether the interrupted
/// code was itself unwinding (a panic allocates, so a probe on `malloc`
/// can hit in the middle of one): only a new panic aborts.
pub(crate) struct AbortOnUnwind {
    was_panicking: bool,
}

impl AbortOnUnwind {
    pub(crate) fn new() -> Self {
        Self {
            was_panicking: std::thread::panicking(),
        }
    }
}

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.was_panicking {
            fatal(b"uprobe-core: a probe handler panicked; aborting\n");
        }
    }
}

/// Writes `msg` to stderr and aborts. Async-signal-safe.
pub(crate) fn fatal(msg: &[u8]) -> ! {
    // SAFETY: write(2) of a buffer we hold to stderr.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    std::process::abort();
}

/// Whether the calling thread is inside the engine's trap handler (a
/// signal handler that interrupted it can ask). Async-signal-safe.
pub(crate) fn in_trap_handler() -> bool {
    DEPTH.get() > 0
}

/// Marks the thread as inside the engine; returns whether it already was
/// (then no handler may run). Async-signal-safe.
pub(crate) fn enter() -> bool {
    IN_ENGINE.replace(true)
}

/// Undoes [`enter`], given what it returned.
pub(crate) fn leave(was_inside: bool) {
    IN_ENGINE.set(was_inside);
}

extern "C" fn on_sigtrap(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let depth = DEPTH.get();
    if depth >= MAX_DEPTH {
        fatal(b"uprobe-core: the trap handler recursed through a probed function; aborting\n");
    }
    DEPTH.set(depth + 1);
    handle_sigtrap(sig, info, ctx);
    DEPTH.set(depth);
}

fn handle_sigtrap(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo and ucontext (SA_SIGINFO).
    let (info_ref, uc) = unsafe { (&*info, &mut *ctx.cast::<libc::ucontext_t>()) };
    let Some(addr) = crate::arch::breakpoint_address(info_ref, uc) else {
        // raise(), kill(), a debugger's trap flag: not a breakpoint.
        return chain(sig, info, ctx);
    };
    if let Some((origin, len, crate::xol::SlotEnd::TrapBack)) = crate::xol::slot_info(addr) {
        // The second trap of a trap-ended slot: on to the instruction after
        // the probed one, and signals back.
        crate::arch::set_pc(uc, origin + len);
        crate::deferral::restore(uc);
        return;
    }
    let found = crate::lookup::with_read_side(|| {
        lookup(addr).map(|site| hit(site, uc)).or_else(|| {
            landing_site(addr).map(|site| match site.landing_entry.load(Ordering::Acquire) {
                0 => hit(site, uc),
                entry => crate::arch::set_pc(uc, entry),
            })
        })
    });
    if found.is_some() {
        return;
    }
    // SAFETY: `addr` is the breakpoint the thread just executed, so it is
    // mapped code.
    if unsafe { crate::arch::is_breakpoint_at(addr) } {
        chain(sig, info, ctx);
    } else {
        // A detach restored the instruction after this thread trapped: run
        // it.
        crate::arch::set_pc(uc, addr);
    }
}

/// The site whose jump, placed after its landing pad, starts at `addr`,
/// while a breakpoint there is the site's. Async-signal-safe.
fn landing_site(addr: usize) -> Option<&'static Site> {
    // `endbr64` and every A64 instruction.
    const LANDING_PAD_LEN: usize = 4;
    addr.checked_sub(LANDING_PAD_LEN)
        .and_then(lookup)
        .filter(|s| s.landing.load(Ordering::Acquire) == addr)
}

/// One trap hit on `site`: consumers, then the displaced instruction.
fn hit(site: &Site, uc: &mut libc::ucontext_t) {
    if run_consumers(site, crate::arch::frame_of(uc)) {
        return;
    }
    let resume_at = site.resume_at.load(Ordering::Acquire);
    if resume_at != 0 {
        // The trampoline's relocated copy of the replaced instructions.
        crate::arch::set_pc(uc, resume_at);
    } else {
        // SAFETY: the thread trapped on this very instruction.
        unsafe { apply(&site.emulation, uc) };
    }
}

/// Runs the consumers of `site` with the registers `frame` (unless the
/// thread is already inside the engine: then the hit is counted as
/// missed). Both ways in share it: the trap handler and the trampolines.
/// Returns whether a handler moved the instruction pointer.
/// Async-signal-safe; inside a read section of [`DOMAIN`].
pub(crate) fn run_consumers(site: &Site, frame: &mut crate::arch::Frame) -> bool {
    let mut ip_changed = false;
    if IN_ENGINE.replace(true) {
        site.missed.add(1);
    } else {
        let _abort = AbortOnUnwind::new();
        // SAFETY: lists are freed only after a grace period, and we are in
        // a read section.
        let consumers = unsafe { &*site.consumers.load(Ordering::Acquire) };
        // The thread id costs a system call: only asked for by a filter.
        let mut tid = None;
        for c in consumers {
            if c.removed.load(Ordering::Relaxed)
                || (c.only_tid != 0 && c.only_tid != *tid.get_or_insert_with(current_tid))
            {
                continue;
            }
            c.hits.add(1);
            let mut cx = EntryContext::new(frame, site.addr);
            cx.usdt = c.usdt_args.as_deref();
            (c.handler)(&mut cx);
            ip_changed |= cx.ip_changed;
            if cx.remove {
                c.removed.store(true, Ordering::Relaxed);
            }
            let (cookie, track_return) = (cx.cookie, !cx.skip_return);
            if let Some(ret) = c.ret.as_ref().filter(|_| track_return) {
                track_return_of(ret, site.addr, cookie, frame);
            }
        }
        IN_ENGINE.set(false);
    }
    ip_changed
}

/// Tracks the return of the function entered at `func` (kept out of
/// line: most hits have no return probe, and their path stays short).
/// Async-signal-safe.
#[inline(never)]
fn track_return_of(
    ret: &crate::returns::ReturnProbe,
    func: usize,
    cookie: u64,
    frame: &mut crate::arch::Frame,
) {
    let (sp, ret_at) = crate::arch::return_address_at(frame);
    // SAFETY: return consumers are attached at a function's first
    // instruction, where `ret_at` holds its return address (checked at
    // attach, or `Uprobe::address`'s contract).
    unsafe { crate::returns::prepare(ret, func, cookie, sp, ret_at) };
}

/// Passes a trap that is not ours to the handler installed before ours, or
/// to the default action.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: written before our handler was installed, read-only since.
    let prev = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    pass_on(prev, sig, info, ctx);
}

/// Runs disposition `prev` for a signal our handler received.
fn pass_on(
    prev: &libc::sigaction,
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    match prev.sa_sigaction {
        libc::SIG_IGN => {}
        libc::SIG_DFL => {
            // The default action (terminate with a core dump), as if we
            // had never been installed.
            // SAFETY: resetting a disposition and re-raising are
            // async-signal-safe.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
        }
        handler if prev.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: the previous handler has the SA_SIGINFO signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { core::mem::transmute(handler) };
            f(sig, info, ctx);
        }
        handler => {
            // SAFETY: a plain handler.
            let f: extern "C" fn(libc::c_int) = unsafe { core::mem::transmute(handler) };
            f(sig);
        }
    }
}

/// What attach and detach unpublish, freed after one grace period.
enum Garbage {
    List(*mut Vec<Arc<Consumer>>),
    Site(*mut Site),
    Table(*mut crate::table::Table),
}

/// Frees what a batch unpublished: at once if `table` keeps every reader
/// out, else after one grace period for all of it (also waited for with
/// nothing to free when `wait`: a return handler was detached).
fn collect(garbage: Vec<Garbage>, table: &crate::lookup::WriteSide, wait: bool) {
    if garbage.is_empty() && !wait {
        return;
    }
    if !table.excludes_readers() {
        DOMAIN.synchronize();
    }
    for g in garbage {
        match g {
            // SAFETY: unpublished before the grace period: no reader holds
            // it, and nothing else frees it.
            Garbage::List(list) => drop(unsafe { Box::from_raw(list) }),
            Garbage::Site(site) => {
                // SAFETY: as above; the site owns its current list.
                let site = unsafe { Box::from_raw(site) };
                // SAFETY: as above.
                drop(unsafe { Box::from_raw(site.consumers.load(Ordering::Relaxed)) });
            }
            // SAFETY: retired by an insert before the grace period.
            Garbage::Table(t) => unsafe { crate::table::free(t) },
        }
    }
}

/// Attaches each `(address, consumer)`, paying one grace period for the
/// whole batch. Stops at the first error, with the earlier ones attached
/// (the caller detaches them).
///
/// # Safety
/// Every address is the first byte of an instruction.
pub(crate) unsafe fn attach_many(
    items: &[(usize, Arc<Consumer>)],
) -> Result<(), (usize, AttachError)> {
    install().map_err(|e| (0, e))?;
    if items.iter().any(|(_, c)| c.ret.is_some()) {
        crate::returns::init().map_err(|e| (0, e))?;
    }
    let _w = writer();
    check_trap_handler().map_err(|e| (0, e))?;
    let mut garbage = Vec::new();
    let mut result = Ok(());
    let table = crate::lookup::write_side();
    let mut batch = Batch::read().map_err(|e| (0, e))?;
    // Every site is published (its analysis in the table) before any
    // breakpoint is written; the breakpoints then go in page by page,
    // with one instruction-stream sync for the batch.
    let mut attached = items.len();
    for (i, (addr, consumer)) in items.iter().enumerate() {
        // SAFETY: forwarded.
        let one = unsafe { attach_one(*addr, Arc::clone(consumer), &mut batch, &mut garbage) };
        if let Err(e) = one {
            result = Err((i, e));
            attached = i;
            break;
        }
    }
    let patches: Vec<Patch<'_>> = batch
        .writes
        .iter()
        .map(|&(_, map, addr)| Patch {
            map,
            addr,
            bytes: &BREAKPOINT,
        })
        .collect();
    // SAFETY: each address starts an instruction (the caller's contract),
    // inside the mapping the snapshot showed.
    if let Err(failed) = unsafe { write_patches(&patches) } {
        // Undo the items from the first one whose page could not be
        // written (the caller detaches the ones before it).
        let (k, e) = failed.into_iter().next().expect("an error names a patch");
        let first = batch.writes[k].0;
        let mut last = Vec::new();
        for (addr, consumer) in &items[first..attached] {
            if let Some(site) = detach_one(*addr, consumer, &mut garbage) {
                last.push(site);
            }
        }
        let _ = unpublish(&last, &batch.maps, &mut garbage);
        result = Err((first, e));
    }
    if result.is_ok() {
        let made: Vec<usize> = batch.writes.iter().map(|&(_, _, addr)| addr).collect();
        choose_modes(&made, &batch.to_trap);
    }
    collect(garbage, &table, false);
    result
}

/// Writes the jumps of the sites just made that are ready for one (each
/// site's mode then says how it runs); `to_trap` (optimized sites a
/// trap-only probe joined) go back to their breakpoints. `WRITER` is
/// held; every new site's breakpoint is in the code and synced.
fn choose_modes(made: &[usize], to_trap: &[usize]) {
    let mut ready = Vec::new();
    for &addr in made {
        let Some(site) = lookup(addr) else { continue };
        let mut guard = site.mode();
        if matches!(*guard, SiteMode::Ready(_)) {
            let SiteMode::Ready(jump) =
                core::mem::replace(&mut *guard, SiteMode::Trap(NotOptimized::CodeChanged))
            else {
                unreachable!("matched above");
            };
            ready.push((site, jump));
        }
    }
    let sites: Vec<&Site> = ready.iter().map(|(s, _)| *s).collect();
    for (site, result) in sites.into_iter().zip(crate::jump::optimize(ready)) {
        *site.mode() = match result {
            Ok(jump) => SiteMode::Jump(jump),
            Err(why) => SiteMode::Trap(why),
        };
    }
    let back: Vec<&Site> = to_trap.iter().filter_map(|&a| lookup(a)).collect();
    to_traps(&back, &NotOptimized::TrapOnly);
}

/// A site attached inside the range of another site's jump (ready or
/// written): that site goes back to its breakpoint for good, and sends
/// its trap hits through the emulation again (its relocated copy would
/// skip the new breakpoint). `WRITER` is held.
fn take_back_covering_jump(addr: usize) {
    // A range starts at its site or after the site's landing pad (4
    // bytes), and ends before the end of the last instruction that the
    // jump's bytes reach into.
    let reach = 4 + crate::jump::JUMP_LEN + crate::arch::MAX_INSN_LEN;
    for k in 1..reach {
        let Some(site) = addr.checked_sub(k).and_then(lookup) else {
            continue;
        };
        let covers = match &*site.mode() {
            SiteMode::Ready(j) | SiteMode::Jump(j) => j.covers(addr),
            SiteMode::Trap(_) => false,
        };
        if covers {
            to_traps(&[site], &NotOptimized::OtherProbeInRange { at: addr });
            let mut mode = site.mode();
            if matches!(*mode, SiteMode::Ready(_)) {
                *mode = SiteMode::Trap(NotOptimized::OtherProbeInRange { at: addr });
            }
            site.set_resume_at(0);
        }
    }
}

/// Off jumps and back to breakpoints, with `why` as the new mode.
/// `WRITER` is held.
fn to_traps(sites: &[&Site], why: &NotOptimized) {
    let mut modes: Vec<_> = sites.iter().map(|s| s.mode()).collect();
    let jumps: Vec<(&crate::jump::Jump, Mapping)> = modes
        .iter()
        .zip(sites)
        .filter_map(|(m, s)| match &**m {
            SiteMode::Jump(j) => Some((j, s.map)),
            _ => None,
        })
        .collect();
    crate::jump::unoptimize(&jumps);
    drop(jumps);
    for (m, site) in modes.iter_mut().zip(sites) {
        if matches!(**m, SiteMode::Jump(_)) {
            **m = SiteMode::Trap(why.clone());
            site.set_landing(0, 0);
        }
    }
}

/// What every attach of a batch checks against, looked at once for the
/// batch (`WRITER` is held, so no attach of ours changes it meanwhile).
struct Batch {
    /// The memory map: attach writes code only inside mappings it saw,
    /// and a mapping that went away since makes the write fail (an error,
    /// never a write elsewhere).
    maps: Snapshot,
    /// The loaded objects' rseq critical sections.
    rseq: crate::checks::RseqSections,
    /// The breakpoints to write once every site is published: the item's
    /// index, its mapping and address.
    writes: Vec<(usize, Mapping, usize)>,
    /// Addresses of `writes` (a second consumer at one of them joins the
    /// site the batch made, whose breakpoint is not written yet).
    pending: std::collections::HashSet<usize>,
    /// Items looked at so far.
    items: usize,
    /// Optimized sites that a trap-only consumer joined: back to traps.
    to_trap: Vec<usize>,
}

impl Batch {
    fn read() -> Result<Self, AttachError> {
        let blocking = crate::checks::threads_blocking_sigtrap();
        if !blocking.is_empty() {
            return Err(AttachError::TrapBlocked { tids: blocking });
        }
        Ok(Self {
            maps: Snapshot::read(),
            rseq: crate::checks::RseqSections::read(),
            writes: Vec::new(),
            pending: std::collections::HashSet::new(),
            items: 0,
            to_trap: Vec::new(),
        })
    }
}

/// # Safety
/// `addr` is the first byte of an instruction; `WRITER` is held.
unsafe fn attach_one(
    addr: usize,
    consumer: Arc<Consumer>,
    batch: &mut Batch,
    garbage: &mut Vec<Garbage>,
) -> Result<(), AttachError> {
    let item = batch.items;
    batch.items += 1;
    let maps = &batch.maps;
    let Some(map) = maps.code_mapping_of(addr) else {
        return Err(AttachError::NotCode { addr });
    };
    if let Some((slot, site)) = crate::table::find(addr) {
        let live =
            batch.pending.contains(&addr) || (site.armed.load(Ordering::Relaxed) && site.in_code());
        if live {
            if consumer.trap_only && site.is_jump() {
                batch.to_trap.push(addr);
            }
            let mut list = current_list(site).clone();
            list.push(consumer);
            garbage.push(Garbage::List(publish_list(site, list)));
            return Ok(());
        }
        // The code the site was made for is gone (unloaded, and other
        // code mapped at the same address since) or was disarmed: the
        // site must not swallow this attach. Its consumers' probes detach
        // without anything to restore.
        if let SiteMode::Jump(j) = &*site.mode() {
            crate::jump::clear_cell(j);
        }
        crate::table::remove(slot);
        garbage.push(Garbage::Site(core::ptr::from_ref(site).cast_mut()));
    }
    batch.rseq.refuse(addr)?;
    // An instruction may straddle two mappings of one code segment.
    let code_end = maps.code_end(addr).unwrap_or(map.end);
    let len = (code_end - addr).min(crate::arch::MAX_INSN_LEN);
    // `[addr, addr + len)` lies in readable executable mappings; another
    // site's breakpoint or jump may cover part of it.
    let bytes = &code_as_original(addr, len)[..];
    if len < BREAKPOINT.len() || crate::arch::is_breakpoint(bytes) {
        return Err(AttachError::ForeignBreakpoint { addr });
    }
    let emulation = analyze(addr, bytes)?;
    take_back_covering_jump(addr);
    let site = Box::into_raw(Box::new(Site {
        addr,
        original: core::array::from_fn(|i| bytes[i]),
        map,
        emulation,
        consumers: AtomicPtr::new(Box::into_raw(Box::new(vec![consumer]))),
        missed: PerCpuCounter::new(),
        armed: AtomicBool::new(true),
        resume_at: AtomicUsize::new(0),
        landing: AtomicUsize::new(0),
        landing_entry: AtomicUsize::new(0),
        mode: Mutex::new(SiteMode::Trap(NotOptimized::TrapOnly)),
    }));
    // SAFETY: just made, not published yet.
    let made = unsafe { &*site };
    let consumer = &current_list(made)[0];
    {
        let (function, trap_only) = (consumer.function, consumer.trap_only);
        *made.mode() = match crate::jump::prepare(made, function, maps, trap_only) {
            _ if trap_only => SiteMode::Trap(NotOptimized::TrapOnly),
            Ok(jump) => SiteMode::Ready(jump),
            Err(why) => SiteMode::Trap(why),
        };
    }
    // Publish the analysis; the breakpoint follows (`attach_many`).
    if let Some(old) = crate::table::insert(site) {
        garbage.push(Garbage::Table(old));
    }
    batch.writes.push((item, map, addr));
    batch.pending.insert(addr);
    Ok(())
}

/// Detaches each `(address, consumer)`; the last consumer of an address
/// removes its breakpoint. One grace period for the whole batch; returns
/// once no handler of these consumers runs or will run. Reports the first
/// error (the others are still detached as far as they can be).
pub(crate) fn detach_many(items: &[(usize, Arc<Consumer>)]) -> Result<(), AttachError> {
    let _w = writer();
    // A replaced handler disarms every site; the detach itself goes on
    // (it has nothing left to restore).
    let _ = check_trap_handler();
    let mut garbage = Vec::new();
    let table = crate::lookup::write_side();
    let last: Vec<(usize, &Site)> = items
        .iter()
        .filter_map(|(addr, consumer)| detach_one(*addr, consumer, &mut garbage))
        .collect();
    let result = unpublish(&last, &Snapshot::read(), &mut garbage);
    let returns_detached = items.iter().any(|(_, c)| c.ret.is_some());
    collect(garbage, &table, returns_detached);
    // A fork child gets its service thread back here (it inherits none).
    let _ = crate::returns::ensure_service();
    result
}

/// Removes `consumer` from the site at `addr`; returns the site (and its
/// table slot) if that was its last consumer, to [`unpublish`]. `WRITER`
/// is held.
fn detach_one<'s>(
    addr: usize,
    consumer: &Arc<Consumer>,
    garbage: &mut Vec<Garbage>,
) -> Option<(usize, &'s Site)> {
    if let Some(ret) = &consumer.ret {
        // No return handler of it runs once the grace period below is over.
        ret.detach();
    }
    let (slot, site) = crate::table::find(addr)?;
    if !current_list(site).iter().any(|c| Arc::ptr_eq(c, consumer)) {
        // A site made anew at the address after this consumer's site went
        // stale (its code was unloaded): nothing of it is here.
        return None;
    }
    let list: Vec<_> = current_list(site)
        .iter()
        .filter(|c| !Arc::ptr_eq(c, consumer))
        .cloned()
        .collect();
    if list.is_empty() {
        return Some((slot, site));
    }
    garbage.push(Garbage::List(publish_list(site, list)));
    None
}

/// Sites whose last consumer left: the original bytes back first (one
/// batch of patches), then unpublished. A site whose bytes could not be
/// restored keeps its breakpoint with no consumer (hits just run the
/// instruction); the first such error is returned. `WRITER` is held.
fn unpublish(
    sites: &[(usize, &Site)],
    maps: &Snapshot,
    garbage: &mut Vec<Garbage>,
) -> Result<(), AttachError> {
    {
        // Jumps back to breakpoints first; the trampolines' cells then
        // name no site (a thread still on its way through one runs no
        // handler once the grace period that follows is over).
        let all: Vec<&Site> = sites.iter().map(|&(_, s)| s).collect();
        for site in &all {
            if let SiteMode::Jump(j) = &*site.mode() {
                crate::jump::clear_cell(j);
            }
        }
        to_traps(&all, &NotOptimized::TrapOnly);
    }
    let mut failed = disarm(sites.iter().map(|&(_, site)| site), maps);
    let mut first_error = None;
    for (i, &(slot, site)) in sites.iter().enumerate() {
        if let Some(at) = failed.iter().position(|(f, _)| *f == i) {
            let (_, e) = failed.swap_remove(at);
            first_error.get_or_insert(e);
            garbage.push(Garbage::List(publish_list(site, Vec::new())));
            continue;
        }
        crate::table::remove(slot);
        garbage.push(Garbage::Site(core::ptr::from_ref(site).cast_mut()));
    }
    first_error.map_or(Ok(()), Err)
}

/// Restores the original bytes of each armed site whose breakpoint is
/// still there (code that was unmapped since, `dlclose`, or replaced by
/// other code has nothing to restore) and marks them disarmed. Returns
/// the sites (their indexes in the iteration) whose bytes could not be
/// restored, still armed. `WRITER` is held.
fn disarm<'s>(sites: impl Iterator<Item = &'s Site>, maps: &Snapshot) -> Vec<(usize, AttachError)> {
    let mut armed = Vec::new();
    let mut patches = Vec::new();
    for (i, site) in sites.enumerate() {
        // A site running through a jump needs no signal: it stays.
        if !site.armed.load(Ordering::Relaxed) || site.is_jump() {
            continue;
        }
        let still_ours = maps.code_mapping_of(site.addr).is_some()
            // SAFETY: `site.addr` is in an executable mapping.
            && unsafe { crate::arch::is_breakpoint_at(site.addr) };
        if still_ours {
            patches.push(Patch {
                map: site.map,
                addr: site.addr,
                bytes: &site.original,
            });
        }
        armed.push((i, site, still_ours.then(|| patches.len() - 1)));
    }
    // SAFETY: each patch restores an instruction's own bytes over our
    // breakpoint.
    let failed = unsafe { write_patches(&patches) }.err().unwrap_or_default();
    let mut not_restored = Vec::new();
    for (i, site, patch) in armed {
        match failed.iter().find(|(k, _)| Some(*k) == patch) {
            Some((_, e)) => not_restored.push((i, e.clone())),
            None => site.armed.store(false, Ordering::Relaxed),
        }
    }
    not_restored
}

/// Whether the engine's SIGTRAP handler is still the installed one. If
/// the program replaced it (`sigaction`, `signal`), a hit would reach the
/// program's handler and resume in the middle of the probed instruction:
/// every site is disarmed (its original bytes restored) and the error
/// says so. `WRITER` is held.
fn check_trap_handler() -> Result<(), AttachError> {
    // SAFETY: a query only; `now` is written by the call.
    let now = unsafe {
        let mut now: libc::sigaction = core::mem::zeroed();
        libc::sigaction(libc::SIGTRAP, core::ptr::null(), &raw mut now);
        now.sa_sigaction
    };
    if now == on_sigtrap as *const () as libc::sighandler_t {
        return Ok(());
    }
    let sites = crate::table::sites();
    let was_armed = sites
        .iter()
        .filter(|s| s.armed.load(Ordering::Relaxed) && !s.is_jump())
        .count();
    let not_restored = disarm(sites.into_iter(), &Snapshot::read()).len();
    let disarmed = was_armed - not_restored;
    Err(AttachError::TrapHandlerReplaced { disarmed })
}

/// Whether a breakpoint of the engine is in the code at `addr` (false if
/// nothing is attached there, or every site was disarmed because the
/// program replaced the SIGTRAP handler).
pub(crate) fn armed(addr: usize) -> bool {
    let _w = writer();
    lookup(addr).is_some_and(|s| s.armed.load(Ordering::Relaxed))
}

/// The code at `[addr, addr + len)` (inside executable mappings) as it
/// was before the engine patched it: each breakpoint and jump of a site
/// replaced by the bytes it covers. `WRITER` is held.
pub(crate) fn code_as_original(addr: usize, len: usize) -> Vec<u8> {
    // SAFETY: the caller's contract.
    let mut code = unsafe { core::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    // A jump's range starts at most a landing pad and an instruction
    // before the bytes it covers.
    let reach = crate::arch::MAX_INSN_LEN + 4;
    for at in addr.saturating_sub(reach)..addr + len {
        let Some((_, site)) = crate::table::find(at) else {
            continue;
        };
        // The breakpoint's bytes (those inside the window) back to the
        // instruction's.
        let n = code.len();
        let inside = |k: usize| (at + k).checked_sub(addr).filter(|&i| i < n);
        let ours =
            (0..BREAKPOINT.len()).all(|k| inside(k).is_none_or(|i| code[i] == BREAKPOINT[k]));
        if ours {
            for k in 0..BREAKPOINT.len() {
                if let Some(i) = inside(k) {
                    code[i] = site.original[k];
                }
            }
        }
        if let SiteMode::Jump(j) = &*site.mode() {
            let (start, bytes) = j.original();
            for (k, &o) in bytes.iter().enumerate() {
                if let Some(c) = (start + k)
                    .checked_sub(addr)
                    .and_then(|at| code.get_mut(at))
                {
                    *c = o;
                }
            }
        }
    }
    code
}

/// [`code_as_original`], taking the writer lock. Not async-signal-safe.
pub(crate) fn original_code(addr: usize, len: usize) -> Vec<u8> {
    let _w = writer();
    code_as_original(addr, len)
}

/// How the site at `addr` runs (`None` if nothing is attached there).
pub(crate) fn mode(addr: usize) -> Option<Mode> {
    let _w = writer();
    lookup(addr).map(|s| match &*s.mode() {
        SiteMode::Trap(why) => Mode::Trap(why.clone()),
        SiteMode::Ready(_) => Mode::Trap(NotOptimized::CodeChanged),
        SiteMode::Jump(_) => Mode::Jump,
    })
}

/// Hits that ran no handler at `addr` (0 if nothing is attached there).
pub(crate) fn missed(addr: usize) -> u64 {
    crate::lookup::with_read_side(|| lookup(addr).map_or(0, |s| s.missed.sum()))
}

fn current_list(site: &Site) -> &Vec<Arc<Consumer>> {
    // SAFETY: the writer lock is held: the list is not freed meanwhile.
    unsafe { &*site.consumers.load(Ordering::Acquire) }
}

/// Publishes `list`; returns the previous one, to free after a grace
/// period.
fn publish_list(site: &Site, list: Vec<Arc<Consumer>>) -> *mut Vec<Arc<Consumer>> {
    site.consumers
        .swap(Box::into_raw(Box::new(list)), Ordering::AcqRel)
}
