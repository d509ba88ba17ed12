//! The rseq critical sections on the current CPU's list: push, pop,
//! the pop that reports an empty local list, and the empty flag's upkeep
//! after them (with their loom model).

use core::ptr::NonNull;

use super::{LocalPop, PerCpuStack};
use crate::sync::atomic::Ordering;

impl PerCpuStack {
    /// The rseq push; `false` if it must take the locked path (always,
    /// where no critical sections run).
    #[inline]
    #[cfg_attr(not(any(pcpu_loom, pcpu_arch = "x86_64")), allow(clippy::unused_self))]
    pub(super) unsafe fn push_fast(&self, node: NonNull<u8>) -> bool {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if self.area != 0 {
            let (area, base) = (self.area, self.heads.raw_layout().0);
            let (node, next) = (node.as_ptr() as usize, self.link_word(node));
            let cpus = self.heads.cpus() as u32;
            // SAFETY: rseq mode: CPU slots are `Head`s written only by this
            // CPU's critical sections or under their lock; the caller
            // guarantees the node's link word.
            let rc = unsafe {
                if self.empty_flags {
                    let summary = self.summary.as_ptr().cast();
                    crate::rseq::raw_push_clearing_flag(area, base, cpus, node, next, summary)
                } else {
                    crate::rseq::raw_push(area, base, cpus, node, next)
                }
            };
            return rc == crate::rseq::DONE;
        }
        #[cfg(pcpu_loom)]
        return self.use_rseq
            && self.modelled_section(|slot| {
                // SAFETY: forwarded.
                unsafe { self.link(slot, node) };
            });
        #[allow(unreachable_code)]
        {
            let _ = node;
            false
        }
    }

    /// The look of [`pop_local`](Self::pop_local): list `slot`'s flag if
    /// kept, else its head.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[cfg_attr(not(any(pcpu_arch = "x86_64", pcpu_loom)), allow(dead_code))]
    ///
    /// # Safety
    /// `slot < self.slots()` (the callers' CPU id, checked below the CPU
    /// count).
    pub(super) unsafe fn looks_empty_for_pop(&self, slot: usize) -> bool {
        // SAFETY: the caller's contract.
        let head = unsafe { self.heads.get_unchecked(slot) };
        if self.empty_flags {
            head.empty.load(Ordering::Relaxed) != 0
        } else {
            head.top.load(Ordering::Relaxed) == 0
        }
    }

    /// The rseq pop; `Err` if it must take the locked path. With empty
    /// flags, a set flag answers `None` without a section.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(super) fn pop_fast(&self) -> Result<Option<NonNull<u8>>, ()> {
        match self.pop_local(self.empty_flags) {
            LocalPop::Popped(node) => Ok(Some(node)),
            LocalPop::Empty { .. } => Ok(None),
            LocalPop::Locked => Err(()),
        }
    }

    /// After a critical section popped a node, leaving `next` as the head:
    /// if that emptied the list, set the empty flag with a second section
    /// that checks the head again (a flag set by the pop itself could not
    /// be undone if the pop were restarted elsewhere).
    #[inline]
    #[cfg_attr(not(any(pcpu_loom, pcpu_arch = "x86_64")), allow(dead_code))]
    pub(super) fn after_local_pop(&self, next: usize) {
        if next == 0 && self.empty_flags {
            self.mark_empty_fast();
        }
    }

    /// After a critical section found the current CPU's list empty: if its
    /// flag is clear (left so by a pop that migrated before its flag step,
    /// or a restarted push), set it, so other CPUs stop looking.
    #[inline]
    #[cfg_attr(not(any(pcpu_loom, pcpu_arch = "x86_64")), allow(dead_code))]
    pub(super) fn after_local_empty(&self) {
        if self.empty_flags && !self.flagged_empty(self.current_slot()) {
            self.mark_empty_fast();
        }
    }

    #[cold]
    #[inline(never)]
    #[cfg_attr(
        not(any(pcpu_loom, pcpu_arch = "x86_64")),
        allow(dead_code, clippy::unused_self)
    )]
    fn mark_empty_fast(&self) {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if self.area != 0 {
            let (area, base) = (self.area, self.heads.raw_layout().0);
            let summary = self.summary.as_ptr().cast();
            // SAFETY: as in `push_fast`; the section writes only the flag
            // and the list's summary bit. Whatever it returns, the flag is
            // right or conservatively clear, and the bit clear only on an
            // empty list (a locked list is the lock holder's business).
            let _ = unsafe {
                crate::rseq::raw_mark_empty(area, base, self.heads.cpus() as u32, summary)
            };
        }
        #[cfg(pcpu_loom)]
        self.modelled_section(|slot| {
            let head = self.head(slot);
            if head.top.load(Ordering::Relaxed) == 0 {
                self.note_emptied(slot);
                head.empty.store(1, Ordering::Relaxed);
            }
        });
    }

    /// The loom model of a critical section on the current CPU's list
    /// (`f` gets its slot): runs `f` unless the list is locked (then
    /// `false`). The lock is read with `Acquire` because x86-64 loads are
    /// (the only place the real sections run).
    #[cfg(pcpu_loom)]
    pub(super) fn modelled_section(&self, f: impl FnOnce(usize)) -> bool {
        let slot = self.current_slot();
        if slot >= self.heads.cpus() {
            return false;
        }
        let head = self.head(slot);
        crate::loom_cpu::critical_section(slot, || {
            if head.lock.load(Ordering::Acquire) != 0 {
                return false;
            }
            f(slot);
            true
        })
    }
}
