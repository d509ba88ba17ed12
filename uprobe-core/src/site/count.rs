//! Counting probes: a probe with no handler (no [`on_entry`], no
//! [`on_return`], no thread filter) only counts its hits. Where its site
//! runs through a jump and it is the site's only consumer, the
//! trampoline's entry counts the hit itself, on the CPU it runs on, and
//! goes straight back to the relocated code: no register frame, no read
//! section, no call into Rust (`crate::arch::count`).
//!
//! **The protocol.** The trampoline's `JumpCell`
//! holds a pointer, `fast`, to the [`FastCount`] (its CPU slot 0) of the
//! consumer the hit counts for, or null (every hit takes the full path, which counts in
//! the consumer's own per-CPU `hits`). The prelude loads
//! `fast` *inside* a restartable sequence whose one store is the add to
//! the current CPU's slot, so "which counter" and "count" are one unit
//! against preemption, migration and signals. The writer (under the
//! attach lock) changes `fast` whenever a site's consumer list or its
//! cell changes (`Site::publish_list`, `Site::take_cell`,
//! `Site::clear_cell`); after taking a non-null pointer away it calls
//! [`pcpu::rseq::fence_all`], which restarts every section in flight, so
//! that once it returns no thread can still add to the old counter. The
//! consumer that owned it is freed only after that (and after the grace
//! period of the table's domain that follows).
//!
//! So every hit is counted exactly once: in the `FastCount` of the
//! consumer (the section committed) or in its `hits` (the full path ran
//! it), and [`Probe::hits`](crate::Probe::hits) sums both. Fork keeps both
//! in the child's copy of memory. A thread whose rseq area is not
//! registered, or whose CPU id is beyond the possible count, takes the
//! full path.
//!
//! [`on_entry`]: crate::Uprobe::on_entry
//! [`on_return`]: crate::Uprobe::on_return

use std::sync::atomic::{AtomicU64, Ordering};

use pcpu::PerCpu;

/// The per-CPU counts of a counting probe's fast path: what its
/// trampolines add to, one slot per CPU (the layout the architecture's
/// prelude indexes).
pub(crate) struct FastCount {
    slots: PerCpu<AtomicU64>,
}

impl FastCount {
    /// Counters at zero. Not async-signal-safe (allocates).
    ///
    /// # Panics
    /// If the per-CPU layout is not the one trampolines index (never:
    /// both come from the same possible-CPU count and padding).
    pub(crate) fn new() -> Self {
        let slots = PerCpu::<AtomicU64>::default();
        let slot = |i: usize| core::ptr::from_ref(slots.get(i).expect("slot")) as usize;
        // Slot `cpus()` is the overflow slot: at least two slots exist.
        assert!(
            crate::arch::count::fits(slot(1) - slot(0), slots.cpus()),
            "per-CPU counters laid out as trampolines do not expect"
        );
        Self { slots }
    }

    /// Slot 0's counter: what a trampoline's cell points at (on the
    /// heap: it stays where it is when the `FastCount` moves).
    pub(crate) fn base(&self) -> *mut AtomicU64 {
        core::ptr::from_ref(self.slots.get(0).expect("slot 0")).cast_mut()
    }

    /// Hits counted on the fast path. Async-signal-safe.
    pub(crate) fn sum(&self) -> u64 {
        self.slots
            .iter()
            .fold(0, |s, c| s.wrapping_add(c.load(Ordering::Relaxed)))
    }
}

/// Whether trampolines count hits themselves in this process: the
/// architecture has the entry for it, and rseq critical sections run
/// with fences that restart them (x86-64 with glibc's rseq registration
/// and `membarrier` rseq fences). Decided once. Not async-signal-safe on
/// the first call.
pub(crate) fn enabled() -> bool {
    crate::arch::count::enabled()
}
