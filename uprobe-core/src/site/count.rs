//! Counting probes: a probe with no handler (no [`on_entry`], no
//! [`on_return`], no thread filter) only counts its hits. Where its site
//! runs through a jump and it is the site's only consumer, the
//! trampoline's entry counts the hit itself, on the CPU it runs on, and
//! goes straight back to the relocated code: no register frame, no read
//! section, no call into Rust (`crate::arch::count`).
//!
//! **The protocol.** The trampoline's `JumpCell`
//! holds a pointer, `counter`, to the [`TrampolineCounter`] (its CPU slot 0) of the
//! consumer the hit counts for, or null (every hit takes the full path, which counts in
//! the consumer's own per-CPU `hits`). The prelude loads
//! `counter` *inside* a restartable sequence whose one store is the add to
//! the current CPU's slot, so "which counter" and "count" are one unit
//! against preemption, migration and signals. The writer (under the
//! attach lock) changes `counter` whenever a site's consumer list or its
//! cell changes (`Site::publish_list`, `Site::take_cell`,
//! `Site::clear_cell`); after taking a non-null pointer away it calls
//! [`pcpu::rseq::fence_all`], which restarts every section in flight, so
//! that once it returns no thread can still add to the old counter. The
//! consumer that owned it is freed only after that (and after the grace
//! period of the table's domain that follows).
//!
//! So every hit is counted exactly once: in the `TrampolineCounter` of the
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

use super::timing::LatencyCell;

/// One CPU's counter of a counting probe whose counts live in memory the
/// caller provides ([`Uprobe::count_into`](crate::Uprobe::count_into)):
/// a 64-bit count alone on 128 bytes, the stride trampolines index.
///
/// A probe counting into a slice of them adds to cell `n` only while it
/// runs on CPU `n`, inside a restartable sequence, and to the last cell
/// (index [`count_cells()`]` - 1`) with an atomic add where no sequence
/// can run (a thread without rseq, a hit the engine itself counts); so
/// the cells may be shared with other processes (a `MAP_SHARED` mapping:
/// restartable sequences are per CPU, whatever process runs there) and
/// read at any time by summing them.
///
/// ```
/// use uprobe_core::{CountCell, count_cells};
/// let cells: &'static [CountCell] =
///     Box::leak((0..count_cells()).map(|_| CountCell::new()).collect());
/// assert_eq!(CountCell::sum(cells), 0);
/// ```
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct CountCell {
    count: AtomicU64,
}

impl CountCell {
    /// A cell at zero.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            count: AtomicU64::new(0),
        }
    }

    /// This cell's count. Async-signal-safe.
    #[must_use]
    pub fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The wrapping sum of `cells`' counts: the hits of the probes that
    /// count into them. Async-signal-safe.
    #[must_use]
    pub fn sum(cells: &[Self]) -> u64 {
        cells.iter().fold(0, |s, c| s.wrapping_add(c.get()))
    }
}

/// Counts a hit the engine's path saw into the last of the caller's
/// `cells` (the one no restartable sequence writes), atomically. Out of
/// line: the hit path of a handler keeps its registers. Async-signal-safe.
#[inline(never)]
pub(crate) fn count_in_last(cells: &[CountCell]) {
    if let Some(last) = cells.last() {
        last.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// How many [`CountCell`]s a probe counting into caller memory needs: one
/// per possible CPU, and one more for hits counted without a restartable
/// sequence. The same in every process of this machine. Not
/// async-signal-safe on the first call (it reads the possible CPUs).
#[must_use]
pub fn count_cells() -> usize {
    pcpu::possible_cpus() + 1
}

/// Where a counting probe's fast-path counts go.
enum Cells {
    /// The engine's own per-CPU counters.
    Owned(PerCpu<AtomicU64>),
    /// The caller's ([`count_cells`] of them at least, checked at attach).
    Borrowed(&'static [CountCell]),
    /// A timing probe's (`super::timing`): its calls, counted by the
    /// timed entry routine, never by the counting prelude.
    Latency(&'static [LatencyCell]),
}

/// The per-CPU counts of a counting probe's fast path: what its
/// trampolines add to, one slot per CPU (the layout the architecture's
/// prelude indexes).
pub(crate) struct TrampolineCounter {
    cells: Cells,
}

impl TrampolineCounter {
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
            crate::arch::TRAMPOLINE_COUNTING
                .is_some_and(|c| (c.fits)(slot(1) - slot(0), slots.cpus())),
            "per-CPU counters laid out as trampolines do not expect"
        );
        Self {
            cells: Cells::Owned(slots),
        }
    }

    /// The caller's cells, or `None` where fewer than [`count_cells`]
    /// are given. Where trampolines count, they add to these; the
    /// engine's path adds to the last one (see [`CountCell`]). Not
    /// async-signal-safe.
    pub(crate) fn borrowed(cells: &'static [CountCell]) -> Option<Self> {
        Some(Self {
            cells: Cells::Borrowed(cells.get(..count_cells())?),
        })
    }

    /// A timing probe's cells, where the engine counts its calls too.
    pub(crate) fn latency(cells: &'static [LatencyCell]) -> Self {
        Self {
            cells: Cells::Latency(cells),
        }
    }

    /// A timing probe's cells, if these are.
    pub(crate) fn latency_cells(&self) -> Option<&'static [LatencyCell]> {
        match self.cells {
            Cells::Latency(cells) => Some(cells),
            Cells::Owned(_) | Cells::Borrowed(_) => None,
        }
    }

    /// Slot 0's counter: what a trampoline's cell points at (on the
    /// heap: it stays where it is when the `TrampolineCounter` moves); null for
    /// a timing probe's cells, which no counting prelude adds to.
    pub(crate) fn base(&self) -> *mut AtomicU64 {
        match &self.cells {
            Cells::Owned(slots) => core::ptr::from_ref(slots.get(0).expect("slot 0")).cast_mut(),
            Cells::Borrowed(cells) => core::ptr::from_ref(&cells[0].count).cast_mut(),
            Cells::Latency(_) => core::ptr::null_mut(),
        }
    }

    /// Whether trampolines may count into these cells (the engine's own
    /// always fit; the caller's where trampolines count at all).
    pub(crate) fn trampolines_count(&self) -> bool {
        match &self.cells {
            Cells::Owned(_) => true,
            Cells::Borrowed(_) => enabled(),
            Cells::Latency(_) => false,
        }
    }

    /// Counts a hit the engine saw in the caller's cells (the last one,
    /// atomically: [`Uprobe::count_into`](crate::Uprobe::count_into)'s
    /// or a timing probe's), and says so; false for the engine's own
    /// counters, which the consumer's own counter stands in for on that
    /// path. The adds are out of line. Async-signal-safe.
    #[inline]
    pub(crate) fn count_in_caller_cells(&self) -> bool {
        // Tested apart from the rest: a `match` of all three compiles to
        // an indirect jump through a table.
        if let Cells::Owned(_) = self.cells {
            return false;
        }
        self.count_in_last_cell();
        true
    }

    /// [`count_in_caller_cells`](Self::count_in_caller_cells)'s add.
    #[inline(never)]
    fn count_in_last_cell(&self) {
        match self.cells {
            Cells::Borrowed(cells) => count_in_last(cells),
            Cells::Latency(cells) => LatencyCell::count_call_in_last(cells),
            Cells::Owned(_) => {}
        }
    }

    /// Hits counted on the fast path. Async-signal-safe.
    pub(crate) fn sum(&self) -> u64 {
        match &self.cells {
            Cells::Owned(slots) => slots
                .iter()
                .fold(0, |s, c| s.wrapping_add(c.load(Ordering::Relaxed))),
            Cells::Borrowed(cells) => CountCell::sum(cells),
            Cells::Latency(cells) => LatencyCell::total_calls(cells),
        }
    }
}

/// Whether trampolines count hits themselves in this process: the
/// architecture has the entry for it, and rseq critical sections run
/// with fences that restart them (x86-64 with glibc's rseq registration
/// and `membarrier` rseq fences). Decided once. Not async-signal-safe on
/// the first call.
pub(crate) fn enabled() -> bool {
    crate::arch::TRAMPOLINE_COUNTING.is_some_and(|c| (c.enabled)())
}
