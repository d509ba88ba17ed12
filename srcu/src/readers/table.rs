//! The process-wide tables of slots: their memory (reserved, never
//! freed), handing a table from a dropped domain to the next, and
//! claiming a slot (a free one, an exited thread's, or a fresh one).

use pcpu::unstable::sync::atomic::{AtomicUsize, Ordering};

use super::slot::{CAPACITY, Slot, TABLE_ALIGN};
use super::thread::{current_tid, has_exited};

/// [`CAPACITY`] slots in zeroed memory (a zeroed `Slot` is a valid one:
/// all its fields are atomics), never freed. Tables form a process-wide
/// list; a domain takes one that no live domain holds.
pub(super) struct Table {
    base: *const Slot,
    len: usize,
    /// Slots handed out so far: grace periods read `slots[..used]`.
    used: AtomicUsize,
    /// Whether a live domain holds the table.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    held: core::sync::atomic::AtomicBool,
    /// The next table of the list.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    pub(super) next: *const Table,
}

// SAFETY: a table only hands out `&Slot`s, whose fields are atomics; its
// other fields are atomics or set before it is shared.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

/// The base address of a table without slots (aligned as tables are): no
/// cached slot address lies within `TABLE_ALIGN` above it.
const NO_SLOTS_BASE: usize = usize::MAX.wrapping_sub(TABLE_ALIGN - 1);

/// The table of a domain without slots (where membarrier is unavailable,
/// or no memory could be reserved).
#[cfg(not(pcpu_loom))]
static NO_SLOTS: Table = Table {
    base: NO_SLOTS_BASE as *const Slot,
    len: 0,
    used: AtomicUsize::new(0),
    held: core::sync::atomic::AtomicBool::new(true),
    next: core::ptr::null(),
};

/// Every table made so far (never freed), newest first.
#[cfg(not(pcpu_loom))]
pub(super) static TABLES: core::sync::atomic::AtomicPtr<Table> =
    core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

impl Table {
    #[cfg(not(pcpu_loom))]
    pub(super) fn none() -> &'static Self {
        &NO_SLOTS
    }

    /// loom: loom's atomics cannot be in a `static`.
    #[cfg(pcpu_loom)]
    pub(super) fn none() -> &'static Self {
        Self::leak(NO_SLOTS_BASE as *const Slot, 0)
    }

    /// A table of `len` slots at `base`, held, leaked (tables are never
    /// freed).
    fn leak(base: *const Slot, len: usize) -> &'static mut Self {
        Box::leak(Box::new(Self {
            base,
            len,
            used: AtomicUsize::new(0),
            held: core::sync::atomic::AtomicBool::new(true),
            next: core::ptr::null(),
        }))
    }

    /// A table no live domain holds, made if there is none.
    #[cfg(not(pcpu_loom))]
    pub(super) fn take() -> &'static Self {
        use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
        let mut t = TABLES.load(Acquire);
        while !t.is_null() {
            // SAFETY: tables are never freed.
            let table = unsafe { &*t };
            if !table.held.load(Relaxed)
                && table
                    .held
                    .compare_exchange(false, true, Acquire, Relaxed)
                    .is_ok()
            {
                return table;
            }
            t = table.next.cast_mut();
        }
        let Some(base) = reserve() else {
            return Self::none();
        };
        let table = Self::leak(base, CAPACITY);
        let mut head = TABLES.load(Relaxed);
        loop {
            table.next = head;
            match TABLES.compare_exchange_weak(head, table, AcqRel, Relaxed) {
                Ok(_) => return table,
                Err(now) => head = now,
            }
        }
    }

    /// loom: a fresh table per domain (loom's atomics live for one
    /// execution, so tables are not kept across them).
    #[cfg(pcpu_loom)]
    pub(super) fn take() -> &'static Self {
        let layout =
            std::alloc::Layout::from_size_align(TABLE_ALIGN, TABLE_ALIGN).expect("a power of two");
        // SAFETY: a layout of non-zero size.
        let base = unsafe { std::alloc::alloc(layout) }.cast::<Slot>();
        assert!(!base.is_null(), "loom table allocation");
        for i in 0..CAPACITY {
            // SAFETY: `CAPACITY` slots fit in the allocation (`TABLE_BYTES`
            // is at most `TABLE_ALIGN`), aligned (`Slot`'s alignment
            // divides the table's).
            unsafe { base.add(i).write(Slot::new()) };
        }
        Self::leak(base, CAPACITY)
    }

    /// Hands the table on to a later domain, its counts cleared.
    pub(super) fn release(&self) {
        if self.len == 0 {
            return; // no slots: nothing to hand on
        }
        for i in 0..self.handed_out() {
            self.slot(i).clear_counts();
        }
        self.held
            .store(false, core::sync::atomic::Ordering::Release);
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(super) fn base(&self) -> usize {
        self.base as usize
    }

    pub(super) fn handed_out(&self) -> usize {
        self.used.load(Ordering::Acquire).min(self.len)
    }

    pub(super) fn slot(&self, i: usize) -> &Slot {
        assert!(i < self.len, "slot index below the capacity");
        // SAFETY: inside the table, which is never freed.
        unsafe { &*self.base.add(i) }
    }

    /// Finds the slot `me` owns (its cache entry was evicted), or claims a
    /// free one, one of an exited thread, or a fresh one.
    pub(super) fn claim(&self, me: u64) -> Option<usize> {
        if let Some(i) =
            (0..self.handed_out()).find(|&i| self.slot(i).owner.load(Ordering::Relaxed) == me)
        {
            return Some(i);
        }
        let tid = current_tid();
        loop {
            let taken = (0..self.handed_out())
                .find(|&i| self.take_slot(i, 0, me))
                .or_else(|| (0..self.handed_out()).find(|&i| self.take_from_exited(i, me)));
            if let Some(i) = taken {
                self.slot(i).tid.store(tid, Ordering::Relaxed);
                return Some(i);
            }
            let fresh = self
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                    (u < self.len).then_some(u + 1)
                })
                .ok()?;
            if self.take_slot(fresh, 0, me) {
                self.slot(fresh).tid.store(tid, Ordering::Relaxed);
                return Some(fresh);
            }
            // Another thread's scan took the fresh slot first: look again.
        }
    }

    fn take_slot(&self, i: usize, from: u64, me: u64) -> bool {
        let owner = &self.slot(i).owner;
        owner.load(Ordering::Relaxed) == from
            && owner
                .compare_exchange(from, me, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// Takes slot `i` if its owner has exited with no section open (a
    /// guard forgotten with `mem::forget` keeps its slot, and its grace
    /// periods, waiting forever, as it would per CPU).
    fn take_from_exited(&self, i: usize, me: u64) -> bool {
        let slot = self.slot(i);
        let owner = slot.owner.load(Ordering::Relaxed);
        if owner == 0 || !has_exited(slot.tid.load(Ordering::Relaxed)) {
            return false;
        }
        // The owner's last stores happened before its exit, which the
        // failed `tgkill` saw.
        pcpu::unstable::sync::atomic::fence(Ordering::SeqCst);
        slot.balanced() && self.take_slot(i, owner, me)
    }
}

/// Reserves a table's zero-filled memory with `mmap` (untouched pages
/// cost nothing), aligned to [`TABLE_ALIGN`]: twice that is mapped and
/// what lies outside the aligned part unmapped again.
#[cfg(not(any(pcpu_loom, miri)))]
fn reserve() -> Option<*const Slot> {
    let span = 2 * TABLE_ALIGN;
    // SAFETY: a fresh private anonymous mapping; no existing memory is
    // affected.
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED || p.is_null() {
        return None;
    }
    let start = p as usize;
    let base = start.next_multiple_of(TABLE_ALIGN);
    let end = start + span;
    // SAFETY: both ranges lie inside the mapping just made, outside the
    // aligned table (page-aligned: `TABLE_ALIGN` is a multiple of the
    // page size, as is `start`); nothing else uses them. A failure leaves
    // them mapped and unused: harmless.
    unsafe {
        if base > start {
            libc::munmap(p, base - start);
        }
        if end > base + TABLE_ALIGN {
            libc::munmap(
                (base + TABLE_ALIGN) as *mut libc::c_void,
                end - base - TABLE_ALIGN,
            );
        }
    }
    Some(base as *const Slot)
}

/// Under Miri, whose `munmap` frees only whole mappings: the same
/// zero-filled, aligned, never-freed memory from the allocator.
#[cfg(all(miri, not(pcpu_loom)))]
fn reserve() -> Option<*const Slot> {
    let layout = std::alloc::Layout::from_size_align(TABLE_ALIGN, TABLE_ALIGN).ok()?;
    // SAFETY: a layout of non-zero size.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    // Aligned to `TABLE_ALIGN`, a multiple of `Slot`'s alignment.
    #[allow(clippy::cast_ptr_alignment)]
    let base = base.cast::<Slot>();
    (!base.is_null()).then_some(base.cast_const())
}
