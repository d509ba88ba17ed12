//! Per-thread reader slots: where a domain counts the guard sections
//! ([`ReadGuard`](crate::ReadGuard), and so [`SrcuCell::read`](crate::SrcuCell::read))
//! of each thread.
//!
//! # Why per thread
//! A guard ends on the thread that began it, so its section can be
//! counted in a word only that thread writes: one nesting count per bank,
//! raised by a plain load and store at `read_lock` and lowered the same
//! way when the guard drops, with the light fence in between. No atomic
//! read-modify-write and no restartable sequence: the read side costs what
//! liburcu's does (a thread-local word and a compiler barrier), where two
//! per-CPU rseq adds cost about twice that.
//!
//! A plain load and store is enough against signal handlers too: a
//! handler that interrupts the owner between the two runs whole sections
//! (each raises and lowers a count), so the value the owner stores is
//! still right.
//!
//! Sections that may end on another thread (raw sections, leases) stay on
//! the per-CPU counts, whose lock and unlock counts only grow; a grace
//! period waits for both kinds.
//!
//! # Slots, claims and thread exit
//! Each domain reserves [`CAPACITY`] slots of one cache-line pair each
//! (virtual memory only; a page is touched when a slot on it is first
//! claimed). A thread claims a slot on its first guard section of the
//! domain and remembers it in a small thread-local cache (keyed by the
//! domain's unique id, so a dropped domain's entry never matches a new
//! domain). Claiming is a scan and a compare-and-swap, with no lock and
//! no allocation, so a first section in a signal handler is fine.
//!
//! There is no registration and nothing runs at thread exit (a
//! thread-local destructor cannot be registered from a signal handler).
//! Instead a slot records its owner's kernel thread id, and a thread that
//! finds no free slot takes over one whose owner has exited
//! (`tgkill(pid, tid, 0)` fails with `ESRCH`) and whose counts are zero.
//! A domain therefore holds about as many slots as threads that used it
//! at once. When all [`CAPACITY`] slots are taken by live threads, further
//! threads count their guard sections per CPU instead: correct, slower.
//!
//! # What a grace period pays
//! Checking a bank reads the per-CPU counts and then one word per claimed
//! slot (each on its own cache line): the cost grows with the number of
//! threads that used the domain, where the per-CPU scheme's grew with the
//! number of CPUs. The heavy fence before the slots are read pairs with
//! the reader's light fence after its store, exactly as for the per-CPU
//! lock counts (see the crate's *Memory ordering*).

use core::cell::Cell;
use core::sync::atomic::AtomicU64 as IdCounter;

use pcpu::unstable::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Slots per domain; threads beyond this many count per CPU instead.
#[cfg(not(pcpu_loom))]
pub(crate) const CAPACITY: usize = 1024;
/// Slots per domain in the loom models (small state space).
#[cfg(pcpu_loom)]
pub(crate) const CAPACITY: usize = 3;

/// Domains' cache entries per thread (a thread alternating between more
/// domains than this takes the claim path's scan for a cache miss).
const CACHE_WAYS: usize = 4;
/// Bits of a cache entry that hold the slot's byte offset in the table
/// (the rest: the domain id).
const OFFSET_BITS: u32 = 20;
const _: () = assert!(CAPACITY * core::mem::size_of::<Slot>() <= 1 << OFFSET_BITS);

/// One thread's guard sections in one domain.
#[repr(align(128))] // its own pair of cache lines (adjacent-line prefetch)
pub(crate) struct Slot {
    /// Guard sections open per bank.
    nest: [Nest; 2],
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
            nest: [Nest(AtomicU64::new(0)), Nest(AtomicU64::new(0))],
            owner: AtomicU64::new(0),
            tid: AtomicU64::new(0),
        }
    }

    /// The count of guard sections open on `bank`.
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn nest(&self, bank: usize) -> &Nest {
        &self.nest[bank & 1]
    }

    fn idle(&self) -> bool {
        self.nest[0].get() == 0 && self.nest[1].get() == 0
    }
}

/// Guard sections of one thread open on one bank. Written by the owner
/// only (and by its signal handlers, whose sections are balanced), read
/// by grace periods.
pub(crate) struct Nest(AtomicU64);

impl Nest {
    /// Counts a section begun (owner only). Async-signal-safe.
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn enter(&self) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
    }

    /// Counts a section ended (owner only). Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn leave(&self) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_sub(1),
            Ordering::Relaxed,
        );
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    #[cfg(not(pcpu_loom))]
    fn clear(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// A domain's slots.
pub(crate) struct Readers {
    /// The domain's unique id (never reused) `<< OFFSET_BITS`: a cache
    /// entry of this domain is `key | byte offset of the slot`.
    key: u64,
    slots: SlotTable,
    /// Slots handed out so far: grace periods read `slots[..used]`.
    used: AtomicUsize,
}

/// Domain ids, from 1 (0 marks an empty cache entry).
static NEXT_DOMAIN_ID: IdCounter = IdCounter::new(1);
/// Thread ids (never reused, unlike kernel thread ids), from 1.
static NEXT_THREAD_ID: IdCounter = IdCounter::new(1);

#[cfg(not(pcpu_loom))]
std::thread_local! {
    /// This thread's id (0: none yet). Const-initialised without a
    /// destructor, like the cache: usable from signal handlers.
    static THREAD_ID: Cell<u64> = const { Cell::new(0) };
    /// `domain id << OFFSET_BITS | byte offset of the slot` per way (way:
    /// the domain id's low bits); 0: empty.
    static CACHE: [Cell<u64>; CACHE_WAYS] = const { [const { Cell::new(0) }; CACHE_WAYS] };
}

#[cfg(pcpu_loom)]
loom::thread_local! {
    static THREAD_ID: Cell<u64> = Cell::new(0);
    static CACHE: [Cell<u64>; CACHE_WAYS] = [Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0)];
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
    /// A domain's slots; none if not `enabled` (every guard section is
    /// then counted per CPU).
    pub(crate) fn new(enabled: bool) -> Self {
        let id = NEXT_DOMAIN_ID.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        Self {
            key: id << OFFSET_BITS,
            slots: if enabled {
                SlotTable::new()
            } else {
                SlotTable::empty()
            },
            used: AtomicUsize::new(0),
        }
    }

    /// The calling thread's slot: the cached one, else claimed now; `None`
    /// when every slot is taken by a live thread (count per CPU then).
    /// Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn mine(&self) -> Option<&Slot> {
        let offset = CACHE.with(|c| c[self.way()].get()) ^ self.key;
        if offset < 1 << OFFSET_BITS {
            // SAFETY: the entry is this domain's (its key matched), and
            // holds the offset of a slot `claim` returned.
            return Some(unsafe { self.slots.at_offset(offset as usize) });
        }
        self.claim_and_cache()
    }

    /// This domain's way in each thread's cache: the id's low bits.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn way(&self) -> usize {
        (self.key >> OFFSET_BITS) as usize % CACHE_WAYS
    }

    #[cold]
    #[inline(never)]
    fn claim_and_cache(&self) -> Option<&Slot> {
        let index = self.claim(thread_id())?;
        let offset = (index * core::mem::size_of::<Slot>()) as u64;
        // One store: a signal handler sees the old entry or the new one.
        CACHE.with(|c| c[self.way()].set(self.key | offset));
        self.slots.get(index)
    }

    /// Finds the slot `me` owns (its cache entry was evicted), or claims a
    /// free one, one of an exited thread, or a fresh one.
    fn claim(&self, me: u64) -> Option<usize> {
        let used = || self.used.load(Ordering::Acquire).min(self.slots.len());
        if let Some(i) = (0..used()).find(|&i| self.slot(i).owner.load(Ordering::Relaxed) == me) {
            return Some(i);
        }
        let tid = current_tid();
        loop {
            let taken = (0..used())
                .find(|&i| self.take(i, 0, me))
                .or_else(|| (0..used()).find(|&i| self.take_from_exited(i, me)));
            if let Some(i) = taken {
                self.slot(i).tid.store(tid, Ordering::Relaxed);
                return Some(i);
            }
            let fresh = self
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                    (u < self.slots.len()).then_some(u + 1)
                })
                .ok()?;
            if self.take(fresh, 0, me) {
                self.slot(fresh).tid.store(tid, Ordering::Relaxed);
                return Some(fresh);
            }
            // Another thread's scan took the fresh slot first: look again.
        }
    }

    fn take(&self, i: usize, from: u64, me: u64) -> bool {
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
        slot.idle() && self.take(i, owner, me)
    }

    fn slot(&self, i: usize) -> &Slot {
        self.slots.get(i).expect("slot index below the capacity")
    }

    /// Slots handed out so far.
    pub(crate) fn handed_out(&self) -> usize {
        self.used.load(Ordering::Relaxed).min(self.slots.len())
    }

    /// Whether no thread has a guard section open on `bank` (read after
    /// the heavy fence of the caller).
    pub(crate) fn idle(&self, bank: usize) -> bool {
        let used = self.used.load(Ordering::Acquire).min(self.slots.len());
        (0..used).all(|i| self.slot(i).nest(bank).get() == 0)
    }

    /// In a fork child (only the forking thread, `me`, exists): frees the
    /// slots of every other thread, with their sections (they cannot end
    /// here), and records the forking thread's new kernel thread id in its
    /// own.
    #[cfg(not(pcpu_loom))]
    pub(crate) fn after_fork(&self, me: u64) {
        let tid = current_tid();
        for i in 0..self.used.load(Ordering::Relaxed).min(self.slots.len()) {
            let slot = self.slot(i);
            if slot.owner.load(Ordering::Relaxed) == me {
                slot.tid.store(tid, Ordering::Relaxed);
            } else {
                slot.nest[0].clear();
                slot.nest[1].clear();
                slot.tid.store(0, Ordering::Relaxed);
                slot.owner.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// The calling thread's id for [`Readers::after_fork`] (0 if it never
/// claimed a slot).
#[cfg(not(pcpu_loom))]
pub(crate) fn current_thread_id() -> u64 {
    THREAD_ID.with(Cell::get)
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

/// [`CAPACITY`] slots in zeroed memory: reserved with `mmap`, so untouched
/// pages cost no memory. If the reservation fails the table is empty and
/// every thread counts per CPU.
#[cfg(not(pcpu_loom))]
struct SlotTable {
    base: core::ptr::NonNull<Slot>,
    len: usize,
}

// SAFETY: the table only hands out `&Slot`, whose fields are atomics.
#[cfg(not(pcpu_loom))]
unsafe impl Send for SlotTable {}
// SAFETY: as above.
#[cfg(not(pcpu_loom))]
unsafe impl Sync for SlotTable {}

#[cfg(not(pcpu_loom))]
impl SlotTable {
    const BYTES: usize = CAPACITY * core::mem::size_of::<Slot>();

    fn new() -> Self {
        // SAFETY: a fresh private anonymous mapping; no existing memory
        // is affected.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                Self::BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        match core::ptr::NonNull::new(p.cast::<Slot>()) {
            Some(base) if p != libc::MAP_FAILED => Self {
                base,
                len: CAPACITY,
            },
            _ => Self::empty(),
        }
    }

    fn empty() -> Self {
        Self {
            base: core::ptr::NonNull::dangling(),
            len: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, i: usize) -> Option<&Slot> {
        // SAFETY: the offset of slot `i < len`.
        (i < self.len).then(|| unsafe { self.at_offset(i * core::mem::size_of::<Slot>()) })
    }

    /// The slot at byte offset `offset`.
    ///
    /// # Safety
    /// `offset` is a multiple of the slot size below `len` slots.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn at_offset(&self, offset: usize) -> &Slot {
        debug_assert!(offset < self.len * core::mem::size_of::<Slot>());
        // SAFETY: a slot inside the mapping (the caller's promise), which
        // is zero-filled (a zeroed `Slot` is a valid one: all its fields
        // are atomics) and lives as long as `self`.
        unsafe { &*self.base.as_ptr().byte_add(offset) }
    }
}

#[cfg(not(pcpu_loom))]
impl Drop for SlotTable {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: our mapping; the domain is gone, so no slot is used.
            unsafe { libc::munmap(self.base.as_ptr().cast(), Self::BYTES) };
        }
    }
}

/// loom: a boxed slice (loom's atomics cannot be zero-filled).
#[cfg(pcpu_loom)]
struct SlotTable(Box<[Slot]>);

#[cfg(pcpu_loom)]
impl SlotTable {
    fn new() -> Self {
        Self((0..CAPACITY).map(|_| Slot::new()).collect())
    }

    fn empty() -> Self {
        Self(Box::new([]))
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, i: usize) -> Option<&Slot> {
        self.0.get(i)
    }

    unsafe fn at_offset(&self, offset: usize) -> &Slot {
        &self.0[offset / core::mem::size_of::<Slot>()]
    }
}
