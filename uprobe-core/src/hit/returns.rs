//! Return probes: the per-thread stack of pending returns, the leases that
//! keep their consumers alive, and the service thread that cleans up after
//! threads that died with returns pending.
//!
//! **At the entry trap** of a consumer with a return handler, the engine
//! [`prepare`]s a return: it takes an `srcu` **lease** on the consumer's
//! return part (seed 002: an SRCU read section that the lease set's expiry
//! thread turns into a reference after 100 ms, instead of a reference
//! count per hit), charges the consumer's in-flight account if it has a
//! limit (`sigpending`), and replaces the return address with the stub of
//! the return trampoline for that call site (see the arch's `trampoline`).
//! The instance (lease, original return address, stack slot, cookie) goes
//! on the thread's [`ThreadReturns`] stack.
//!
//! **At the return**, the plain-code trampoline calls [`on_return`]:
//! instances of frames that are gone (`longjmp`, unwinding) are dropped,
//! the instances of this frame (several when chained: tail calls, several
//! consumers) run their handlers and are consumed, and the thread goes on
//! at the original return address, which the stub itself names: returning
//! never depends on this bookkeeping.
//!
//! **Lifetime.** A return handler runs only inside a read section of the
//! engine's table domain and only if its consumer was not detached, so a
//! detach (which marks the consumer, then waits for a grace period of that
//! domain) returns once no return handler of it runs or will run. The
//! consumer's memory is another matter: pending returns hold leases on it,
//! in a separate domain that detach never waits for; it is freed after
//! two grace periods of that domain, which expiry keeps bounded.
//!
//! **Nothing is freed in a signal handler or the trampoline**: a lease
//! that expired into a reference is handed to the lease set's thread
//! (`LeaseSet::release`), in-flight accounts pin no owner, and the
//! per-thread stacks come from a preallocated `pcpu-freelist` pool, taken
//! by a thread's first return probe hit and given back by the service
//! thread once the thread is gone (`tgkill(pid, tid, 0)` fails with
//! `ESRCH`).

use core::cell::Cell;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use pcpu_freelist::FreeList;
use sigpending::Account;
use srcu::{LeaseBlock, LeaseSet, RawLease, Strong};

use super::timing::TimedStack;
use crate::AttachError;
use crate::arch::trampoline;
use crate::code::return_stubs;
use crate::site::handler::Returned;
use crate::site::returns::{
    Pinning, RETURN_DOMAIN, ReturnCounters, ReturnHold, ReturnPart, ReturnProbe, hold_mode, pinning,
};
use crate::thread::{AbortOnUnwind, current_tid, enter, fatal, leave};

/// Pending returns a thread may have (the kernel's `max_uretprobe_depth`);
/// a return probe hit past it is not tracked and counts as missed.
pub(crate) const MAX_RETURN_DEPTH: usize = 64;
/// Per-thread stacks of the first chunk of the pool; chunk `k` holds
/// `FIRST_CHUNK << k`. The pool grows a chunk at a time, in ordinary
/// context only (an attach of a return probe, the service thread), so the
/// trap handler only ever pops a preallocated stack.
const FIRST_CHUNK: usize = 256;
/// Chunks the pool can grow to: 256 * (2^8 - 1) = 65,280 threads with
/// returns pending at once (a stack is about 3 KiB).
const CHUNKS: usize = 8;
/// How often the service thread looks for threads that are gone.
const SERVICE_PERIOD: Duration = Duration::from_millis(20);

enum Hold {
    Lease(RawLease),
    Reference(Strong<ReturnPart>),
}

/// One pending return.
#[derive(Default)]
struct Instance {
    hold: Cell<Option<Hold>>,
    /// The probed function.
    func: Cell<usize>,
    /// The original return address.
    ret: Cell<usize>,
    /// Where the return address lives (x86-64: the stack slot; a frame is
    /// gone once the stack pointer is above it).
    slot: Cell<usize>,
    cookie: Cell<u64>,
    charged: Cell<bool>,
    /// The charge took a reference on the counters (`Pinning::PerReturn`).
    pinned: Cell<bool>,
}

/// One thread's pending returns.
pub(crate) struct ThreadReturns {
    /// The owning thread's id (0: free).
    owner: AtomicI32,
    /// Its element index in the free pool, while owned.
    element: AtomicUsize,
    block: LeaseBlock<'static, 'static, ReturnPart>,
    depth: Cell<usize>,
    instances: [Instance; MAX_RETURN_DEPTH],
    /// Its pending calls of timing probes.
    timed: TimedStack,
}

/// Where a thread's stack of pending returns keeps what the
/// architecture's timing routines read: its timed calls, and the depth
/// and the top instance's slot of its other pending returns (a return
/// with an instance of its frame there goes to the engine).
#[cfg_attr(not(uprobe_arch = "x86_64"), allow(dead_code))]
pub(crate) mod layout {
    use super::{Instance, ThreadReturns};
    use core::mem::{offset_of, size_of};
    pub(crate) const TIMED_AT: usize = offset_of!(ThreadReturns, timed);
    pub(crate) const DEPTH_AT: usize = offset_of!(ThreadReturns, depth);
    pub(crate) const INSTANCES_AT: usize = offset_of!(ThreadReturns, instances);
    pub(crate) const INSTANCE_SIZE: usize = size_of::<Instance>();
    pub(crate) const SLOT_AT: usize = offset_of!(Instance, slot);
}

// SAFETY: the cells are used by the owning thread only (its trap handler
// and trampoline, which never interleave on one stack: both run with the
// thread marked as inside the engine), or by the service thread once the
// owner is gone; `owner` and `element` are atomics.
unsafe impl Sync for ThreadReturns {}
// SAFETY: as above: ownership moves between threads, never shared use.
unsafe impl Send for ThreadReturns {}

/// One chunk of the pool of per-thread stacks.
struct Chunk {
    all: Box<[ThreadReturns]>,
    /// Indexes into `all` of the stacks no thread owns.
    free: FreeList<u32>,
}

/// The pool of per-thread stacks: chunks made as threads need them.
struct Threads {
    chunks: [OnceLock<Chunk>; CHUNKS],
    /// Stacks owned by a thread now, across chunks.
    taken: AtomicUsize,
    /// Serialises growing.
    grow: Mutex<()>,
}

impl Threads {
    /// The chunks made so far, in order.
    fn made(&self) -> impl Iterator<Item = &Chunk> {
        self.chunks.iter().map_while(OnceLock::get)
    }

    fn capacity(&self) -> usize {
        self.made().map(|c| c.all.len()).sum()
    }

    /// Adds chunks until at least `want` stacks exist (as far as the
    /// chunks go). Ordinary context only: it allocates.
    fn grow_to(&self, leases: &'static LeaseSet<'static, ReturnPart>, want: usize) {
        let _g = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        for (k, chunk) in self.chunks.iter().enumerate() {
            if self.capacity() >= want {
                return;
            }
            chunk.get_or_init(|| {
                let n = FIRST_CHUNK << k;
                Chunk {
                    all: (0..n)
                        .map(|_| ThreadReturns {
                            owner: AtomicI32::new(0),
                            element: AtomicUsize::new(0),
                            block: leases.block(MAX_RETURN_DEPTH),
                            depth: Cell::new(0),
                            instances: core::array::from_fn(|_| Instance::default()),
                            timed: TimedStack::new(),
                        })
                        .collect(),
                    free: FreeList::new(0..n as u32),
                }
            });
        }
    }

    /// Grows while fewer than a quarter of the stacks are free, so a burst
    /// of new threads finds stacks waiting.
    fn keep_spare(&self, leases: &'static LeaseSet<'static, ReturnPart>) {
        let taken = self.taken.load(Ordering::Relaxed);
        if taken * 4 >= self.capacity() * 3 {
            self.grow_to(leases, self.capacity() + 1);
        }
    }
}

static LEASES: OnceLock<LeaseSet<'static, ReturnPart>> = OnceLock::new();
static THREADS: OnceLock<Threads> = OnceLock::new();

/// Makes return probes ready: the stubs, the lease set, the per-thread
/// stacks and the service thread. Refuses where a hijacked return would
/// fault. Not async-signal-safe.
pub(crate) fn init(trampoline: usize) -> Result<(), AttachError> {
    if trampoline::shadow_stack_enabled() {
        return Err(AttachError::ShadowStack);
    }
    return_stubs::init(trampoline)?;
    RETURN_DOMAIN.prepare();
    let leases = if let Some(leases) = LEASES.get() {
        leases
    } else {
        let set = LeaseSet::try_new(&RETURN_DOMAIN).map_err(|e| AttachError::Os {
            what: "spawn the lease expiry thread of return probes",
            errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
        })?;
        // Another attach may have won the race: its set is kept.
        LEASES.get_or_init(|| set)
    };
    let threads = THREADS.get_or_init(|| Threads {
        chunks: [const { OnceLock::new() }; CHUNKS],
        taken: AtomicUsize::new(0),
        grow: Mutex::new(()),
    });
    // Room for every thread there is now, and as many again.
    threads.grow_to(leases, 2 * thread_count());
    ensure_service()
}

/// The calling thread's stack, if it has taken one. Async-signal-safe.
fn owned() -> Option<&'static ThreadReturns> {
    let p = crate::thread::return_stack().cast::<ThreadReturns>();
    // SAFETY: stacks live in THREADS forever; ours stays ours until this
    // thread is gone.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The calling thread's stack, taken from the pool on first use.
/// Async-signal-safe (a non-waiting pop).
#[inline]
fn current() -> Option<&'static ThreadReturns> {
    owned().or_else(take_first)
}

/// The calling thread's first stack: taken from the pool, once per
/// thread (kept out of the hit's path). Async-signal-safe.
#[cold]
#[inline(never)]
fn take_first() -> Option<&'static ThreadReturns> {
    let threads = THREADS.get()?;
    let (chunk, element) = take_stack(threads)?;
    let tr = &chunk.all[*element as usize];
    threads.taken.fetch_add(1, Ordering::Relaxed);
    tr.element.store(element.into_index(), Ordering::Relaxed);
    tr.owner.store(current_tid(), Ordering::Release);
    crate::thread::set_return_stack(core::ptr::from_ref(tr).cast());
    Some(tr)
}

/// Pops a free per-thread stack. `try_pop` skips a list another thread
/// has locked for a moment (always so without rseq, where every pop and
/// push locks its list), so while stacks are free a failed round is
/// retried: spinning first, then yielding the CPU to a holder that may
/// have been preempted. Once per thread, at its first return probe hit.
/// Async-signal-safe (`sched_yield` is a system call).
fn take_stack(
    threads: &'static Threads,
) -> Option<(&'static Chunk, pcpu_freelist::Element<'static, u32>)> {
    const ROUNDS: usize = 200;
    const SPINNING: usize = 20;
    for round in 0..ROUNDS {
        if let Some(found) = threads
            .made()
            .find_map(|c| c.free.try_pop().map(|e| (c, e)))
        {
            return Some(found);
        }
        if threads.taken.load(Ordering::Relaxed) >= threads.capacity() {
            return None;
        }
        if round < SPINNING {
            for _ in 0..64 {
                core::hint::spin_loop();
            }
        } else {
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
        }
    }
    None
}

/// At an entry trap: tracks the return of the function entered, whose
/// return address is at `*ret_at` (the stack slot at `sp` on x86-64).
/// Async-signal-safe; called with the thread inside the engine.
///
/// # Safety
/// `ret_at` is where the interrupted thread keeps the return address of
/// the function being entered, readable and writable.
pub(crate) unsafe fn prepare(
    probe: &ReturnProbe,
    func: usize,
    cookie: u64,
    sp: usize,
    ret_at: *mut usize,
) {
    let missed = || probe.counters.missed.fetch_add(1, Ordering::Relaxed);
    let Some(tr) = current() else {
        missed();
        return;
    };
    // SAFETY: the caller's contract.
    let ret = unsafe { ret_at.read() };
    // Frames the thread left without returning (longjmp, unwinding):
    // below the new frame's slot, or at it without our stub (a tail call
    // reuses the slot and keeps the stub: chained, still alive).
    tr.drop_abandoned(|slot| slot < sp || (slot == sp && return_stubs::target_of(ret).is_none()));
    let depth = tr.depth.get();
    if depth == MAX_RETURN_DEPTH {
        missed();
        return;
    }
    // The original return address: the stub's, if this is a chained
    // return (the slot already holds a stub), else a new stub will go in.
    // Found first: nothing is charged or held yet if there is none.
    let (original, stub) = if let Some(original) = return_stubs::target_of(ret) {
        (original, None)
    } else {
        let Some(stub) = return_stubs::stub_for(ret) else {
            missed();
            return;
        };
        (ret, Some(stub))
    };
    let charged = if let Some(account) = &probe.in_flight {
        let Ok(charge) = account.charge() else {
            missed();
            return;
        };
        charge.forget();
        true
    } else {
        false
    };
    let pinned = charged && pinning() == Pinning::PerReturn;
    if pinned {
        // SAFETY: `probe` holds the counters; this count is dropped when
        // the charge is.
        unsafe { Arc::increment_strong_count(Arc::as_ptr(&probe.counters)) };
    }
    // The hold goes straight into the instance, in each arm, not through
    // a local and `Cell::set`: that kept it on the stack, then moved it in
    // with a 16-byte load of what two 8-byte stores had just written, a
    // load the processor cannot forward from the stores, which stalled
    // every call (~4 ns on an Ice Lake host).
    let inst = &tr.instances[depth];
    let slot = inst.hold.as_ptr();
    // SAFETY: an instance above the depth holds nothing (`finish` took
    // its hold, or it never had one), so nothing that needs dropping is
    // overwritten; the thread's own stack, not shared, and no other hit
    // of the thread gets here meanwhile (it is inside the engine).
    debug_assert!(unsafe { &*slot }.is_none());
    let held = match hold_mode() {
        ReturnHold::Lease => tr
            .block
            .lease(&probe.cell)
            .map(|l| {
                // SAFETY: as above.
                unsafe { slot.write(Some(Hold::Lease(l.into_raw()))) };
            })
            .is_ok(),
        ReturnHold::Refcount => probe
            .cell
            .get()
            .map(|part| {
                // SAFETY: as above.
                unsafe { slot.write(Some(Hold::Reference(part))) };
            })
            .is_some(),
    };
    if !held {
        // Detached meanwhile (or a full block, which the depth rules out).
        uncharge(probe.in_flight.as_ref(), &probe.counters, charged, pinned);
        return;
    }
    if let Some(stub) = stub {
        // SAFETY: the caller's contract.
        unsafe { ret_at.write(stub) };
    }
    inst.func.set(func);
    inst.ret.set(original);
    inst.slot.set(sp);
    inst.cookie.set(cookie);
    inst.charged.set(charged);
    inst.pinned.set(pinned);
    tr.depth.set(depth + 1);
}

/// At the entry of a function a timing probe (its `switch`) times: pushes the
/// call on the thread's timed calls with the clock now, and replaces its
/// return address (at `*ret_at`, the stack slot at `sp`) with the stub
/// of its call site, unless a return probe already did (a tail call, or
/// another probe on the function). A call that cannot be tracked is not
/// timed. Async-signal-safe; called with the thread inside the engine.
///
/// # Safety
/// As [`prepare`]'s.
pub(crate) unsafe fn prepare_timed(
    switch: &'static crate::site::timing::Switch,
    sp: usize,
    ret_at: *mut usize,
) {
    let Some(tr) = current() else {
        return;
    };
    // SAFETY: the caller's contract.
    let ret = unsafe { ret_at.read() };
    let chained = return_stubs::target_of(ret).is_some();
    tr.timed
        .drop_abandoned(|slot| slot < sp || (slot == sp && !chained));
    let stub = if chained {
        None
    } else {
        let Some(stub) = return_stubs::stub_for(ret) else {
            return;
        };
        Some(stub)
    };
    if tr.timed.push(sp, crate::clock::now(), switch)
        && let Some(stub) = stub
    {
        // SAFETY: the caller's contract.
        unsafe { ret_at.write(stub) };
    }
}

impl ThreadReturns {
    /// Pops, from the top, the instances whose slot `gone` says is left,
    /// releasing them without running their handlers (counted as missed).
    fn drop_abandoned(&self, gone: impl Fn(usize) -> bool) {
        while let Some(inst) = self.top() {
            if !gone(inst.slot.get()) {
                break;
            }
            self.finish(inst, |part, _| {
                part.counters.missed.fetch_add(1, Ordering::Relaxed);
            });
        }
    }

    fn top(&self) -> Option<&Instance> {
        self.depth.get().checked_sub(1).map(|d| &self.instances[d])
    }

    /// Pops `inst` (the top), hands its consumer to `with` if it is still
    /// alive, uncharges and releases it. Frees nothing: async-signal-safe.
    fn finish(&self, inst: &Instance, with: impl FnOnce(&ReturnPart, &Instance)) {
        self.depth.set(self.depth.get() - 1);
        let Some(hold) = inst.hold.take() else {
            return;
        };
        let undo_charge = |part: &ReturnPart| {
            uncharge(
                part.in_flight.as_ref(),
                &part.counters,
                inst.charged.get(),
                inst.pinned.get(),
            );
        };
        let Some(leases) = LEASES.get() else { return };
        match hold {
            Hold::Lease(raw) => {
                // SAFETY: `raw` came from this block in `prepare`, once.
                let lease = unsafe { self.block.from_raw(raw) };
                if let Some(held) = lease.consume() {
                    with(&held, inst);
                    undo_charge(&held);
                    leases.release(held);
                }
            }
            Hold::Reference(part) => {
                with(&part, inst);
                undo_charge(&part);
                drop_reference(leases, part);
            }
        }
    }
}

/// Drops a reference taken per pending return (the refcount mode): a
/// plain decrement, as the kernel's `put_uprobe`, unless it could be the
/// last one (the consumer was detached), which goes to the lease set's
/// thread instead. Async-signal-safe.
fn drop_reference(leases: &LeaseSet<'static, ReturnPart>, part: Strong<ReturnPart>) {
    // Inside a read section of the domain, a value seen not retired keeps
    // the cell's own reference until after the section: it is not ours to
    // free.
    let _section = RETURN_DOMAIN.read_lock();
    if part.is_retired() {
        leases.drop_later(part);
    } else {
        drop(part);
    }
}

/// Undoes what `prepare` charged for one return: the in-flight charge
/// (if `charged`) and the reference taken with it (if `pinned`). The
/// caller holds the counters through the probe or its return part, so
/// nothing is freed here: async-signal-safe. Most returns charged
/// nothing: that test is inline, the rest out of line.
#[inline]
fn uncharge(
    in_flight: Option<&Arc<Account>>,
    counters: &Arc<ReturnCounters>,
    charged: bool,
    pinned: bool,
) {
    if charged || pinned {
        uncharge_charged(in_flight, counters, charged, pinned);
    }
}

/// [`uncharge`] of a return that charged something.
#[inline(never)]
fn uncharge_charged(
    in_flight: Option<&Arc<Account>>,
    counters: &Arc<ReturnCounters>,
    charged: bool,
    pinned: bool,
) {
    if let Some(account) = in_flight.filter(|_| charged) {
        // SAFETY: charged in `prepare` and forgotten there, once.
        unsafe { account.uncharge_unchecked() };
    }
    if pinned {
        // SAFETY: the count `prepare` took; the caller's hold on the
        // counters keeps this from being the last one.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(counters)) };
    }
}

/// Called by the trampoline when a hijacked function returns. Runs the
/// return handlers of the frame's instances and sends the thread on to
/// the original return address (`arch::trampoline::return_to`).
/// Async-signal-safe.
pub(crate) fn on_return(regs: &mut trampoline::SavedRegs, xmm: &mut trampoline::SavedVector) {
    let Some(original) = return_stubs::target_of(regs.ret as usize) else {
        // Only a stub's `call` enters the trampoline, and stubs always
        // have a target: nothing sane to return to.
        fatal(b"uprobe-core: return trampoline entered without a stub\n");
    };
    let slot = regs.entry_sp();
    if let Some(tr) = owned() {
        let was_inside = enter();
        // Inside the engine: the clock may be a probed libc function.
        if tr.timed.pending() {
            tr.timed.returned(slot, crate::clock::now());
        }
        tr.drop_abandoned(|s| s < slot);
        while let Some(inst) = tr.top() {
            if inst.slot.get() != slot || inst.ret.get() != original {
                break;
            }
            tr.finish(inst, |part, inst| {
                if was_inside {
                    if crate::thread::observed() {
                        part.counters.missed.fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
                crate::table::lookup::with_read_side(|| {
                    if part.detached.load(Ordering::Acquire) {
                        return;
                    }
                    part.counters.returns.add(1);
                    let abort = AbortOnUnwind::new();
                    let call = Returned {
                        func: inst.func.get(),
                        ret: original,
                        cookie: inst.cookie.get(),
                    };
                    part.handler.run(regs, xmm, call);
                    abort.disarm();
                });
            });
        }
        leave(was_inside);
    }
    trampoline::return_to(regs, original);
}

/// Pending returns of the calling thread (for tests). Async-signal-safe.
pub(crate) fn pending() -> usize {
    owned().map_or(0, |tr| tr.depth.get())
}

/// Per-thread stacks made so far.
pub(crate) fn stacks() -> usize {
    THREADS.get().map_or(0, Threads::capacity)
}

/// The process the service thread runs in (0: none).
static SERVICE_PID: Mutex<i32> = Mutex::new(0);

/// The process that started the first service thread (a fork child
/// inherits the number, and is not it).
static FIRST_SERVICE: AtomicI32 = AtomicI32::new(0);

/// Consumers with a return handler attached now. While there are none, the
/// service thread and the lease expiry thread end (see
/// [`consumers_detached`]); the next attach starts them again.
static RETURN_CONSUMERS: AtomicUsize = AtomicUsize::new(0);

/// `n` consumers with a return handler are (about to be) attached.
pub(crate) fn consumers_attached(n: usize) {
    RETURN_CONSUMERS.fetch_add(n, Ordering::Relaxed);
}

/// `n` consumers with a return handler were detached (after the grace
/// period past which none of their hits takes a lease). With none left,
/// the lease set's expiry thread ends once no lease is held, and the
/// service thread at its next round: a program that detached every
/// return probe keeps no thread of the engine's.
pub(crate) fn consumers_detached(n: usize) {
    if n == 0 {
        return;
    }
    let before = RETURN_CONSUMERS
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
            Some(c.saturating_sub(n))
        })
        .unwrap_or(0);
    if before <= n
        && let Some(leases) = LEASES.get()
    {
        leases.park_expiry();
    }
}

/// Starts the service thread in this process if it has none (a fork child
/// inherits none) and return consumers are attached. Not
/// async-signal-safe.
pub(crate) fn ensure_service() -> Result<(), AttachError> {
    let Some(threads) = THREADS.get() else {
        return Ok(());
    };
    if RETURN_CONSUMERS.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    if let Some(leases) = LEASES.get() {
        leases.resume_expiry().map_err(|e| AttachError::Os {
            what: "spawn the lease expiry thread of return probes",
            errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
        })?;
    }
    let mut pid = SERVICE_PID.lock().unwrap_or_else(PoisonError::into_inner);
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    if *pid == me {
        return Ok(());
    }
    let first = FIRST_SERVICE.load(Ordering::Relaxed);
    let forked = first != 0 && first != me;
    if first == 0 {
        FIRST_SERVICE.store(me, Ordering::Relaxed);
        // SAFETY: registering a plain function; the handler only stores.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    }
    std::thread::Builder::new()
        .name("uprobe-returns".into())
        .spawn(move || service(threads, forked))
        .map_err(|e| AttachError::Os {
            what: "spawn the return probe service thread",
            errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
        })?;
    *pid = me;
    Ok(())
}

/// In a fork child: the forking thread keeps its pending returns under its
/// new thread id. Async-signal-safe (a store).
extern "C" fn after_fork_in_child() {
    if let Some(tr) = owned() {
        tr.owner.store(current_tid(), Ordering::Release);
    }
}

/// The service loop: gives back the stacks of threads that are gone. In a
/// fork child, where the lease set's expiry thread does not exist, it also
/// expires every lease each round (as the kernel expires a child's).
fn service(threads: &'static Threads, forked: bool) {
    // Its calls (frees of stacks) are not the program's.
    crate::thread::set_observed(false);
    loop {
        std::thread::sleep(SERVICE_PERIOD);
        reap(threads);
        // No return consumer left: end (under the lock `ensure_service`
        // takes, so an attach either sees this thread or starts another).
        // Stacks of threads that die meanwhile are reaped by the next one.
        {
            let mut pid = SERVICE_PID.lock().unwrap_or_else(PoisonError::into_inner);
            if RETURN_CONSUMERS.load(Ordering::Relaxed) == 0 {
                *pid = 0;
                return;
            }
        }
        if let Some(leases) = LEASES.get() {
            threads.keep_spare(leases);
        }
        if forked && let Some(leases) = LEASES.get() {
            let _ = leases.expire_all();
        }
    }
}

/// Releases everything held by threads that no longer exist. Ordinary
/// context.
fn reap(threads: &Threads) {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    for chunk in threads.made() {
        for tr in &chunk.all {
            let tid = tr.owner.load(Ordering::Acquire);
            if tid == 0 || thread_exists(pid, tid) {
                continue;
            }
            // The owner is gone: its stack is ours now.
            tr.drop_abandoned(|_| true);
            tr.timed.clear();
            let element = tr.element.load(Ordering::Relaxed);
            tr.owner.store(0, Ordering::Release);
            threads.taken.fetch_sub(1, Ordering::Relaxed);
            // SAFETY: the element index was taken from this chunk's pool
            // by the owner and is given back once.
            chunk.free.push(unsafe { chunk.free.from_index(element) });
        }
    }
}

/// The threads of this process now (1 if `/proc` cannot tell).
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(1, Iterator::count)
}

fn thread_exists(pid: i32, tid: i32) -> bool {
    // SAFETY: signal 0 only checks that the thread exists.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
