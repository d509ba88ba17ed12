//! A lease set at `fork()`: its locks held across the fork, its leases
//! expired in the child, and its expiry thread started anew there.

use std::sync::Arc;
#[cfg(not(pcpu_loom))]
use std::sync::PoisonError;

use pcpu::unstable::sync::atomic::Ordering;

use super::expiry::Shared;
#[cfg(not(pcpu_loom))]
use super::expiry::spawn_expiry;

impl<T: Send + Sync + 'static> crate::fork::ForkHooks for Shared<T> {
    fn lock_for_fork(self: Arc<Self>, held: &mut Vec<Box<dyn crate::fork::HeldLock>>) {
        // In the order the expiry thread nests them (`expire` holds the
        // scratch buffer, then takes `blocks`). The scratch is held for a
        // whole expiry round: a child that inherited it locked would hang
        // in `expire_in_child`.
        // SAFETY: the three mutexes are fields of `self`.
        unsafe {
            crate::fork::hold(&self, &self.ctl.0, held);
            crate::fork::hold(&self, &self.expiry_scratch, held);
            crate::fork::hold(&self, &self.blocks, held);
        }
    }

    fn expire_in_child(&self) {
        // A round of the parent's expiry thread may have been running: it
        // is over (that thread does not exist here).
        self.expiring.store(0, Ordering::Relaxed);
        self.expire(0);
    }

    fn restart(self: Arc<Self>) {
        #[cfg(not(pcpu_loom))]
        {
            let mut ctl = self.ctl.0.lock().unwrap_or_else(PoisonError::into_inner);
            let generation = crate::fork::generation();
            if ctl.stopped
                || ctl.parked
                || ctl.thread.as_ref().is_some_and(|(g, _)| *g == generation)
            {
                return;
            }
            if let Some((_, inherited)) = ctl.thread.take() {
                // The parent's thread: not ours to join or detach.
                core::mem::forget(inherited);
            }
            // A child that cannot start the thread keeps its leases until
            // they are consumed (nothing expires them: grace periods wait
            // for them, as for plain read sections).
            ctl.thread = spawn_expiry(&self).ok().map(|t| (generation, t));
        }
    }
}
