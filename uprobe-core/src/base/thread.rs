//! What the engine keeps per thread, below everything else: the thread's
//! kernel id, whether it is inside the engine (a hit there runs no
//! handler) or not observed at all (a hit there runs no handler and
//! counts nothing: [`set_observed`]), whether it holds the probe table's
//! write side, how deep its trap handlers are nested, and the way out when
//! something cannot go on (`fatal`). Nothing here knows about probes.
//!
//! Every function is async-signal-safe: per-thread state without
//! destructors, and raw system calls.
//!
//! # Static TLS, also when loaded with `dlopen`
//! The per-thread state is one block of thread-local storage, [`State`],
//! declared in assembly and always reached through the *initial-exec*
//! model: the thread pointer plus an offset the dynamic linker writes
//! once (`R_X86_64_TPOFF64`, `R_AARCH64_TLS_TPREL`). Two things follow.
//!
//! - **No call on the hit path.** Rust's own thread-locals in a shared
//!   object go through `__tls_get_addr`, a call per access; the engine
//!   reads and writes its flags on every hit.
//! - **No allocation on the hit path.** A thread-local of a library
//!   loaded with `dlopen` normally lives in *dynamic* TLS: glibc allocates
//!   a thread's block on that thread's first access, with `malloc`. On the
//!   hit path that is fatal: a thread that existed before the load hits a
//!   probe, the handler's first thread-local access calls `malloc` from
//!   inside the hit (a probed `malloc` hits again, on a breakpoint that
//!   kills the thread; an interrupted `malloc` deadlocks). The
//!   initial-exec relocation makes the dynamic linker place the library's
//!   whole TLS block (the engine's Rust thread-locals too) in the static
//!   TLS area of every thread, existing and new, at `dlopen`; where the
//!   process has no room left, `dlopen` fails with "cannot allocate memory
//!   in static TLS block" (the tunable `glibc.rtld.optional_static_tls`
//!   makes more) instead of a hit crashing later. (The x86-64 linker also
//!   marks the library `DF_STATIC_TLS`.) In an executable, TLS is static
//!   anyway.

use core::cell::Cell;

/// What the engine keeps per thread. All zeros is a new thread's state
/// (`.tbss`).
#[repr(C)]
struct State {
    /// [`IN_ENGINE`] while this thread runs the engine's handler or a
    /// consumer, [`UNOBSERVED`] while its hits are not observed; 0 for a
    /// thread whose hits run handlers. Both bits are far above any CPU
    /// id: the x86-64 counting prelude adds this word to the CPU id it
    /// checks, so that a thread with either bit set takes the full path
    /// (`crate::arch::count`).
    flags: Cell<u32>,
    /// Set while this thread holds the probe table's write side (its own
    /// traps then look up without the read side, which would deadlock).
    writing: Cell<bool>,
    /// Trap handlers of the engine active on this thread (nested when the
    /// handler's own code hits a probe).
    trap_depth: Cell<u32>,
    /// The thread's kernel id, once asked for (0: not yet); reset in a
    /// fork child.
    tid: Cell<i32>,
    /// The thread's stack of pending returns (`crate::hit::returns`;
    /// null until its first return probe hit).
    return_stack: Cell<*const ()>,
}

// The block, in the thread-local BSS of whatever object links the engine.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
core::arch::global_asm!(
    ".pushsection .tbss.uprobe_core_thread_state,\"awT\",%nobits",
    ".globl uprobe_core_thread_state",
    ".hidden uprobe_core_thread_state",
    ".p2align 3",
    "uprobe_core_thread_state:",
    ".zero {size}",
    ".popsection",
    size = const size_of::<State>(),
);

/// The calling thread's [`State`] (valid on this thread only, for as long
/// as it runs). Async-signal-safe: two loads, no call.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[allow(clippy::inline_always)]
#[inline(always)]
fn state() -> &'static State {
    // SAFETY: the block is `State`'s size and alignment, zero-initialised
    // per thread (a valid `State`), and only this thread reaches it.
    unsafe { &*(block() as *const State) }
}

/// The address of the calling thread's block: the GOT entry of an
/// initial-exec thread-local holds its offset from the thread pointer,
/// `fs:0` (the TCB's self pointer) on x86-64, `tpidr_el0` on aarch64.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[allow(clippy::inline_always)]
#[inline(always)]
fn block() -> usize {
    let at: usize;
    // SAFETY: reads the GOT entry and the thread pointer only.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        core::arch::asm!(
            "mov {at}, qword ptr [rip + uprobe_core_thread_state@GOTTPOFF]",
            "add {at}, qword ptr fs:[0]",
            at = out(reg) at,
            options(pure, readonly, nostack),
        );
    }
    // SAFETY: as above.
    #[cfg(target_arch = "aarch64")]
    unsafe {
        core::arch::asm!(
            "adrp {at}, :gottprel:uprobe_core_thread_state",
            "ldr {at}, [{at}, #:gottprel_lo12:uprobe_core_thread_state]",
            "mrs {tp}, tpidr_el0",
            "add {at}, {at}, {tp}",
            at = out(reg) at,
            tp = out(reg) _,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    at
}

/// The calling thread's [`State`], where the engine has no architecture
/// of its own (a plain thread-local; nothing is probed there).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn state() -> &'static State {
    std::thread_local! {
        static STATE: State = const {
            State {
                flags: Cell::new(0),
                writing: Cell::new(false),
                trap_depth: Cell::new(0),
                tid: Cell::new(0),
                return_stack: Cell::new(core::ptr::null()),
            }
        };
    }
    // SAFETY: as the asm versions: used on this thread only.
    STATE.with(|s| unsafe { &*core::ptr::from_ref(s) })
}

/// The calling thread's stack of pending returns (null: none yet).
/// Async-signal-safe.
#[inline]
pub(crate) fn return_stack() -> *const () {
    state().return_stack.get()
}

/// Sets the calling thread's stack of pending returns.
/// Async-signal-safe.
#[inline]
pub(crate) fn set_return_stack(stack: *const ()) {
    state().return_stack.set(stack);
}

/// Whether this thread holds the probe table's write side.
/// Async-signal-safe.
#[inline]
pub(crate) fn writing() -> bool {
    state().writing.get()
}

/// Marks whether this thread holds the probe table's write side.
/// Async-signal-safe.
#[inline]
pub(crate) fn set_writing(on: bool) {
    state().writing.set(on);
}

/// Traps nested deeper than this mean the handler's own path calls the
/// probed function on every level (a bug: it must not copy through
/// `memcpy`, say): abort with a message instead of overflowing the stack.
/// The program's own signal handlers cannot deepen it: asynchronous
/// signals are blocked while the trap handler runs.
const MAX_TRAP_DEPTH: u32 = 8;

/// The calling thread's kernel id (a system call the first time only).
/// Async-signal-safe.
pub(crate) fn current_tid() -> i32 {
    let state = state();
    let cached = state.tid.get();
    if cached != 0 {
        return cached;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) as i32 };
    state.tid.set(tid);
    tid
}

/// Forgets the cached thread id (the forking thread's, in a fork child:
/// registered with `pthread_atfork`). Async-signal-safe.
pub(crate) extern "C" fn forget_tid() {
    state().tid.set(0);
}

/// [`State::flags`]: the thread runs the engine's handler or a consumer.
const IN_ENGINE: u32 = 1 << 31;
/// [`State::flags`]: the thread's hits are not observed ([`set_observed`]).
const UNOBSERVED: u32 = 1 << 30;

/// Marks the thread as inside the engine; returns whether it already was,
/// or is not observed (then no handler may run, and nothing is marked).
/// Async-signal-safe.
#[inline]
pub(crate) fn enter() -> bool {
    let state = state();
    if state.flags.get() != 0 {
        return true;
    }
    state.flags.set(IN_ENGINE);
    false
}

/// Undoes [`enter`], given what it returned. Async-signal-safe.
#[inline]
pub(crate) fn leave(was_inside: bool) {
    if !was_inside {
        let state = state();
        state.flags.set(state.flags.get() & !IN_ENGINE);
    }
}

/// Whether hits of the calling thread are observed (see [`set_observed`]).
/// Async-signal-safe.
#[inline]
pub(crate) fn observed() -> bool {
    state().flags.get() & UNOBSERVED == 0
}

/// Makes hits of the calling thread observed or not; returns whether they
/// were. A hit in a thread that is not observed runs no handler, entry or
/// return, and counts nothing, on either way in. Async-signal-safe (one
/// thread-local store).
pub(crate) fn set_observed(on: bool) -> bool {
    let state = state();
    let flags = state.flags.get();
    state.flags.set(if on {
        flags & !UNOBSERVED
    } else {
        flags | UNOBSERVED
    });
    flags & UNOBSERVED == 0
}

/// Where the calling thread's flag word lies, from the thread pointer
/// (the same for every thread: static TLS). What the x86-64 counting
/// prelude reads. Async-signal-safe.
#[cfg(target_arch = "x86_64")]
pub(crate) fn flags_offset() -> isize {
    let tp: usize;
    // SAFETY: reads the TCB's self pointer, `fs:0`.
    unsafe {
        core::arch::asm!(
            "mov {tp}, qword ptr fs:[0]",
            tp = out(reg) tp,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    (core::ptr::from_ref(&state().flags) as usize).wrapping_sub(tp) as isize
}

/// Where the calling thread's pointer to its stack of pending returns
/// lies, from the thread pointer (static TLS, as [`flags_offset`]). What
/// the x86-64 timing routines read. Async-signal-safe.
#[cfg(target_arch = "x86_64")]
pub(crate) fn return_stack_offset() -> isize {
    flags_offset() + core::mem::offset_of!(State, return_stack) as isize
        - core::mem::offset_of!(State, flags) as isize
}

/// Runs `f` as one more nested trap handler of the engine on this thread
/// (aborting past [`MAX_TRAP_DEPTH`]). Async-signal-safe.
#[inline]
pub(crate) fn in_trap(f: impl FnOnce()) {
    let state = state();
    let depth = state.trap_depth.get();
    if depth >= MAX_TRAP_DEPTH {
        fatal(b"uprobe-core: the trap handler recursed through a probed function; aborting\n");
    }
    state.trap_depth.set(depth + 1);
    f();
    state.trap_depth.set(depth);
}

/// Whether the calling thread is inside the engine's trap handler (a
/// signal handler that interrupted it can ask). Async-signal-safe.
pub(crate) fn in_trap_handler() -> bool {
    state().trap_depth.get() > 0
}

/// Aborts (with a message) if a consumer panics: unwinding through the
/// signal frame or the trampoline is undefined behaviour. Made before a
/// handler runs and [`disarm`](Self::disarm)ed after it returns, so its
/// `drop` runs only when a panic unwinds through the frame holding it: a
/// new panic, raised below it (not one the interrupted code was already
/// unwinding: a panic allocates, so a probe on `malloc` can hit in the
/// middle of one). The path that does not unwind checks nothing.
pub(crate) struct AbortOnUnwind(());

impl AbortOnUnwind {
    /// Armed. Async-signal-safe.
    pub(crate) fn new() -> Self {
        Self(())
    }

    /// The handler returned: nothing to abort for. Async-signal-safe.
    pub(crate) fn disarm(self) {
        core::mem::forget(self);
    }
}

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        fatal(b"uprobe-core: a probe handler panicked; aborting\n");
    }
}

/// Writes `msg` to stderr and aborts. Async-signal-safe.
pub(crate) fn fatal(msg: &[u8]) -> ! {
    // SAFETY: write(2) of a buffer we hold to stderr.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    std::process::abort();
}
