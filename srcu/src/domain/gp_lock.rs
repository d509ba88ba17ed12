//! The grace-period lock: serialises grace periods, and is taken over
//! rather than waited for in a fork child whose parent held it.

use pcpu::unstable::sync::atomic::{AtomicU64, Ordering};

use super::backoff::backoff;

/// The grace-period lock: the pid of the process whose thread holds it
/// (0: free). Not a `Mutex` because a thread of the parent that held it at
/// `fork()` does not exist in the child, where the lock is then taken over
/// instead of waited for: a grace period abandoned half-way leaves the
/// domain as consistent as a timed-out one does (the next grace period
/// waits for the inactive bank first).
pub(super) struct GpLock {
    pub(super) owner: AtomicU64,
}

pub(super) struct GpGuard<'a>(&'a GpLock);

impl GpLock {
    pub(super) fn lock(&self) -> GpGuard<'_> {
        let me = u64::from(std::process::id());
        let mut round = 0u32;
        loop {
            let holder = self.owner.load(Ordering::Relaxed);
            // Free, or held by a thread of another process (the parent,
            // before this child was forked): take it.
            if (holder == 0 || holder != me)
                && self
                    .owner
                    .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return GpGuard(self);
            }
            round += 1;
            backoff(round, false);
        }
    }
}

impl Drop for GpGuard<'_> {
    fn drop(&mut self) {
        self.0.owner.store(0, Ordering::Release);
    }
}
