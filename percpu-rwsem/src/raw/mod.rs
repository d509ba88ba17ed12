//! `RawPercpuRwSem`: the lock without the data, in the shape of the
//! kernel's `struct percpu_rw_semaphore`.
//!
//! # State
//!
//! | field | kernel | meaning |
//! |---|---|---|
//! | `counts` | `read_count` | per-CPU reader counts; only their sum means anything |
//! | `gate` | `rss` + `block` | 0: readers take the fast path. `LINGER`: no writer, but readers stay on the slow path for a while after the last write (`rcu_sync`'s delayed exit). `WRITER`: a writer is entering (fast path closed, slow-path readers still admitted). `BLOCK`: a writer holds the lock or waits for readers to drain. `ENTERED`: that writer has seen the readers drained and is inside (nested readers still pass `BLOCK`, not `ENTERED`). `PARKED`: some reader sleeps on `gate`. |
//! | `writer` | `rwsem`'s writer mutex | serialises writers |
//! | `drain` | `writer` rcuwait | futex word the writer sleeps on while readers drain; leaving readers bump it |
//! | `owner` | | the writer's thread, for self-deadlock detection: set before the gate closes, cleared after it reopens |
//! | `READ_DEPTH` (per thread) | | how many reads the thread holds or is taking: counted in before the count is taken, out after it is released |
//!
//! # Signal handlers on the lock's own threads
//!
//! A handler can interrupt its thread at any instruction of a lock
//! operation, so the facts the handler's `read_checked` decides on are
//! established before the gate can close against it and retracted only
//! after it reopens:
//!
//! - the writer's `owner` is stored before `WRITER`/`BLOCK` are set and
//!   cleared after the gate is back to `LINGER` (each with a signal fence):
//!   a handler that finds `BLOCK` on its own writer's lock also finds
//!   itself the owner and reports `WouldDeadlock`;
//! - a reader's `READ_DEPTH` is raised before its count is added and
//!   lowered after the count is gone: a handler of a thread whose count a
//!   writer may be waiting for sees a non-zero depth and enters as a
//!   *nested* reader, which passes `BLOCK` and waits only for `ENTERED`.
//!
//! A depth can overstate (the thread is still taking its read, or it
//! released a guard on another thread), so a nested reader is admitted by
//! a store-buffering handshake with the writer, not by trust: it adds its
//! count, `fence(SeqCst)`, and backs out if it sees `ENTERED`; the writer,
//! after seeing the counts drained, sets `ENTERED`, `fence(SeqCst)`, and
//! sums again, clearing `ENTERED` (and waking parked nested readers) if a
//! reader came in.
//!
//! # Memory ordering
//!
//! Three pairings make it correct.
//!
//! 1. **Fast reader vs. entering writer (the grace period).** A fast reader
//!    runs [`pcpu::rseq::add_if_zero`]: "if `gate == 0`, add 1 to my CPU's
//!    count" in one restartable sequence, with no fence. A writer that
//!    moves `gate` from 0 to non-zero then calls [`pcpu::rseq::fence_all`]
//!    (`membarrier(PRIVATE_EXPEDITED_RSEQ)`), which restarts every
//!    critical section in flight and issues a full barrier on every CPU
//!    running our threads. Afterwards no fast add can commit, and every
//!    one that did is visible to the writer's sum. This is exactly the
//!    kernel's `rcu_sync_enter()` waiting for a grace period while readers
//!    test `rcu_sync_is_idle()` with preemption disabled. Fast unlocks are
//!    gated the same way, so while `gate != 0` every unlock takes the slow
//!    path below.
//! 2. **Fallback readers** (no rseq: aarch64, qemu, old glibc, or a CPU id
//!    beyond the possible count) do `add; fence::light(); load gate` and
//!    the writer's grace period is a heavy fence: the store-buffering
//!    pattern of [`pcpu::fence`], so either the reader sees the gate or the
//!    writer sees the count. A fallback unlock that saw `gate == 0` before
//!    decrementing re-checks after a light fence and wakes the writer if
//!    the gate closed meanwhile.
//! 3. **Slow paths** (`gate != 0`) use `fence(SeqCst)` on both sides: a
//!    reader does `add; fence; load gate` and backs out if `BLOCK` is set
//!    (a nested reader: `ENTERED`); the writer does
//!    `gate |= BLOCK; fence; read drain; sum`, then
//!    `gate |= ENTERED; fence; sum`. A reader
//!    leaving while `BLOCK` is set bumps `drain` and wakes the writer, so
//!    the writer's `FUTEX_WAIT(drain, seen)` never misses the last reader.
//!
//! The gate only returns to 0 through a compare-and-swap from exactly
//! `LINGER`, so a writer that finds it non-zero knows a previous writer's
//! grace period still holds and skips its own: back-to-back writers pay
//! one `membarrier` between them, not one each.
//!
//! Data ordering: a reader's section is bracketed by an acquire (the gate
//! load, which on x86-64's rseq path is a plain load under TSO) and a
//! release (a release fence before the decrement, implicit under TSO); the
//! writer reads the counts and then issues an acquire fence before
//! entering, and releases with the store that reopens the gate.
//!
//! # Files
//!
//! The state and its memory are here; the read side (and the per-thread
//! read depth that signal handlers decide on) is in `read`, the write
//! side (the grace period, draining readers, the gate's return to the
//! fast path) in `write`.

use core::time::Duration;

use pcpu::PerCpu;
use pcpu::rseq;
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::futex_mutex::FutexMutex;

mod read;
mod write;

pub(crate) use read::{Reading, thread_token};

/// A writer holds the lock or is draining readers.
const BLOCK: u32 = 1;
/// No writer, but readers stay on the slow path until the linger delay.
const LINGER: u32 = 2;
/// At least one reader sleeps on the gate (the unlocking writer wakes them).
const PARKED: u32 = 4;
/// A writer holds the writer mutex: the fast path is closed and may not be
/// reopened, but readers still enter on the slow path until `BLOCK` (so a
/// grace period in progress does not stall them, as in the kernel, where
/// `rcu_sync_enter` runs before `block` is set).
const WRITER: u32 = 8;
/// The writer has seen the readers drained and is inside (or checking that
/// no nested reader slipped in meanwhile). Nested readers (threads that
/// already read) pass `BLOCK` but not `ENTERED`.
const ENTERED: u32 = 16;

/// Rounds of polling before a waiter sleeps in `FUTEX_WAIT`: a reader's
/// section or a write is usually over within nanoseconds, and a futex
/// sleep plus wake-up costs tens of microseconds on a VM.
const SPIN_ROUNDS: u32 = 200;

/// How long readers stay on the slow path after a write by default, so
/// that a burst of writers pays one grace period between them. The kernel
/// waits one RCU grace period (milliseconds) before `rcu_sync` returns to
/// idle; our grace period is a `membarrier`, which takes microseconds or
/// less, so the delay that amortises it is microseconds too. Too short and
/// every isolated write pays a grace period; too long and readers pay a
/// fence for longer after each write (`bench rwsem-mixed` measures the
/// trade-off on a host). Tune it per lock with
/// [`RawPercpuRwSem::set_linger`].
pub const LINGER_DELAY: Duration = Duration::from_micros(5);

/// How a read attempt behaves when a writer is in the way.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Sleep until the writer leaves.
    Block,
    /// Give up at once.
    Never,
}

/// Why a read attempt did not take the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadRefused {
    WouldBlock,
    HeldByThisThread,
}

/// The per-CPU reader counts, allocated on first use, with the gated-add
/// token next to them (one cache line, loaded once per operation).
struct Counts {
    gated: Option<rseq::GatedAdder>,
    slots: PerCpu<AtomicU64>,
}

impl Counts {
    /// Counts for the machine's CPUs, or as if it had `cpus` (`Some`).
    fn new(cpus: Option<usize>) -> Self {
        let zero = |_| AtomicU64::new(0);
        Self {
            gated: rseq::GatedAdder::get(),
            slots: cpus.map_or_else(|| PerCpu::new(zero), |n| PerCpu::with_cpus(n, zero)),
        }
    }

    /// What a read's lock and unlock need of the counts, read once.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn reading(&self) -> Reading<'_> {
        Reading {
            counts: self,
            gated: self.gated,
            slots: rseq::Counters::new(&self.slots),
        }
    }

    /// Unconditional add (rseq where possible, else atomic).
    fn add(&self, delta: u64) {
        rseq::add(&self.slots, delta);
    }

    fn sum(&self) -> u64 {
        self.slots
            .iter()
            .fold(0u64, |s, c| s.wrapping_add(c.load(Ordering::Relaxed)))
    }
}

/// The raw per-CPU reader-writer semaphore (no data): the lock that
/// [`PercpuRwSem`](crate::PercpuRwSem) wraps, and a
/// [`lock_api::RawRwLock`] (so `lock_api::RwLock<RawPercpuRwSem, T>` works).
///
/// Constructible in a `const` context: the per-CPU counts are allocated on
/// first use, or by [`prepare`](Self::prepare), which code that will take
/// the lock inside a signal handler must call first.
pub struct RawPercpuRwSem {
    counts: AtomicPtr<Counts>,
    /// The CPUs to count for when the counts are made (0: the machine's).
    cpus: usize,
    gate: AtomicU32,
    drain: AtomicU32,
    writer: FutexMutex,
    owner: AtomicUsize,
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    last_write_ns: AtomicU64,
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    linger_ns: AtomicU64,
}

// The lock word and counts are atomics; the raw pointer is owned.
// SAFETY: every field is an atomic or owned through one; nothing is tied
// to a thread.
unsafe impl Send for RawPercpuRwSem {}
// SAFETY: as above; all shared access goes through atomics.
unsafe impl Sync for RawPercpuRwSem {}

impl Default for RawPercpuRwSem {
    fn default() -> Self {
        Self::new()
    }
}

impl core::fmt::Debug for RawPercpuRwSem {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RawPercpuRwSem")
            .field("gate", &self.gate.load(Ordering::Relaxed))
            .field("write_locked", &self.writer.is_locked())
            .finish_non_exhaustive()
    }
}

/// An unlocked semaphore's fields, for both builds' `new` (`const` in
/// one, not in loom's).
macro_rules! unlocked {
    () => {
        Self {
            counts: AtomicPtr::new(core::ptr::null_mut()),
            cpus: 0,
            gate: AtomicU32::new(0),
            drain: AtomicU32::new(0),
            writer: FutexMutex::new(),
            owner: AtomicUsize::new(0),
            last_write_ns: AtomicU64::new(0),
            linger_ns: AtomicU64::new(LINGER_DELAY.as_nanos() as u64),
        }
    };
}

impl RawPercpuRwSem {
    /// An unlocked semaphore; allocates nothing.
    #[cfg(not(pcpu_loom))]
    #[must_use]
    pub const fn new() -> Self {
        unlocked!()
    }

    /// An unlocked semaphore (loom build: not `const`).
    #[cfg(pcpu_loom)]
    #[must_use]
    pub fn new() -> Self {
        unlocked!()
    }

    /// An unlocked semaphore as if the machine had `cpus` CPUs: its
    /// per-CPU counts have `cpus` slots (and the overflow slot, which the
    /// machine's CPUs at or above `cpus` share). For measuring on a small
    /// machine what a writer's grace period over a big machine's counts
    /// costs; everything else behaves as [`new`](Self::new)'s. Allocates
    /// nothing until first use.
    #[must_use]
    pub fn with_cpus(cpus: usize) -> Self {
        let mut sem = Self::new();
        sem.cpus = cpus;
        sem
    }

    /// Allocates the per-CPU counts now, so no later lock operation
    /// allocates. Call it before the lock is used from a signal handler.
    /// Not async-signal-safe (it allocates); idempotent.
    pub fn prepare(&self) {
        let _ = self.counts();
    }

    // The read path is forced inline: its rseq sections need many
    // registers, and a call would cost more than the sections themselves.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn counts(&self) -> &Counts {
        let p = self.counts.load(Ordering::Acquire);
        if p.is_null() {
            return self.allocate_counts();
        }
        // SAFETY: a non-null pointer was published by `allocate_counts`
        // and lives until `drop`.
        unsafe { &*p }
    }

    #[cold]
    fn allocate_counts(&self) -> &Counts {
        let fresh = Box::into_raw(Box::new(Counts::new((self.cpus != 0).then_some(self.cpus))));
        let p = pcpu::unstable::sync::publish_once(&self.counts, fresh, |f| {
            // SAFETY: a loser's `fresh` was never shared.
            drop(unsafe { Box::from_raw(f) });
        });
        // SAFETY: published (by us or the winner); lives until `drop`.
        unsafe { &*p }
    }

    /// Polls `done` for a bounded number of rounds (with growing pauses);
    /// returns whether it became true.
    fn spin_until(done: impl Fn() -> bool) -> bool {
        for round in 0..SPIN_ROUNDS {
            for _ in 0..1u32 << round.min(5) {
                pcpu::unstable::sync::hint::spin_loop();
            }
            if done() {
                return true;
            }
        }
        false
    }

    fn readers(&self) -> u64 {
        self.counts().sum()
    }

    // ----- read side -----------------------------------------------------

    /// Whether some thread holds (or is acquiring) the write side: a
    /// snapshot, for diagnostics and assertions.
    #[must_use]
    pub fn is_locked_exclusive(&self) -> bool {
        self.gate.load(Ordering::Relaxed) & BLOCK != 0
    }

    /// Whether some reader is inside (a snapshot: sums the per-CPU counts).
    #[must_use]
    pub fn has_readers(&self) -> bool {
        self.readers() != 0
    }
}

impl Drop for RawPercpuRwSem {
    fn drop(&mut self) {
        let p = self.counts.load(Ordering::Relaxed);
        if !p.is_null() {
            // SAFETY: `p` came from `Box::into_raw` and `&mut self` means
            // no guard is alive.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}
