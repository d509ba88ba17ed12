//! The write side: the writer mutex, the grace period that closes the
//! fast path, draining readers, and the gate's return to the fast path
//! after the linger delay.

use core::time::Duration;

// `core`'s signal fence in both builds (see `read`).
use core::sync::atomic::compiler_fence;
use pcpu::rseq;
use pcpu::unstable::sync::atomic::{Ordering, fence};
use pcpu::unstable::sync::futex;

use super::read::{Reading, enter_read, thread_token};
use super::{BLOCK, ENTERED, LINGER, PARKED, RawPercpuRwSem, WRITER, Wait};

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

impl RawPercpuRwSem {
    #[cfg(not(pcpu_loom))]
    pub(super) fn linger_over(&self) -> bool {
        pcpu::unstable::time::monotonic_ns()
            .wrapping_sub(self.last_write_ns.load(Ordering::Relaxed))
            >= self.linger_ns.load(Ordering::Relaxed)
    }

    /// Sets how long readers stay on the slow path after a write before
    /// the first of them reopens the fast path (default [`LINGER_DELAY`](super::LINGER_DELAY)).
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
    pub(super) fn linger_over(&self) -> bool {
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
    pub(crate) fn downgrade(&self) -> Reading<'_> {
        hook(Point::Downgrade(0));
        enter_read();
        let counts = self.counts();
        counts.add(1);
        hook(Point::Downgrade(1));
        self.release_write();
        hook(Point::Downgrade(2));
        counts.reading()
    }

    /// Reopens the gate to slow-path readers (`LINGER`, clearing `WRITER`,
    /// `BLOCK` and `ENTERED`) and wakes sleepers.
    fn release_gate(&self) {
        #[cfg(not(pcpu_loom))]
        self.last_write_ns
            .store(pcpu::unstable::time::monotonic_ns(), Ordering::Relaxed);
        if self.gate.swap(LINGER, Ordering::Release) & PARKED != 0 {
            futex::wake(&self.gate, u32::MAX);
        }
    }
}
