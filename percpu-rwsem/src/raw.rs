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

use core::time::Duration;

use core::cell::Cell;
use pcpu::PerCpu;
use pcpu::rseq::{self, GatedAdd};

// A signal fence orders this thread against its own signal handlers, with
// no instruction; loom has no signals, so it is `core`'s in both builds.
use core::sync::atomic::compiler_fence;
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
use pcpu::unstable::sync::futex;

use crate::futex_mutex::FutexMutex;
#[cfg(feature = "test-hooks")]
use crate::hooks::{Point, at as hook};

/// Without the test hooks, a hook point compiles to nothing.
#[cfg(not(feature = "test-hooks"))]
#[allow(clippy::inline_always)]
#[inline(always)]
fn hook(_: Point) {}

/// The points of `crate::hooks` (test builds only), here unused.
#[cfg(not(feature = "test-hooks"))]
#[allow(dead_code)]
#[derive(Clone, Copy)]
enum Point {
    WriteLock(u8),
    WriteUnlock(u8),
    Downgrade(u8),
}

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
/// idle; our grace period is a `membarrier` of about 0.5 us here, so the
/// delay that amortises it is microseconds: 5 us is ten grace periods. (In
/// `bench rwsem-mixed`, one write per ~180 us, readers kept 380-400 M/s
/// with 2-5 us, 370 with 20 us, 300 with 50 us or with none.) Tune it per
/// lock with [`RawPercpuRwSem::set_linger`].
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
    fn new() -> Self {
        Self {
            gated: rseq::GatedAdder::get(),
            slots: PerCpu::default(),
        }
    }

    /// "If the gate is open, add `delta` to my CPU's count", in one
    /// restartable sequence (pairing 1), or `Unavailable`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn add_if_open(&self, gate: &AtomicU32, delta: u64) -> GatedAdd {
        match self.gated {
            Some(adder) => adder.add_if_zero(&self.slots, gate, delta),
            None => GatedAdd::Unavailable,
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

// The calling thread's read depth: how many read sides (of any
// semaphore) it holds or is taking, counted before the read is taken and
// after it is released, so that a signal handler interrupting the thread
// anywhere in between sees it as a reader. A `const`-initialised
// thread-local without a destructor: touching it never allocates or
// registers anything, even for the first time in a signal handler.
#[cfg(not(pcpu_loom))]
std::thread_local!(static READ_DEPTH: Cell<usize> = const { Cell::new(0) });
#[cfg(pcpu_loom)]
loom::thread_local!(static READ_DEPTH: Cell<usize> = Cell::new(0));

/// Counts the calling thread in as a reader; returns its depth before.
/// Async-signal-safe: a handler that interrupts the load-store pair
/// leaves the depth as it found it.
#[allow(clippy::inline_always)]
#[inline(always)]
fn enter_read() -> usize {
    let outer = READ_DEPTH.with(|d| {
        let outer = d.get();
        d.set(outer.wrapping_add(1));
        outer
    });
    // Counted in before the read side is taken (for this thread's handlers).
    compiler_fence(Ordering::SeqCst);
    outer
}

/// Counts one read of the calling thread out (after it was released).
#[allow(clippy::inline_always)]
#[inline(always)]
fn leave_read() {
    compiler_fence(Ordering::SeqCst);
    READ_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
}

/// An address unique to the calling thread (while it lives), used to
/// recognise the writer and the thread that took a read guard: the
/// address of its read depth.
#[cfg(not(pcpu_loom))]
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) fn thread_token() -> usize {
    READ_DEPTH.with(|d| core::ptr::from_ref(d) as usize)
}

/// Under loom, thread-locals of different model threads may share an
/// address: number the threads instead (the counter is outside the model).
#[cfg(pcpu_loom)]
pub(crate) fn thread_token() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    loom::thread_local!(static TOKEN: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    TOKEN.with(|t| *t)
}

/// Monotonic time in nanoseconds (`CLOCK_MONOTONIC`, vDSO, ~20 ns;
/// async-signal-safe).
#[cfg(not(pcpu_loom))]
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

impl RawPercpuRwSem {
    /// An unlocked semaphore; allocates nothing.
    #[cfg(not(pcpu_loom))]
    #[must_use]
    pub const fn new() -> Self {
        Self {
            counts: AtomicPtr::new(core::ptr::null_mut()),
            gate: AtomicU32::new(0),
            drain: AtomicU32::new(0),
            writer: FutexMutex::new(),
            owner: AtomicUsize::new(0),
            last_write_ns: AtomicU64::new(0),
            linger_ns: AtomicU64::new(LINGER_DELAY.as_nanos() as u64),
        }
    }

    /// An unlocked semaphore (loom build: not `const`).
    #[cfg(pcpu_loom)]
    #[must_use]
    pub fn new() -> Self {
        Self {
            counts: AtomicPtr::new(core::ptr::null_mut()),
            gate: AtomicU32::new(0),
            drain: AtomicU32::new(0),
            writer: FutexMutex::new(),
            owner: AtomicUsize::new(0),
            last_write_ns: AtomicU64::new(0),
            linger_ns: AtomicU64::new(LINGER_DELAY.as_nanos() as u64),
        }
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
        let fresh = Box::into_raw(Box::new(Counts::new()));
        let p = pcpu::unstable::sync::publish_once(&self.counts, fresh, |f| {
            // SAFETY: a loser's `fresh` was never shared.
            drop(unsafe { Box::from_raw(f) });
        });
        // SAFETY: published (by us or the winner); lives until `drop`.
        unsafe { &*p }
    }

    fn readers(&self) -> u64 {
        self.counts().sum()
    }

    // ----- read side -----------------------------------------------------

    /// Takes the read side; see [`PercpuRwSem::read`](crate::PercpuRwSem::read).
    /// Only the per-thread depth and the gated add are inline; everything
    /// else is out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_lock(&self, wait: Wait) -> Result<(), ReadRefused> {
        let outer = enter_read();
        let counts = self.counts();
        match counts.add_if_open(&self.gate, 1) {
            GatedAdd::Added => Ok(()),
            other => self.read_lock_not_fast(counts, other, wait, outer != 0),
        }
    }

    /// The read lock when the rseq fast path did not commit: the gate is
    /// closed, or rseq is unavailable here (fallback pairing 2). `nested`:
    /// the calling thread already reads (see `read_lock_slow`).
    #[cold]
    #[inline(never)]
    fn read_lock_not_fast(
        &self,
        counts: &Counts,
        fast: GatedAdd,
        wait: Wait,
        nested: bool,
    ) -> Result<(), ReadRefused> {
        if fast == GatedAdd::Unavailable {
            counts.add(1);
            pcpu::fence::light();
            if self.gate.load(Ordering::Acquire) == 0 {
                return Ok(());
            }
            self.leave_slow(counts);
        }
        let taken = self.read_lock_slow(counts, wait, nested);
        if taken.is_err() {
            leave_read();
        }
        taken
    }

    /// The slow path. A reader waits while a writer blocks readers
    /// (`BLOCK`), except a *nested* blocking one: a thread that already reads (or
    /// is taking a read; its signal handler, typically) may be what the
    /// writer waits for, so it waits only for a writer that is inside
    /// (`ENTERED`). The writer re-checks the counts after setting
    /// `ENTERED` (store buffering, `SeqCst` fences on both sides): either
    /// it sees the nested reader and steps back, or the reader sees
    /// `ENTERED` and backs out. A depth that overstates (a guard released
    /// on another thread) thus costs fairness, never exclusion.
    #[cold]
    fn read_lock_slow(&self, counts: &Counts, wait: Wait, nested: bool) -> Result<(), ReadRefused> {
        // `try_read` never waits, so it cannot deadlock: it keeps yielding
        // to a waiting writer, nested or not.
        let shut = if nested && wait == Wait::Block {
            ENTERED
        } else {
            BLOCK
        };
        loop {
            let g = self.gate.load(Ordering::Acquire);
            if g & BLOCK != 0 && self.owner.load(Ordering::Relaxed) == thread_token() {
                // This thread is the writer (between closing the gate and
                // reopening it: see `write_lock`/`write_unlock`).
                return Err(match wait {
                    Wait::Never => ReadRefused::WouldBlock,
                    Wait::Block => ReadRefused::HeldByThisThread,
                });
            }
            if g & shut == 0 {
                if g & !PARKED == LINGER && self.linger_over() {
                    // Back to the fast path for later readers; this one
                    // still enters below, which is correct in every state.
                    let _ = self
                        .gate
                        .compare_exchange(g, 0, Ordering::AcqRel, Ordering::Relaxed);
                }
                counts.add(1);
                fence(Ordering::SeqCst);
                if self.gate.load(Ordering::Acquire) & shut == 0 {
                    return Ok(());
                }
                self.leave_slow(counts);
                continue;
            }
            if wait == Wait::Never {
                return Err(ReadRefused::WouldBlock);
            }
            if Self::spin_until(|| self.gate.load(Ordering::Relaxed) & shut == 0) {
                continue;
            }
            if g & PARKED == 0
                && self
                    .gate
                    .compare_exchange(g, g | PARKED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            futex::wait(&self.gate, g | PARKED);
        }
    }

    /// Releases the read side (possibly taken on another thread or CPU).
    /// `taken_here`: the calling thread took it, and counts it in its read
    /// depth; it is counted out after the release.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_unlock(&self, taken_here: bool) {
        let counts = self.counts();
        match counts.add_if_open(&self.gate, 1u64.wrapping_neg()) {
            GatedAdd::Added => {}
            other => self.read_unlock_not_fast(counts, other),
        }
        if taken_here {
            leave_read();
        }
    }

    #[cold]
    #[inline(never)]
    fn read_unlock_not_fast(&self, counts: &Counts, fast: GatedAdd) {
        match fast {
            GatedAdd::Added => {}
            GatedAdd::Gated => self.leave_slow(counts),
            GatedAdd::Unavailable if self.gate.load(Ordering::Relaxed) != 0 => {
                self.leave_slow(counts);
            }
            GatedAdd::Unavailable => {
                fence(Ordering::Release);
                counts.add(1u64.wrapping_neg());
                pcpu::fence::light();
                // The gate may have closed between the check and the
                // decrement; a writer may already have summed our count.
                if self.gate.load(Ordering::Relaxed) != 0 {
                    self.wake_writer();
                }
            }
        }
    }

    /// Decrements on the slow path and wakes a draining writer.
    fn leave_slow(&self, counts: &Counts) {
        fence(Ordering::Release);
        counts.add(1u64.wrapping_neg());
        fence(Ordering::SeqCst);
        if self.gate.load(Ordering::Relaxed) & BLOCK != 0 {
            self.wake_writer();
        }
    }

    fn wake_writer(&self) {
        self.drain.fetch_add(1, Ordering::Release);
        futex::wake(&self.drain, 1);
    }

    #[cfg(not(pcpu_loom))]
    fn linger_over(&self) -> bool {
        now_ns().wrapping_sub(self.last_write_ns.load(Ordering::Relaxed))
            >= self.linger_ns.load(Ordering::Relaxed)
    }

    /// Sets how long readers stay on the slow path after a write before
    /// the first of them reopens the fast path (default [`LINGER_DELAY`]).
    /// Longer: writers in bursts share one grace period, readers pay a
    /// fence meanwhile. Shorter: readers return to the fence-free path
    /// sooner, and each isolated write pays a `membarrier`.
    /// Async-signal-safe.
    pub fn set_linger(&self, delay: Duration) {
        self.linger_ns.store(
            delay.as_nanos().try_into().unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Under loom time does not pass on its own: the delay is modelled as
    /// always over, so models explore the return to the fast path racing
    /// with writers.
    #[cfg(pcpu_loom)]
    fn linger_over(&self) -> bool {
        true
    }

    // ----- write side ----------------------------------------------------

    /// Takes the write side; `false` only with `Wait::Never` when readers
    /// or another writer are in the way.
    pub(crate) fn write_lock(&self, wait: Wait) -> bool {
        match wait {
            Wait::Block => self.writer.lock(),
            Wait::Never => {
                if !self.writer.try_lock() {
                    return false;
                }
            }
        }
        hook(Point::WriteLock(0));
        self.prepare();
        // The owner is recorded before the gate can close: a handler of
        // this thread that finds `BLOCK` also finds itself the writer.
        self.owner.store(thread_token(), Ordering::Relaxed);
        compiler_fence(Ordering::SeqCst);
        hook(Point::WriteLock(1));
        let old = self.gate.fetch_or(WRITER, Ordering::SeqCst);
        if old == 0 {
            // Readers were on the fast path: one grace period moves them
            // all to the slow path (kernel: rcu_sync_enter). Otherwise the
            // gate has been closed since an earlier writer's grace period.
            rseq::fence_all();
        }
        hook(Point::WriteLock(2));
        self.gate.fetch_or(BLOCK, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        hook(Point::WriteLock(3));
        loop {
            let seen = self.drain.load(Ordering::Acquire);
            fence(Ordering::SeqCst);
            let drained = self.readers() == 0
                || (wait == Wait::Block && Self::spin_until(|| self.readers() == 0));
            if drained && self.enter() {
                fence(Ordering::Acquire);
                hook(Point::WriteLock(5));
                return true;
            }
            if wait == Wait::Never {
                self.release_write();
                return false;
            }
            if !drained {
                futex::wait(&self.drain, seen);
            }
        }
    }

    /// With the readers seen drained: sets `ENTERED` and checks again that
    /// no nested reader came in meanwhile (see `read_lock_slow`); if one
    /// did, clears it again (waking the nested readers parked on it).
    fn enter(&self) -> bool {
        self.gate.fetch_or(ENTERED, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        hook(Point::WriteLock(4));
        if self.readers() == 0 {
            return true;
        }
        if self.gate.fetch_and(!ENTERED, Ordering::SeqCst) & PARKED != 0 {
            futex::wake(&self.gate, u32::MAX);
        }
        false
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

    /// Releases the write side.
    pub(crate) fn write_unlock(&self) {
        self.release_write();
    }

    /// Releases the write side (or gives up acquiring it): reopens the
    /// gate, then stops being the owner (a handler of this thread that
    /// still finds `BLOCK` also still finds itself the writer), then lets
    /// the next writer in.
    fn release_write(&self) {
        hook(Point::WriteUnlock(0));
        self.release_gate();
        compiler_fence(Ordering::SeqCst);
        hook(Point::WriteUnlock(1));
        self.owner.store(0, Ordering::Relaxed);
        hook(Point::WriteUnlock(2));
        self.writer.unlock();
        hook(Point::WriteUnlock(3));
    }

    /// Turns the write side held by the calling thread into a read side
    /// held by it, letting no other writer in between: counted as a reader
    /// (depth, then count) while the gate is still closed, then released
    /// as a writer. Returns with the read side held, to be released with
    /// `read_unlock(true)` on this thread.
    pub(crate) fn downgrade(&self) {
        hook(Point::Downgrade(0));
        enter_read();
        self.counts().add(1);
        hook(Point::Downgrade(1));
        self.release_write();
        hook(Point::Downgrade(2));
    }

    /// Reopens the gate to slow-path readers (`LINGER`, clearing `WRITER`,
    /// `BLOCK` and `ENTERED`) and wakes sleepers.
    fn release_gate(&self) {
        #[cfg(not(pcpu_loom))]
        self.last_write_ns.store(now_ns(), Ordering::Relaxed);
        if self.gate.swap(LINGER, Ordering::Release) & PARKED != 0 {
            futex::wake(&self.gate, u32::MAX);
        }
    }

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
