//! `SrcuCell<T>`: a pointer that readers follow inside read sections and
//! writers replace, the old value being dropped after grace periods.

use std::ops::Deref;
use std::sync::Arc;

use pcpu::unstable::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use crate::domain::Inner;
use crate::{ReadGuard, Srcu};

/// What a cell points to: the value and whether it was retired (replaced).
pub(crate) struct Node<T> {
    pub(crate) retired: AtomicBool,
    /// Strong references handed to a lease set's deferred drops and not
    /// dropped yet (see `LeaseSet::drop_later`).
    pub(crate) owed: AtomicUsize,
    /// The next node on that set's list of nodes owing drops.
    pub(crate) next_owed: AtomicPtr<Node<T>>,
    pub(crate) value: T,
}

/// A strong reference to a value that was (or is) in an [`SrcuCell`]:
/// keeps it alive outside read sections. What a lease turns into when it
/// expires ([`Held`](crate::Held)).
pub struct Strong<T>(pub(crate) Arc<Node<T>>);

impl<T> Clone for Strong<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> Deref for Strong<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0.value
    }
}

impl<T> Strong<T> {
    /// Whether the value has been replaced in its cell since (it stays
    /// valid as long as this reference lives).
    #[must_use]
    pub fn is_retired(&self) -> bool {
        self.0.retired.load(Ordering::Acquire)
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Strong<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.value.fmt(f)
    }
}

/// A value read with [`SrcuCell::read`], valid while this lives (it holds
/// the read section).
pub struct CellRef<'a, T> {
    value: &'a T,
    _guard: ReadGuard<'a>,
}

impl<T> Deref for CellRef<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for CellRef<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.value.fmt(f)
    }
}

/// An SRCU-protected pointer to a `T` (or to nothing).
///
/// Readers [`load`](Self::load) it inside a read section of the cell's
/// domain and get a `&T` that lives as long as their guard. Writers
/// [`replace`](Self::replace) it; the old value is marked retired and
/// dropped on the domain's reclaimer thread after **two** grace periods.
/// (One would suffice for readers; the second one is what makes a lease
/// expiry's "take a reference unless retired" safe against a grace period
/// that was already in progress when the expiry started. The kernel gets
/// the same from RCU Tasks Trace.)
///
/// ```
/// static DOMAIN: srcu::Srcu = srcu::Srcu::new();
/// let cell = srcu::SrcuCell::new(&DOMAIN, Some(String::from("v1")));
/// {
///     let guard = DOMAIN.read_lock();
///     assert_eq!(cell.load(&guard).map(String::as_str), Some("v1"));
/// }
/// cell.replace(Some(String::from("v2"))); // "v1" is dropped later
/// assert_eq!(cell.read().as_deref().map(String::as_str), Some("v2"));
/// ```
pub struct SrcuCell<'d, T: Send + Sync + 'static> {
    srcu: &'d Srcu,
    /// The domain's state, resolved once: [`read`](Self::read) skips the
    /// domain's lazy-allocation check.
    inner: &'d Inner,
    ptr: AtomicPtr<Node<T>>,
}

// SAFETY: the cell hands out `&T` to readers on any thread (`T: Sync`) and
// drops values on the reclaimer thread (`T: Send`).
unsafe impl<T: Send + Sync + 'static> Send for SrcuCell<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync + 'static> Sync for SrcuCell<'_, T> {}

fn into_node<T>(value: Option<T>) -> *mut Node<T> {
    value.map_or(core::ptr::null_mut(), |v| {
        Arc::into_raw(Arc::new(Node {
            retired: AtomicBool::new(false),
            owed: AtomicUsize::new(0),
            next_owed: AtomicPtr::new(core::ptr::null_mut()),
            value: v,
        }))
        .cast_mut()
    })
}

impl<'d, T: Send + Sync + 'static> SrcuCell<'d, T> {
    /// A cell of domain `srcu` holding `value`. Not async-signal-safe
    /// (allocates, and prepares the domain as [`Srcu::prepare`] does).
    pub fn new(srcu: &'d Srcu, value: Option<T>) -> Self {
        Self {
            srcu,
            inner: srcu.inner(),
            ptr: AtomicPtr::new(into_node(value)),
        }
    }

    /// The cell's domain.
    #[must_use]
    pub fn domain(&self) -> &'d Srcu {
        self.srcu
    }

    /// The current value, valid while `guard` lives. **Async-signal-safe.**
    ///
    /// # Panics
    /// If `guard` belongs to another domain than the cell.
    #[inline]
    #[must_use]
    pub fn load<'g>(&self, guard: &'g ReadGuard<'_>) -> Option<&'g T> {
        assert!(
            core::ptr::eq(guard.domain(), self.srcu),
            "read guard of another SRCU domain"
        );
        // SAFETY: the guard's read section began before this load, so the
        // node cannot be dropped before the guard (drops wait for grace
        // periods of this domain).
        self.node_ptr().map(|n| unsafe { &(*n).value })
    }

    /// Begins a read section of the cell's own domain and returns the
    /// current value under it (`None` if the cell is empty; the section
    /// ends when the [`CellRef`] drops). The one-object shortcut for
    /// `domain.read_lock()` + [`load`](Self::load), without the domain
    /// check. **Async-signal-safe.**
    #[allow(clippy::inline_always)] // the read path must inline
    #[inline(always)]
    #[must_use]
    pub fn read(&self) -> Option<CellRef<'_, T>> {
        let guard = self.srcu.read_lock_in(self.inner);
        let node = self.node_ptr()?;
        // SAFETY: as in `load`: the section began before the load.
        let value = unsafe { &(*node).value };
        Some(CellRef {
            value,
            _guard: guard,
        })
    }

    /// A strong reference to the current value (an atomic increment; for
    /// keeping a value beyond a read section). Not for hot paths.
    #[must_use]
    pub fn get(&self) -> Option<Strong<T>> {
        let _guard = self.srcu.read_lock();
        let n = self.node_ptr()?;
        // SAFETY: protected by the guard, as in `load`; the cell's own
        // strong count keeps the count above zero until its deferred drop.
        unsafe {
            Arc::increment_strong_count(n);
            Some(Strong(Arc::from_raw(n)))
        }
    }

    /// The raw node pointer (Acquire), for leases.
    #[inline]
    pub(crate) fn node_ptr(&self) -> Option<*const Node<T>> {
        let p = self.ptr.load(Ordering::Acquire);
        (!p.is_null()).then_some(p.cast_const())
    }

    /// Stores `value`, retiring the previous one (dropped after two grace
    /// periods). Not async-signal-safe.
    pub fn replace(&self, value: Option<T>) {
        let old = self.ptr.swap(into_node(value), Ordering::AcqRel);
        self.retire(old);
    }

    fn retire(&self, old: *mut Node<T>) {
        if old.is_null() {
            return;
        }
        // SAFETY: `old` came from `into_node` and was the cell's; we own
        // its strong count now.
        let old = unsafe { Arc::from_raw(old.cast_const()) };
        old.retired.store(true, Ordering::Release);
        self.srcu.defer(Box::new(move || drop(old)), 2);
    }
}

impl<T: Send + Sync + 'static> Drop for SrcuCell<'_, T> {
    fn drop(&mut self) {
        // `&mut self`: no other access; a relaxed load reads our own value.
        let old = self.ptr.load(Ordering::Relaxed);
        self.retire(old);
    }
}

impl<T: Send + Sync + std::fmt::Debug + 'static> std::fmt::Debug for SrcuCell<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let guard = self.srcu.read_lock();
        f.debug_tuple("SrcuCell").field(&self.load(&guard)).finish()
    }
}

#[cfg(all(test, not(pcpu_loom)))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::mpsc::channel;
    use std::time::Duration;

    use super::SrcuCell;
    use crate::Srcu;

    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }

    /// `barrier` waits for a deferred drop that needs two grace periods
    /// even when callbacks queued after the barrier began finish first.
    /// The batches are lined up deterministically: the reclaimer is parked
    /// inside a callback while the drop (two grace periods), the barrier and
    /// a later callback (one) line up in one batch; that callback queues
    /// another one, which runs just before the drop's second turn and holds
    /// the drop back until the barrier has returned (or a second has
    /// passed: only a correct barrier is still waiting then).
    #[test]
    fn barrier_waits_for_a_two_grace_period_drop_whatever_is_queued_after_it() {
        // `'static` for the callbacks; a `static` rather than a leaked
        // box, which LeakSanitizer reports.
        static DOMAIN: Srcu = Srcu::new();
        let domain: &'static Srcu = &DOMAIN;
        let dropped = Arc::new(AtomicBool::new(false));
        let cell = SrcuCell::new(domain, Some(Flag(Arc::clone(&dropped))));
        let (started_tx, started_rx) = channel();
        let (go_tx, go_rx) = channel::<()>();
        domain.call(move || {
            started_tx.send(()).unwrap();
            go_rx.recv().unwrap();
        });
        started_rx.recv().unwrap(); // the reclaimer is inside that callback
        cell.replace(Some(Flag(Arc::new(AtomicBool::new(false)))));
        let (returned_tx, returned_rx) = channel::<()>();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                domain.barrier();
                let was_dropped = dropped.load(SeqCst);
                let _ = returned_tx.send(());
                was_dropped
            });
            while domain.inner().reclaimer.barrier_waiters() == 0 {
                std::thread::yield_now();
            }
            // Queued after the barrier began; queues the drop's blocker.
            domain.call(move || {
                domain.call(move || {
                    let _ = returned_rx.recv_timeout(Duration::from_secs(1));
                });
            });
            go_tx.send(()).unwrap();
            assert!(
                waiter.join().unwrap(),
                "barrier returned before the replaced value was dropped"
            );
        });
    }
}
