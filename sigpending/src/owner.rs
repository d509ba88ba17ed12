//! `Owner`: what an account pins while something is charged to it.

use std::sync::{Arc, Weak};

/// The reference an [`Account`](crate::Account) takes on its owner on the
/// 0 -> 1 transition of its charge count and drops on 1 -> 0 (the kernel's
/// `get_uid` / `free_uid` on the user that signals are charged to).
///
/// Three kinds:
/// - [`Owner::none`]: nothing to pin (a bare counter with a limit);
/// - [`Owner::arc`]: a strong count on an `Arc<T>` (the account keeps only
///   a `Weak`, so an idle account does not keep its owner alive; a charge
///   after the owner was dropped is refused with
///   [`ChargeError::OwnerGone`](crate::ChargeError::OwnerGone));
/// - [`Owner::from_fns`]: a user callback pair on a context pointer.
///
/// Pinning is async-signal-safe for `none` and `arc` (an atomic
/// compare-and-swap loop on the strong count); unpinning an `Arc` may drop
/// the owner, which is why accounts used from signal handlers defer it
/// ([`Release::Deferred`](crate::Release::Deferred)).
pub struct Owner {
    kind: Kind,
}

/// The kinds of [`Owner`], matched directly (no call through a vtable on
/// the charge path; the `Arc` kind's pin and unpin inline into it).
enum Kind {
    Nothing,
    Arc(StrongCount),
    Callbacks(Callbacks),
}

struct StrongCount {
    /// The owner, its type erased: the counts of an `Arc`'s allocation do
    /// not depend on the type, so `upgrade` and the strong count's
    /// decrement need no vtable (only a last release, which drops the
    /// value, calls through it).
    weak: Weak<dyn Send + Sync>,
    /// Under loom: `upgrade` is one atomic of `std`, invisible to the
    /// model; a load of this modelled atomic just before it lets the model
    /// interleave other threads between the charge's increment and the pin.
    #[cfg(pcpu_loom)]
    point: loom::sync::atomic::AtomicUsize,
}

impl StrongCount {
    #[inline]
    fn pin(&self) -> bool {
        #[cfg(pcpu_loom)]
        self.point.load(loom::sync::atomic::Ordering::Relaxed);
        // `upgrade` increments the strong count unless it is zero; the
        // count then stays with the account until `unpin`.
        self.weak.upgrade().map(core::mem::forget).is_some()
    }

    /// Whether this is the allocation `ptr` (an `Arc`'s value) points to.
    #[inline]
    fn is_at(&self, ptr: *const ()) -> bool {
        core::ptr::addr_eq(self.weak.as_ptr(), ptr)
    }

    /// A pin that cannot fail: one plain increment of the strong count.
    ///
    /// # Safety
    /// The caller holds a strong reference on this allocation (so its
    /// strong count is above 0 and stays so during the call).
    #[inline]
    unsafe fn pin_held(&self) {
        #[cfg(pcpu_loom)]
        self.point.load(loom::sync::atomic::Ordering::Relaxed);
        // SAFETY: the `Weak` keeps the allocation, and the caller's strong
        // reference keeps the value alive: the pointer is that of a live
        // `Arc`'s value.
        unsafe { Arc::increment_strong_count(self.weak.as_ptr()) };
    }

    /// # Safety
    /// Balanced with an earlier successful `pin`.
    #[inline]
    unsafe fn unpin(&self) {
        // SAFETY: a successful `pin` left one strong count, forgotten, on
        // this allocation, which the `Weak` keeps allocated.
        unsafe { Arc::decrement_strong_count(self.weak.as_ptr()) };
    }
}

struct Callbacks {
    context: *const (),
    pin: unsafe fn(*const ()),
    unpin: unsafe fn(*const ()),
}

// SAFETY: `from_fns`'s contract: the callbacks may run on any thread.
unsafe impl Send for Callbacks {}
// SAFETY: as above.
unsafe impl Sync for Callbacks {}

impl Owner {
    /// No owner: the account is a counter with a limit.
    #[must_use]
    pub fn none() -> Self {
        Self {
            kind: Kind::Nothing,
        }
    }

    /// Pins `owner` (a strong count) while anything is charged.
    #[must_use]
    pub fn arc<T: Send + Sync + 'static>(owner: &Arc<T>) -> Self {
        let weak: Weak<T> = Arc::downgrade(owner);
        Self {
            kind: Kind::Arc(StrongCount {
                weak,
                #[cfg(pcpu_loom)]
                point: loom::sync::atomic::AtomicUsize::new(0),
            }),
        }
    }

    /// A callback pair: `pin(context)` on 0 -> 1, `unpin(context)` on
    /// 1 -> 0 (or later, in ordinary context, for a deferred account).
    ///
    /// # Safety
    /// `context` stays valid for both callbacks as long as the account
    /// lives; the callbacks may be called from any thread, and `pin` (and
    /// `unpin` for an account with immediate release) from wherever the
    /// account is charged, including signal handlers if it is charged
    /// there.
    #[must_use]
    pub unsafe fn from_fns(
        context: *const (),
        pin: unsafe fn(*const ()),
        unpin: unsafe fn(*const ()),
    ) -> Self {
        Self {
            kind: Kind::Callbacks(Callbacks {
                context,
                pin,
                unpin,
            }),
        }
    }

    /// Whether pinning can fail ([`Owner::arc`] only).
    #[inline]
    pub(crate) fn can_fail(&self) -> bool {
        matches!(self.kind, Kind::Arc(_))
    }

    /// Takes a reference; `false` if the owner is gone.
    #[inline]
    pub(crate) fn pin(&self) -> bool {
        match &self.kind {
            Kind::Nothing => true,
            Kind::Arc(strong) => strong.pin(),
            Kind::Callbacks(c) => {
                // SAFETY: `from_fns`'s contract.
                unsafe { (c.pin)(c.context) };
                true
            }
        }
    }

    /// Whether this owner is an [`Owner::arc`] of the allocation `ptr`
    /// points to (an `Arc`'s value, as [`Arc::as_ptr`] gives it). The
    /// account's `Weak` keeps the allocation, so no other `Arc` can be at
    /// that address while the account lives.
    #[inline]
    pub(crate) fn is_arc_at(&self, ptr: *const ()) -> bool {
        match &self.kind {
            Kind::Arc(strong) => strong.is_at(ptr),
            Kind::Nothing | Kind::Callbacks(_) => false,
        }
    }

    /// Pins an owner the caller holds: for an owner [`is_arc_at`]
    /// the caller's `Arc`, a plain increment of the strong count, which
    /// cannot fail (no compare-and-swap loop, no "gone" case).
    ///
    /// [`is_arc_at`]: Self::is_arc_at
    ///
    /// # Safety
    /// `self.is_arc_at(p)` for the value pointer `p` of an `Arc` the caller
    /// holds for the duration of the call.
    #[inline]
    pub(crate) unsafe fn pin_held(&self) {
        match &self.kind {
            // SAFETY: forwarded: the caller holds a strong reference on
            // this allocation.
            Kind::Arc(strong) => unsafe { strong.pin_held() },
            // Not reachable (the caller checked `is_arc_at`); pinning is
            // infallible for these kinds anyway.
            Kind::Nothing | Kind::Callbacks(_) => {
                let _ = self.pin();
            }
        }
    }

    /// Drops a reference taken by a successful [`pin`](Self::pin).
    ///
    /// # Safety
    /// Balanced with an earlier successful [`pin`](Self::pin).
    #[inline]
    pub(crate) unsafe fn unpin(&self) {
        match &self.kind {
            Kind::Nothing => {}
            // SAFETY: forwarded.
            Kind::Arc(strong) => unsafe { strong.unpin() },
            // SAFETY: `from_fns`'s contract.
            Kind::Callbacks(c) => unsafe { (c.unpin)(c.context) },
        }
    }
}

impl core::fmt::Debug for Owner {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Owner").finish_non_exhaustive()
    }
}
