//! `PerCpu<T>`: one cache-padded slot per possible CPU, plus an overflow slot.

use crossbeam_utils::CachePadded;

use crate::cpu::{possible_cpus, slot_cpu};

/// One cache-padded `T` per possible CPU, plus one *overflow* slot shared by
/// every CPU id at or above [`possible_cpus()`] (hotplug beyond the boot-time
/// mask).
///
/// Slots are addressed by a *slot index*: the CPU id for ids below
/// [`cpus()`](Self::cpus), [`overflow_index()`](Self::overflow_index) above.
/// Indexing can therefore never go out of bounds, and no two CPUs ever share
/// a CPU slot, which is what lets [`rseq`](crate::rseq) operations write a
/// CPU's slot with plain stores; the overflow slot is only ever written with
/// atomic read-modify-write (the rseq operations' fallback).
///
/// The slot a thread picks may stop being "its CPU's" at any moment
/// (preemption, migration): use atomic operations on it, or the `rseq`
/// operations, and sum over [`iter()`](Self::iter) for totals.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
/// let hits = pcpu::PerCpu::<AtomicU64>::default();
/// hits.current().fetch_add(1, Relaxed);
/// assert_eq!(hits.iter().map(|c| c.load(Relaxed)).sum::<u64>(), 1);
/// ```
pub struct PerCpu<T> {
    slots: Box<[CachePadded<T>]>,
}

impl<T> PerCpu<T> {
    /// Builds the slots, calling `init(slot_index)` for each CPU slot and
    /// the overflow slot. Not async-signal-safe (allocates).
    pub fn new(init: impl FnMut(usize) -> T) -> Self {
        Self::with_cpus(possible_cpus(), init)
    }

    /// [`new`](Self::new) as if the machine had `cpus` possible CPUs: `cpus`
    /// CPU slots and the overflow slot, which CPU ids at or above `cpus`
    /// share. For measuring on a small machine what a structure costs on a
    /// big one (a walk over 256 slots), and for tests; with fewer slots
    /// than CPUs the overflow slot takes the rest. Not async-signal-safe
    /// (allocates).
    pub fn with_cpus(cpus: usize, mut init: impl FnMut(usize) -> T) -> Self {
        Self {
            slots: (0..=cpus).map(|i| CachePadded::new(init(i))).collect(),
        }
    }

    /// The number of CPU slots (the possible-CPU count when built), not
    /// counting the overflow slot. Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn cpus(&self) -> usize {
        self.slots.len() - 1
    }

    /// The index of the overflow slot (equal to [`cpus()`](Self::cpus)).
    #[inline]
    #[must_use]
    pub fn overflow_index(&self) -> usize {
        self.cpus()
    }

    /// The slot index for CPU id `cpu`. Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn index_of(&self, cpu: usize) -> usize {
        cpu.min(self.cpus())
    }

    /// The slot index of the calling thread's current CPU
    /// ([`current_cpu()`](crate::current_cpu); where reading that costs a
    /// system call, as on aarch64 without an rseq area, the CPU the thread
    /// read last, read again every 64 calls). Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn current_index(&self) -> usize {
        self.index_of(slot_cpu())
    }

    /// The calling thread's current CPU's slot (as picked by
    /// [`current_index`](Self::current_index)). Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn current(&self) -> &T {
        // SAFETY: `current_index` is at most `cpus()`, the last index.
        unsafe { self.slots.get_unchecked(self.current_index()) }
    }

    /// The slot at `index`, or `None` past the overflow slot.
    /// Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn get(&self, index: usize) -> Option<&T> {
        self.slots.get(index).map(|s| &**s)
    }

    /// The slot at `index`, unchecked.
    ///
    /// # Safety
    /// `index <= self.cpus()`.
    #[inline]
    #[cfg_attr(not(any(pcpu_arch = "x86_64", pcpu_loom)), allow(dead_code))]
    pub(crate) unsafe fn get_unchecked(&self, index: usize) -> &T {
        // SAFETY: the caller's contract.
        unsafe { self.slots.get_unchecked(index) }
    }

    /// Mutable access to the slot at `index`.
    #[inline]
    pub fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.slots.get_mut(index).map(|s| &mut **s)
    }

    /// All slots, CPU slots first, then the overflow slot. Async-signal-safe.
    #[must_use]
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &T> + '_ {
        self.slots.iter().map(|s| &**s)
    }

    /// All slots, mutably.
    pub fn iter_mut(&mut self) -> impl ExactSizeIterator<Item = &mut T> + '_ {
        self.slots.iter_mut().map(|s| &mut **s)
    }

    /// Address of slot 0 and the distance between slots, for the rseq
    /// critical sections.
    #[cfg_attr(any(pcpu_loom, not(pcpu_arch = "x86_64")), allow(dead_code))]
    #[inline]
    pub(crate) fn raw_layout(&self) -> (*const u8, usize) {
        (self.slots.as_ptr().cast(), size_of::<CachePadded<T>>())
    }
}

impl<T: Default> Default for PerCpu<T> {
    fn default() -> Self {
        Self::new(|_| T::default())
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for PerCpu<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}
