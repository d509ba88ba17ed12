//! The SRCU domain: read counts in two banks (per thread for guard
//! sections, per CPU for sections that may end elsewhere), and grace
//! periods.
//!
//! The domain owns its read counts, its grace periods and the public
//! handles on them ([`Srcu`], [`ReadGuard`], [`ReadIndex`]). It builds on
//! `readers` (the per-thread slots), `reclaim` (its callback queue, which
//! runs grace periods through `reclaim::Domain`) and `fork` (with which it
//! registers itself, answering through `fork::Domain`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pcpu::PerCpu;
use pcpu::unstable::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};

use crate::fork::{self, LeaseSets};
use crate::readers::{Readers, Section, Slot};
use crate::reclaim::{self, Reclaimer};

/// Words of a CPU's counts: `LOCK + bank`, `UNLOCK + bank`.
const LOCK: usize = 0;
const UNLOCK: usize = 2;

/// One domain's state. Guard sections are counted in per-thread slots
/// (`readers`, see `crate::readers`); sections that may end on another
/// thread (raw ones, leases) in the per-CPU `counts`, all four in one
/// cache line per CPU: word `LOCK + b` counts read sections that began on
/// bank `b`, word `UNLOCK + b` those that ended. They only grow, so a
/// section may begin on one CPU and end on another.
pub(crate) struct Inner {
    /// The per-CPU counts' rseq add: present only where rseq is
    /// registered *and* the light fence is a compiler fence.
    fast: Option<pcpu::rseq::Adder>,
    pub(crate) readers: Readers,
    counts: PerCpu<[AtomicU64; 4]>,
    /// Grace periods started; the active bank is `completed & 1`.
    completed: AtomicU64,
    /// `readers.hot(completed & 1)`, stored at each flip: what the guard
    /// path checks its cached slot against and stores there for an
    /// outermost section.
    hot: AtomicU64,
    /// Serialises grace periods (ordinary context only).
    gp_lock: GpLock,
    /// Set when the `Srcu` is dropped: no guard can exist any more and raw
    /// sections can no longer be ended, so grace periods complete at once
    /// (the queued callbacks run instead of waiting forever).
    dead: AtomicBool,
    pub(crate) reclaimer: Reclaimer,
    /// The lease sets of this domain, for the fork handlers (expired in a
    /// child, their expiry threads restarted there).
    pub(crate) lease_sets: LeaseSets,
    /// The fork generation (`fork::generation`) the helper threads were
    /// last checked in: a child restarts them on its first use of the
    /// domain (`Srcu::revive`).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    helpers_gen: AtomicU64,
}

/// The grace-period lock: the pid of the process whose thread holds it
/// (0: free). Not a `Mutex` because a thread of the parent that held it at
/// `fork()` does not exist in the child, where the lock is then taken over
/// instead of waited for: a grace period abandoned half-way leaves the
/// domain as consistent as a timed-out one does (the next grace period
/// waits for the inactive bank first).
struct GpLock {
    owner: AtomicU64,
}

struct GpGuard<'a>(&'a GpLock);

impl GpLock {
    fn lock(&self) -> GpGuard<'_> {
        let me = u64::from(std::process::id());
        let mut round = 0u32;
        loop {
            let holder = self.owner.load(Ordering::Relaxed);
            // Free, or held by a thread of another process (the parent,
            // before this child was forked): take it.
            if (holder == 0 || holder != me)
                && self
                    .owner
                    .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return GpGuard(self);
            }
            round += 1;
            backoff(round, false);
        }
    }
}

impl Drop for GpGuard<'_> {
    fn drop(&mut self) {
        self.0.owner.store(0, Ordering::Release);
    }
}

impl Inner {
    fn new() -> Self {
        let light_is_compiler = pcpu::fence::light_is_compiler_only();
        let this = Self {
            fast: pcpu::rseq::Adder::get().filter(|_| light_is_compiler),
            // Slots rely on membarrier (their fence is a compiler fence);
            // loom models them with full fences.
            readers: Readers::new(light_is_compiler || cfg!(pcpu_loom)),
            counts: PerCpu::default(),
            completed: AtomicU64::new(0),
            hot: AtomicU64::new(0),
            gp_lock: GpLock {
                owner: AtomicU64::new(0),
            },
            dead: AtomicBool::new(false),
            reclaimer: Reclaimer::default(),
            lease_sets: LeaseSets::default(),
            helpers_gen: AtomicU64::new(0),
        };
        this.hot.store(this.readers.hot(0), Ordering::Relaxed);
        this
    }

    /// Begins a guard section (one that ends on this thread): counted in
    /// this thread's slot, or per CPU if no slot is free.
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn guard_lock(&self) -> Section {
        let hot = self.hot.load(Ordering::Relaxed);
        match self.readers.cached(hot) {
            Some(slot) => Self::enter(slot, hot),
            None => self.guard_lock_uncached(),
        }
    }

    /// Counts a guard section in `slot`, this thread's.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn enter(slot: &Slot, hot: u64) -> Section {
        let section = slot.enter(hot);
        // B: the section's loads come after the count; pairs with the
        // heavy fences in `drained`.
        slot_fence();
        section
    }

    /// A guard section of a thread whose slot is not cached: claims one,
    /// or counts per CPU if none is free.
    #[cold]
    #[inline(never)]
    fn guard_lock_uncached(&self) -> Section {
        match self.readers.claim() {
            Some(slot) => Self::enter(slot, self.hot.load(Ordering::Relaxed)),
            None => Section::per_cpu(self.guard_lock_per_cpu()),
        }
    }

    /// Ends a section begun by [`guard_lock`](Self::guard_lock), on the
    /// thread that began it.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn guard_unlock(&self, section: Section) {
        if section.is_outer() {
            // C: the section's loads are done before the store.
            slot_fence();
            section.leave_outer();
        } else {
            self.guard_unlock_other(section);
        }
    }

    /// Ends a guard section nested in the slot, or counted per CPU.
    #[cold]
    #[inline(never)]
    fn guard_unlock_other(&self, section: Section) {
        if let Some(bank) = section.per_cpu_bank() {
            self.guard_unlock_per_cpu(bank);
        } else {
            // C, as above.
            slot_fence();
            section.leave_nested();
        }
    }

    /// A guard section of a thread that found no free slot.
    fn guard_lock_per_cpu(&self) -> usize {
        fork::held_add(1);
        self.read_lock()
    }

    fn guard_unlock_per_cpu(&self, bank: usize) {
        fork::held_add(-1);
        self.read_unlock(bank);
    }

    /// Begins a section counted per CPU (it may end on another thread).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_lock(&self) -> usize {
        let bank = (self.completed.load(Ordering::Relaxed) & 1) as usize;
        match self.fast {
            Some(adder) => {
                adder.add_word(&self.counts, LOCK + bank, 1);
                // B (membarrier mode): the section's loads come after the
                // count; pairs with the heavy fences in `drained`.
                core::sync::atomic::compiler_fence(Ordering::SeqCst);
            }
            None => self.lock_slow(bank),
        }
        bank
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_unlock(&self, bank: usize) {
        let bank = bank & 1;
        match self.fast {
            Some(adder) => {
                // C (membarrier mode): the section's loads are done before
                // the count.
                core::sync::atomic::compiler_fence(Ordering::SeqCst);
                adder.add_word(&self.counts, UNLOCK + bank, 1);
            }
            None => self.unlock_slow(bank),
        }
    }

    /// B without rseq or without membarrier (out of line: the inlined read
    /// path stays small).
    #[cold]
    #[inline(never)]
    fn lock_slow(&self, bank: usize) {
        pcpu::rseq::add_word(&self.counts, LOCK + bank, 1);
        pcpu::fence::light();
    }

    /// C without rseq or without membarrier.
    #[cold]
    #[inline(never)]
    fn unlock_slow(&self, bank: usize) {
        pcpu::fence::light();
        pcpu::rseq::add_word(&self.counts, UNLOCK + bank, 1);
    }

    fn sum(&self, word: usize) -> u64 {
        self.counts
            .iter()
            .fold(0u64, |s, c| s.wrapping_add(c[word].load(Ordering::Relaxed)))
    }

    /// Whether every read section that began on `bank` has ended. Per
    /// CPU, unlocks are summed before locks, with a heavy fence between
    /// (A): a section whose unlock is counted also has its lock counted,
    /// so an unbalanced sum can only overestimate the readers. The
    /// threads' slots are read after the fence: each is one word that
    /// only its owner writes, open on `bank` while its outermost guard
    /// section that began there lasts.
    fn drained(&self, bank: usize) -> bool {
        let unlocks = self.sum(UNLOCK + bank);
        pcpu::fence::heavy();
        let locks = self.sum(LOCK + bank);
        locks == unlocks && !self.readers.open_on(bank)
    }

    /// Waits until `bank` drains: polls, then yields, then sleeps with a
    /// growing delay (`expedited`: never sleeps). With `deadline`, gives up
    /// at that time and returns `false`.
    fn wait_drained(&self, bank: usize, expedited: bool, deadline: Option<Instant>) -> bool {
        let mut round = 0u32;
        loop {
            // A dead domain's grace periods are over (see `dead`), also for
            // a reclaimer that was already waiting when the domain died.
            if self.drained(bank) || self.dead.load(Ordering::Acquire) {
                return true;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            round += 1;
            backoff(round, expedited);
        }
    }

    /// A grace period: returns once every read section that began before
    /// the call has ended (the kernel's classic SRCU algorithm).
    pub(crate) fn synchronize(&self, expedited: bool, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let _gp = self.gp_lock.lock();
        if self.dead.load(Ordering::Acquire) {
            return true;
        }
        // No fence is needed before the first check: the heavy fence (A)
        // inside it separates the caller's updates (unlinking) from the
        // first read of any lock count, which is all a reader's
        // "count, then load" needs to pair with (the loom models check
        // this).
        let active = (self.completed.load(Ordering::Relaxed) & 1) as usize;
        // Readers that fetched the inactive index during the previous grace
        // period but incremented late: this grace period must wait for them.
        if !self.wait_drained(active ^ 1, expedited, deadline) {
            return false;
        }
        // Flip: new readers use the other bank.
        let started = self.completed.fetch_add(1, Ordering::Relaxed);
        self.hot.store(
            self.readers.hot(((started + 1) & 1) as usize),
            Ordering::Relaxed,
        );
        pcpu::fence::heavy();
        // Every reader of the bank that was active when we started.
        if !self.wait_drained(active, expedited, deadline) {
            return false;
        }
        // D: the readers' loads are done before the caller frees anything.
        pcpu::fence::heavy();
        true
    }

    /// Grace periods started so far (for `barrier` bookkeeping and tests).
    pub(crate) fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }
}

/// The reclaimer's view: its queue, and ordinary grace periods.
impl reclaim::Domain for Inner {
    fn reclaimer(&self) -> &Reclaimer {
        &self.reclaimer
    }

    fn grace_period(&self) {
        self.synchronize(false, None);
    }
}

/// The fork handlers' view (see `fork`).
#[cfg(not(pcpu_loom))]
impl fork::Domain for Inner {
    fn lock_for_fork(self: Arc<Self>, held: &mut Vec<Box<dyn fork::HeldLock>>) {
        // SAFETY: the mutex is a field of `self`.
        unsafe { fork::hold(&self, self.reclaimer.state_lock(), held) };
        // SAFETY: the list is a field of `self`.
        unsafe { self.lease_sets.lock_for_fork(&self, held) };
    }

    fn lease_sets(&self) -> &LeaseSets {
        &self.lease_sets
    }

    /// Callers make sure that no such section can still be ended (see
    /// `fork`).
    fn discount_per_cpu(&self) {
        for c in self.counts.iter() {
            for bank in 0..2 {
                c[UNLOCK + bank].store(c[LOCK + bank].load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
    }
}

/// The light fence of the slot path (B, C): slots are handed out only in
/// membarrier mode, where it is a compiler fence (loom: a full fence, as
/// `pcpu::fence::light` models membarrier).
#[allow(clippy::inline_always)]
#[inline(always)]
fn slot_fence() {
    #[cfg(not(pcpu_loom))]
    core::sync::atomic::compiler_fence(Ordering::SeqCst);
    #[cfg(pcpu_loom)]
    pcpu::fence::light();
}

/// Waiting for readers: spin, then yield, then sleep with a growing delay
/// (1 us to 1 ms; `expedited`: never sleep).
#[cfg(not(pcpu_loom))]
fn backoff(round: u32, expedited: bool) {
    if round < 64 {
        for _ in 0..1u32 << round.min(6) {
            std::hint::spin_loop();
        }
    } else if expedited || round < 128 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(1u64 << (round - 128).min(10)));
    }
}

/// loom: a waiting loop must let the model run other threads.
#[cfg(pcpu_loom)]
fn backoff(_round: u32, _expedited: bool) {
    loom::thread::yield_now();
}

/// A sleepable-RCU domain: readers mark read sections with
/// [`read_lock`](Self::read_lock), writers wait for the sections that
/// began before them with [`synchronize`](Self::synchronize) or defer work
/// with [`call`](Self::call).
///
/// Independent domains never wait for each other's readers. A domain can
/// be a `static` (construction is `const`; its counts are allocated on
/// first use, or by [`prepare`](Self::prepare)).
///
/// # Costs
/// A guard section ([`read_lock`](Self::read_lock),
/// [`SrcuCell::read`](crate::SrcuCell::read)) stores a word in the
/// calling thread's *slot* of the domain and 0 at its end (a nested one
/// adds 1 to a count there and takes it away), with compiler fences:
/// what liburcu's read side costs. A thread claims its slot on its first section,
/// without registering, and keeps its address in a small thread-local
/// cache: the domain it used last is the fast path (one compare), and
/// four domains used in turn stay cached (a compare more); more cost a
/// scan of the domain's slots per miss. The slot of a thread that exited
/// is taken over by the next thread that needs one.
/// A slot is 128 bytes; a domain's table reserves 1024 of them (virtual
/// memory, touched as claimed; a dropped domain's table is kept for the
/// next new domain, never unmapped); threads beyond that, and every
/// thread where `membarrier` is not available, count guard sections per
/// CPU instead. A raw section
/// ([`read_lock_raw`](Self::read_lock_raw)), which may end on another
/// thread, is always counted per CPU (an rseq add). A grace period reads
/// every CPU's counts and every claimed slot: its cost grows with the
/// threads that used the domain. See [`reader_slots`](Self::reader_slots).
///
/// # Async-signal safety
/// | operation | from a signal handler |
/// |---|---|
/// | [`read_lock`](Self::read_lock), [`read_lock_raw`](Self::read_lock_raw), unlocking | yes (after [`prepare`](Self::prepare)): a word in the thread's slot or a count per CPU, and a compiler fence; a thread's first section of a domain claims its slot without locks or allocation; a guard a handler takes is dropped before the handler returns |
/// | [`synchronize`](Self::synchronize) and its variants, [`call`](Self::call), [`barrier`](Self::barrier) | no (they block, lock mutexes or allocate) |
///
/// # Fork
/// Only the forking thread exists in a child. At the fork (srcu's
/// `pthread_atfork` handlers, see [`after_fork_in_child`](crate::after_fork_in_child)):
/// - every lease of every [`LeaseSet`](crate::LeaseSet) is expired (as the
///   kernel expires a child's), so leases never stall the child;
/// - the guard sections ([`ReadGuard`], [`CellRef`](crate::CellRef)) of
///   every other thread are **discounted** in the child (their slots are
///   freed); the forking thread's own stay counted until they end there;
/// - if the forking thread holds no section counted per CPU that ends on
///   it (a consumed lease's [`LeasedValue`](crate::LeasedValue), or a
///   guard of a thread that found no free slot) of any domain, every
///   section counted per CPU is discounted too: grace periods in the child
///   then wait only for sections begun there. Raw sections open at the
///   fork are discounted with them, so they must not be ended in the child
///   (see [`read_unlock_raw`](Self::read_unlock_raw));
/// - if it does hold one, the per-CPU counts are left as they are (they
///   do not say which thread a section belongs to): its own sections stay
///   valid, and grace periods in the child also wait for the other
///   threads' per-CPU sections, which never end there (use
///   [`synchronize_timeout`](Self::synchronize_timeout)).
///
/// Deferred callbacks keep working in the child: its reclaimer thread and
/// the lease sets' expiry threads are started anew on the domain's first
/// use there, and callbacks queued before the fork (also those the
/// parent's reclaimer was waiting a grace period for) run in the child
/// after a grace period of the child's. Only a callback the parent's
/// reclaimer was running at the very moment of the fork is the parent's
/// alone.
///
/// # Drop
/// Dropping a domain runs every callback still queued, then stops its
/// reclaimer thread. Guards, cells and lease sets borrow the domain, so
/// none outlives it; a raw section still open cannot be ended any more
/// (that needs the domain) and is forgotten: the remaining callbacks run
/// without waiting for it.
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// static DOMAIN: srcu::Srcu = srcu::Srcu::new();
/// static OLD_FREED: AtomicBool = AtomicBool::new(false);
///
/// let guard = DOMAIN.read_lock();
/// // ... read shared data ...
/// drop(guard);
/// DOMAIN.call(|| OLD_FREED.store(true, Ordering::SeqCst));
/// DOMAIN.barrier();
/// assert!(OLD_FREED.load(Ordering::SeqCst));
/// ```
pub struct Srcu {
    inner: AtomicPtr<Inner>,
}

impl Default for Srcu {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Srcu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.load(Ordering::Acquire);
        let mut d = f.debug_struct("Srcu");
        if !inner.is_null() {
            // SAFETY: published by `inner()`, alive until drop.
            d.field("grace_periods", &unsafe { &*inner }.completed());
        }
        d.finish_non_exhaustive()
    }
}

impl Srcu {
    /// A new domain; allocates nothing until first use.
    #[cfg(not(pcpu_loom))]
    #[must_use]
    pub const fn new() -> Self {
        Self {
            inner: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// A new domain (loom build: not `const`).
    #[cfg(pcpu_loom)]
    #[must_use]
    pub fn new() -> Self {
        Self {
            inner: AtomicPtr::new(core::ptr::null_mut()),
        }
    }

    /// Allocates the per-CPU counts now, so that no later read operation
    /// allocates (required before use from a signal handler). Idempotent.
    pub fn prepare(&self) {
        let _ = self.inner();
    }

    #[allow(clippy::inline_always)] // on the read path
    #[inline(always)]
    pub(crate) fn inner(&self) -> &Inner {
        let p = self.inner.load(Ordering::Acquire);
        if p.is_null() {
            return self.allocate();
        }
        // SAFETY: published by `allocate` (an `Arc` we own a count of),
        // alive until `drop`.
        unsafe { &*p }
    }

    /// The shared state, for the reclaimer thread.
    pub(crate) fn inner_arc(&self) -> Arc<Inner> {
        let p: *const Inner = self.inner();
        // SAFETY: `p` came from `Arc::into_raw` and we hold that count.
        unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        }
    }

    #[cold]
    fn allocate(&self) -> &Inner {
        let fresh = Arc::into_raw(Arc::new(Inner::new())).cast_mut();
        let p = pcpu::unstable::sync::publish_once(&self.inner, fresh, |f| {
            // SAFETY: a loser's `fresh` was never shared.
            drop(unsafe { Arc::from_raw(f) });
        });
        #[cfg(not(pcpu_loom))]
        if p == fresh {
            fork::register(&self.inner_arc());
        }
        // SAFETY: published (by us or the winner); alive until drop.
        unsafe { &*p }
    }

    /// Begins a read section, ended when the guard drops (on this thread:
    /// guards are not `Send`). Never blocks, never allocates after
    /// [`prepare`](Self::prepare); the read side stores a word in this
    /// thread's slot (adds 1 to a count there when nested) and issues a
    /// compiler fence (see *Costs* above). **Async-signal-safe**, also as a
    /// thread's first section of the domain, and nested in a section the
    /// interrupted code holds, begins or ends; a guard taken in a signal
    /// handler must be dropped before the handler returns (moved out of
    /// it, into a thread-local, it could go uncounted if the handler
    /// interrupted this thread's outermost `read_lock` of the domain).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use = "the read section ends when the guard is dropped"]
    pub fn read_lock(&self) -> ReadGuard<'_> {
        self.read_lock_in(self.inner())
    }

    /// [`read_lock`](Self::read_lock) with the domain's state resolved.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn read_lock_in<'a>(&'a self, inner: &'a Inner) -> ReadGuard<'a> {
        ReadGuard {
            srcu: self,
            inner,
            section: inner.guard_lock(),
        }
    }

    /// Begins a read section without a guard: end it with
    /// [`read_unlock_raw`](Self::read_unlock_raw), from any thread.
    /// **Async-signal-safe.**
    #[inline]
    pub fn read_lock_raw(&self) -> ReadIndex {
        ReadIndex(self.inner().read_lock() as u8)
    }

    /// Ends a section begun by [`read_lock_raw`](Self::read_lock_raw).
    /// **Async-signal-safe.**
    ///
    /// The index is consumed (it is neither `Copy` nor `Clone`), so a
    /// section cannot be ended twice:
    ///
    /// ```compile_fail
    /// let domain = srcu::Srcu::new();
    /// let index = domain.read_lock_raw();
    /// // SAFETY: `index` came from this domain.
    /// unsafe { domain.read_unlock_raw(index) };
    /// unsafe { domain.read_unlock_raw(index) }; // error: use of moved value
    /// ```
    ///
    /// # Safety
    /// `index` was returned by `read_lock_raw` of **this** domain. An
    /// index of another domain would end a section that was never begun
    /// here: grace periods of this domain could then return while a reader
    /// is still inside one, and values retired under it (an
    /// [`SrcuCell`](crate::SrcuCell)'s old value) would be dropped while
    /// the reader uses them.
    #[inline]
    #[allow(clippy::needless_pass_by_value)] // by value: a section ends once
    pub unsafe fn read_unlock_raw(&self, index: ReadIndex) {
        self.inner().read_unlock(usize::from(index.0));
    }

    /// How many per-thread reader slots the domain's table has handed
    /// out: about the most threads that held guard sections at once (a
    /// slot of an exited thread is taken over by the next thread that
    /// needs one). A dropped domain's table passes to the next new domain
    /// with its slots, so this counts the threads of earlier domains too.
    /// A snapshot, for diagnostics and memory accounting (one slot is 128
    /// bytes, a table at most 1024 slots). Async-signal-safe.
    ///
    /// ```
    /// let domain = srcu::Srcu::new();
    /// drop(domain.read_lock());
    /// // One slot, this thread's (none where membarrier is unavailable:
    /// // guard sections are then counted per CPU).
    /// assert!(domain.reader_slots() <= 1);
    /// ```
    #[must_use]
    pub fn reader_slots(&self) -> usize {
        self.inner().readers.handed_out()
    }

    /// Waits until every read section that began before this call has
    /// ended. Sleeps (with a growing delay) while readers remain; with
    /// short read sections a grace period takes a few microseconds (four
    /// `membarrier` calls). Not async-signal-safe; must not be called
    /// inside a read section of this domain (it would wait for itself).
    pub fn synchronize(&self) {
        self.revive();
        self.inner().synchronize(false, None);
    }

    /// Like [`synchronize`](Self::synchronize), but never sleeps: it polls
    /// and yields, trading CPU time for latency.
    pub fn synchronize_expedited(&self) {
        self.revive();
        self.inner().synchronize(true, None);
    }

    /// Like [`synchronize`](Self::synchronize), but gives up after
    /// `timeout`: returns whether the grace period completed. (A timed-out
    /// attempt leaves the domain consistent; the next grace period waits
    /// for the same readers.)
    pub fn synchronize_timeout(&self, timeout: Duration) -> bool {
        self.revive();
        self.inner().synchronize(false, Some(timeout))
    }

    /// Runs `f` on the domain's reclaimer thread after a grace period that
    /// begins after this call (`call_srcu`). Not async-signal-safe (it
    /// allocates and takes a mutex). If the process cannot start the
    /// reclaimer thread (out of threads or memory), the queued callbacks
    /// run on the calling thread instead, after their grace periods,
    /// before `call` returns: nothing is lost, at the price of a wait. A
    /// callback that panics is caught (see
    /// [`on_callback_panic`](Self::on_callback_panic)). The reclaimer
    /// thread ends after a second with nothing to do; the next callback
    /// starts another.
    pub fn call(&self, f: impl FnOnce() + Send + 'static) {
        self.defer(Box::new(f), 1);
    }

    /// Callbacks of this domain ([`call`](Self::call),
    /// [`retire`](Self::retire), deferred drops) that panicked so far. A
    /// panicking callback is caught; the others keep running.
    #[must_use]
    pub fn callback_panics(&self) -> u64 {
        self.inner().reclaimer.panics()
    }

    /// Calls `hook` with the payload of each callback of this domain that
    /// panics (on the thread that ran it: the reclaimer's, or a caller's
    /// when no thread could be started), replacing any earlier hook. The
    /// process's panic hook has already reported the panic by then
    /// (`std`'s default prints it). Not async-signal-safe.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    ///
    /// static SEEN: AtomicU64 = AtomicU64::new(0);
    /// let domain = srcu::Srcu::new();
    /// domain.on_callback_panic(|_payload| {
    ///     SEEN.fetch_add(1, Relaxed);
    /// });
    /// domain.call(|| panic!("a bug in a callback"));
    /// domain.barrier();
    /// assert_eq!((domain.callback_panics(), SEEN.load(Relaxed)), (1, 1));
    /// ```
    pub fn on_callback_panic(
        &self,
        hook: impl Fn(&(dyn core::any::Any + Send)) + Send + Sync + 'static,
    ) {
        self.inner()
            .reclaimer
            .set_panic_hook(Some(std::sync::Arc::new(hook)));
    }

    /// Queues `f` to run after `grace_periods` grace periods.
    pub(crate) fn defer(&self, f: Box<dyn FnOnce() + Send>, grace_periods: u8) {
        self.revive();
        self.inner().reclaimer.enqueue(
            || self.inner_arc(),
            reclaim::Deferred::new(f, grace_periods),
        );
    }

    /// In a fork child, on the first use of the domain after the fork:
    /// restarts the expiry threads of its lease sets and, if callbacks are
    /// pending, the reclaimer (the parent's threads do not exist here).
    /// Cheap otherwise (one load). Ordinary context only.
    #[cfg(not(pcpu_loom))]
    pub(crate) fn revive(&self) {
        let inner = self.inner();
        let generation = fork::generation();
        if inner.helpers_gen.load(Ordering::Acquire) == generation
            || inner.helpers_gen.swap(generation, Ordering::AcqRel) == generation
        {
            return;
        }
        for hooks in inner.lease_sets.live() {
            hooks.restart();
        }
        inner.reclaimer.revive(|| self.inner_arc());
    }

    #[cfg(pcpu_loom)]
    pub(crate) fn revive(&self) {}

    /// Drops `value` after a grace period: the usual way to free something
    /// readers may still be looking at.
    pub fn retire<T: Send + 'static>(&self, value: T) {
        self.call(move || drop(value));
    }

    /// Waits until every callback queued before this call has run
    /// (`srcu_barrier`), deferred drops included ([`retire`](Self::retire),
    /// values replaced in an [`SrcuCell`](crate::SrcuCell), which wait for
    /// two grace periods), however many grace periods each needs and
    /// whatever other threads queue meanwhile (callbacks queued after the
    /// call may finish before it returns, but never stand in for earlier
    /// ones). Not async-signal-safe.
    pub fn barrier(&self) {
        self.revive();
        self.inner().reclaimer.barrier(|| self.inner_arc());
    }
}

impl Drop for Srcu {
    fn drop(&mut self) {
        let p = self.inner.load(Ordering::Acquire);
        if p.is_null() {
            return;
        }
        // SAFETY: published by `allocate`; we still own our count.
        let inner = unsafe { Arc::from_raw(p.cast_const()) };
        inner.dead.store(true, Ordering::Release);
        inner.reclaimer.shut_down(|| Arc::clone(&inner));
    }
}

/// A read section begun with [`Srcu::read_lock`]; ends when dropped
/// (async-signal-safe). Not `Send`: a guard section ends on the thread that
/// began it (each thread counts its own in its slot, which is how a fork
/// child tells the forking thread's sections from the vanished threads');
/// a section that must end elsewhere is a raw one ([`Srcu::read_lock_raw`]).
#[must_use = "the read section ends when the guard is dropped"]
pub struct ReadGuard<'a> {
    srcu: &'a Srcu,
    inner: &'a Inner,
    /// Where the section is counted. Neither `Send` nor `Sync`, nor is
    /// the guard: the section ends on the thread that began it.
    section: Section,
}

impl ReadGuard<'_> {
    /// The domain this section belongs to.
    #[must_use]
    pub fn domain(&self) -> &Srcu {
        self.srcu
    }
}

impl Drop for ReadGuard<'_> {
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn drop(&mut self) {
        self.inner.guard_unlock(self.section);
    }
}

impl std::fmt::Debug for ReadGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadGuard")
            .field("bank", &self.section.bank())
            .finish()
    }
}

/// The index of a read section begun with [`Srcu::read_lock_raw`]
/// (0 or 1, as the kernel's `srcu_read_lock` returns): a token that
/// [`Srcu::read_unlock_raw`] consumes, so each section ends once. It may
/// move to another thread, which ends the section there.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "the read section lasts until read_unlock_raw"]
pub struct ReadIndex(u8);

impl ReadIndex {
    /// The bank number, 0 or 1.
    #[must_use]
    pub fn bank(&self) -> u8 {
        self.0
    }
}
