//! The public domain handle, [`Srcu`]: its documentation, its
//! construction, the allocation of its shared state on first use, and
//! its drop.

use std::sync::Arc;

use pcpu::unstable::sync::atomic::{AtomicPtr, Ordering};

use super::state::Inner;
#[cfg(not(pcpu_loom))]
use crate::fork;

/// A sleepable-RCU domain: readers mark read sections with
/// [`read_lock`](Self::read_lock), writers wait for the sections that
/// began before them with [`synchronize`](Self::synchronize) or defer work
/// with [`call`](Self::call).
///
/// Independent domains never wait for each other's readers. A domain can
/// be a `static` (construction is `const`; its counts are allocated on
/// first use, or by [`prepare`](Self::prepare)).
///
/// # Costs
/// A guard section ([`read_lock`](Self::read_lock),
/// [`SrcuCell::read`](crate::SrcuCell::read)) stores a word in the
/// calling thread's *slot* of the domain and 0 at its end (a nested one
/// adds 1 to a count there and takes it away), with compiler fences:
/// what liburcu's read side costs. A thread claims its slot on its first section,
/// without registering, and keeps its address in a small thread-local
/// cache: the domain it used last is the fast path (one compare), and
/// four domains used in turn stay cached (a compare more); more cost a
/// scan of the domain's slots per miss. The slot of a thread that exited
/// is taken over by the next thread that needs one.
/// A slot is 128 bytes; a domain's table reserves 1024 of them (virtual
/// memory, touched as claimed; a dropped domain's table is kept for the
/// next new domain, never unmapped); threads beyond that, and every
/// thread where `membarrier` is not available, count guard sections per
/// CPU instead. A raw section
/// ([`read_lock_raw`](Self::read_lock_raw)), which may end on another
/// thread, is always counted per CPU (an rseq add). A grace period reads
/// every CPU's counts and every claimed slot: its cost grows with the
/// threads that used the domain. See [`reader_slots`](Self::reader_slots).
///
/// # Async-signal safety
/// | operation | from a signal handler |
/// |---|---|
/// | [`read_lock`](Self::read_lock), [`read_lock_raw`](Self::read_lock_raw), unlocking | yes (after [`prepare`](Self::prepare)): a word in the thread's slot or a count per CPU, and a compiler fence; a thread's first section of a domain claims its slot without locks or allocation; a guard a handler takes is dropped before the handler returns |
/// | [`synchronize`](Self::synchronize) and its variants, [`call`](Self::call), [`barrier`](Self::barrier) | no (they block, lock mutexes or allocate) |
///
/// # Fork
/// Only the forking thread exists in a child. At the fork (srcu's
/// `pthread_atfork` handlers, see [`after_fork_in_child`](crate::after_fork_in_child)):
/// - every lease of every [`LeaseSet`](crate::LeaseSet) is expired (as the
///   kernel expires a child's), so leases never stall the child;
/// - the guard sections ([`ReadGuard`](crate::ReadGuard), [`CellRef`](crate::CellRef)) of
///   every other thread are **discounted** in the child (their slots are
///   freed); the forking thread's own stay counted until they end there;
/// - if the forking thread holds no section counted per CPU that ends on
///   it (a consumed lease's [`LeasedValue`](crate::LeasedValue), or a
///   guard of a thread that found no free slot) of any domain, every
///   section counted per CPU is discounted too: grace periods in the child
///   then wait only for sections begun there. Raw sections open at the
///   fork are discounted with them, so they must not be ended in the child
///   (see [`read_unlock_raw`](Self::read_unlock_raw));
/// - if it does hold one, the per-CPU counts are left as they are (they
///   do not say which thread a section belongs to): its own sections stay
///   valid, and grace periods in the child also wait for the other
///   threads' per-CPU sections, which never end there (use
///   [`synchronize_timeout`](Self::synchronize_timeout)).
///
/// Deferred callbacks keep working in the child: its reclaimer thread and
/// the lease sets' expiry threads are started anew on the domain's first
/// use there, and callbacks queued before the fork (also those the
/// parent's reclaimer was waiting a grace period for) run in the child
/// after a grace period of the child's. Only a callback the parent's
/// reclaimer was running at the very moment of the fork is the parent's
/// alone.
///
/// # Drop
/// Dropping a domain runs every callback still queued, then stops its
/// reclaimer thread. Guards, cells and lease sets borrow the domain, so
/// none outlives it; a raw section still open cannot be ended any more
/// (that needs the domain) and is forgotten: the remaining callbacks run
/// without waiting for it.
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// static DOMAIN: srcu::Srcu = srcu::Srcu::new();
/// static OLD_FREED: AtomicBool = AtomicBool::new(false);
///
/// let guard = DOMAIN.read_lock();
/// // ... read shared data ...
/// drop(guard);
/// DOMAIN.call(|| OLD_FREED.store(true, Ordering::SeqCst));
/// DOMAIN.barrier();
/// assert!(OLD_FREED.load(Ordering::SeqCst));
/// ```
pub struct Srcu {
    inner: AtomicPtr<Inner>,
    /// The CPUs to count for when the state is made (0: the machine's).
    cpus: usize,
}

impl Default for Srcu {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Srcu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.load(Ordering::Acquire);
        let mut d = f.debug_struct("Srcu");
        if !inner.is_null() {
            // SAFETY: published by `inner()`, alive until drop.
            d.field("grace_periods", &unsafe { &*inner }.completed());
        }
        d.finish_non_exhaustive()
    }
}

impl Srcu {
    /// A new domain; allocates nothing until first use.
    #[cfg(not(pcpu_loom))]
    #[must_use]
    pub const fn new() -> Self {
        Self {
            inner: AtomicPtr::new(core::ptr::null_mut()),
            cpus: 0,
        }
    }

    /// A new domain (loom build: not `const`).
    #[cfg(pcpu_loom)]
    #[must_use]
    pub fn new() -> Self {
        Self {
            inner: AtomicPtr::new(core::ptr::null_mut()),
            cpus: 0,
        }
    }

    /// A new domain as if the machine had `cpus` CPUs: its per-CPU
    /// counts have `cpus` slots (and the overflow slot, which the
    /// machine's CPUs at or above `cpus` share). For measuring on a small
    /// machine what a grace period over a big machine's counts costs;
    /// everything else behaves as [`new`](Self::new)'s.
    #[must_use]
    pub fn with_cpus(cpus: usize) -> Self {
        let mut domain = Self::new();
        domain.cpus = cpus;
        domain
    }

    /// Allocates the per-CPU counts now, so that no later read operation
    /// allocates (required before use from a signal handler). Idempotent.
    pub fn prepare(&self) {
        let _ = self.inner();
    }

    #[allow(clippy::inline_always)] // on the read path
    #[inline(always)]
    pub(crate) fn inner(&self) -> &Inner {
        // SAFETY: published by `allocate` (an `Arc` we own a count of),
        // alive until `drop`.
        unsafe { &*self.inner_ptr() }
    }

    /// The shared state as `Arc::into_raw` gave it, allocated on first
    /// use: a pointer with the provenance of the whole `Arc` allocation
    /// (a pointer made from the `&Inner` of [`inner`](Self::inner) may
    /// only touch `Inner`, not the counts in front of it that
    /// [`inner_arc`](Self::inner_arc) increments).
    #[allow(clippy::inline_always)] // on the read path
    #[inline(always)]
    fn inner_ptr(&self) -> *const Inner {
        let p = self.inner.load(Ordering::Acquire);
        if p.is_null() {
            return self.allocate();
        }
        p
    }

    /// The shared state, for the reclaimer thread.
    pub(crate) fn inner_arc(&self) -> Arc<Inner> {
        let p = self.inner_ptr();
        // SAFETY: `p` came from `Arc::into_raw` and we hold that count.
        unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        }
    }

    #[cold]
    fn allocate(&self) -> *const Inner {
        let fresh =
            Arc::into_raw(Arc::new(Inner::new((self.cpus != 0).then_some(self.cpus)))).cast_mut();
        let p = pcpu::unstable::sync::publish_once(&self.inner, fresh, |f| {
            // SAFETY: a loser's `fresh` was never shared.
            drop(unsafe { Arc::from_raw(f) });
        });
        #[cfg(not(pcpu_loom))]
        if p == fresh {
            fork::register(&self.inner_arc());
        }
        // Published (by us or the winner); alive until drop.
        p
    }
}

impl Drop for Srcu {
    fn drop(&mut self) {
        let p = self.inner.load(Ordering::Acquire);
        if p.is_null() {
            return;
        }
        // SAFETY: published by `allocate`; we still own our count.
        let inner = unsafe { Arc::from_raw(p.cast_const()) };
        inner.dead.store(true, Ordering::Release);
        inner.reclaimer.shut_down(|| Arc::clone(&inner));
    }
}
