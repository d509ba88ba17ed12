//! The read side: guard sections counted in the calling thread's slot
//! (per CPU when it has none), and sections counted per CPU, which may
//! end on another thread.

use pcpu::unstable::sync::atomic::Ordering;

use super::state::{Inner, LOCK, UNLOCK};
use crate::fork;
use crate::readers::{Section, Slot};

impl Inner {
    /// Begins a guard section (one that ends on this thread): counted in
    /// this thread's slot, or per CPU if no slot is free.
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn guard_lock(&self) -> Section {
        let hot = self.hot.load(Ordering::Relaxed);
        match self.readers.cached(hot) {
            Some(slot) => Self::enter(slot, hot),
            None => self.guard_lock_uncached(),
        }
    }

    /// Counts a guard section in `slot`, this thread's.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn enter(slot: &Slot, hot: u64) -> Section {
        let section = slot.enter(hot);
        // B: the section's loads come after the count; pairs with the
        // heavy fences in `drained`.
        slot_fence();
        section
    }

    /// A guard section of a thread whose slot is not cached: claims one,
    /// or counts per CPU if none is free.
    #[cold]
    #[inline(never)]
    fn guard_lock_uncached(&self) -> Section {
        match self.readers.claim() {
            Some(slot) => Self::enter(slot, self.hot.load(Ordering::Relaxed)),
            None => Section::per_cpu(self.guard_lock_per_cpu()),
        }
    }

    /// Ends a section begun by [`guard_lock`](Self::guard_lock), on the
    /// thread that began it.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn guard_unlock(&self, section: Section) {
        if section.is_outer() {
            // C: the section's loads are done before the store.
            slot_fence();
            section.leave_outer();
        } else {
            self.guard_unlock_other(section);
        }
    }

    /// Ends a guard section nested in the slot, or counted per CPU.
    #[cold]
    #[inline(never)]
    fn guard_unlock_other(&self, section: Section) {
        if let Some(bank) = section.per_cpu_bank() {
            self.guard_unlock_per_cpu(bank);
        } else {
            // C, as above.
            slot_fence();
            section.leave_nested();
        }
    }

    /// A guard section of a thread that found no free slot.
    fn guard_lock_per_cpu(&self) -> usize {
        fork::held_add(1);
        self.read_lock()
    }

    fn guard_unlock_per_cpu(&self, bank: usize) {
        fork::held_add(-1);
        self.read_unlock(bank);
    }

    /// Begins a section counted per CPU (it may end on another thread).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_lock(&self) -> usize {
        let bank = (self.completed.load(Ordering::Relaxed) & 1) as usize;
        match self.fast {
            Some(adder) => {
                adder.add_word(&self.counts, LOCK + bank, 1);
                // B (membarrier mode): the section's loads come after the
                // count; pairs with the heavy fences in `drained`.
                core::sync::atomic::compiler_fence(Ordering::SeqCst);
            }
            None => self.lock_slow(bank),
        }
        bank
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_unlock(&self, bank: usize) {
        let bank = bank & 1;
        match self.fast {
            Some(adder) => {
                // C (membarrier mode): the section's loads are done before
                // the count.
                core::sync::atomic::compiler_fence(Ordering::SeqCst);
                adder.add_word(&self.counts, UNLOCK + bank, 1);
            }
            None => self.unlock_slow(bank),
        }
    }

    /// B without rseq or without membarrier (out of line: the inlined read
    /// path stays small).
    #[cold]
    #[inline(never)]
    fn lock_slow(&self, bank: usize) {
        pcpu::rseq::add_word(&self.counts, LOCK + bank, 1);
        pcpu::fence::light();
    }

    /// C without rseq or without membarrier.
    #[cold]
    #[inline(never)]
    fn unlock_slow(&self, bank: usize) {
        pcpu::fence::light();
        pcpu::rseq::add_word(&self.counts, UNLOCK + bank, 1);
    }
}

/// The light fence of the slot path (B, C): slots are handed out only in
/// membarrier mode, where it is a compiler fence (loom and Miri: a full
/// fence, as `pcpu::fence::light` models membarrier there).
#[allow(clippy::inline_always)]
#[inline(always)]
fn slot_fence() {
    #[cfg(not(any(pcpu_loom, miri)))]
    core::sync::atomic::compiler_fence(Ordering::SeqCst);
    #[cfg(any(pcpu_loom, miri))]
    pcpu::fence::light();
}
