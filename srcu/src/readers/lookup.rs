//! A domain's slots ([`Readers`]): the table it holds, its hot word, and
//! finding the calling thread's slot from the read side (the slot used
//! last, the thread's cache way, or a claim).

use super::slot::{BANK_SHIFT, Slot, TABLE_ALIGN, TABLE_BYTES};
use super::table::Table;
use super::thread::{CACHE, CACHE_WAYS, LAST, thread_id};

/// A domain's slots: the table it holds while it lives.
pub(crate) struct Readers {
    table: &'static Table,
    /// The table's base address and cache way, copied here: fewer loads
    /// and no arithmetic on the read side.
    base: usize,
    way: usize,
}

impl Readers {
    /// A domain's slots: a table no live domain holds (one a dropped
    /// domain held, with its owners, or a new one); none if not `enabled`
    /// (every guard section is then counted per CPU).
    pub(crate) fn new(enabled: bool) -> Self {
        let table = if enabled {
            Table::take()
        } else {
            Table::none()
        };
        Self {
            table,
            base: table.base(),
            way: way(table.base()),
        }
    }

    /// The domain's hot word for `bank`: the table's base, `bank` at bit
    /// [`BANK_SHIFT`], and bit 0 (never 0, even for the table without
    /// slots). The read side loads it (kept in the
    /// domain, next to nothing else it writes) both to check the slot
    /// the thread used last and to store it there as an outermost
    /// section's word.
    pub(crate) fn hot(&self, bank: usize) -> u64 {
        self.base as u64 | ((bank as u64 & 1) << BANK_SHIFT) | 1
    }

    /// The calling thread's slot if it is the one the thread used last
    /// (one thread-local load and an exclusive or with the domain's `hot`
    /// word: the same table when they agree above the table's
    /// alignment), else [`cached_way`](Self::cached_way).
    /// Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn cached(&self, hot: u64) -> Option<&Slot> {
        // SAFETY: `LAST` is below `CACHE_ENTRIES`.
        let last = CACHE.with(|c| unsafe { c.get_unchecked(LAST) }.get());
        if (last ^ hot as usize) < TABLE_ALIGN {
            // SAFETY: inside this domain's table: a slot of this thread
            // (see the module docs), valid as long as the table, forever;
            // so not null either (tables are mapped memory).
            return Some(unsafe { &*(last as *const Slot) });
        }
        self.cached_way()
    }

    /// The calling thread's slot if its way of the cache holds it (else
    /// [`claim`](Self::claim) it), made the one used last.
    /// Async-signal-safe.
    #[cold]
    #[inline(never)]
    fn cached_way(&self) -> Option<&Slot> {
        let cached = CACHE.with(|c| c[self.way].get());
        if cached.wrapping_sub(self.base) < TABLE_BYTES {
            // One store: a signal handler sees the old entry or the new
            // one, both slots of this thread.
            CACHE.with(|c| c[LAST].set(cached));
            // SAFETY: as in `cached`.
            return Some(unsafe { &*(cached as *const Slot) });
        }
        None
    }

    /// Claims the calling thread's slot (or finds it, if its cache entry
    /// was evicted) and caches it; `None` when every slot is taken by a
    /// live thread (count per CPU then). Async-signal-safe.
    pub(crate) fn claim(&self) -> Option<&Slot> {
        let slot = self.table.slot(self.table.claim(thread_id())?);
        // One store each: a signal handler sees the old entry or the new
        // one.
        CACHE.with(|c| {
            c[self.way].set(core::ptr::from_ref(slot) as usize);
            c[LAST].set(core::ptr::from_ref(slot) as usize);
        });
        Some(slot)
    }

    /// Slots handed out in the domain's table.
    pub(crate) fn handed_out(&self) -> usize {
        self.table.handed_out()
    }

    /// Whether a slot holds a section open on `bank` (read after the
    /// heavy fence; see `Inner::drained`).
    pub(crate) fn open_on(&self, bank: usize) -> bool {
        (0..self.table.handed_out()).any(|i| self.table.slot(i).open_on(bank))
    }
}

impl Drop for Readers {
    fn drop(&mut self) {
        // No guard of the domain can exist any more (guards borrow it),
        // so a count left open belongs to a forgotten guard: clear it,
        // then hand the table on.
        self.table.release();
    }
}

/// The cache way of the table at `base`.
fn way(base: usize) -> usize {
    (base / TABLE_BYTES) % CACHE_WAYS
}
