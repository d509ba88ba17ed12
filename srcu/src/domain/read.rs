//! The read API of a domain: guard sections ([`Srcu::read_lock`],
//! [`ReadGuard`]) and raw ones ([`Srcu::read_lock_raw`], [`ReadIndex`]).

use super::handle::Srcu;
use super::state::Inner;
use crate::readers::Section;

impl Srcu {
    /// Begins a read section, ended when the guard drops (on this thread:
    /// guards are not `Send`). Never blocks, never allocates after
    /// [`prepare`](Self::prepare); the read side stores a word in this
    /// thread's slot (adds 1 to a count there when nested) and issues a
    /// compiler fence (see [`Srcu`]'s *Costs*). **Async-signal-safe**, also as a
    /// thread's first section of the domain, and nested in a section the
    /// interrupted code holds, begins or ends; a guard taken in a signal
    /// handler must be dropped before the handler returns (moved out of
    /// it, into a thread-local, it could go uncounted if the handler
    /// interrupted this thread's outermost `read_lock` of the domain).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use = "the read section ends when the guard is dropped"]
    pub fn read_lock(&self) -> ReadGuard<'_> {
        self.read_lock_in(self.inner())
    }

    /// [`read_lock`](Self::read_lock) with the domain's state resolved.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_lock_in<'a>(&'a self, inner: &'a Inner) -> ReadGuard<'a> {
        ReadGuard {
            srcu: self,
            inner,
            section: inner.guard_lock(),
        }
    }

    /// Begins a read section without a guard: end it with
    /// [`read_unlock_raw`](Self::read_unlock_raw), from any thread.
    /// **Async-signal-safe.**
    #[inline]
    pub fn read_lock_raw(&self) -> ReadIndex {
        ReadIndex(self.inner().read_lock() as u8)
    }

    /// Ends a section begun by [`read_lock_raw`](Self::read_lock_raw).
    /// **Async-signal-safe.**
    ///
    /// The index is consumed (it is neither `Copy` nor `Clone`), so a
    /// section cannot be ended twice:
    ///
    /// ```compile_fail
    /// let domain = srcu::Srcu::new();
    /// let index = domain.read_lock_raw();
    /// // SAFETY: `index` came from this domain.
    /// unsafe { domain.read_unlock_raw(index) };
    /// unsafe { domain.read_unlock_raw(index) }; // error: use of moved value
    /// ```
    ///
    /// # Safety
    /// `index` was returned by `read_lock_raw` of **this** domain. An
    /// index of another domain would end a section that was never begun
    /// here: grace periods of this domain could then return while a reader
    /// is still inside one, and values retired under it (an
    /// [`SrcuCell`](crate::SrcuCell)'s old value) would be dropped while
    /// the reader uses them.
    #[inline]
    #[allow(clippy::needless_pass_by_value)] // by value: a section ends once
    pub unsafe fn read_unlock_raw(&self, index: ReadIndex) {
        self.inner().read_unlock(usize::from(index.0));
    }

    /// How many per-thread reader slots the domain's table has handed
    /// out: about the most threads that held guard sections at once (a
    /// slot of an exited thread is taken over by the next thread that
    /// needs one). A dropped domain's table passes to the next new domain
    /// with its slots, so this counts the threads of earlier domains too.
    /// A snapshot, for diagnostics and memory accounting (one slot is 128
    /// bytes, a table at most 1024 slots). Async-signal-safe.
    ///
    /// ```
    /// let domain = srcu::Srcu::new();
    /// drop(domain.read_lock());
    /// // One slot, this thread's (none where membarrier is unavailable:
    /// // guard sections are then counted per CPU).
    /// assert!(domain.reader_slots() <= 1);
    /// ```
    #[must_use]
    pub fn reader_slots(&self) -> usize {
        self.inner().readers.handed_out()
    }
}

/// A read section begun with [`Srcu::read_lock`]; ends when dropped
/// (async-signal-safe). Not `Send`: a guard section ends on the thread that
/// began it (each thread counts its own in its slot, which is how a fork
/// child tells the forking thread's sections from the vanished threads');
/// a section that must end elsewhere is a raw one ([`Srcu::read_lock_raw`]).
#[must_use = "the read section ends when the guard is dropped"]
pub struct ReadGuard<'a> {
    srcu: &'a Srcu,
    inner: &'a Inner,
    /// Where the section is counted. Neither `Send` nor `Sync`, nor is
    /// the guard: the section ends on the thread that began it.
    section: Section,
}

impl ReadGuard<'_> {
    /// The domain this section belongs to.
    #[must_use]
    pub fn domain(&self) -> &Srcu {
        self.srcu
    }
}

impl Drop for ReadGuard<'_> {
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn drop(&mut self) {
        self.inner.guard_unlock(self.section);
    }
}

impl std::fmt::Debug for ReadGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadGuard")
            .field("bank", &self.section.bank())
            .finish()
    }
}

/// The index of a read section begun with [`Srcu::read_lock_raw`]
/// (0 or 1, as the kernel's `srcu_read_lock` returns): a token that
/// [`Srcu::read_unlock_raw`] consumes, so each section ends once. It may
/// move to another thread, which ends the section there.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "the read section lasts until read_unlock_raw"]
pub struct ReadIndex(u8);

impl ReadIndex {
    /// The bank number, 0 or 1.
    #[must_use]
    pub fn bank(&self) -> u8 {
        self.0
    }
}
