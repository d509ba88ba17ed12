//! The published regions of one kind of generated code (out-of-line
//! slots, trampolines): each region's base and a table of its own (what
//! each slot or trampoline in it runs), for the trap and fault handlers,
//! which find the region of an instruction pointer without a lock.
//! Regions are published once, in order, and never removed; their tables
//! are leaked, like the regions.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use super::REGION_SIZE;

/// The most regions of one kind a process maps (64 MiB of code).
pub(crate) const MAX_REGIONS: usize = 1024;

/// Regions of one kind, each with a `T` of its own.
pub(crate) struct Regions<T: 'static> {
    /// Region bases (0: unused); an entry is written once, after its
    /// table.
    bases: [AtomicUsize; MAX_REGIONS],
    tables: [AtomicPtr<T>; MAX_REGIONS],
}

impl<T: 'static> Regions<T> {
    /// No region yet.
    pub(crate) const fn new() -> Self {
        Self {
            bases: [const { AtomicUsize::new(0) }; MAX_REGIONS],
            tables: [const { AtomicPtr::new(core::ptr::null_mut()) }; MAX_REGIONS],
        }
    }

    /// Publishes the region at `base` with its table, in the next free
    /// entry; `None` if every entry is taken. The caller serialises
    /// publishing (its region lock). Not async-signal-safe (the table is
    /// leaked from the heap).
    pub(crate) fn publish(&self, base: usize, table: Box<T>) -> Option<usize> {
        let free = self
            .bases
            .iter()
            .position(|b| b.load(Ordering::Relaxed) == 0)?;
        self.tables[free].store(Box::leak(table), Ordering::Release);
        self.bases[free].store(base, Ordering::Release);
        Some(free)
    }

    /// The table of region `i`, published before. Async-signal-safe.
    pub(crate) fn table(&self, i: usize) -> Option<&'static T> {
        // SAFETY: a published table is leaked, never freed or changed.
        unsafe { self.tables[i].load(Ordering::Acquire).as_ref() }
    }

    /// The region that holds `ip`: its base and its table.
    /// Async-signal-safe: loads only, in a plain index loop (an iterator
    /// adapter's moves could be `memcpy` calls in unoptimised builds, and
    /// `memcpy` may be what is probed).
    pub(crate) fn find(&self, ip: usize) -> Option<(usize, &'static T)> {
        for i in 0..MAX_REGIONS {
            let base = self.bases[i].load(Ordering::Acquire);
            if base == 0 {
                return None;
            }
            if ip >= base && ip < base + REGION_SIZE {
                return self.table(i).map(|t| (base, t));
            }
        }
        None
    }

    /// Regions published.
    pub(crate) fn count(&self) -> usize {
        self.bases
            .iter()
            .take_while(|b| b.load(Ordering::Acquire) != 0)
            .count()
    }

    /// Bytes of address space the regions take (never unmapped).
    /// Async-signal-safe: loads only.
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.count() * REGION_SIZE
    }

    /// Whether a region was published. Async-signal-safe.
    pub(crate) fn any(&self) -> bool {
        self.bases[0].load(Ordering::Acquire) != 0
    }
}
