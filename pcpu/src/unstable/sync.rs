//! The loom shim: every synchronisation primitive the workspace's lock-free
//! code uses, re-exported from [`loom`](https://docs.rs/loom) under
//! `--cfg pcpu_loom` and from `core`/`std` otherwise (the crossbeam and tokio
//! pattern).
//!
//! Crates of the workspace import atomics, `UnsafeCell`, threads and the
//! futex-style wait/wake from here, so one `RUSTFLAGS="--cfg pcpu_loom"` build
//! model-checks all of them. Under loom:
//! - the CPU id comes from `pcpu::unstable::loom_cpu` (a per-loom-thread value),
//! - rseq operations take their atomic fallback,
//! - both sides of the asymmetric fence are `fence(SeqCst)`,
//! - [`futex::wait`] yields to other loom threads (a futex may wake
//!   spuriously, so callers loop; a lost wake-up shows up as a loom deadlock).
//!
//! **The cfg is `pcpu_loom`, not `loom`.** A `--cfg` applies to every
//! crate of a build: a program that model-checks its own code with
//! `RUSTFLAGS="--cfg loom"` would otherwise switch these crates to loom
//! too, and their `const fn new` (not `const` under loom) would stop
//! compiling in the program's statics. A name of the family's own (as
//! crossbeam's `crossbeam_loom`) switches them only when asked:
//! `RUSTFLAGS="--cfg pcpu_loom"` builds the family's models, with or
//! without the program's own `loom`.

#[cfg(not(any(pcpu_loom, pcpu_tsan)))]
pub use core::sync::atomic;
#[cfg(pcpu_loom)]
pub use loom::sync::atomic;

/// `core`'s atomics, with [`fence`](atomic::fence) modelled for the thread
/// sanitizer (`--cfg pcpu_tsan`, which `.ci/sanitizers` passes with
/// `-Zsanitizer=thread`).
///
/// The thread sanitizer does not implement standalone fences (its
/// `__tsan_atomic_thread_fence` is a plain barrier that records no
/// synchronisation), so every happens-before edge that a fence pair
/// makes out of relaxed accesses is invisible to it: a reader's
/// `fence(Release)` before its relaxed decrement and a writer's
/// `fence(Acquire)` after summing the counts, which is how every
/// primitive here hands a read section over to a writer or a grace
/// period. It then reports the data the section protects as raced.
/// Here each fence is also a read-modify-write of one process-wide
/// atomic with the fence's ordering: a release fence followed (later in
/// that atomic's order) by an acquire fence makes a happens-before edge
/// the sanitizer records. That edge is what the fences give wherever
/// the acquiring side read a value the releasing side wrote after its
/// fence (the only case the code relies on); where it did not, the model
/// orders more than the memory model does, so the sanitizer may miss a
/// race there (never report a false one). The fence itself is kept.
#[cfg(all(pcpu_tsan, not(pcpu_loom)))]
pub mod atomic {
    pub use core::sync::atomic::*;

    /// The one atomic every modelled fence reads and writes.
    static FENCES: AtomicUsize = AtomicUsize::new(0);

    /// `core::sync::atomic::fence(order)`, and the same ordering on a
    /// read-modify-write of one process-wide atomic, which the thread
    /// sanitizer sees (see the module).
    ///
    /// # Panics
    /// On `Relaxed`, as `core`'s fence does.
    #[inline]
    pub fn fence(order: Ordering) {
        core::sync::atomic::fence(order);
        FENCES.fetch_add(0, order);
    }
}

#[cfg(pcpu_loom)]
pub use loom::thread;
#[cfg(not(pcpu_loom))]
pub use std::thread;

#[cfg(not(pcpu_loom))]
pub use core::hint;
#[cfg(pcpu_loom)]
pub use loom::hint;

/// Publishes `fresh` in `slot` if `slot` is still null and returns what
/// `slot` holds afterwards: `fresh`, or the pointer another thread published
/// first, in which case `fresh` is handed to `discard` (it was never
/// shared). The lazily allocated state of `const`-constructible types
/// (percpu-rwsem's counts, an SRCU domain) is published this way.
/// Not async-signal-safe in itself only because callers allocate `fresh`.
pub fn publish_once<T>(
    slot: &atomic::AtomicPtr<T>,
    fresh: *mut T,
    discard: impl FnOnce(*mut T),
) -> *mut T {
    use atomic::Ordering::{AcqRel, Acquire};
    match slot.compare_exchange(core::ptr::null_mut(), fresh, AcqRel, Acquire) {
        Ok(_) => fresh,
        Err(winner) => {
            discard(fresh);
            winner
        }
    }
}

/// `UnsafeCell` with loom's closure-based access API on both builds, so code
/// written against it compiles unchanged under `--cfg pcpu_loom`.
pub mod cell {
    #[cfg(pcpu_loom)]
    pub use loom::cell::UnsafeCell;

    /// A `core::cell::UnsafeCell` with loom's `with`/`with_mut` accessors.
    #[cfg(not(pcpu_loom))]
    #[derive(Debug, Default)]
    #[repr(transparent)]
    pub struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

    #[cfg(not(pcpu_loom))]
    impl<T> UnsafeCell<T> {
        /// Wraps `value`.
        pub const fn new(value: T) -> Self {
            Self(core::cell::UnsafeCell::new(value))
        }

        /// Calls `f` with a shared raw pointer to the value.
        #[inline]
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Calls `f` with a mutable raw pointer to the value.
        #[inline]
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }

        /// Unwraps the value.
        pub fn into_inner(self) -> T {
            self.0.into_inner()
        }
    }
}

/// Futex-style waiting on a 32-bit atomic: the blocking primitive that is
/// also usable inside a signal handler (a raw `futex` system call takes no
/// user-space lock and allocates nothing).
pub mod futex {
    use super::atomic::AtomicU32;

    /// Blocks while `word` holds `expected`, until [`wake`] is called on it.
    ///
    /// May return spuriously (as `FUTEX_WAIT` does): callers re-check their
    /// condition in a loop. Async-signal-safe.
    #[cfg(not(pcpu_loom))]
    pub fn wait(word: &AtomicU32, expected: u32) {
        // SAFETY: FUTEX_WAIT_PRIVATE reads the aligned u32 behind `word`,
        // which lives for the duration of the call; a null timeout waits
        // without limit. Errors (EAGAIN when the value changed, EINTR) are
        // spurious returns, which the contract allows.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                core::ptr::null::<libc::timespec>(),
            );
        }
    }

    /// Like [`wait`], but gives up after `timeout`. Async-signal-safe.
    #[cfg(not(pcpu_loom))]
    pub fn wait_timeout(word: &AtomicU32, expected: u32, timeout: core::time::Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().try_into().unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(timeout.subsec_nanos().cast_signed()),
        };
        // SAFETY: as in `wait`; `ts` outlives the call (relative timeout).
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                &raw const ts,
            );
        }
    }

    /// Wakes up to `count` threads blocked in [`wait`] on `word`.
    /// Async-signal-safe.
    #[cfg(not(pcpu_loom))]
    pub fn wake(word: &AtomicU32, count: u32) {
        let count = count.min(i32::MAX as u32);
        // SAFETY: FUTEX_WAKE_PRIVATE only uses the address of `word` as a key.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                count,
            );
        }
    }

    /// Loom model of `FUTEX_WAIT`: a spurious wake-up after letting other
    /// threads run.
    #[cfg(pcpu_loom)]
    pub fn wait(word: &AtomicU32, expected: u32) {
        use super::atomic::Ordering;
        if word.load(Ordering::SeqCst) == expected {
            loom::thread::yield_now();
        }
    }

    /// Loom model of a timed `FUTEX_WAIT`: the same as [`wait`].
    #[cfg(pcpu_loom)]
    pub fn wait_timeout(word: &AtomicU32, expected: u32, _timeout: core::time::Duration) {
        wait(word, expected);
    }

    /// Loom model of `FUTEX_WAKE`: waiters re-check on their own.
    #[cfg(pcpu_loom)]
    pub fn wake(_word: &AtomicU32, _count: u32) {}
}
