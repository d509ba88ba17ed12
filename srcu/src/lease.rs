//! Leases: read-side holds on one object that expire into a reference.
//!
//! The kernel's "hprobe" (uprobes, 6.12): a pending uretprobe holds an SRCU
//! read section on its uprobe instead of a reference count, because
//! incrementing one shared count per hit was the scalability wall. User
//! code decides how long a function runs, so such a section could stall
//! grace periods forever; a timer therefore *expires* old leases, turning
//! the section into a real reference.
//!
//! # States and races
//!
//! | state | holds | entered by |
//! |---|---|---|
//! | `LEASED` | an SRCU read section of the domain | [`LeaseBlock::lease`] |
//! | `STABLE` | one strong reference (the section was ended) | expiry, if the value was not retired |
//! | `GONE` | nothing (the value was retired before expiry) | expiry |
//! | `CONSUMED` | nothing: the holder took over what there was | [`Lease::consume`] |
//!
//! Expiry and consumption race on one word: expiry moves `LEASED` to
//! `STABLE`/`GONE` with a compare-and-swap, consumption swaps in
//! `CONSUMED`. Exactly one of them sees `LEASED`, and that one ends the
//! SRCU section, so it is ended exactly once whatever the interleaving.
//! The swap is only needed while an expiry round runs: a consumer first
//! sets its slot's claim flag and, after a light fence, checks whether a
//! round is in progress; a round announces itself and issues a heavy fence
//! before looking at slots, and skips claimed ones. So either the consumer
//! sees the round (and swaps), or the round sees the claim (and keeps
//! off), and the common case costs plain stores and a compiler fence. An
//! expiry that loses gives back the reference it took. The expiry's "take
//! a reference unless retired" runs inside its own read section, and
//! values leave an [`SrcuCell`](crate::SrcuCell) only after two grace
//! periods, so the value it looks at cannot be freed under it.
//!
//! Each state word carries a generation, so an expiry that read a slot just
//! before its owner reused it fails its compare-and-swap instead of acting
//! on the new lease.
//!
//! # Slots
//!
//! Leases live in preallocated per-thread [`LeaseBlock`]s (taking and
//! consuming a lease never allocates, never takes a lock and, outside
//! expiry rounds, issues no atomic read-modify-write), which are registered with the [`LeaseSet`] so that its
//! expiry thread can find them.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering};

use crate::Srcu;
use crate::cell::{Node, SrcuCell, Strong};
use crate::domain::Inner;

const FREE: u64 = 0;
const LEASED: u64 = 1;
const STABLE: u64 = 2;
const GONE: u64 = 3;
const CONSUMED: u64 = 4;

/// The kernel's lease timeout (uprobes: `RI_TIMER_PERIOD`, 100 ms).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

/// Ticks a parked expiry thread waits with nothing to do before it ends.
#[cfg_attr(pcpu_loom, allow(dead_code))]
const PARKED_IDLE_TICKS: u32 = 8;

/// How many expiry ticks make one timeout: a lease expires between
/// `timeout` and `timeout * (1 + 1/TICKS)` after it was taken.
#[cfg_attr(pcpu_loom, allow(dead_code))]
const TICKS: u64 = 4;

fn word(generation: u64, state: u64) -> u64 {
    generation << 8 | state
}

fn state_of(w: u64) -> u64 {
    w & 0xff
}

/// One lease slot. The owner thread writes `node`, `bank` and `tick`, then
/// publishes with `word` (Release); expiry reads `word` (Acquire) first.
struct Slot<T> {
    word: AtomicU64,
    node: AtomicPtr<Node<T>>,
    bank: AtomicU8,
    tick: AtomicU64,
    /// Set by the owner when it starts consuming (see `Lease::take`),
    /// cleared when the slot is leased again (`LeaseBlock::lease`).
    claimed: AtomicU8,
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self {
            word: AtomicU64::new(word(0, FREE)),
            node: AtomicPtr::new(core::ptr::null_mut()),
            bank: AtomicU8::new(0),
            tick: AtomicU64::new(0),
            claimed: AtomicU8::new(0),
        }
    }
}

type Slots<T> = Box<[CachePadded<Slot<T>>]>;

/// State shared by a lease set, its blocks and its expiry thread.
struct Shared<T> {
    domain: Arc<Inner>,
    /// Expiry ticks so far (the expiry thread advances it every
    /// `timeout / TICKS`); leases record it instead of reading a clock.
    tick: CachePadded<AtomicU64>,
    blocks: Mutex<Vec<Arc<Slots<T>>>>,
    /// `expire`'s copy of `blocks`, reused round after round.
    expiry_scratch: Mutex<Vec<Arc<Slots<T>>>>,
    /// Expiry rounds in progress. A consumer that sees none takes the
    /// fence-free path (see `Lease::take`).
    expiring: CachePadded<AtomicU64>,
    expired: AtomicU64,
    /// Strong references handed over by `drop_later`, dropped by the
    /// expiry thread (`deferred_drop`).
    owing: AtomicPtr<Node<T>>,
    /// The expiry thread's control (stop flag, its handle), and its wake-up.
    ctl: (Mutex<Ctl>, Condvar),
    /// Time between expiry ticks (`timeout / TICKS`).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    period: Duration,
}

/// Whether the set is being dropped, whether its expiry thread may end
/// once no lease is held ([`LeaseSet::park_expiry`]), and the thread with
/// the fork generation it was started in (a fork child starts its own).
#[derive(Default)]
struct Ctl {
    stopped: bool,
    parked: bool,
    thread: Option<(u64, JoinHandle<()>)>,
}

/// Starts the expiry thread of `shared`.
#[cfg(not(pcpu_loom))]
fn spawn_expiry<T: Send + Sync + 'static>(
    shared: &Arc<Shared<T>>,
) -> std::io::Result<JoinHandle<()>> {
    let s = Arc::clone(shared);
    std::thread::Builder::new()
        .name("srcu-lease-expiry".into())
        .spawn(move || expiry_loop(&s, s.period))
}

impl<T: Send + Sync + 'static> crate::fork::ForkHooks for Shared<T> {
    fn lock_for_fork(self: Arc<Self>, held: &mut Vec<Box<dyn crate::fork::HeldLock>>) {
        // In the order the expiry thread nests them (`expire` holds the
        // scratch buffer, then takes `blocks`). The scratch is held for a
        // whole expiry round: a child that inherited it locked would hang
        // in `expire_in_child`.
        // SAFETY: the three mutexes are fields of `self`.
        unsafe {
            crate::fork::hold(&self, &self.ctl.0, held);
            crate::fork::hold(&self, &self.expiry_scratch, held);
            crate::fork::hold(&self, &self.blocks, held);
        }
    }

    fn expire_in_child(&self) {
        // A round of the parent's expiry thread may have been running: it
        // is over (that thread does not exist here).
        self.expiring.store(0, Ordering::Relaxed);
        self.expire(0);
    }

    fn restart(self: Arc<Self>) {
        #[cfg(not(pcpu_loom))]
        {
            let mut ctl = self.ctl.0.lock().unwrap_or_else(PoisonError::into_inner);
            let generation = crate::fork::generation();
            if ctl.stopped
                || ctl.parked
                || ctl.thread.as_ref().is_some_and(|(g, _)| *g == generation)
            {
                return;
            }
            if let Some((_, inherited)) = ctl.thread.take() {
                // The parent's thread: not ours to join or detach.
                core::mem::forget(inherited);
            }
            // A child that cannot start the thread keeps its leases until
            // they are consumed (nothing expires them: grace periods wait
            // for them, as for plain read sections).
            ctl.thread = spawn_expiry(&self).ok().map(|t| (generation, t));
        }
    }
}

impl<T> Shared<T> {
    /// Expires the leases of every block whose age is at least `min_age`
    /// ticks; returns how many it expired.
    fn expire(&self, min_age: u64) -> u64 {
        let now = self.tick.load(Ordering::Relaxed);
        // The blocks, copied into a buffer kept across rounds: an expiry
        // tick allocates nothing (a program tracing `malloc` sees no call
        // of ours), and `blocks` is not held across the heavy fence.
        let mut blocks = self
            .expiry_scratch
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        blocks.clear();
        blocks.extend(
            self.blocks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .cloned(),
        );
        // Our own read section: a value we look at cannot be freed while
        // we hold it (see the module docs).
        let bank = self.domain.read_lock();
        // Announce the round, then the heavy fence: a consumer either sees
        // the announcement (and arbitrates with a swap) or its claim is
        // visible to us (and we leave the slot alone).
        self.expiring.fetch_add(1, Ordering::Relaxed);
        pcpu::fence::heavy();
        let mut n = 0;
        for slots in blocks.iter() {
            for slot in slots.iter() {
                n += u64::from(self.expire_slot(slot, now, min_age));
            }
        }
        // The references go now, the buffer stays.
        blocks.clear();
        // Release: a consumer that reads the end of the round sees our CASes.
        self.expiring.fetch_sub(1, Ordering::Release);
        self.domain.read_unlock(bank);
        self.expired.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// Whether some slot holds a lease not consumed yet (a read section,
    /// or the reference it expired into: its release hands that to the
    /// expiry thread).
    fn any_held(&self) -> bool {
        self.blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|slots| {
                slots.iter().any(|slot| {
                    matches!(
                        state_of(slot.word.load(Ordering::Acquire)),
                        LEASED | STABLE | GONE
                    )
                })
            })
    }

    fn expire_slot(&self, slot: &Slot<T>, now: u64, min_age: u64) -> bool {
        let w = slot.word.load(Ordering::Acquire);
        if state_of(w) != LEASED
            || slot.claimed.load(Ordering::Relaxed) != 0
            || now.wrapping_sub(slot.tick.load(Ordering::Relaxed)) < min_age
        {
            return false;
        }
        let node = slot.node.load(Ordering::Relaxed);
        let bank = slot.bank.load(Ordering::Relaxed);
        // SAFETY: our read section plus the two-grace-period retirement
        // keep `node` allocated (module docs), even if the slot has been
        // consumed or reused since we read `w`.
        let retired = unsafe { (*node).retired.load(Ordering::Acquire) };
        let next = if retired {
            GONE
        } else {
            // SAFETY: as above; the cell's own count keeps the strong
            // count above zero until its deferred drop, which waits for us.
            unsafe { Arc::increment_strong_count(node) };
            STABLE
        };
        let generation = w >> 8;
        if slot
            .word
            .compare_exchange(
                w,
                word(generation, next),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            // We won: the lease's section is ours to end.
            self.domain.read_unlock(usize::from(bank));
            true
        } else {
            if next == STABLE {
                // The owner consumed (or reused) the slot first.
                // SAFETY: we took this count just above.
                unsafe { Arc::decrement_strong_count(node) };
            }
            false
        }
    }
}

/// The leases of one SRCU domain over values of [`SrcuCell<T>`]s, with an
/// expiry thread that converts leases older than the timeout into strong
/// references, so [`Srcu::synchronize`] never waits on a lease for longer
/// than about `timeout * 1.25`.
///
/// ```
/// static DOMAIN: srcu::Srcu = srcu::Srcu::new();
/// let cell = srcu::SrcuCell::new(&DOMAIN, Some(42u32));
/// let set = srcu::LeaseSet::new(&DOMAIN);
/// let block = set.block(4);
///
/// let lease = block.lease(&cell).unwrap();   // an SRCU read section
/// // ... a long time may pass (the function runs) ...
/// DOMAIN.synchronize();                      // returns within ~100 ms: the lease expires
/// assert_eq!(lease.consume().as_deref(), Some(&42));
/// ```
pub struct LeaseSet<'d, T: Send + Sync + 'static> {
    shared: Arc<Shared<T>>,
    timeout: Duration,
    /// The set must not outlive its domain: leases point at values of the
    /// domain's cells.
    srcu: &'d Srcu,
}

impl<'d, T: Send + Sync + 'static> LeaseSet<'d, T> {
    /// A lease set of `srcu` with the kernel's timeout (100 ms). Starts the
    /// expiry thread. Not async-signal-safe.
    ///
    /// # Panics
    /// If the expiry thread cannot be started; [`try_new`](Self::try_new)
    /// returns the error instead.
    #[must_use]
    pub fn new(srcu: &'d Srcu) -> Self {
        Self::with_timeout(srcu, DEFAULT_TIMEOUT)
    }

    /// Like [`new`](Self::new), or the error of starting the expiry thread
    /// (the process is out of threads or memory).
    pub fn try_new(srcu: &'d Srcu) -> std::io::Result<Self> {
        Self::try_with_timeout(srcu, DEFAULT_TIMEOUT)
    }

    /// Like [`new`](Self::new) with another timeout.
    ///
    /// # Panics
    /// If `timeout` is zero, or the expiry thread cannot be started
    /// ([`try_with_timeout`](Self::try_with_timeout) returns that error).
    #[must_use]
    pub fn with_timeout(srcu: &'d Srcu, timeout: Duration) -> Self {
        match Self::try_with_timeout(srcu, timeout) {
            Ok(set) => set,
            Err(e) => panic!("srcu: cannot start the lease expiry thread: {e}"),
        }
    }

    /// Like [`with_timeout`](Self::with_timeout), or the error of starting
    /// the expiry thread.
    ///
    /// # Panics
    /// If `timeout` is zero.
    pub fn try_with_timeout(srcu: &'d Srcu, timeout: Duration) -> std::io::Result<Self> {
        assert!(!timeout.is_zero(), "lease timeout must be positive");
        let shared = Arc::new(Shared {
            domain: srcu.inner_arc(),
            tick: CachePadded::new(AtomicU64::new(0)),
            blocks: Mutex::new(Vec::new()),
            expiry_scratch: Mutex::new(Vec::new()),
            expiring: CachePadded::new(AtomicU64::new(0)),
            expired: AtomicU64::new(0),
            owing: AtomicPtr::new(core::ptr::null_mut()),
            ctl: (Mutex::new(Ctl::default()), Condvar::new()),
            period: timeout / TICKS as u32,
        });
        // A fork child restarts the thread on first use (its threads
        // started before the fork are the parent's).
        srcu.revive();
        {
            let hooks: Arc<dyn crate::fork::ForkHooks> = shared.clone();
            shared.domain.lease_sets.add(&hooks);
        }
        // loom cannot model a real thread: models call `expire_all`.
        #[cfg(not(pcpu_loom))]
        {
            let handle = spawn_expiry(&shared)?;
            shared
                .ctl
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .thread = Some((crate::fork::generation(), handle));
        }
        Ok(Self {
            shared,
            timeout,
            srcu,
        })
    }

    /// The timeout after which leases expire.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A block of `capacity` lease slots for one thread (e.g. one per
    /// thread in a thread-local). Not async-signal-safe (allocates, locks).
    ///
    /// # Panics
    /// If `capacity` is not in `1..=64`.
    #[must_use]
    pub fn block(&self, capacity: usize) -> LeaseBlock<'_, 'd, T> {
        assert!(
            (1..=64).contains(&capacity),
            "a lease block holds 1 to 64 slots, not {capacity}"
        );
        self.srcu.revive();
        let slots: Arc<Slots<T>> =
            Arc::new((0..capacity).map(|_| CachePadded::default()).collect());
        self.shared
            .blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&slots));
        LeaseBlock {
            set: self,
            srcu: self.srcu,
            shared: &self.shared,
            domain: &self.shared.domain,
            slots,
            free: Cell::new(u64::MAX >> (64 - capacity)),
            _not_sync: PhantomData,
        }
    }

    /// Expires every lease now, whatever its age, and returns how many.
    /// For a child after `fork()` (the parent's expiry thread does not
    /// exist there, and the kernel too expires a child's leases at fork),
    /// and for shutting down. Not async-signal-safe.
    #[allow(clippy::must_use_candidate)] // the count is informational
    pub fn expire_all(&self) -> u64 {
        self.srcu.revive();
        let n = self.shared.expire(0);
        self.drop_deferred();
        n
    }

    /// Hands `strong` to the expiry thread, which drops it at its next
    /// tick (at most `timeout / 4` later), instead of dropping it here.
    /// For a signal handler that consumed a lease which had expired into a
    /// reference ([`Held::Stable`]): dropping that reference may free the
    /// value. Lock-free, no allocation: **async-signal-safe**.
    pub fn drop_later(&self, strong: Strong<T>) {
        crate::deferred_drop::push(&self.shared.owing, strong.0);
    }

    /// Ends what a consumed lease handed over without freeing anything
    /// here: a read section ends at once, a strong reference goes to
    /// [`drop_later`](Self::drop_later). **Async-signal-safe.**
    pub fn release(&self, held: Held<'_, T>) {
        match held {
            Held::Leased(value) => drop(value),
            Held::Stable(strong) => self.drop_later(strong),
        }
    }

    /// Drops the references handed to [`drop_later`](Self::drop_later)
    /// so far, now, and returns how many (the expiry thread does this
    /// every tick). Not async-signal-safe.
    #[allow(clippy::must_use_candidate)] // the count is informational
    pub fn drop_deferred(&self) -> usize {
        crate::deferred_drop::drain(&self.shared.owing)
    }

    /// Lets the expiry thread end once no lease is held (nor the reference
    /// an expired one became) and nothing is left to drop, for two
    /// timeouts in a row: for a program done taking leases for a while (a
    /// tracer that detached its return probes), so that no thread of the
    /// set stays behind. A lease taken while parked is not expired (a
    /// grace period waits for it like for a read section) until
    /// [`resume_expiry`](Self::resume_expiry). Not async-signal-safe.
    pub fn park_expiry(&self) {
        let (ctl, cv) = &self.shared.ctl;
        ctl.lock().unwrap_or_else(PoisonError::into_inner).parked = true;
        cv.notify_all();
    }

    /// Undoes [`park_expiry`](Self::park_expiry): the expiry thread runs
    /// again (started anew if it ended). Not async-signal-safe.
    ///
    /// # Errors
    /// The error of starting the thread (the process is out of threads or
    /// memory); the set stays parked then.
    pub fn resume_expiry(&self) -> std::io::Result<()> {
        // What was handed over while no thread ran goes now.
        self.drop_deferred();
        let mut ctl = self
            .shared
            .ctl
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !ctl.parked {
            return Ok(());
        }
        #[cfg(not(pcpu_loom))]
        {
            let generation = crate::fork::generation();
            if ctl.stopped || ctl.thread.as_ref().is_some_and(|(g, _)| *g == generation) {
                ctl.parked = false;
                return Ok(());
            }
            if let Some((_, inherited)) = ctl.thread.take() {
                // A parent's thread (we are a fork child): not ours.
                core::mem::forget(inherited);
            }
            ctl.thread = Some((generation, spawn_expiry(&self.shared)?));
        }
        ctl.parked = false;
        Ok(())
    }

    /// Whether the expiry thread runs now (it may have ended, parked).
    #[must_use]
    pub fn expiry_running(&self) -> bool {
        self.shared
            .ctl
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .thread
            .is_some()
    }

    /// How many leases have been expired so far.
    #[must_use]
    pub fn expired(&self) -> u64 {
        self.shared.expired.load(Ordering::Relaxed)
    }
}

impl<T: Send + Sync + 'static> Drop for LeaseSet<'_, T> {
    fn drop(&mut self) {
        let (ctl, cv) = &self.shared.ctl;
        let thread = {
            let mut ctl = ctl.lock().unwrap_or_else(PoisonError::into_inner);
            ctl.stopped = true;
            ctl.thread.take()
        };
        cv.notify_all();
        if let Some((generation, t)) = thread {
            #[cfg(not(pcpu_loom))]
            if generation == crate::fork::generation() {
                let _ = t.join();
            } else {
                // Started before a fork: that thread is not in this process.
                core::mem::forget(t);
            }
            #[cfg(pcpu_loom)]
            let _ = (generation, t);
        }
        self.drop_deferred();
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for LeaseSet<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseSet")
            .field("timeout", &self.timeout)
            .field("expired", &self.expired())
            .finish_non_exhaustive()
    }
}

#[cfg(not(pcpu_loom))]
fn expiry_loop<T>(shared: &Shared<T>, period: Duration) {
    crate::service::started();
    let (ctl, cv) = &shared.ctl;
    let mut guard = ctl.lock().unwrap_or_else(PoisonError::into_inner);
    // Parked: consecutive ticks with nothing held and nothing to drop.
    let mut idle = 0;
    loop {
        guard = cv
            .wait_timeout(guard, period)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
        if guard.stopped {
            return;
        }
        shared.tick.fetch_add(1, Ordering::Relaxed);
        drop(guard);
        shared.expire(TICKS);
        let dropped = crate::deferred_drop::drain(&shared.owing);
        guard = ctl.lock().unwrap_or_else(PoisonError::into_inner);
        // Parked, and for a while nothing held and nothing handed over to
        // drop (a lease consumed just now hands its reference over right
        // after): this thread ends (its handle is dropped, detaching it);
        // `resume_expiry` starts another.
        idle = if guard.parked && dropped == 0 && !shared.any_held() {
            idle + 1
        } else {
            0
        };
        if idle >= PARKED_IDLE_TICKS {
            drop(guard.thread.take());
            return;
        }
    }
}

/// Why no lease was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    /// Every slot of the block holds a lease (capacity is at most 64).
    BlockFull,
    /// The cell holds no value.
    Empty,
}

impl std::fmt::Display for LeaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::BlockFull => "every lease slot of this block is in use",
            Self::Empty => "the cell holds no value to lease",
        })
    }
}

impl std::error::Error for LeaseError {}

/// One thread's lease slots (at most 64). Not `Sync`: the owner thread
/// takes and consumes its leases; only the expiry thread looks at the
/// slots concurrently, through atomics. Dropping the block ends every
/// lease still in it (a thread that exits with leases pending releases
/// them).
pub struct LeaseBlock<'s, 'd, T: Send + Sync + 'static> {
    set: &'s LeaseSet<'d, T>,
    /// What taking and consuming a lease read, one load away (not
    /// through the set, its shared state and the domain in turn: on a
    /// probe hit each step is a load the next one waits for).
    srcu: &'d Srcu,
    shared: &'s Shared<T>,
    domain: &'s Inner,
    slots: Arc<Slots<T>>,
    /// Bit `i` set: slot `i` is free (owner-local bookkeeping).
    free: Cell<u64>,
    _not_sync: PhantomData<Cell<()>>,
}

impl<'s, 'd, T: Send + Sync + 'static> LeaseBlock<'s, 'd, T> {
    /// Takes a lease on the value `cell` holds now: an SRCU read section
    /// of the cell's domain and a few plain stores, no atomic
    /// read-modify-write. **Async-signal-safe** (interrupting the owner
    /// between its own block operations is fine only if the handler uses a
    /// different block).
    ///
    /// # Panics
    /// If `cell` belongs to another domain than the set.
    pub fn lease(&self, cell: &SrcuCell<'_, T>) -> Result<Lease<'_, 's, 'd, T>, LeaseError> {
        let shared = self.shared;
        // The same `Srcu`, the same state: a domain's state is made once
        // and kept until it is dropped.
        assert!(
            core::ptr::eq(cell.domain(), self.srcu),
            "cell of another SRCU domain than the lease set"
        );
        let free = self.free.get();
        if free == 0 {
            return Err(LeaseError::BlockFull);
        }
        let index = free.trailing_zeros() as usize;
        let bank = self.domain.read_lock();
        let Some(node) = cell.node_ptr() else {
            self.domain.read_unlock(bank);
            return Err(LeaseError::Empty);
        };
        self.free.set(free & !(1 << index));
        let slot = &self.slots[index];
        let generation = slot.word.load(Ordering::Relaxed) >> 8;
        // The previous lease of this slot was claimed by its consumer: the
        // new one is unclaimed. Published with the word (Release), so an
        // expiry that reads the new generation also reads this reset, and
        // a claim on the old lease can never make the new one unexpirable.
        slot.claimed.store(0, Ordering::Relaxed);
        slot.node.store(node.cast_mut(), Ordering::Relaxed);
        slot.bank.store(bank as u8, Ordering::Relaxed);
        slot.tick
            .store(shared.tick.load(Ordering::Relaxed), Ordering::Relaxed);
        slot.word.store(word(generation, LEASED), Ordering::Release);
        Ok(Lease {
            block: self,
            index,
            generation,
        })
    }

    /// Turns a [`RawLease`] of this block back into its lease.
    ///
    /// # Safety
    /// `raw` came from [`Lease::into_raw`] on a lease of **this** block,
    /// and each `RawLease` is turned back at most once (it is not `Clone`,
    /// so passing it by value ensures that). Async-signal-safe.
    #[allow(clippy::needless_pass_by_value)] // by value: used once
    pub unsafe fn from_raw(&self, raw: RawLease) -> Lease<'_, 's, 'd, T> {
        let RawLease { index, generation } = raw;
        debug_assert!(index < self.slots.len());
        Lease {
            block: self,
            index,
            generation,
        }
    }

    /// How many leases this block holds now.
    #[must_use]
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.get().count_ones() as usize
    }
}

impl<T: Send + Sync + 'static> Drop for LeaseBlock<'_, '_, T> {
    fn drop(&mut self) {
        // Leases borrow the block, so none is alive here; unregister.
        let mut blocks = self
            .set
            .shared
            .blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        blocks.retain(|b| !Arc::ptr_eq(b, &self.slots));
    }
}

/// A lease on one value: an SRCU read section that the expiry thread may
/// turn into a strong reference. [`consume`](Self::consume) it (or drop it)
/// exactly once.
#[must_use = "a lease holds a read section (or a reference) until consumed or dropped"]
pub struct Lease<'b, 's, 'd, T: Send + Sync + 'static> {
    block: &'b LeaseBlock<'s, 'd, T>,
    index: usize,
    generation: u64,
}

/// A lease without the borrow of its block: for storing a lease in a data
/// structure next to the block it belongs to (a return-instance stack, say).
/// Made by [`Lease::into_raw`], turned back by [`LeaseBlock::from_raw`].
/// Forgetting one leaks what the lease holds (its read section, until the
/// expiry turns it into a reference that is never dropped).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a raw lease still holds a read section (or a reference)"]
pub struct RawLease {
    index: usize,
    generation: u64,
}

impl<'b, T: Send + Sync + 'static> Lease<'b, '_, '_, T> {
    /// Forgets the borrow of the block, keeping the lease (see
    /// [`RawLease`]). Async-signal-safe.
    pub fn into_raw(self) -> RawLease {
        let this = core::mem::ManuallyDrop::new(self);
        RawLease {
            index: this.index,
            generation: this.generation,
        }
    }

    /// Ends the lease and hands over what it holds: the value under the
    /// lease's read section (`LEASED`), under a strong reference
    /// (`STABLE`), or nothing if the value was retired before the lease
    /// expired (`GONE`). Plain stores and a compiler fence (an atomic swap
    /// while an expiry round runs). **Async-signal-safe**, except
    /// that dropping a [`Held::Stable`] may free the value.
    #[must_use = "dropping what a lease hands over ends it at once"]
    pub fn consume(self) -> Option<Held<'b, T>> {
        let this = core::mem::ManuallyDrop::new(self);
        this.take()
    }

    fn take(&self) -> Option<Held<'b, T>> {
        let block = self.block;
        let slot = &block.slots[self.index];
        let node = slot.node.load(Ordering::Relaxed);
        let bank = slot.bank.load(Ordering::Relaxed);
        let shared = block.shared;
        // Claim, light fence, look for an expiry round (pairs with the
        // round's announcement and heavy fence). No round: no expiry can
        // touch the slot before we are done, and every earlier round's
        // outcome is visible through `expiring`'s Acquire, so plain
        // accesses do. A round in progress: arbitrate with a swap against
        // its compare-and-swap.
        slot.claimed.store(1, Ordering::Relaxed);
        pcpu::fence::light();
        let prev = if shared.expiring.load(Ordering::Acquire) == 0 {
            let prev = slot.word.load(Ordering::Acquire);
            slot.word
                .store(word(self.generation, CONSUMED), Ordering::Relaxed);
            prev
        } else {
            slot.word
                .swap(word(self.generation, CONSUMED), Ordering::AcqRel)
        };
        // Free the slot for reuse under a new generation.
        slot.word
            .store(word(self.generation + 1, FREE), Ordering::Release);
        block.free.set(block.free.get() | 1 << self.index);
        let node = NonNull::new(node)?;
        match state_of(prev) {
            LEASED => Some(Held::Leased({
                // A guard section of this thread from now on (see
                // `fork::SECTIONS_HELD`; `LeasedValue` is not `Send`).
                crate::fork::held_add(1);
                LeasedValue {
                    domain: block.domain,
                    bank: usize::from(bank),
                    node,
                }
            })),
            // SAFETY: the expiry took one strong count for this lease and
            // handed it over by moving to STABLE; we own it now.
            STABLE => Some(Held::Stable(Strong(unsafe {
                Arc::from_raw(node.as_ptr().cast_const())
            }))),
            _ => None,
        }
    }

    /// Whether the lease has been expired into a reference or found gone
    /// (a snapshot, for diagnostics and tests).
    #[must_use]
    pub fn is_expired(&self) -> bool {
        matches!(
            state_of(self.block.slots[self.index].word.load(Ordering::Acquire)),
            STABLE | GONE
        )
    }
}

impl<T: Send + Sync + 'static> Drop for Lease<'_, '_, '_, T> {
    fn drop(&mut self) {
        drop(self.take());
    }
}

/// What a consumed lease hands over; derefs to the value.
pub enum Held<'b, T> {
    /// The lease had not expired: the value, under the lease's read
    /// section, which ends when this is dropped (async-signal-safe).
    Leased(LeasedValue<'b, T>),
    /// The lease had expired into a strong reference (dropping it may free
    /// the value: not async-signal-safe).
    Stable(Strong<T>),
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Self::Leased(v) => v,
            Self::Stable(s) => s,
        }
    }
}

/// A value under a read section inherited from a lease.
pub struct LeasedValue<'b, T> {
    domain: &'b Inner,
    bank: usize,
    node: NonNull<Node<T>>,
}

impl<T> Deref for LeasedValue<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the read section is still held (ended in `drop`).
        unsafe { &self.node.as_ref().value }
    }
}

impl<T> Drop for LeasedValue<'_, T> {
    fn drop(&mut self) {
        crate::fork::held_add(-1);
        self.domain.read_unlock(self.bank);
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for LeaseBlock<'_, '_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseBlock")
            .field("capacity", &self.slots.len())
            .field("free", &self.free.get().count_ones())
            .finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for Lease<'_, '_, '_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("slot", &self.index)
            .field("expired", &self.is_expired())
            .finish_non_exhaustive()
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Held<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Leased(v) => f.debug_tuple("Leased").field(&**v).finish(),
            Self::Stable(s) => f.debug_tuple("Stable").field(&**s).finish(),
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for LeasedValue<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LeasedValue").field(&**self).finish()
    }
}
