//! Return probes: the per-thread stack of pending returns, how they reach
//! their consumers, and the service thread that cleans up after threads
//! that died with returns pending.
//!
//! **At the entry** of a consumer with a return handler, the engine
//! [`prepare`]s a return: it names the consumer's return part, charges
//! the consumer's in-flight account if it has a limit (`sigpending`), and
//! replaces the return address with the stub of the return trampoline for
//! that call site (see the arch's `trampoline`). The instance (what names
//! the part, original return address, stack slot, cookie) goes on the
//! thread's [`ThreadReturns`] stack.
//!
//! **What names the part.** A pending return that owes nothing at its end
//! (the default) holds nothing: it names the consumer's switch and its
//! generation (`crate::site::switch`), and its return reaches the part
//! inside a read section of the table's domain, or not at all once the
//! consumer is detached, as the kernel's `handle_uretprobe_chain` walks
//! only the consumers live at the return. Where such a consumer has no entry
//! handler and its site runs through a jump, the architecture's return
//! entry routine pushes the instance itself, with no register frame and
//! no call into Rust (x86-64's `lean_return`): the instance's layout is
//! `#[repr(C)]` for it (`crate::base::abi`). One that charged an in-flight
//! account (it must uncharge it), or whose handler runs after detach,
//! holds an `srcu` **lease** on the part (as the kernel's uretprobes since
//! 2024: an SRCU read section that the lease set's expiry thread turns
//! into a reference after 100 ms, instead of a reference count per hit),
//! in a separate domain that detach never waits for; the part is freed
//! after two grace periods of that domain, which expiry keeps bounded.
//!
//! **At the return**, the plain-code trampoline calls [`on_return`]:
//! instances of frames that are gone (`longjmp`, unwinding) are dropped,
//! the instances of this frame (several when chained: tail calls, several
//! consumers) run their handlers and are consumed, and the thread goes on
//! at the original return address, which the stub itself names: returning
//! never depends on this bookkeeping. A return handler runs only inside a
//! read section of the table's domain and only if its consumer was not
//! detached (unless it runs after detach), so a detach (which turns the
//! switch off or marks the part, then waits for a grace period of that
//! domain) returns once no return handler of it runs or will run.
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
use std::sync::{Arc, OnceLock};

use sigpending::Account;
use srcu::{LeaseBlock, LeaseSet, RawLease, Strong};

use super::timing::TimedStack;
use crate::AttachError;
use crate::arch::{SavedRegs, SavedVector, trampoline};
use crate::base::thread::{AbortOnUnwind, enter, fatal, leave};
use crate::code::return_stubs;
use crate::site::handler::Returned;
use crate::site::returns::{
    Pinning, RETURN_DOMAIN, Reach, ReturnCounters, ReturnHold, ReturnPart, ReturnProbe, hold_mode,
    pinning,
};
use crate::site::switch::Switch;

pub(crate) use crate::base::abi::MAX_RETURN_DEPTH;

/// What a pending return that keeps its consumer's return part alive
/// holds (one that names its switch holds nothing).
enum KeepAlive {
    Lease(RawLease),
    Reference(Strong<ReturnPart>),
}

/// One pending return. `#[repr(C)]`: the architecture's routines read
/// its slot, and its return entry routine writes every field but `hold`
/// (`crate::base::abi`).
#[repr(C)]
struct PendingReturn {
    /// Where the return address lives (x86-64: the stack slot; a frame is
    /// gone once the stack pointer is above it).
    slot: Cell<usize>,
    /// The probed function.
    func: Cell<usize>,
    /// The original return address.
    ret: Cell<usize>,
    cookie: Cell<u64>,
    /// The consumer's switch, for a pending return that holds nothing
    /// (null otherwise): its return reaches the part while the switch is
    /// on for `generation`.
    switch: Cell<*const Switch>,
    generation: Cell<u64>,
    charged: Cell<bool>,
    /// The charge took a reference on the counters (`Pinning::PerReturn`).
    pinned: Cell<bool>,
    /// A lease or reference, for one that keeps the part alive. `None`
    /// above the depth (`finish` takes it): the return entry routine,
    /// which never writes it, relies on that.
    hold: Cell<Option<KeepAlive>>,
}

impl Default for PendingReturn {
    fn default() -> Self {
        Self {
            slot: Cell::new(0),
            func: Cell::new(0),
            ret: Cell::new(0),
            cookie: Cell::new(0),
            switch: Cell::new(core::ptr::null()),
            generation: Cell::new(0),
            charged: Cell::new(false),
            pinned: Cell::new(false),
            hold: Cell::new(None),
        }
    }
}

/// One thread's pending returns. `#[repr(C)]`: the architecture's timing
/// routines read its timed calls, its depth and its top pending return's
/// slot (a return with a pending return of its frame there goes to the
/// engine) at the offsets `crate::base::abi` declares.
#[repr(C)]
pub(crate) struct ThreadReturns {
    /// Its pending calls of timing probes.
    timed: TimedStack,
    depth: Cell<usize>,
    instances: [PendingReturn; MAX_RETURN_DEPTH],
    /// The owning thread's id (0: free).
    owner: AtomicI32,
    /// Its element index in the free pool, while owned.
    element: AtomicUsize,
    block: LeaseBlock<'static, 'static, ReturnPart>,
}

const _: () = {
    use crate::base::abi;
    use core::mem::{offset_of, size_of};
    assert!(
        offset_of!(ThreadReturns, timed) == abi::RETURNS_TIMED_AT
            && offset_of!(ThreadReturns, depth) == abi::RETURNS_DEPTH_AT
            && offset_of!(ThreadReturns, instances) == abi::RETURNS_AT
            && size_of::<PendingReturn>() == abi::RETURN_SIZE
            && offset_of!(PendingReturn, slot) == abi::RETURN_SLOT_AT
            && offset_of!(PendingReturn, func) == abi::RETURN_FUNC_AT
            && offset_of!(PendingReturn, ret) == abi::RETURN_RET_AT
            && offset_of!(PendingReturn, cookie) == abi::RETURN_COOKIE_AT
            && offset_of!(PendingReturn, switch) == abi::RETURN_SWITCH_AT
            && offset_of!(PendingReturn, generation) == abi::RETURN_GENERATION_AT
            && offset_of!(PendingReturn, charged) == abi::RETURN_CHARGED_AT
            && offset_of!(PendingReturn, pinned) == abi::RETURN_CHARGED_AT + 1
    );
};

// SAFETY: the cells are used by the owning thread only (its trap handler
// and trampoline, which never interleave on one stack: both run with the
// thread marked as inside the engine), or by the service thread once the
// owner is gone; `owner` and `element` are atomics.
unsafe impl Sync for ThreadReturns {}
// SAFETY: as above: ownership moves between threads, never shared use.
unsafe impl Send for ThreadReturns {}

/// The lease set pending returns take their leases from.
static LEASES: OnceLock<LeaseSet<'static, ReturnPart>> = OnceLock::new();
mod pool;
mod service;

#[cfg(feature = "test-hooks")]
pub(crate) use pool::stacks;
use pool::{thread_stack, thread_stack_or_take};
pub(crate) use service::{consumers_attached, consumers_detached, ensure_service};

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
            errno: crate::base::error::Errno::of(&e, libc::EAGAIN),
        })?;
        // Another attach may have won the race: its set is kept.
        LEASES.get_or_init(|| set)
    };
    // Room for every thread there is now, and as many again.
    pool::pool().grow_to(leases, 2 * service::thread_count());
    ensure_service()
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
    let Some(tr) = thread_stack_or_take() else {
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
    // every call.
    let inst = &tr.instances[depth];
    let slot = inst.hold.as_ptr();
    // SAFETY: an instance above the depth holds nothing (`finish` took
    // its hold, or it never had one), so nothing that needs dropping is
    // overwritten; the thread's own stack, not shared, and no other hit
    // of the thread gets here meanwhile (it is inside the engine).
    debug_assert!(unsafe { &*slot }.is_none());
    inst.switch.set(core::ptr::null());
    let held = match &probe.reach {
        Reach::Switched { switch, .. } => {
            inst.switch.set(*switch);
            inst.generation.set(switch.generation());
            true
        }
        Reach::Leased(cell) if hold_mode() == ReturnHold::Refcount => cell
            .get()
            .map(|part| {
                // SAFETY: as above.
                unsafe { slot.write(Some(KeepAlive::Reference(part))) };
            })
            .is_some(),
        Reach::Leased(cell) => tr
            .block
            .lease(cell)
            .map(|l| {
                // SAFETY: as above.
                unsafe { slot.write(Some(KeepAlive::Lease(l.into_raw()))) };
            })
            .is_ok(),
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
    let Some(tr) = thread_stack_or_take() else {
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
    if tr.timed.push(sp, crate::base::clock::now(), switch)
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

    fn top(&self) -> Option<&PendingReturn> {
        self.depth.get().checked_sub(1).map(|d| &self.instances[d])
    }

    /// Pops `inst` (the top), hands its consumer to `with` if it is still
    /// alive, uncharges and releases it. Frees nothing: async-signal-safe.
    /// Called inside a read section of the table's domain (what a pending
    /// return that holds nothing reaches its part in).
    fn finish(&self, inst: &PendingReturn, with: impl FnOnce(&ReturnPart, &PendingReturn)) {
        self.depth.set(self.depth.get() - 1);
        // SAFETY: switches are never freed.
        if let Some(switch) = unsafe { inst.switch.get().as_ref() } {
            // Named only where nothing was charged: nothing to undo.
            // SAFETY: the caller's read section; a return probe's switch.
            if let Some(part) = unsafe { switch.part_of(inst.generation.get()) } {
                with(part, inst);
            }
            return;
        }
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
        match hold {
            KeepAlive::Lease(raw) => {
                let Some(leases) = LEASES.get() else { return };
                // SAFETY: `raw` came from this block in `prepare`, once.
                let lease = unsafe { self.block.from_raw(raw) };
                if let Some(held) = lease.consume() {
                    with(&held, inst);
                    undo_charge(&held);
                    leases.release(held);
                }
            }
            KeepAlive::Reference(part) => {
                let Some(leases) = LEASES.get() else { return };
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
pub(crate) fn on_return(regs: &mut SavedRegs, xmm: &mut SavedVector) {
    let Some(original) = return_stubs::target_of(regs.ret as usize) else {
        // Only a stub's `call` enters the trampoline, and stubs always
        // have a target: nothing sane to return to.
        fatal(b"uprobe-core: return trampoline entered without a stub\n");
    };
    let slot = regs.entry_sp();
    if let Some(tr) = thread_stack() {
        let was_inside = enter();
        // Inside the engine: the clock may be a probed libc function.
        if tr.timed.pending() {
            tr.timed.returned(slot, crate::base::clock::now());
        }
        // One read section for the frame's returns: those that hold
        // nothing reach their parts in it, and handlers run in it.
        crate::table::lookup::with_read_side(|| {
            tr.drop_abandoned(|s| s < slot);
            while let Some(inst) = tr.top() {
                if inst.slot.get() != slot || inst.ret.get() != original {
                    break;
                }
                tr.finish(inst, |part, inst| {
                    if was_inside {
                        if crate::base::thread::observed() {
                            part.counters.missed.fetch_add(1, Ordering::Relaxed);
                        }
                        return;
                    }
                    if part.detached.load(Ordering::Acquire) && !part.after_detach {
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
            }
        });
        leave(was_inside);
    }
    trampoline::return_to(regs, original);
}

/// Pending returns of the calling thread (for tests). Async-signal-safe.
#[cfg(feature = "test-hooks")]
pub(crate) fn pending() -> usize {
    thread_stack().map_or(0, |tr| tr.depth.get())
}
