//! The calling thread: its id (ours, never reused), its kernel thread id,
//! whether another thread has exited, and the thread's cache of its slot
//! addresses.

use core::cell::Cell;
use core::sync::atomic::AtomicU64 as IdCounter;

/// Domains' cache entries per thread (a thread alternating between more
/// domains than this takes the claim path's scan for a cache miss).
pub(super) const CACHE_WAYS: usize = 4;

/// The cache entry of the slot this thread used last, after the ways.
pub(super) const LAST: usize = CACHE_WAYS;

/// Cache entries per thread: the ways and [`LAST`].
pub(super) const CACHE_ENTRIES: usize = CACHE_WAYS + 1;

/// Thread ids (never reused, unlike kernel thread ids), from 1.
static NEXT_THREAD_ID: IdCounter = IdCounter::new(1);

#[cfg(not(pcpu_loom))]
std::thread_local! {
    /// This thread's id (0: none yet). Const-initialised without a
    /// destructor, like the cache: usable from signal handlers.
    pub(super) static THREAD_ID: Cell<u64> = const { Cell::new(0) };
    /// The address of a slot of this thread per way (way: bits of the
    /// table's address), then the one it used last ([`LAST`]); 0: empty.
    pub(super) static CACHE: [Cell<usize>; CACHE_ENTRIES] = const { [const { Cell::new(0) }; CACHE_ENTRIES] };
}

#[cfg(pcpu_loom)]
loom::thread_local! {
    pub(super) static THREAD_ID: Cell<u64> = Cell::new(0);
    pub(super) static CACHE: [Cell<usize>; CACHE_ENTRIES] = [Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0)];
}

/// The calling thread's id, assigned on first use. Async-signal-safe (a
/// handler that assigns one first leaves the thread with two ids, so one
/// claimed slot idles until the thread exits: wasted, never shared).
pub(super) fn thread_id() -> u64 {
    THREAD_ID.with(|id| {
        if id.get() == 0 {
            id.set(NEXT_THREAD_ID.fetch_add(1, core::sync::atomic::Ordering::Relaxed));
        }
        id.get()
    })
}

/// The calling thread's kernel thread id. Async-signal-safe, and calls
/// no libc function (a probe handler's read section may run while libc
/// is probed).
#[cfg(not(pcpu_loom))]
pub(super) fn current_tid() -> u64 {
    u64::try_from(pcpu::unstable::syscall::gettid()).unwrap_or(0)
}

#[cfg(pcpu_loom)]
pub(super) fn current_tid() -> u64 {
    0
}

/// Whether the thread `tid` of this process has exited (0: unknown, so
/// no). Async-signal-safe, without libc.
#[cfg(not(pcpu_loom))]
pub(super) fn has_exited(tid: u64) -> bool {
    libc::pid_t::try_from(tid).is_ok_and(pcpu::unstable::syscall::thread_exited)
}

/// loom threads never exit from the model's point of view.
#[cfg(pcpu_loom)]
pub(super) fn has_exited(_tid: u64) -> bool {
    false
}
