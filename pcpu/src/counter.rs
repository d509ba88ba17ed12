//! `PerCpuCounter`: a counter that scales with CPUs.

use crate::PerCpu;
use crate::sync::atomic::{AtomicU64, Ordering};

/// A statistics counter split into one cache-padded word per CPU: adding
/// touches only the current CPU's line ([`rseq::add`](crate::rseq::add):
/// a plain `add` in a restartable sequence where available), reading sums
/// all of them.
///
/// The sum is exact once adders are quiescent; while they run it is some
/// value between the sums at the start and the end of the read (each word
/// is read once, atomically). Values wrap modulo 2^64, so [`add`](Self::add)
/// with `delta.wrapping_neg()` subtracts.
///
/// ```
/// let hits = pcpu::PerCpuCounter::new();
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| for _ in 0..1000 { hits.add(1) });
///     }
/// });
/// assert_eq!(hits.sum(), 4000);
/// ```
#[derive(Debug, Default)]
pub struct PerCpuCounter {
    slots: PerCpu<AtomicU64>,
}

impl PerCpuCounter {
    /// A counter at zero. Allocates one line per possible CPU; not
    /// async-signal-safe.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `delta` to the current CPU's word. **Async-signal-safe.**
    #[inline]
    pub fn add(&self, delta: u64) {
        crate::rseq::add(&self.slots, delta);
    }

    /// The wrapping sum over all CPUs. **Async-signal-safe.**
    #[must_use]
    pub fn sum(&self) -> u64 {
        self.slots
            .iter()
            .fold(0u64, |s, c| s.wrapping_add(c.load(Ordering::Relaxed)))
    }

    /// The per-CPU words, for callers that order them with fences
    /// themselves (e.g. a reader count checked after a heavy fence).
    #[must_use]
    pub fn slots(&self) -> &PerCpu<AtomicU64> {
        &self.slots
    }
}
