//! Per-thread reader slots: where a domain counts the guard sections
//! ([`ReadGuard`](crate::ReadGuard), and so [`SrcuCell::read`](crate::SrcuCell::read))
//! of each thread.
//!
//! # Why per thread
//! A guard ends on the thread that began it, so its section can be
//! counted in words only that thread writes: per bank, a count of
//! sections begun and one of sections ended, both only growing, as the
//! per-CPU counts. `read_lock` adds 1 to the first, the guard's drop to
//! the second, with the light fence in between. No `lock`-prefixed
//! instruction and no restartable sequence: on x86-64 each add is one
//! `inc` on memory, which a signal handler cannot split (an interrupted
//! load-add-store could lose a handler's add), elsewhere a relaxed atomic
//! add. The read side costs what liburcu's does (a thread-local word and
//! a compiler barrier), where two per-CPU rseq adds cost about twice that.
//! (Two growing counts rather than one count of open sections: the next
//! section's add does not wait for the last one's to be forwarded.)
//!
//! Sections that may end on another thread (raw sections, leases) stay on
//! the per-CPU counts, whose lock and unlock counts only grow; a grace
//! period waits for both kinds.
//!
//! # Slots, tables, claims and thread exit
//! A domain's slots are a *table* of [`CAPACITY`] slots of one
//! cache-line pair each (virtual memory only; a page is touched when a
//! slot on it is first claimed). A thread claims a slot on its first
//! guard section of the domain and remembers the slot's address in a
//! small thread-local cache. Claiming is a scan and a compare-and-swap,
//! with no lock and no allocation, so a first section in a signal handler
//! is fine.
//!
//! Tables are never unmapped: a dropped domain's table goes back to a
//! process-wide list and the next new domain takes it, **with its
//! owners**. So a cached address is right whenever it lies inside the
//! domain's table: a thread caches only slots it owns, and it owns them
//! in whichever domain holds the table. The read side checks the range
//! with the table's base address; there is no domain id to compare, and
//! an address from a dropped domain never points at freed memory.
//!
//! There is no registration and nothing runs at thread exit (a
//! thread-local destructor cannot be registered from a signal handler).
//! Instead a slot records its owner's kernel thread id, and a thread that
//! finds no free slot takes over one whose owner has exited
//! (`tgkill(pid, tid, 0)` fails with `ESRCH`) and whose counts balance
//! (every section it began has ended).
//! A table therefore holds about as many slots as threads that used its
//! domains at once, and the process as many tables as domains that were
//! alive at once. When all [`CAPACITY`] slots are taken by live threads,
//! further threads count their guard sections per CPU instead: correct,
//! slower.
//!
//! # What a grace period pays
//! Checking a bank sums the unlock counts of every CPU and every claimed
//! slot, issues the heavy fence, and sums their lock counts (each slot on
//! its own cache line): the cost grows with the number of threads that
//! used the domain's table, where the per-CPU scheme's grew with the
//! number of CPUs. The ordering argument is the per-CPU counts' (see the
//! crate's *Memory ordering*).

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

/// Domains' cache entries per thread (a thread alternating between more
/// domains than this takes the claim path's scan for a cache miss).
const CACHE_WAYS: usize = 4;

/// One thread's guard sections in one domain.
#[repr(align(128))] // its own pair of cache lines (adjacent-line prefetch)
pub(crate) struct Slot {
    /// Guard sections begun per bank (`LOCK + bank`), and ended
    /// (`UNLOCK + bank`): counts that only grow, like the per-CPU ones.
    /// Written by the owner only, each add indivisible (a signal handler
    /// of the owner cannot split it), read by grace periods. Two counts
    /// rather than one count of open sections: the next section's add
    /// does not wait for the last one's to be forwarded from the store
    /// buffer.
    counts: [AtomicU64; 4],
    /// The owning thread's [`thread_id`] (0: free).
    owner: AtomicU64,
    /// The owner's kernel thread id (0: not yet known), for telling an
    /// exited owner's slot from a live one.
    tid: AtomicU64,
}

impl Slot {
    #[cfg(pcpu_loom)]
    fn new() -> Self {
        Self {
            counts: core::array::from_fn(|_| AtomicU64::new(0)),
            owner: AtomicU64::new(0),
            tid: AtomicU64::new(0),
        }
    }

    /// Counts a section begun on `bank` (0 or 1; owner only) and returns
    /// its ticket for [`leave`]. Async-signal-safe.
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn enter(&self, bank: usize) -> Ticket {
        debug_assert!(bank < 2);
        // SAFETY: banks are 0 and 1 (the caller's `active_bank`).
        let word = unsafe { self.counts.get_unchecked(LOCK + bank) };
        raise(word, 0);
        Ticket(core::ptr::NonNull::from(word))
    }

    /// Whether every section counted here has ended.
    fn balanced(&self) -> bool {
        (0..2).all(|b| {
            self.counts[LOCK + b].load(Ordering::Relaxed)
                == self.counts[UNLOCK + b].load(Ordering::Relaxed)
        })
    }

    fn clear_counts(&self) {
        for word in &self.counts {
            word.store(0, Ordering::Relaxed);
        }
    }
}

/// Words of a slot's counts: `LOCK + bank`, `UNLOCK + bank`.
const LOCK: usize = 0;
const UNLOCK: usize = 2;

/// A guard section counted in a slot: the lock count it raised (its
/// unlock count lies `UNLOCK - LOCK` words on). A raw pointer, so neither
/// `Send` nor `Sync`: the section ends on the thread that began it.
#[derive(Clone, Copy)]
pub(crate) struct Ticket(core::ptr::NonNull<AtomicU64>);

/// Counts the section of `ticket` ended (on the thread that began it).
/// Async-signal-safe.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) fn leave(ticket: Ticket) {
    // SAFETY: a ticket is a slot's lock count (slots are never freed); its
    // unlock count is in the same array, `UNLOCK - LOCK` words on.
    raise(unsafe { ticket.0.as_ref() }, UNLOCK - LOCK);
}

/// Adds 1 to the count `words` after `word` in a slot's counts (0 or
/// `UNLOCK - LOCK`), which only this thread writes: in one instruction on
/// x86-64 (`inc` on memory: no `lock` prefix is needed for a word no
/// other thread writes, and an instruction is never split by a signal
/// handler), an atomic add elsewhere. Async-signal-safe.
#[allow(clippy::inline_always)]
#[inline(always)]
fn raise(word: &AtomicU64, words: usize) {
    #[cfg(all(target_arch = "x86_64", not(pcpu_loom)))]
    // SAFETY: an aligned `u64` of this thread's slot (`words` stays in
    // its counts), written by this thread only; other threads read it
    // with atomic loads, which see the old or the new value (aligned
    // 8-byte accesses do not tear).
    unsafe {
        if words == 0 {
            core::arch::asm!("inc qword ptr [{0}]", in(reg) word.as_ptr(), options(nostack));
        } else {
            core::arch::asm!(
                "inc qword ptr [{0} + {d}]",
                in(reg) word.as_ptr(),
                d = const (UNLOCK - LOCK) * 8,
                options(nostack),
            );
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(pcpu_loom))))]
    // SAFETY: as above, within the slot's counts.
    unsafe { &*core::ptr::from_ref(word).add(words) }.fetch_add(1, Ordering::Relaxed);
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
    /// table's address); 0: empty.
    static CACHE: [Cell<usize>; CACHE_WAYS] = const { [const { Cell::new(0) }; CACHE_WAYS] };
}

#[cfg(pcpu_loom)]
loom::thread_local! {
    static THREAD_ID: Cell<u64> = Cell::new(0);
    static CACHE: [Cell<usize>; CACHE_WAYS] = [Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0)];
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

    /// The calling thread's slot if its cache holds it (else
    /// [`claim`](Self::claim) it). Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn cached(&self) -> Option<&Slot> {
        let base = self.base;
        // SAFETY: `way` is below `CACHE_WAYS`.
        let cached = CACHE.with(|c| unsafe { c.get_unchecked(self.way) }.get());
        if cached.wrapping_sub(base) < TABLE_BYTES {
            // SAFETY: inside this domain's table: a slot of this thread
            // (see the module docs), valid as long as the table, forever;
            // so not null either (tables are mapped memory).
            return Some(unsafe { &*(cached as *const Slot) });
        }
        None
    }

    /// Claims the calling thread's slot (or finds it, if its cache entry
    /// was evicted) and caches it; `None` when every slot is taken by a
    /// live thread (count per CPU then). Async-signal-safe.
    pub(crate) fn claim(&self) -> Option<&Slot> {
        let slot = self.table.slot(self.table.claim(thread_id())?);
        // One store: a signal handler sees the old entry or the new one.
        CACHE.with(|c| c[self.way].set(core::ptr::from_ref(slot) as usize));
        Some(slot)
    }

    /// Slots handed out in the domain's table.
    pub(crate) fn handed_out(&self) -> usize {
        self.table.handed_out()
    }

    /// The sum of the slots' counts of sections ended on `bank` (read
    /// before the heavy fence, as the per-CPU unlock counts).
    pub(crate) fn unlocks(&self, bank: usize) -> u64 {
        self.sum(|slot| &slot.counts[UNLOCK + (bank & 1)])
    }

    /// The sum of the slots' counts of sections begun on `bank` (read
    /// after the heavy fence). Slots claimed since
    /// [`unlocks`](Self::unlocks) add locks without unlocks: an
    /// overestimate, never an underestimate.
    pub(crate) fn locks(&self, bank: usize) -> u64 {
        self.sum(|slot| &slot.counts[LOCK + (bank & 1)])
    }

    fn sum(&self, word: impl Fn(&Slot) -> &AtomicU64) -> u64 {
        (0..self.table.handed_out()).fold(0u64, |s, i| {
            s.wrapping_add(word(self.table.slot(i)).load(Ordering::Relaxed))
        })
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

/// The base address of a table without slots: no cached slot address
/// lies within `TABLE_BYTES` above it.
const NO_SLOTS_BASE: usize = usize::MAX.wrapping_sub(TABLE_BYTES - 1);

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
        let slots: &'static [Slot] = Box::leak((0..CAPACITY).map(|_| Slot::new()).collect());
        Self::leak(slots.as_ptr(), CAPACITY)
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
/// cost nothing).
#[cfg(not(pcpu_loom))]
fn reserve() -> Option<*const Slot> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is
    // affected.
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            TABLE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED && !p.is_null()).then_some(p.cast_const().cast())
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
    let cached: [usize; CACHE_WAYS] = CACHE.with(|c| core::array::from_fn(|w| c[w].get()));
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
