//! `fork()`: what a child inherits and what it does about it.
//!
//! Only the forking thread exists in the child. Three things of the parent
//! would otherwise stall the child forever:
//!
//! - **locks** held by other threads at the fork (a domain's callback
//!   queue, a lease set's block list and thread control). The `prepare`
//!   handler takes them, in one order, before the fork, and both sides
//!   release them after it, so the child finds them free and consistent.
//!   These locks are held for a few instructions, or (a lease set's
//!   expiry buffer) for one expiry round, which waits for nothing the
//!   forking thread holds; the one lock held for long, the grace-period
//!   lock, is not taken: a child takes it over from a thread of the
//!   parent (see `GpLock`).
//! - **read sections** of threads that do not exist in the child. The
//!   child handler first expires every lease of every lease set (a lease's
//!   section is ended the ordinary way, its value kept by a reference),
//!   then frees the other threads' reader slots with their guard sections
//!   (`readers::after_fork`) and, if the forking thread holds no
//!   section counted per CPU that ends on it (`SECTIONS_HELD`), discounts
//!   every section counted per CPU in every domain. Raw sections
//!   (`read_lock_raw`) open at the fork are discounted too: ending one in
//!   the child is a broken contract of `read_unlock_raw`. If the forking
//!   thread does hold one, the per-CPU counts stay (they do not say whose
//!   a section is): grace periods in the child then wait for the parent's
//!   other per-CPU readers, as `Srcu`'s docs say.
//! - **helper threads** (the reclaimer, the lease expiry threads) do not
//!   exist in the child. Each domain restarts them on its first ordinary
//!   use in the child (`Srcu::revive`), from `synchronize`, `call`,
//!   `barrier` and the lease sets' non-signal-safe operations; the batch
//!   the parent's reclaimer was waiting a grace period for is queued again.
//!
//! This module owns what the handlers need, below the domains: the list
//! of domains (each registers itself when allocated and answers through
//! `Domain`), each domain's list of lease sets (`LeaseSets`, answering
//! through `ForkHooks`), the fork generation, and the count of this
//! thread's sections counted per CPU. It uses only `readers` (whose slots
//! it frees in a child).

// Under loom only the traits, the lists of lease sets and `held_add` are
// used (fork is no model).
#![cfg_attr(pcpu_loom, allow(dead_code, unused_imports))]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

// Statics: plain atomics (loom's are not const), and fork is no model.
use core::sync::atomic::{AtomicU64, Ordering};

/// What the fork handlers need of a domain (type-erased: a domain
/// registers itself when allocated, see `register`).
pub(crate) trait Domain: Send + Sync {
    /// `prepare`: takes the domain's locks (its callback queue, then its
    /// lease sets', see `LeaseSets::lock_for_fork`), pushing their
    /// guards on `held`.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    fn lock_for_fork(self: Arc<Self>, held: &mut Vec<Box<dyn HeldLock>>);
    /// The domain's lease sets.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    fn lease_sets(&self) -> &LeaseSets;
    /// In the child (only the forking thread exists), when that thread
    /// holds no section counted per CPU: ends every section counted per
    /// CPU, so that grace periods stop waiting for threads that do not
    /// exist here (the other threads' guard sections are ended in their
    /// slots by `readers::after_fork`).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    fn discount_per_cpu(&self);
}

/// What the fork handlers need of a lease set (type-erased over `T`).
pub(crate) trait ForkHooks: Send + Sync {
    /// `prepare`: takes the set's locks, pushing their guards on `held`.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    fn lock_for_fork(self: Arc<Self>, held: &mut Vec<Box<dyn HeldLock>>);
    /// In the child, before sections are discounted: expires every lease
    /// (nothing else runs in the child yet).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    fn expire_in_child(&self);
    /// In the child, on first use: starts the expiry thread anew.
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    fn restart(self: Arc<Self>);
}

/// A lock guard kept across `fork` (only dropped).
pub(crate) trait HeldLock {}
impl<T> HeldLock for T {}

/// A guard of a lock inside `owner`, kept alive with it.
struct Hold<O: ?Sized + 'static, S: 'static> {
    guard: core::mem::ManuallyDrop<MutexGuard<'static, S>>,
    _owner: Arc<O>,
}

impl<O: ?Sized + 'static, S: 'static> Drop for Hold<O, S> {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, before `_owner` (fields drop after
        // this body), which keeps the mutex alive.
        unsafe { core::mem::ManuallyDrop::drop(&mut self.guard) };
    }
}

/// Locks `mutex` and pushes the guard, with `owner`, on `held`.
///
/// # Safety
/// `mutex` lives inside `owner`'s allocation (so `owner` keeps it alive).
#[cfg_attr(pcpu_loom, allow(dead_code))]
pub(crate) unsafe fn hold<O: ?Sized + 'static, S: 'static>(
    owner: &Arc<O>,
    mutex: &Mutex<S>,
    held: &mut Vec<Box<dyn HeldLock>>,
) {
    let guard = mutex.lock().unwrap_or_else(PoisonError::into_inner);
    // SAFETY: the guard borrows from `owner`'s allocation (the caller's
    // contract), which `Hold` keeps alive until after the guard is dropped
    // (see its `Drop`).
    let guard: MutexGuard<'static, S> = unsafe { core::mem::transmute(guard) };
    held.push(Box::new(Hold {
        guard: core::mem::ManuallyDrop::new(guard),
        _owner: Arc::clone(owner),
    }));
}

/// The lease sets of one domain, for the fork handlers (expired in a
/// child, their expiry threads restarted there).
#[derive(Default)]
pub(crate) struct LeaseSets(Mutex<Vec<Weak<dyn ForkHooks>>>);

impl LeaseSets {
    /// Registers `set`, forgetting the sets that no longer exist.
    pub(crate) fn add(&self, set: &Arc<dyn ForkHooks>) {
        let mut sets = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        sets.retain(|s| s.strong_count() > 0);
        sets.push(Arc::downgrade(set));
    }

    /// The sets registered that still exist.
    pub(crate) fn live(&self) -> Vec<Arc<dyn ForkHooks>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// `prepare`: takes the list's lock, then every set's locks, pushing
    /// the guards on `held`.
    ///
    /// # Safety
    /// `self` lives inside `owner`'s allocation (so `owner` keeps it alive).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    pub(crate) unsafe fn lock_for_fork<O: ?Sized + 'static>(
        &self,
        owner: &Arc<O>,
        held: &mut Vec<Box<dyn HeldLock>>,
    ) {
        let guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let sets: Vec<Arc<dyn ForkHooks>> = guard.iter().filter_map(Weak::upgrade).collect();
        // SAFETY: as in `hold`: the mutex lives in `owner`'s allocation
        // (the caller's contract), which `Hold` keeps alive past the guard.
        let guard: MutexGuard<'static, Vec<Weak<dyn ForkHooks>>> =
            unsafe { core::mem::transmute(guard) };
        held.push(Box::new(Hold {
            guard: core::mem::ManuallyDrop::new(guard),
            _owner: Arc::clone(owner),
        }));
        for set in sets {
            set.lock_for_fork(held);
        }
    }
}

/// Every domain allocated so far (weakly), for the fork handlers.
static DOMAINS: Mutex<Vec<Weak<dyn Domain>>> = Mutex::new(Vec::new());

/// Forks this process has gone through in the child's line (incremented
/// in each child): helper threads started in an older generation do not
/// exist.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The current fork generation.
#[cfg_attr(pcpu_loom, allow(dead_code))]
pub(crate) fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Registers a new domain with the fork handlers (installed on the first).
#[cfg(not(pcpu_loom))]
pub(crate) fn register<D: Domain + 'static>(domain: &Arc<D>) {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        // SAFETY: plain functions; see each for what it may do.
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        assert_eq!(rc, 0, "pthread_atfork failed");
    });
    let mut domains = DOMAINS.lock().unwrap_or_else(PoisonError::into_inner);
    domains.retain(|d| d.strong_count() > 0);
    let domain: Weak<D> = Arc::downgrade(domain);
    domains.push(domain);
}

#[cfg(not(pcpu_loom))]
thread_local! {
    /// Sections counted per CPU that end on this thread (a consumed
    /// lease's `LeasedValue`, a `ReadGuard` of a thread that found no free
    /// slot), of every domain. Const-initialised without a
    /// destructor: no lazy allocation, usable from signal handlers (a
    /// handler's sections are balanced, so interrupting the owner's
    /// read-modify-write loses nothing). Guards are not `Send`, so this is
    /// exact. Read at fork: the child discounts the sections of the threads
    /// that do not exist there only if the forking thread holds none.
    static SECTIONS_HELD: core::cell::Cell<usize> = const { core::cell::Cell::new(0) };
}

/// Counts a thread-bound per-CPU section opened (`1`) or closed (`-1`) on this thread.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) fn held_add(delta: isize) {
    #[cfg(not(pcpu_loom))]
    SECTIONS_HELD.with(|h| h.set(h.get().wrapping_add_signed(delta)));
    #[cfg(pcpu_loom)]
    let _ = delta;
}

/// Thread-bound per-CPU sections open on this thread.
#[cfg(not(pcpu_loom))]
fn held() -> usize {
    SECTIONS_HELD.with(core::cell::Cell::get)
}

/// What the forking thread holds across `fork`: the per-domain locks and
/// the domain list's lock.
#[cfg(not(pcpu_loom))]
struct ForkHeld {
    locks: Vec<Box<dyn HeldLock>>,
    /// Held until released after the per-domain locks.
    _domains: MutexGuard<'static, Vec<Weak<dyn Domain>>>,
}

#[cfg(not(pcpu_loom))]
thread_local! {
    /// What the forking thread holds across `fork` (set by `prepare`,
    /// released by `parent` or in the child). A plain pointer: no
    /// thread-local destructor is registered (and no memory freed at the
    /// thread's exit) because a thread once forked.
    static HELD: core::cell::Cell<*mut ForkHeld> = const { core::cell::Cell::new(core::ptr::null_mut()) };
}

/// The pid that last ran `prepare` (a child's pid differs), and the child
/// that last ran the child handler (run once per fork).
static FORKING_PID: AtomicU64 = AtomicU64::new(0);
static HANDLED_PID: AtomicU64 = AtomicU64::new(0);

/// `pthread_atfork` prepare: takes every lock a child must find free, in
/// one order (the domain list, then per domain its callback queue and its
/// list of lease sets, then per lease set its own locks). Each is held
/// briefly by its users, never while waiting for another.
#[cfg(not(pcpu_loom))]
extern "C" fn prepare() {
    FORKING_PID.store(u64::from(std::process::id()), Ordering::Relaxed);
    let domains = DOMAINS.lock().unwrap_or_else(PoisonError::into_inner);
    let mut held = Vec::new();
    for domain in domains.iter().filter_map(Weak::upgrade) {
        domain.lock_for_fork(&mut held);
    }
    HELD.set(Box::into_raw(Box::new(ForkHeld {
        locks: held,
        _domains: domains,
    })));
}

/// Releases what `prepare` took (reverse order).
#[cfg(not(pcpu_loom))]
fn release() {
    let held = HELD.replace(core::ptr::null_mut());
    if held.is_null() {
        return;
    }
    // SAFETY: made by `prepare` on this thread, taken once.
    let mut held = unsafe { Box::from_raw(held) };
    while let Some(lock) = held.locks.pop() {
        drop(lock);
    }
    drop(held);
}

/// `pthread_atfork` parent: releases the locks.
#[cfg(not(pcpu_loom))]
extern "C" fn parent() {
    release();
}

/// `pthread_atfork` child.
#[cfg(not(pcpu_loom))]
extern "C" fn child() {
    after_fork_in_child();
}

/// srcu's fork-child handler, for other crates' own `pthread_atfork`
/// child handlers that use SRCU (run it first there: handlers run in
/// registration order, and srcu registers its own on the first domain's
/// allocation). Idempotent: the work is done once per fork, whoever calls
/// it first; a call outside a fork child does nothing.
///
/// In the child it releases the locks taken before the fork, expires
/// every lease of every [`LeaseSet`](crate::LeaseSet), discounts the
/// other threads' guard sections ([`ReadGuard`](crate::ReadGuard)) and,
/// if the forking thread holds no section counted per CPU that ends on it
/// (a consumed lease's [`LeasedValue`](crate::LeasedValue)) of any domain,
/// every section counted per CPU: grace periods in the child then wait
/// only for sections begun in the child and the forking thread's own.
/// The domains' reclaimer and expiry threads are restarted on first use.
///
/// Allocates (the child of a glibc process may); no other thread exists
/// when it runs.
pub fn after_fork_in_child() {
    #[cfg(not(pcpu_loom))]
    {
        let me = u64::from(std::process::id());
        if FORKING_PID.load(Ordering::Relaxed) == me || HANDLED_PID.swap(me, Ordering::AcqRel) == me
        {
            return; // not a child, or done already
        }
        release();
        GENERATION.fetch_add(1, Ordering::AcqRel);
        let domains: Vec<_> = DOMAINS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for domain in &domains {
            for set in domain.lease_sets().live() {
                set.expire_in_child();
            }
        }
        crate::readers::after_fork();
        if held() == 0 {
            for domain in &domains {
                domain.discount_per_cpu();
            }
        }
    }
}
