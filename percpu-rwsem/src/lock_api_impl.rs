//! `RawPercpuRwSem` as a [`lock_api::RawRwLock`], so
//! `lock_api::RwLock<RawPercpuRwSem, T>` works with `lock_api`'s guards and
//! mapping. The fast paths are the same calls [`PercpuRwSem`](crate::PercpuRwSem)
//! makes. Shared guards are `Send` (a read may end on another thread);
//! exclusive guards are not (the writer's thread is remembered to detect
//! self-deadlock).
//!
//! `lock_api` keeps no state in its guards, so the per-thread read depth
//! (see [`PercpuRwSem`](crate::PercpuRwSem)) is counted in by the thread
//! that locks and out by the thread that unlocks (never below zero): a
//! shared guard moved to another thread leaves the taker counted in and
//! may leave the other thread counted short, which is only a problem for
//! a signal handler on that other thread that reads while it holds a read
//! of its own and a writer waits.

use lock_api::{GuardNoSend, GuardSend};

use crate::raw::{RawPercpuRwSem, Wait};

// SAFETY: `read_lock`/`write_lock` implement shared/exclusive locking with
// acquire semantics and the unlocks release; a shared lock may be released
// on any thread (the per-CPU counts are summed), an exclusive one only on
// the thread that took it (its guard is not `Send`).
unsafe impl lock_api::RawRwLock for RawPercpuRwSem {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = RawPercpuRwSem::new();
    type SharedGuard = GuardSend;
    type ExclusiveGuard = GuardNoSend;

    /// # Panics
    /// If the calling thread holds the write side (it would deadlock).
    #[inline]
    fn lock_shared(&self) -> GuardSend {
        assert!(
            self.read_lock(Wait::Block).is_ok(),
            "{}",
            crate::WouldDeadlock
        );
        GuardSend::new()
    }

    #[inline]
    fn try_lock_shared(&self) -> Option<GuardSend> {
        self.read_lock(Wait::Never).ok().map(|_| GuardSend::new())
    }

    #[inline]
    unsafe fn unlock_shared(&self, _guard: GuardSend) {
        self.read_unlock(true);
    }

    fn lock_exclusive(&self) -> GuardNoSend {
        self.write_lock(Wait::Block);
        GuardNoSend::new()
    }

    fn try_lock_exclusive(&self) -> Option<GuardNoSend> {
        self.write_lock(Wait::Never).then(GuardNoSend::new)
    }

    unsafe fn unlock_exclusive(&self, _guard: GuardNoSend) {
        self.write_unlock();
    }

    fn is_locked(&self) -> bool {
        self.is_locked_exclusive() || self.has_readers()
    }

    fn is_locked_exclusive(&self) -> bool {
        RawPercpuRwSem::is_locked_exclusive(self)
    }
}

// SAFETY: `downgrade` turns the exclusive lock held by the calling thread
// into a shared one held by it, with no other writer in between.
unsafe impl lock_api::RawRwLockDowngrade for RawPercpuRwSem {
    unsafe fn downgrade(&self, _guard: GuardNoSend) -> GuardSend {
        let _ = RawPercpuRwSem::downgrade(self);
        GuardSend::new()
    }
}
