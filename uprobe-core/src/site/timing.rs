//! Timing probes ([`Uprobe::time_into`](crate::Uprobe::time_into)): a
//! probe at a function's entry that counts its calls and adds the time
//! from each call to its return into a log2 histogram of nanoseconds, in
//! [`LatencyCell`]s the caller provides. No handler runs: where the site
//! runs through a jump and the probe is its only consumer, the entry
//! routine and the return trampoline do all of it themselves, with no
//! register frame, no read section and no call into Rust
//! (`crate::arch::timing`); elsewhere the engine's path does the same
//! work (`crate::hit::returns::prepare_timed`).
//!
//! **Where counts go.** A call is counted, and a return added to its
//! bucket, in the cell of the CPU it runs on, inside a restartable
//! sequence (as counting probes count, see [`super::count`]), or, where
//! no sequence runs (the engine's path, a thread without rseq), in the
//! last cell with an atomic add: a CPU's cell is never written outside a
//! sequence. So cells may be shared with other processes (`MAP_SHARED`:
//! sequences are per CPU, whatever process runs there) and read at any
//! time.
//!
//! **After detach, nothing.** A call still pending when its probe is
//! detached must not write to the cells once the detach has returned
//! (the caller may unmap them then). Every pending call names the
//! probe's [`Switch`], which holds the cells while it is attached (see
//! [`super::switch`]), and its return reads the cells from it inside the
//! restartable sequence that records, or, on the engine's path, inside a
//! read section of the table's domain.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) use super::switch::Switch;

/// Buckets of a [`LatencyCell`]'s histogram: bucket 0 counts calls that
/// took 0 ns, bucket `k` those that took `[2^(k-1), 2^k)` ns, the last
/// one everything from `2^62` ns on.
pub const LATENCY_BUCKETS: usize = crate::base::abi::LATENCY_BUCKETS;

/// One CPU's counts of a timing probe
/// ([`Uprobe::time_into`](crate::Uprobe::time_into)): its calls, and how
/// long they took, as a log2 histogram of nanoseconds. A probe times into
/// [`latency_cells()`] of them; read them by summing
/// ([`LatencyCell::total_calls`], [`LatencyCell::histogram`]).
///
/// ```
/// use uprobe_core::{LatencyCell, latency_cells};
/// let cells: &'static [LatencyCell] =
///     Box::leak((0..latency_cells()).map(|_| LatencyCell::new()).collect());
/// assert_eq!(LatencyCell::total_calls(cells), 0);
/// assert_eq!(LatencyCell::bucket_of(1000), 10);
/// ```
#[repr(C, align(128))]
#[derive(Debug)]
pub struct LatencyCell {
    calls: AtomicU64,
    buckets: [AtomicU64; LATENCY_BUCKETS],
}

// The layout the architectures' routines read (`crate::base::abi`).
const _: () = assert!(
    core::mem::offset_of!(LatencyCell, buckets) == crate::base::abi::LATENCY_BUCKETS_AT
        && size_of::<LatencyCell>() == crate::base::abi::LATENCY_CELL_SIZE
);

impl Default for LatencyCell {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyCell {
    /// A cell at zero.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            calls: AtomicU64::new(0),
            buckets: [const { AtomicU64::new(0) }; LATENCY_BUCKETS],
        }
    }

    /// Calls counted in this cell. Async-signal-safe.
    #[must_use]
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Returns counted in bucket `k` of this cell (0 for `k` out of
    /// range). Async-signal-safe.
    #[must_use]
    pub fn bucket(&self, k: usize) -> u64 {
        self.buckets.get(k).map_or(0, |b| b.load(Ordering::Relaxed))
    }

    /// The calls counted in `cells` (wrapping sum). Async-signal-safe.
    #[must_use]
    pub fn total_calls(cells: &[Self]) -> u64 {
        cells.iter().fold(0, |s, c| s.wrapping_add(c.calls()))
    }

    /// The histogram of `cells`: bucket by bucket, the sum over cells.
    /// Its total is the returns timed. Async-signal-safe.
    #[must_use]
    pub fn histogram(cells: &[Self]) -> [u64; LATENCY_BUCKETS] {
        core::array::from_fn(|k| cells.iter().fold(0u64, |s, c| s.wrapping_add(c.bucket(k))))
    }

    /// The bucket a call that took `nanos` goes to (see
    /// [`LATENCY_BUCKETS`]). Async-signal-safe.
    #[must_use]
    pub const fn bucket_of(nanos: u64) -> usize {
        let k = (u64::BITS - nanos.leading_zeros()) as usize;
        if k < LATENCY_BUCKETS {
            k
        } else {
            LATENCY_BUCKETS - 1
        }
    }

    /// Counts a call the engine's path saw, in the last of `cells` (the
    /// one no restartable sequence writes), atomically. Out of line: the
    /// hit path of a handler keeps its registers. Async-signal-safe.
    #[inline(never)]
    pub(crate) fn count_call_in_last(cells: &[Self]) {
        if let Some(last) = cells.last() {
            last.calls.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Adds a return the engine's path timed (`nanos`) to the histogram,
    /// in the last of `cells`, atomically. Async-signal-safe.
    pub(crate) fn record_in_last(cells: &[Self], nanos: u64) {
        if let Some(last) = cells.last() {
            last.buckets[Self::bucket_of(nanos)].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How many [`LatencyCell`]s a timing probe needs: one per possible CPU,
/// and one for calls counted without a restartable sequence. The same in
/// every process of this machine. Not async-signal-safe on the first
/// call (it reads the possible CPUs).
#[must_use]
pub fn latency_cells() -> usize {
    pcpu::possible_cpus() + 1
}

/// A timing probe's switch holds its cells.
impl Switch {
    /// A switch on, holding a timing probe's `cells`. Not
    /// async-signal-safe.
    pub(crate) fn timing(cells: &'static [LatencyCell]) -> &'static Self {
        Self::on(NonNull::from(cells).cast())
    }

    /// The cells, while the switch is on for the timing probe of
    /// `generation`. Async-signal-safe.
    pub(crate) fn cells_of(&self, generation: u64) -> Option<&'static [LatencyCell]> {
        let p = self.target_of(generation)?;
        // SAFETY: a timing probe's switch holds its cells, `'static` and
        // `latency_cells()` of them (checked at attach).
        Some(unsafe { core::slice::from_raw_parts(p.as_ptr().cast(), latency_cells()) })
    }
}
