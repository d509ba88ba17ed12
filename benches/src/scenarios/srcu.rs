//! `srcu-read`, `srcu-sync` and `lease`: seed 002, SRCU read sections and
//! leases against a reference count per access and against the
//! reclamation schemes Rust users pick today.

use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering, compiler_fence};

use arc_swap::ArcSwap;
use seize::{Collector, Guard as _};
use srcu::{LeaseSet, Srcu, SrcuCell};

use crate::harness::{Scenario, Workload, split_lists};

pub const READ: Scenario = Scenario {
    name: "srcu-read",
    about: "seed 002: each thread loops read-lock, read through a protected pointer, unlock (refcount = Arc clone+drop, the seed's WITHOUT SRCU row); urcu-memb is liburcu's default flavour itself (C, its inline read side; where liburcu-dev was installed at build time); thread-local is the floor: liburcu's memb read side (a thread-local word takes the grace-period counter, compiler barriers), with no writer, no registration, no unlock by another thread and no domain",
    impls: &[
        "srcu",
        "urcu-memb",
        "thread-local",
        "refcount",
        "epoch",
        "seize",
        "arc-swap",
    ],
    build: build_read,
    lists: &[],
};

pub const SYNC: Scenario = Scenario {
    name: "srcu-sync",
    about: "seed 002: one thread calls synchronize() in a loop while the others run short read sections; rows srcu:syncs and srcu:reads; --lists N builds the domain's counts as if the machine had N CPUs",
    impls: &["srcu"],
    build: build_sync,
    lists: &["srcu"],
};

pub const LEASE: Scenario = Scenario {
    name: "lease",
    about: "seed 002: each thread takes a lease on a value and consumes it (lease) vs clones and drops one shared Arc (refcount)",
    impls: &["lease", "refcount"],
    build: build_lease,
    lists: &[],
};

/// A domain per workload, leaked: workloads are few and short-lived, and
/// a `SrcuCell` needs a domain that outlives it.
fn domain() -> &'static Srcu {
    domain_for(None)
}

/// A domain for the machine's CPUs, or as if it had `cpus` (leaked: the
/// bench's cells borrow it for good).
fn domain_for(cpus: Option<usize>) -> &'static Srcu {
    let d: &'static Srcu = Box::leak(Box::new(cpus.map_or_else(Srcu::new, Srcu::with_cpus)));
    d.prepare();
    d
}

struct SrcuRead {
    domain: &'static Srcu,
    cell: SrcuCell<'static, u64>,
}

impl Workload for SrcuRead {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        for _ in 0..iters {
            if let Some(v) = self.cell.read() {
                acc = acc.wrapping_add(*v);
            }
        }
        black_box(acc);
    }
}

/// The floor: liburcu's `urcu-memb` read-side fast path, reading through
/// a pointer in between. What it leaves out is what makes it a floor:
/// no grace period ever waits for it (so its writer-side `membarrier`
/// and the scan of registered threads are absent), threads are not
/// registered, and a section can only end on the thread that began it.
struct ThreadLocalRead {
    ptr: AtomicPtr<u64>,
    /// The grace-period counter a reader's word takes at its outermost
    /// lock (liburcu's `gp.ctr`: a phase bit and a nesting count of one;
    /// constant here, as no writer runs), and the word a reader checks
    /// after its outermost unlock to wake a waiting writer (`gp.futex`).
    /// Fields, not statics: a static never written is folded into a
    /// constant, and liburcu loads both from memory.
    gp_counter: AtomicU64,
    gp_futex: AtomicU64,
}

const NEST_MASK: u64 = 0xffff_ffff;

thread_local! {
    /// The reader's word: 0 outside a section, else the phase it took
    /// plus the nesting depth.
    static READER: Cell<u64> = const { Cell::new(0) };
}

impl Workload for ThreadLocalRead {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        let mut wakeups = 0u64;
        for _ in 0..iters {
            READER.with(|r| {
                let word = r.get();
                r.set(if word & NEST_MASK == 0 {
                    self.gp_counter.load(Ordering::Relaxed)
                } else {
                    word + 1
                });
            });
            compiler_fence(Ordering::SeqCst);
            // SAFETY: the pointer is set once and never freed while the
            // workload lives.
            acc = acc.wrapping_add(unsafe { *self.ptr.load(Ordering::Acquire) });
            compiler_fence(Ordering::SeqCst);
            READER.with(|r| {
                let word = r.get();
                r.set(word - 1);
                if word & NEST_MASK == 1 {
                    compiler_fence(Ordering::SeqCst);
                    wakeups += u64::from(self.gp_futex.load(Ordering::Relaxed) != 0);
                }
            });
        }
        black_box((acc, wakeups));
    }
}

impl Drop for ThreadLocalRead {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` in `build_read`, no reader left.
        drop(unsafe { Box::from_raw(*self.ptr.get_mut()) });
    }
}

struct Refcount(Arc<u64>);

impl Workload for Refcount {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        for _ in 0..iters {
            let a = Arc::clone(&self.0);
            acc = acc.wrapping_add(*a);
        }
        black_box(acc);
    }
}

struct Epoch(crossbeam_epoch::Atomic<u64>);

impl Workload for Epoch {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        for _ in 0..iters {
            let g = crossbeam_epoch::pin();
            // SAFETY: the value is never retired during the benchmark.
            acc = acc.wrapping_add(*unsafe { self.0.load(Ordering::Acquire, &g).deref() });
        }
        black_box(acc);
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        // SAFETY: no guard is alive; the pointer came from `Owned::new`.
        drop(unsafe { std::mem::take(&mut self.0).into_owned() });
    }
}

struct Seize {
    collector: Collector,
    ptr: AtomicPtr<u64>,
}

impl Workload for Seize {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        for _ in 0..iters {
            let g = self.collector.enter();
            // SAFETY: the value is never retired during the benchmark.
            acc = acc.wrapping_add(unsafe { *g.protect(&self.ptr, Ordering::Acquire) });
        }
        black_box(acc);
    }
}

impl Drop for Seize {
    fn drop(&mut self) {
        // SAFETY: from `Box::into_raw`, no reader left.
        drop(unsafe { Box::from_raw(*self.ptr.get_mut()) });
    }
}

struct ArcSwapRead(ArcSwap<u64>);

impl Workload for ArcSwapRead {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        for _ in 0..iters {
            acc = acc.wrapping_add(**self.0.load());
        }
        black_box(acc);
    }
}

/// liburcu's `urcu-memb` read side, in C (`urcu_memb.c`).
#[cfg(has_liburcu)]
struct UrcuMemb(Box<u64>);

#[cfg(has_liburcu)]
unsafe extern "C" {
    fn kscale_urcu_memb_reads(ptr: *const *const u64, iters: u64) -> u64;
    fn kscale_urcu_memb_register();
    fn kscale_urcu_memb_unregister();
}

/// The calling thread's liburcu registration, undone when it exits.
#[cfg(has_liburcu)]
struct Registered;

#[cfg(has_liburcu)]
impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: registered when this was made, on this thread.
        unsafe { kscale_urcu_memb_unregister() };
    }
}

#[cfg(has_liburcu)]
std::thread_local! {
    static REGISTERED: Registered = {
        // SAFETY: registers the calling thread with liburcu once.
        unsafe { kscale_urcu_memb_register() };
        Registered
    };
}

#[cfg(has_liburcu)]
impl Workload for UrcuMemb {
    fn run(&self, _tid: usize, iters: u64) {
        REGISTERED.with(|_| {});
        let p: *const u64 = &raw const *self.0;
        // SAFETY: the C loop reads through `p`, which lives as long as
        // `self`, on a registered thread.
        black_box(unsafe { kscale_urcu_memb_reads(&raw const p, iters) });
    }
}

#[cfg(has_liburcu)]
#[allow(clippy::unnecessary_wraps)] // the other cfg's signature
fn urcu_memb() -> Result<Box<dyn Workload>, String> {
    Ok(Box::new(UrcuMemb(Box::new(7))))
}

#[cfg(not(has_liburcu))]
fn urcu_memb() -> Result<Box<dyn Workload>, String> {
    Err("liburcu-dev was not installed when bench was built".into())
}

fn build_read(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    Ok(match imp {
        "srcu" => {
            let domain = domain();
            Box::new(SrcuRead {
                domain,
                cell: SrcuCell::new(domain, Some(7)),
            })
        }
        "thread-local" => Box::new(ThreadLocalRead {
            ptr: AtomicPtr::new(Box::into_raw(Box::new(7))),
            gp_counter: AtomicU64::new(1 << 32 | 1),
            gp_futex: AtomicU64::new(0),
        }),
        "refcount" => Box::new(Refcount(Arc::new(7))),
        "epoch" => Box::new(Epoch(crossbeam_epoch::Atomic::new(7))),
        "seize" => Box::new(Seize {
            collector: Collector::new(),
            ptr: AtomicPtr::new(Box::into_raw(Box::new(7))),
        }),
        "arc-swap" => Box::new(ArcSwapRead(ArcSwap::from_pointee(7))),
        "urcu-memb" => urcu_memb()?,
        _ => unreachable!("unknown implementation {imp}"),
    })
}

/// Worker 0 runs grace periods, the others short read sections.
struct Sync(SrcuRead);

impl Workload for Sync {
    fn run(&self, tid: usize, iters: u64) {
        if tid == 0 {
            for _ in 0..iters {
                self.0.domain.synchronize();
            }
        } else {
            self.0.run(tid, iters);
        }
    }

    fn role(&self, tid: usize) -> &'static str {
        if tid == 0 { "syncs" } else { "reads" }
    }

    fn batch(&self, tid: usize) -> u64 {
        if tid == 0 { 16 } else { 1024 }
    }
}

fn build_sync(imp: &str, threads: usize) -> Result<Box<dyn Workload>, String> {
    if threads < 2 {
        return Err("needs 2 or more threads: one calls synchronize(), the rest read".into());
    }
    let domain = domain_for(split_lists(imp).1);
    Ok(Box::new(Sync(SrcuRead {
        domain,
        cell: SrcuCell::new(domain, Some(7)),
    })))
}

struct Lease {
    cell: SrcuCell<'static, u64>,
    set: LeaseSet<'static, u64>,
}

impl Workload for Lease {
    fn run(&self, _tid: usize, iters: u64) {
        // One block per batch and thread (a block belongs to one thread).
        let block = self.set.block(1);
        let mut acc = 0u64;
        for _ in 0..iters {
            let lease = block.lease(&self.cell).expect("slot free, cell full");
            acc = acc.wrapping_add(*lease.consume().expect("not retired"));
        }
        black_box(acc);
    }
}

#[allow(clippy::unnecessary_wraps)] // the signature of `harness::Build`
fn build_lease(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    Ok(match imp {
        "lease" => {
            let domain = domain();
            Box::new(Lease {
                cell: SrcuCell::new(domain, Some(7)),
                set: LeaseSet::new(domain),
            })
        }
        "refcount" => Box::new(Refcount(Arc::new(7))),
        _ => unreachable!("unknown implementation {imp}"),
    })
}
