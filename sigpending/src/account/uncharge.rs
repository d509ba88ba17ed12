//! Uncharging: one decrement per level, and the 1 -> 0 uncharge
//! releasing the owner, in one step or, once a charge has raced it, two
//! (see "The 1 -> 0 transition" in the parent module).

use std::sync::Arc;

use pcpu::unstable::sync::atomic::{Ordering, fence};

use super::{Account, COUNT, GONE, PINNED, Release};

impl Account {
    /// Uncharges one unit here and at every ancestor, releasing each
    /// level's owner on its 1 -> 0 transition: the undo of a charge whose
    /// [`Charge`](crate::Charge) was [forgotten](crate::Charge::forget). **Async-signal-safe**
    /// for [`Release::Deferred`] accounts (and for owners whose release
    /// is); otherwise the release runs here.
    ///
    /// # Safety
    /// Balances one earlier charge of this account whose token was
    /// forgotten (more uncharges than charges would release an owner
    /// reference that was never taken).
    #[inline]
    pub unsafe fn uncharge_unchecked(self: &Arc<Self>) {
        self.decrement_levels(None);
    }

    /// Undoes a charge at every level strictly below `stop` (from `self`
    /// up to, not including, `stop`).
    pub(super) fn undo_below(self: &Arc<Self>, stop: &Self) {
        self.decrement_levels(Some(stop));
    }

    /// One decrement at each level from `self` up to (not including)
    /// `stop`, or to the root; each level releases its owner on 1 -> 0.
    #[inline]
    fn decrement_levels(self: &Arc<Self>, stop: Option<&Self>) {
        let mut level = Some(self);
        while let Some(l) =
            level.filter(|l| !stop.is_some_and(|s| core::ptr::eq(Arc::as_ptr(l), s)))
        {
            // Read the parent before the release: nothing of a level is
            // touched after its owner may be gone.
            level = l.parent.as_ref();
            l.decrement();
        }
    }

    /// One decrement at this level, releasing on 1 -> 0 (see "The
    /// 1 -> 0 transition" at `Account`).
    #[inline]
    pub(super) fn decrement(self: &Arc<Self>) {
        // One step, for a level that has never seen a charge race its
        // 1 -> 0: the count and the pin off together.
        if !self.shared.load(Ordering::Relaxed) && self.state.load(Ordering::Relaxed) == PINNED | 1
        {
            // `PINNED` is still set at the decrement (clearing it takes a
            // count of 0, and this uncharge's count is in), so this
            // borrows nothing from `GONE`.
            let old = self.state.fetch_sub(PINNED | 1, Ordering::Release);
            if old == PINNED | 1 {
                return self.release_owner();
            }
            return self.republish();
        }
        let old = self.state.fetch_sub(1, Ordering::Release);
        if old & (GONE | PINNED | COUNT) == PINNED | 1 {
            self.unpin_idle();
        }
    }

    /// After a one-step 1 -> 0 that a charge raced (it incremented
    /// between the load and the decrement, finding `PINNED`): the
    /// reference taken off the word with this uncharge's count is still
    /// held, here, and goes back, and the level is marked shared. If
    /// another charge published a reference meanwhile, this one is extra;
    /// if the level went idle meanwhile, it is released unless a charge
    /// comes in.
    #[cold]
    fn republish(self: &Arc<Self>) {
        self.shared.store(true, Ordering::Relaxed);
        let old = self.state.fetch_or(PINNED, Ordering::AcqRel);
        if old & PINNED != 0 {
            // Released as the account's mode says, not as `release_extra`
            // does: the published reference may be released concurrently
            // (its charges gone), so this one may be the last.
            self.release_owner();
        } else if old & COUNT == 0 {
            self.unpin_idle();
        }
    }

    /// With the level pinned at count 0 (a decrement took it 1 -> 0, or
    /// a reference went back to an idle level): release, unless a charge
    /// came in since (it found `PINNED` and relies on the reference; the
    /// last of its epoch releases it instead).
    #[inline(never)]
    fn unpin_idle(self: &Arc<Self>) {
        if self
            .state
            .compare_exchange(PINNED, 0, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            self.release_owner();
        }
    }

    /// Drops the owner reference taken on 0 -> 1, now or deferred.
    #[inline]
    pub(super) fn release_owner(self: &Arc<Self>) {
        // Every decrement was Release: see all uses before the owner goes.
        fence(Ordering::Acquire);
        match self.release {
            // SAFETY: balanced with the pin of the 0 -> 1 transition this
            // 1 -> 0 transition ends.
            Release::Immediate => unsafe { self.owner.unpin() },
            Release::Deferred => super::deferred::defer(self),
        }
    }

    /// Runs `owed` deferred releases (ordinary context).
    pub(crate) fn run_owed(&self, owed: usize) {
        for _ in 0..owed {
            // SAFETY: each owed release ends a 0 -> 1 pin.
            unsafe { self.owner.unpin() };
        }
    }
}
