//! Per-thread reader slots: where a domain counts the guard sections
//! ([`ReadGuard`](crate::ReadGuard), and so [`SrcuCell::read`](crate::SrcuCell::read))
//! of each thread.
//!
//! # Why per thread, and why stores rather than counts
//! A guard ends on the thread that began it, so its sections can be
//! counted in words only that thread writes. A slot's `outer` word holds
//! the thread's outermost open guard section of the domain: `read_lock`
//! reads it and, when it is 0 (the usual case), stores the domain's
//! [`hot`](Readers::hot) word there (the active bank, and bit 0 so it is
//! never 0); the guard's drop stores 0. A section begun while `outer` is
//! taken (a nested one, or one begun while the outermost one's guard,
//! dropped out of order, left a nested one open) adds 1 to a count of
//! open sections of its own bank, `nested[bank]`, and its drop takes 1
//! away. The light fence comes after the store or add, and before the
//! drop's. A grace period waiting for bank `b` waits while a slot's
//! `outer` holds `b` or its `nested[b]` is not 0.
//!
//! No `lock`-prefixed instruction and no restartable sequence, and above
//! all, on the usual path, no chain of dependent memory operations from
//! one section to the next, and no load at the drop: the outermost store
//! writes a value loaded from the domain, not one computed from the slot,
//! and the drop writes a constant, so a section waits for no earlier
//! store to be forwarded (counts that only grow, which this replaced, did:
//! every add read the last add's result, about 7 cycles a section on the
//! bench machine, where liburcu's read side takes about 4).
//!
//! **Signal handlers.** Each store, and each add to a `nested` count, is
//! one instruction that a handler cannot split (on x86-64 the adds are
//! `inc`/`dec` on memory, which no other thread writes, so no `lock`
//! prefix; elsewhere relaxed atomic read-modify-writes). Between reading
//! `outer` as 0 and storing the hot word a handler may run read sections
//! of its own, which take `outer` and give it back: they end before the
//! handler returns (guards are scoped, not `Send`, and a handler's must
//! not outlive it, as liburcu's readers and this crate's per-thread
//! per-CPU bookkeeping, `fork::held_add`, assume too), so `outer` is 0
//! again when the interrupted store writes. A handler that interrupts an
//! open outermost section finds `outer` taken and counts in `nested`.
//!
//! Sections that may end on another thread (raw sections, leases) stay on
//! the per-CPU counts, whose lock and unlock counts only grow; a grace
//! period waits for both kinds.

//! # Slots, tables, claims and thread exit
//! A domain's slots are a *table* of [`CAPACITY`] slots of one
//! cache-line pair each (virtual memory only; a page is touched when a
//! slot on it is first claimed), aligned to its size rounded up to a
//! power of two ([`TABLE_ALIGN`]). A thread claims a slot on its first
//! guard section of the domain and remembers the slot's address in a
//! small thread-local cache: one entry per way, and the slot it used
//! last. Claiming is a scan and a compare-and-swap, with no lock and no
//! allocation, so a first section in a signal handler is fine.
//!
//! Tables are never unmapped: a dropped domain's table goes back to a
//! process-wide list and the next new domain takes it, **with its
//! owners**. So a cached address is right whenever it lies inside the
//! domain's table: a thread caches only slots it owns, and it owns them
//! in whichever domain holds the table. There is no domain id to compare
//! (an id or an `Inner` address can be reused with another table: a
//! table's address cannot), and an address from a dropped domain never
//! points at freed memory. The read side's check of the slot used last
//! is one exclusive or: the domain's hot word carries the table's base
//! above bit `TABLE_ALIGN.trailing_zeros()` (its bank and bit 0 below),
//! so it agrees with a slot address there exactly when the slot lies in
//! the table. The same load gives the word to store, so the fast path
//! loads one word of the domain, one thread-local word and the slot's.
//!
//! There is no registration and nothing runs at thread exit (a
//! thread-local destructor cannot be registered from a signal handler).
//! Instead a slot records its owner's kernel thread id, and a thread that
//! finds no free slot takes over one whose owner has exited
//! (`tgkill(pid, tid, 0)` fails with `ESRCH`) and whose words are all 0
//! (every section it began has ended).
//! A table therefore holds about as many slots as threads that used its
//! domains at once, and the process as many tables as domains that were
//! alive at once. When all [`CAPACITY`] slots are taken by live threads,
//! further threads count their guard sections per CPU instead: correct,
//! slower.
//!
//! # What a grace period pays
//! Checking a bank sums the unlock counts of every CPU, issues the heavy
//! fence (A), sums their lock counts and reads every claimed slot's
//! `outer` and `nested[bank]` (each slot on its own cache line): the cost
//! grows with the number of threads that used the domain's table, where
//! the per-CPU scheme's grew with the number of CPUs. Each section lives
//! in one word from its beginning to its end, so each word is checked on
//! its own, after the fence: a section whose store or add the read
//! misses began after it, so (B pairing with A) sees the caller's
//! updates; one whose drop the read sees had done its loads (C pairing
//! with the grace period's last heavy fence, D). See the crate's
//! *Memory ordering*.

use core::cell::Cell;
use core::sync::atomic::AtomicU64 as IdCounter;

use pcpu::unstable::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Slots per table; threads beyond this many count per CPU instead.
#[cfg(not(pcpu_loom))]
pub(crate) const CAPACITY: usize = 1024;
/// Slots per table in the loom models (small state space).
#[cfg(pcpu_loom)]
pub(crate) const CAPACITY: usize = 3;

/// A table's size in bytes: a cached slot address `a` is this domain's
/// when `a - base < TABLE_BYTES`.
const TABLE_BYTES: usize = CAPACITY * core::mem::size_of::<Slot>();

/// Tables are aligned to this power of two (at least their size), so a
/// slot's address and its table's base agree above bit
/// `TABLE_ALIGN.trailing_zeros()`; the bits below hold, in the domain's
/// [`hot`](Readers::hot) word, a bank and a mark.
const TABLE_ALIGN: usize = TABLE_BYTES.next_power_of_two();

/// Where a domain's hot word (and so a slot's `outer` word) keeps its
/// bank: the highest bit below the table's alignment.
const BANK_SHIFT: u32 = TABLE_ALIGN.trailing_zeros() - 1;

/// Domains' cache entries per thread (a thread alternating between more
/// domains than this takes the claim path's scan for a cache miss).
const CACHE_WAYS: usize = 4;

/// The cache entry of the slot this thread used last, after the ways.
const LAST: usize = CACHE_WAYS;

/// Cache entries per thread: the ways and [`LAST`].
const CACHE_ENTRIES: usize = CACHE_WAYS + 1;

/// One thread's guard sections in one domain.
#[repr(C, align(128))] // its own pair of cache lines (adjacent-line prefetch)
pub(crate) struct Slot {
    /// The owner's outermost open guard section: the domain's hot word
    /// it stored (its bank at bit [`BANK_SHIFT`], the table's base
    /// above, bit 0 set), or 0 when none is open. Written by the owner
    /// only (and by a signal handler of the owner, whose sections end
    /// before it returns), read by grace periods. First in the slot: a
    /// ticket on it is the slot's (aligned) address.
    outer: AtomicU64,
    /// Guard sections begun while `outer` was taken (nested ones, and
    /// any begun while the outermost one's guard lived after it ended
    /// out of order), open per bank, each counted on the bank it began
    /// on. Written by the owner only, one indivisible add each.
    nested: [AtomicU64; 2],
    /// The owning thread's [`thread_id`] (0: free).
    owner: AtomicU64,
    /// The owner's kernel thread id (0: not yet known), for telling an
    /// exited owner's slot from a live one.
    tid: AtomicU64,
}

/// A slot's alignment: a ticket on its `outer` word is a multiple of it,
/// one on a `nested` word is not.
const SLOT_ALIGN: usize = core::mem::align_of::<Slot>();

impl Slot {
    #[cfg(pcpu_loom)]
    fn new() -> Self {
        Self {
            outer: AtomicU64::new(0),
            nested: [AtomicU64::new(0), AtomicU64::new(0)],
            owner: AtomicU64::new(0),
            tid: AtomicU64::new(0),
        }
    }

    /// Counts a section begun (owner only; `hot` is the domain's
    /// [`hot`](Readers::hot) word for its active bank) and returns where.
    /// Async-signal-safe for handlers whose sections end before they
    /// return (see the module docs).
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn enter(&self, hot: u64) -> Section {
        if self.outer.load(Ordering::Relaxed) == 0 {
            // The outermost section: a store of a value that does not
            // depend on the word's old one (see the module docs).
            self.outer.store(hot, Ordering::Relaxed);
            return Section(core::ptr::from_ref(&self.outer) as usize);
        }
        self.nest(hot)
    }

    /// A section begun while `outer` is taken: counted on its own bank
    /// (out of line: the outermost store stays on the straight path).
    #[cold]
    #[inline(never)]
    fn nest(&self, hot: u64) -> Section {
        let word = &self.nested[(hot >> BANK_SHIFT) as usize & 1];
        step(word, Step::Up);
        Section(core::ptr::from_ref(word) as usize)
    }

    /// Whether every section counted here has ended.
    fn balanced(&self) -> bool {
        self.outer.load(Ordering::Relaxed) == 0
            && self.nested.iter().all(|n| n.load(Ordering::Relaxed) == 0)
    }

    /// Whether a section counted here is open on `bank`.
    fn open_on(&self, bank: usize) -> bool {
        let outer = self.outer.load(Ordering::Relaxed);
        (outer != 0 && (outer >> BANK_SHIFT) & 1 == bank as u64 & 1)
            || self.nested[bank & 1].load(Ordering::Relaxed) != 0
    }

    fn clear_counts(&self) {
        for word in core::iter::once(&self.outer).chain(&self.nested) {
            word.store(0, Ordering::Relaxed);
        }
    }
}

/// Where a guard section is counted, in one word (a raw address, so
/// neither `Send` nor `Sync`: the section ends on the thread that began
/// it): a slot's `outer` word (its address, a multiple of
/// [`SLOT_ALIGN`]: the usual case, tested with one instruction), one of
/// its `nested` words (an address that is not), or per CPU on a bank
/// (`bank + 1`: the thread found no free slot).
#[derive(Clone, Copy)]
pub(crate) struct Section(usize);

impl Section {
    /// A section counted per CPU on `bank`.
    pub(crate) fn per_cpu(bank: usize) -> Self {
        Self((bank & 1) + 1)
    }

    /// Whether the section is a slot's outermost one.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn is_outer(self) -> bool {
        self.0.is_multiple_of(SLOT_ALIGN)
    }

    /// The bank of a section counted per CPU, if it is.
    pub(crate) fn per_cpu_bank(self) -> Option<usize> {
        (self.0 <= 2).then(|| self.0 - 1)
    }

    /// The bank the section is counted on.
    pub(crate) fn bank(self) -> usize {
        if let Some(bank) = self.per_cpu_bank() {
            return bank;
        }
        let slot = self.0 & !(SLOT_ALIGN - 1);
        // SAFETY: a slot's word (slots are never freed); its slot starts
        // at the alignment below it.
        let slot = unsafe { &*(slot as *const Slot) };
        if self.is_outer() {
            (slot.outer.load(Ordering::Relaxed) >> BANK_SHIFT) as usize & 1
        } else {
            usize::from(self.0 != core::ptr::from_ref(&slot.nested[0]) as usize)
        }
    }

    /// Counts the outermost section of a slot ended (on the thread that
    /// began it; `is_outer`): one store of 0. Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn leave_outer(self) {
        debug_assert!(self.is_outer());
        // SAFETY: a slot's `outer` word (slots are never freed).
        unsafe { &*(self.0 as *const AtomicU64) }.store(0, Ordering::Relaxed);
    }

    /// Counts a nested section of a slot ended (on the thread that began
    /// it; neither outer nor per CPU). Async-signal-safe.
    pub(crate) fn leave_nested(self) {
        debug_assert!(!self.is_outer() && self.per_cpu_bank().is_none());
        // SAFETY: one of a slot's `nested` words (slots are never freed).
        step(unsafe { &*(self.0 as *const AtomicU64) }, Step::Down);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    Up,
    Down,
}

/// Adds 1 to (`Up`) or takes 1 from (`Down`) a slot's nested count,
/// which only this thread writes: in one instruction on x86-64
/// (`inc`/`dec` on memory: no `lock` prefix is needed for a word no
/// other thread writes, and an instruction is never split by a signal
/// handler), an atomic add elsewhere. Async-signal-safe.
#[allow(clippy::inline_always)]
#[inline(always)]
fn step(word: &AtomicU64, step: Step) {
    #[cfg(all(target_arch = "x86_64", not(pcpu_loom)))]
    // SAFETY: an aligned `u64` of this thread's slot, written by this
    // thread only; other threads read it with atomic loads, which see the
    // old or the new value (aligned 8-byte accesses do not tear).
    unsafe {
        if step == Step::Up {
            core::arch::asm!("inc qword ptr [{0}]", in(reg) word.as_ptr(), options(nostack));
        } else {
            core::arch::asm!("dec qword ptr [{0}]", in(reg) word.as_ptr(), options(nostack));
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(pcpu_loom))))]
    if step == Step::Up {
        word.fetch_add(1, Ordering::Relaxed);
    } else {
        word.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A domain's slots: the table it holds while it lives.
pub(crate) struct Readers {
    table: &'static Table,
    /// The table's base address and cache way, copied here: fewer loads
    /// and no arithmetic on the read side.
    base: usize,
    way: usize,
}

/// Thread ids (never reused, unlike kernel thread ids), from 1.
static NEXT_THREAD_ID: IdCounter = IdCounter::new(1);

#[cfg(not(pcpu_loom))]
std::thread_local! {
    /// This thread's id (0: none yet). Const-initialised without a
    /// destructor, like the cache: usable from signal handlers.
    static THREAD_ID: Cell<u64> = const { Cell::new(0) };
    /// The address of a slot of this thread per way (way: bits of the
    /// table's address), then the one it used last ([`LAST`]); 0: empty.
    static CACHE: [Cell<usize>; CACHE_ENTRIES] = const { [const { Cell::new(0) }; CACHE_ENTRIES] };
}

#[cfg(pcpu_loom)]
loom::thread_local! {
    static THREAD_ID: Cell<u64> = Cell::new(0);
    static CACHE: [Cell<usize>; CACHE_ENTRIES] = [Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0)];
}

/// The calling thread's id, assigned on first use. Async-signal-safe (a
/// handler that assigns one first leaves the thread with two ids, so one
/// claimed slot idles until the thread exits: wasted, never shared).
fn thread_id() -> u64 {
    THREAD_ID.with(|id| {
        if id.get() == 0 {
            id.set(NEXT_THREAD_ID.fetch_add(1, core::sync::atomic::Ordering::Relaxed));
        }
        id.get()
    })
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

/// [`CAPACITY`] slots in zeroed memory (a zeroed `Slot` is a valid one:
/// all its fields are atomics), never freed. Tables form a process-wide
/// list; a domain takes one that no live domain holds.
pub(crate) struct Table {
    base: *const Slot,
    len: usize,
    /// Slots handed out so far: grace periods read `slots[..used]`.
    used: AtomicUsize,
    /// Whether a live domain holds the table.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    held: core::sync::atomic::AtomicBool,
    /// The next table of the list.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    next: *const Table,
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
static TABLES: core::sync::atomic::AtomicPtr<Table> =
    core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

impl Table {
    #[cfg(not(pcpu_loom))]
    fn none() -> &'static Self {
        &NO_SLOTS
    }

    /// loom: loom's atomics cannot be in a `static`.
    #[cfg(pcpu_loom)]
    fn none() -> &'static Self {
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
    fn take() -> &'static Self {
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
    fn take() -> &'static Self {
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
    fn release(&self) {
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
    fn base(&self) -> usize {
        self.base as usize
    }

    fn handed_out(&self) -> usize {
        self.used.load(Ordering::Acquire).min(self.len)
    }

    fn slot(&self, i: usize) -> &Slot {
        assert!(i < self.len, "slot index below the capacity");
        // SAFETY: inside the table, which is never freed.
        unsafe { &*self.base.add(i) }
    }

    /// Finds the slot `me` owns (its cache entry was evicted), or claims a
    /// free one, one of an exited thread, or a fresh one.
    fn claim(&self, me: u64) -> Option<usize> {
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
#[cfg(not(pcpu_loom))]
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

/// In a fork child (only the forking thread exists): frees the slots of
/// every other thread in every table, with their sections (they cannot
/// end here), and records the forking thread's new kernel thread id in
/// its own. Its own: those it owns, and those its cache holds (a signal
/// handler that interrupted the thread's first id assignment claimed one
/// under an id the thread then lost).
#[cfg(not(pcpu_loom))]
pub(crate) fn after_fork() {
    let me = THREAD_ID.with(Cell::get);
    let cached: [usize; CACHE_ENTRIES] = CACHE.with(|c| core::array::from_fn(|w| c[w].get()));
    let tid = current_tid();
    let mut t = TABLES.load(core::sync::atomic::Ordering::Acquire);
    while !t.is_null() {
        // SAFETY: tables are never freed.
        let table = unsafe { &*t };
        for i in 0..table.handed_out() {
            let slot = table.slot(i);
            let owner = slot.owner.load(Ordering::Relaxed);
            let mine =
                (owner == me && me != 0) || cached.contains(&(core::ptr::from_ref(slot) as usize));
            if mine {
                slot.tid.store(tid, Ordering::Relaxed);
            } else {
                slot.clear_counts();
                slot.tid.store(0, Ordering::Relaxed);
                slot.owner.store(0, Ordering::Relaxed);
            }
        }
        t = table.next.cast_mut();
    }
}

/// The calling thread's kernel thread id. Async-signal-safe, and calls
/// no libc function (a probe handler's read section may run while libc
/// is probed).
#[cfg(not(pcpu_loom))]
fn current_tid() -> u64 {
    u64::try_from(pcpu::unstable::syscall::gettid()).unwrap_or(0)
}

#[cfg(pcpu_loom)]
fn current_tid() -> u64 {
    0
}

/// Whether the thread `tid` of this process has exited (0: unknown, so
/// no). Async-signal-safe, without libc.
#[cfg(not(pcpu_loom))]
fn has_exited(tid: u64) -> bool {
    libc::pid_t::try_from(tid).is_ok_and(pcpu::unstable::syscall::thread_exited)
}

/// loom threads never exit from the model's point of view.
#[cfg(pcpu_loom)]
fn has_exited(_tid: u64) -> bool {
    false
}
