//! The domain at `fork()`: the locks its handlers hold across it, the
//! discounting of per-CPU sections in the child, and the child's helper
//! threads started anew on the domain's first use there.

#[cfg(not(pcpu_loom))]
use std::sync::Arc;

#[cfg(not(pcpu_loom))]
use pcpu::unstable::sync::atomic::Ordering;

use super::handle::Srcu;
#[cfg(not(pcpu_loom))]
use super::state::{Inner, LOCK, UNLOCK};
#[cfg(not(pcpu_loom))]
use crate::fork::{self, LeaseSets};

/// The fork handlers' view (see `fork`).
#[cfg(not(pcpu_loom))]
impl fork::Domain for Inner {
    fn lock_for_fork(self: Arc<Self>, held: &mut Vec<Box<dyn fork::HeldLock>>) {
        // SAFETY: the mutex is a field of `self`.
        unsafe { fork::hold(&self, self.reclaimer.state_lock(), held) };
        // SAFETY: the list is a field of `self`.
        unsafe { self.lease_sets.lock_for_fork(&self, held) };
    }

    fn lease_sets(&self) -> &LeaseSets {
        &self.lease_sets
    }

    /// Callers make sure that no such section can still be ended (see
    /// `fork`).
    fn discount_per_cpu(&self) {
        for c in self.counts.iter() {
            for bank in 0..2 {
                c[UNLOCK + bank].store(c[LOCK + bank].load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
    }
}

impl Srcu {
    /// In a fork child, on the first use of the domain after the fork:
    /// restarts the expiry threads of its lease sets and, if callbacks are
    /// pending, the reclaimer (the parent's threads do not exist here).
    /// Cheap otherwise (one load). Ordinary context only.
    #[cfg(not(pcpu_loom))]
    pub(crate) fn revive(&self) {
        let inner = self.inner();
        let generation = fork::generation();
        if inner.helpers_gen.load(Ordering::Acquire) == generation
            || inner.helpers_gen.swap(generation, Ordering::AcqRel) == generation
        {
            return;
        }
        for hooks in inner.lease_sets.live() {
            hooks.restart();
        }
        inner.reclaimer.revive(|| self.inner_arc());
    }

    #[cfg(pcpu_loom)]
    pub(crate) fn revive(&self) {}
}
