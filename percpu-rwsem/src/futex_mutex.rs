//! The mutex that serialises writers: a three-state futex mutex
//! (0 unlocked, 1 locked, 2 locked with waiters). Its waiters block in the
//! kernel (`FUTEX_WAIT`), so it takes no user-space lock of its own and is
//! usable from a signal handler (blocking there is the caller's choice).

use pcpu::unstable::sync::atomic::{AtomicU32, Ordering};
use pcpu::unstable::sync::futex;

const UNLOCKED: u32 = 0;
const LOCKED: u32 = 1;
const CONTENDED: u32 = 2;

#[derive(Debug)]
pub(crate) struct FutexMutex {
    state: AtomicU32,
}

impl FutexMutex {
    #[cfg(not(pcpu_loom))]
    pub(crate) const fn new() -> Self {
        Self {
            state: AtomicU32::new(UNLOCKED),
        }
    }

    #[cfg(pcpu_loom)]
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU32::new(UNLOCKED),
        }
    }

    pub(crate) fn try_lock(&self) -> bool {
        self.state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    pub(crate) fn lock(&self) {
        if self.try_lock() {
            return;
        }
        // Mark contended, then sleep until we take it (still contended: we
        // cannot know whether others wait, so the unlocker wakes one).
        while self.state.swap(CONTENDED, Ordering::Acquire) != UNLOCKED {
            futex::wait(&self.state, CONTENDED);
        }
    }

    pub(crate) fn unlock(&self) {
        if self.state.swap(UNLOCKED, Ordering::Release) == CONTENDED {
            futex::wake(&self.state, 1);
        }
    }

    pub(crate) fn is_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) != UNLOCKED
    }
}
