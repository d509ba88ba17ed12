//! Deferring asynchronous signals while a thread runs a trap-ended
//! out-of-line slot (the kernel's lock-free restore of a task flag, in userspace).
//!
//! Between the probe's trap and the slot's own trap the thread runs one
//! displaced instruction somewhere else; a signal handled in between would
//! see (and could longjmp from) that slot. So the first trap swaps the
//! `uc_sigmask` that `sigreturn` will restore for one that blocks every
//! asynchronous signal, keeping the original in thread-local state, and
//! denies the thread's `ASYNC_SIGNALS` flag (a `sigpending::TaskFlags`,
//! which remembers the denial without any lock); the second trap, or a
//! fault raised in the slot, restores both. Pending signals are then
//! delivered by the kernel as soon as the mask allows. SIGTRAP, SIGSEGV,
//! SIGBUS, SIGILL and SIGFPE are never blocked (a blocked synchronous
//! signal kills the process).

use core::cell::Cell;
#[cfg(feature = "bench-variants")]
use core::sync::atomic::{AtomicBool, Ordering};

use sigpending::TaskFlags;

/// The thread's flag: asynchronous signals may be delivered.
const ASYNC_SIGNALS: u32 = 1;

std::thread_local! {
    /// Constant-initialised and without destructor: using it from the
    /// trap handler initialises or allocates nothing.
    static FLAGS: TaskFlags = const { TaskFlags::new() };
    static SAVED_MASK: Cell<libc::sigset_t> = const { Cell::new(empty_set()) };
}

const fn empty_set() -> libc::sigset_t {
    // SAFETY: an all-zero sigset_t is the empty set.
    unsafe { core::mem::zeroed() }
}

/// At the first trap: defer asynchronous signals until [`restore`].
/// Async-signal-safe.
pub(crate) fn defer(uc: &mut libc::ucontext_t) {
    under_process_lock(|| {
        FLAGS.with(|f| {
            f.set(ASYNC_SIGNALS);
            f.deny(ASYNC_SIGNALS);
        });
    });
    SAVED_MASK.with(|saved| copy_set(saved.as_ptr(), &raw const uc.uc_sigmask));
    // Written word by word, not with sigfillset/sigdelset: those are libc
    // calls (memset inside), and a libc function may be what is probed.
    let words = (&raw mut uc.uc_sigmask).cast::<u64>();
    for i in 0..SET_WORDS {
        let value = if i == 0 { DEFER_WORD0 } else { u64::MAX };
        // SAFETY: the frame's sigset_t has SET_WORDS aligned words.
        unsafe { words.add(i).write_volatile(value) };
    }
}

/// At the slot's trap (or a fault in it): give the thread its signal mask
/// back, if [`defer`] took it. Async-signal-safe.
pub(crate) fn restore(uc: &mut libc::ucontext_t) {
    if under_process_lock(|| FLAGS.with(TaskFlags::restore)) & ASYNC_SIGNALS != 0 {
        SAVED_MASK.with(|saved| copy_set(&raw mut uc.uc_sigmask, saved.as_ptr()));
    }
}

/// Whether the flag operations run under one process-wide lock, as the
/// kernel's did under `siglock` before 2025 (a benchmark switch).
#[cfg(feature = "bench-variants")]
static LOCKED: AtomicBool = AtomicBool::new(false);
/// That lock (a spinlock: it is taken in the trap handler).
#[cfg(feature = "bench-variants")]
static PROCESS_LOCK: AtomicBool = AtomicBool::new(false);

/// Makes the deferral bookkeeping take a process-wide lock (the kernel's
/// "before"), for `bench`. Only while no probe is hit: a thread interrupted
/// while holding the lock by a signal whose handler hits a trap-ended slot
/// would wait for itself (as the kernel avoids by disabling interrupts).
#[cfg(feature = "bench-variants")]
pub(crate) fn set_locked(on: bool) {
    LOCKED.store(on, Ordering::Relaxed);
}

/// Runs `f` (without the `bench-variants` feature: just runs it).
#[cfg(not(feature = "bench-variants"))]
fn under_process_lock<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Runs `f` under the process-wide lock if the switch asks for it.
#[cfg(feature = "bench-variants")]
fn under_process_lock<R>(f: impl FnOnce() -> R) -> R {
    if !LOCKED.load(Ordering::Relaxed) {
        return f();
    }
    while PROCESS_LOCK.swap(true, Ordering::Acquire) {
        core::hint::spin_loop();
    }
    let r = f();
    PROCESS_LOCK.store(false, Ordering::Release);
    r
}

/// Words in a `sigset_t`.
const SET_WORDS: usize = size_of::<libc::sigset_t>() / size_of::<u64>();

/// The first word of the deferring mask: every signal blocked but the
/// synchronous ones (blocking those kills the process) and glibc's two
/// internal ones (32 and 33, which `sigfillset` leaves out too).
const DEFER_WORD0: u64 = !(bit(libc::SIGTRAP)
    | bit(libc::SIGSEGV)
    | bit(libc::SIGBUS)
    | bit(libc::SIGILL)
    | bit(libc::SIGFPE)
    | bit(32)
    | bit(33));

const fn bit(sig: i32) -> u64 {
    1 << (sig - 1)
}

/// Copies a signal set word by word with volatile accesses: a plain copy
/// of the 128-byte set could be a `memcpy` call, and `memcpy` may be the
/// probed function that brought the thread here.
fn copy_set(dst: *mut libc::sigset_t, src: *const libc::sigset_t) {
    let (dst, src) = (dst.cast::<u64>(), src.cast::<u64>());
    for i in 0..SET_WORDS {
        // SAFETY: both point to live, aligned sigset_t values of
        // SET_WORDS words.
        unsafe { dst.add(i).write_volatile(src.add(i).read_volatile()) };
    }
}
