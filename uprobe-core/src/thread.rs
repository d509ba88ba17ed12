//! What the engine keeps per thread, below everything else: the thread's
//! kernel id, whether it is inside the engine (a hit there runs no
//! handler), how deep its trap handlers are nested, and the way out when
//! something cannot go on (`fatal`). Nothing here knows about probes.
//!
//! Every function is async-signal-safe: thread-locals without
//! destructors, and raw system calls.
//!
//! # Static TLS, also when loaded with `dlopen`
//! A thread-local of a library loaded with `dlopen` normally lives in
//! *dynamic* TLS: glibc allocates a thread's block on that thread's first
//! access, with `malloc`. On the hit path that is fatal: a thread that
//! existed before the load hits a probe, the handler's first thread-local
//! access calls `malloc` from inside the hit (a probed `malloc` hits
//! again, on a breakpoint that kills the thread; an interrupted `malloc`
//! deadlocks). So the engine makes whatever object links it use *static*
//! TLS: [`static_tls_anchor`] reads a thread-local of its own through the
//! initial-exec model. The dynamic linker resolves that relocation
//! (`R_X86_64_TPOFF64`, `R_AARCH64_TLS_TPREL`) by placing the library's
//! whole TLS block in the static TLS area of every thread, existing and
//! new, at `dlopen`; where the process has no room left, `dlopen` fails
//! with "cannot allocate memory in static TLS block" (the tunable
//! `glibc.rtld.optional_static_tls` makes more) instead of a hit
//! crashing later. (The x86-64 linker also marks the library
//! `DF_STATIC_TLS`.) In an executable, TLS is static anyway.

use core::cell::Cell;

std::thread_local! {
    /// Set while this thread runs the engine's handler or a consumer.
    static IN_ENGINE: Cell<bool> = const { Cell::new(false) };
    /// Trap handlers of the engine active on this thread (nested when the
    /// handler's own code hits a probe).
    static TRAP_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The thread's kernel id, once asked for (0: not yet); reset in a
    /// fork child.
    static TID: Cell<i32> = const { Cell::new(0) };
}

// A thread-local of the engine's own, and an initial-exec access to it
// (see the module's docs); the access is kept by `static_tls_anchor`'s
// callers. The variable is the same on both architectures, the access
// their own.
core::arch::global_asm!(
    ".pushsection .tbss.uprobe_core_static_tls,\"awT\",%nobits",
    ".p2align 3",
    "uprobe_core_static_tls:",
    ".zero 8",
    ".popsection",
);
#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_static_tls_anchor,\"ax\",@progbits",
    ".globl uprobe_core_static_tls_anchor",
    ".hidden uprobe_core_static_tls_anchor",
    ".type uprobe_core_static_tls_anchor, @function",
    "uprobe_core_static_tls_anchor:",
    "mov rax, qword ptr [rip + uprobe_core_static_tls@GOTTPOFF]",
    "mov rax, qword ptr fs:[rax]",
    "ret",
    ".size uprobe_core_static_tls_anchor, . - uprobe_core_static_tls_anchor",
    ".popsection",
);
#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_static_tls_anchor,\"ax\",%progbits",
    ".globl uprobe_core_static_tls_anchor",
    ".hidden uprobe_core_static_tls_anchor",
    ".type uprobe_core_static_tls_anchor, %function",
    "uprobe_core_static_tls_anchor:",
    "adrp x0, :gottprel:uprobe_core_static_tls",
    "ldr x0, [x0, #:gottprel_lo12:uprobe_core_static_tls]",
    "mrs x1, tpidr_el0",
    "ldr x0, [x1, x0]",
    "ret",
    ".size uprobe_core_static_tls_anchor, . - uprobe_core_static_tls_anchor",
    ".popsection",
);

unsafe extern "C" {
    fn uprobe_core_static_tls_anchor() -> u64;
}

/// Reads the engine's initial-exec thread-local, so that the object
/// linking the engine has static TLS (see the module's docs). Called on
/// every attach: the call keeps the access (and its relocation) in the
/// link. Async-signal-safe.
pub(crate) fn static_tls_anchor() {
    // SAFETY: reads the calling thread's own 8-byte thread-local.
    core::hint::black_box(unsafe { uprobe_core_static_tls_anchor() });
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
    let cached = TID.get();
    if cached != 0 {
        return cached;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) as i32 };
    TID.set(tid);
    tid
}

/// Forgets the cached thread id (the forking thread's, in a fork child:
/// registered with `pthread_atfork`). Async-signal-safe.
pub(crate) extern "C" fn forget_tid() {
    TID.set(0);
}

/// Marks the thread as inside the engine; returns whether it already was
/// (then no handler may run). Async-signal-safe.
#[inline]
pub(crate) fn enter() -> bool {
    IN_ENGINE.replace(true)
}

/// Undoes [`enter`], given what it returned. Async-signal-safe.
#[inline]
pub(crate) fn leave(was_inside: bool) {
    IN_ENGINE.set(was_inside);
}

/// Runs `f` as one more nested trap handler of the engine on this thread
/// (aborting past [`MAX_TRAP_DEPTH`]). Async-signal-safe.
#[inline]
pub(crate) fn in_trap(f: impl FnOnce()) {
    let depth = TRAP_DEPTH.get();
    if depth >= MAX_TRAP_DEPTH {
        fatal(b"uprobe-core: the trap handler recursed through a probed function; aborting\n");
    }
    TRAP_DEPTH.set(depth + 1);
    f();
    TRAP_DEPTH.set(depth);
}

/// Whether the calling thread is inside the engine's trap handler (a
/// signal handler that interrupted it can ask). Async-signal-safe.
pub(crate) fn in_trap_handler() -> bool {
    TRAP_DEPTH.get() > 0
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
