//! `Tally`: a count that every thread adds to in a thread-local cell (no
//! shared line, no atomic), added to a shared total when the thread
//! ends. The handler of the `hand` floor rows and the engine's consumer
//! in the probe scenarios both count with it, so that the two rows pay
//! for the same handler and differ only in how they get there. The
//! benchmark's workers end before its check reads the total.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of threads that have ended.
static ENDED: AtomicU64 = AtomicU64::new(0);

/// A thread's count, added to [`ENDED`] when the thread ends.
struct ThreadCount(Cell<u64>);

impl Drop for ThreadCount {
    fn drop(&mut self) {
        ENDED.fetch_add(self.0.get(), Ordering::Relaxed);
    }
}

thread_local! {
    static COUNT: ThreadCount = const { ThreadCount(Cell::new(0)) };
}

/// Adds one to the calling thread's count.
#[inline]
pub(super) fn add() {
    COUNT.with(|c| c.0.set(c.0.get() + 1));
}

/// What threads that have ended counted, in all.
pub(super) fn ended() -> u64 {
    ENDED.load(Ordering::Relaxed)
}
