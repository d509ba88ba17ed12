//! The pool of per-thread stacks of pending returns: chunks of
//! preallocated [`ThreadReturns`], made in ordinary context as threads
//! need them, from which a thread's first return probe hit takes its
//! stack with a non-waiting pop (no allocation in a signal handler or a
//! trampoline), and to which the service thread gives back the stacks of
//! threads that are gone.

use core::cell::Cell;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use pcpu_freelist::FreeList;
use srcu::LeaseSet;

use super::{MAX_RETURN_DEPTH, PendingReturn, ThreadReturns};
use crate::base::thread::current_tid;
use crate::hit::timing::TimedStack;
use crate::site::returns::ReturnPart;

/// Per-thread stacks of the first chunk of the pool; chunk `k` holds
/// `FIRST_CHUNK << k`. The pool grows a chunk at a time, in ordinary
/// context only (an attach of a return probe, the service thread), so the
/// trap handler only ever pops a preallocated stack.
const FIRST_CHUNK: usize = 256;
/// Chunks the pool can grow to: 256 * (2^8 - 1) = 65,280 threads with
/// returns pending at once (a stack is about 3 KiB).
const CHUNKS: usize = 8;
/// One chunk of the pool of per-thread stacks.
pub(super) struct Chunk {
    pub(super) all: Box<[ThreadReturns]>,
    /// Indexes into `all` of the stacks no thread owns.
    pub(super) free: FreeList<u32>,
}

/// The pool of per-thread stacks: chunks made as threads need them.
pub(super) struct Pool {
    chunks: [OnceLock<Chunk>; CHUNKS],
    /// Stacks owned by a thread now, across chunks.
    pub(super) taken: AtomicUsize,
    /// Serialises growing.
    grow: Mutex<()>,
}

impl Pool {
    /// The chunks made so far, in order.
    pub(super) fn made(&self) -> impl Iterator<Item = &Chunk> {
        self.chunks.iter().map_while(OnceLock::get)
    }

    pub(super) fn capacity(&self) -> usize {
        self.made().map(|c| c.all.len()).sum()
    }

    /// Adds chunks until at least `want` stacks exist (as far as the
    /// chunks go). Ordinary context only: it allocates.
    pub(super) fn grow_to(&self, leases: &'static LeaseSet<'static, ReturnPart>, want: usize) {
        let _g = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        for (k, chunk) in self.chunks.iter().enumerate() {
            if self.capacity() >= want {
                return;
            }
            chunk.get_or_init(|| {
                let n = FIRST_CHUNK << k;
                Chunk {
                    all: (0..n)
                        .map(|_| ThreadReturns {
                            owner: AtomicI32::new(0),
                            element: AtomicUsize::new(0),
                            block: leases.block(MAX_RETURN_DEPTH),
                            depth: Cell::new(0),
                            instances: core::array::from_fn(|_| PendingReturn::default()),
                            timed: TimedStack::new(),
                        })
                        .collect(),
                    free: FreeList::new(0..n as u32),
                }
            });
        }
    }

    /// Grows while fewer than a quarter of the stacks are free, so a burst
    /// of new threads finds stacks waiting.
    pub(super) fn keep_spare(&self, leases: &'static LeaseSet<'static, ReturnPart>) {
        let taken = self.taken.load(Ordering::Relaxed);
        if taken * 4 >= self.capacity() * 3 {
            self.grow_to(leases, self.capacity() + 1);
        }
    }
}

/// The pool, once return probes were first made ready.
pub(super) static POOL: OnceLock<Pool> = OnceLock::new();

/// The pool, made on first use. Not async-signal-safe.
pub(super) fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool {
        chunks: [const { OnceLock::new() }; CHUNKS],
        taken: AtomicUsize::new(0),
        grow: Mutex::new(()),
    })
}

/// The calling thread's stack, if it has taken one. Async-signal-safe.
pub(super) fn thread_stack() -> Option<&'static ThreadReturns> {
    let p = crate::base::thread::return_stack().cast::<ThreadReturns>();
    // SAFETY: stacks live in THREADS forever; ours stays ours until this
    // thread is gone.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The calling thread's stack, taken from the pool on first use.
/// Async-signal-safe (a non-waiting pop).
#[inline]
pub(super) fn thread_stack_or_take() -> Option<&'static ThreadReturns> {
    thread_stack().or_else(take_first)
}

/// The calling thread's first stack: taken from the pool, once per
/// thread (kept out of the hit's path). Async-signal-safe.
#[cold]
#[inline(never)]
fn take_first() -> Option<&'static ThreadReturns> {
    let pool = POOL.get()?;
    let (chunk, element) = take_stack(pool)?;
    let tr = &chunk.all[*element as usize];
    pool.taken.fetch_add(1, Ordering::Relaxed);
    tr.element.store(element.into_index(), Ordering::Relaxed);
    tr.owner.store(current_tid(), Ordering::Release);
    crate::base::thread::set_return_stack(core::ptr::from_ref(tr).cast());
    Some(tr)
}

/// Pops a free per-thread stack. `try_pop` skips a list another thread
/// has locked for a moment (always so without rseq, where every pop and
/// push locks its list), so while stacks are free a failed round is
/// retried: spinning first, then yielding the CPU to a holder that may
/// have been preempted. Once per thread, at its first return probe hit.
/// Async-signal-safe (`sched_yield` is a system call).
fn take_stack(
    pool: &'static Pool,
) -> Option<(&'static Chunk, pcpu_freelist::Element<'static, u32>)> {
    const ROUNDS: usize = 200;
    const SPINNING: usize = 20;
    for round in 0..ROUNDS {
        if let Some(found) = pool.made().find_map(|c| c.free.try_pop().map(|e| (c, e))) {
            return Some(found);
        }
        if pool.taken.load(Ordering::Relaxed) >= pool.capacity() {
            return None;
        }
        if round < SPINNING {
            for _ in 0..64 {
                core::hint::spin_loop();
            }
        } else {
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
        }
    }
    None
}

/// Per-thread stacks made so far.
#[cfg(feature = "test-hooks")]
pub(crate) fn stacks() -> usize {
    POOL.get().map_or(0, Pool::capacity)
}
