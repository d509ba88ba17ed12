//! The read side: the per-thread read depth, the fast (rseq) and
//! fallback paths, the slow path while a writer is in the way, and
//! unlocking.

use core::cell::Cell;
use pcpu::rseq::{Counters, GatedAdd, GatedAdder};

// A signal fence orders this thread against its own signal handlers, with
// no instruction; loom has no signals, so it is `core`'s in both builds.
use core::sync::atomic::compiler_fence;
use pcpu::unstable::sync::atomic::{AtomicU32, Ordering, fence};
use pcpu::unstable::sync::futex;

use super::{BLOCK, Counts, ENTERED, LINGER, PARKED, RawPercpuRwSem, ReadRefused, Wait};

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
pub(super) fn enter_read() -> usize {
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

/// A read side taken: the counts it was counted in, with what their
/// gated adds need read once, so that its release (when the guard keeps
/// it) subtracts without looking any of it up again.
#[derive(Clone, Copy)]
pub(crate) struct Reading<'a> {
    pub(super) counts: &'a Counts,
    pub(super) gated: Option<GatedAdder>,
    pub(super) slots: Counters<'a>,
}

impl Reading<'_> {
    /// "If the gate is open, add `delta` to my CPU's count", in one
    /// restartable sequence (pairing 1), or `Unavailable`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn add_if_open(self, gate: &AtomicU32, delta: u64) -> GatedAdd {
        match self.gated {
            Some(adder) => adder.add_if_zero_in(self.slots, gate, delta),
            None => GatedAdd::Unavailable,
        }
    }
}

impl RawPercpuRwSem {
    /// Takes the read side; see [`PercpuRwSem::read`](crate::PercpuRwSem::read).
    /// Only the per-thread depth and the gated add are inline; everything
    /// else is out of line.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_lock(&self, wait: Wait) -> Result<Reading<'_>, ReadRefused> {
        let outer = enter_read();
        let reading = self.counts().reading();
        match reading.add_if_open(&self.gate, 1) {
            GatedAdd::Added => Ok(reading),
            other => self
                .read_lock_not_fast(reading.counts, other, wait, outer != 0)
                .map(|()| reading),
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
        self.read_unlock_counted(self.counts().reading(), taken_here);
    }

    /// [`read_unlock`](Self::read_unlock) of the read `reading` took,
    /// without looking the counts up again.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_unlock_counted(&self, reading: Reading<'_>, taken_here: bool) {
        match reading.add_if_open(&self.gate, 1u64.wrapping_neg()) {
            GatedAdd::Added => {}
            other => self.read_unlock_not_fast(reading.counts, other),
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
}
