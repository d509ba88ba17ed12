//! `freelist-pop-empty`, `freelist-pushpop`, `freelist-steal`,
//! `freelist-oversub`: seed 004,
//! the per-CPU freelist with its `is_empty` hint, against the variants the
//! kernel went through and the pools Rust users pick today.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use core::ptr::NonNull;
use crossbeam_queue::ArrayQueue;
use lockfree_object_pool::LinearObjectPool;

use pcpu::unstable::bare_stack::BareStack;
use pcpu_freelist::{EmptyHint, FreeList};

use crate::harness::{Scenario, Workload, split_lists};

pub const POP_EMPTY: Scenario = Scenario {
    name: "freelist-pop-empty",
    about: "seed 004: every list empty, each thread pops in a loop (the map-full case): the crate's default hint (hint: the per-list flags summed up in a bitmap, a word per 64 lists) vs the per-list flag alone (flag: the patch as posted) vs head-pointer hint vs locking every list vs crossbeam ArrayQueue; --lists N builds the pools as if the machine had N CPUs",
    impls: &["hint", "flag", "head", "nohint", "arrayqueue"],
    build: build_pop_empty,
    lists: FREELISTS,
};

pub const STEAL: Scenario = Scenario {
    name: "freelist-steal",
    about: "seed 004: every free element on lists no thread runs on, far along each thread's walk (list N-1-c for the thread on CPU c); each thread pops one (a steal: its own list is empty) and puts it back on its far list (FreeList::push_to): the empty lists between walked by the summary's bits (hint), a flag a list (flag), a head a list (head) or every list's lock (nohint); --lists N builds the pools as if the machine had N CPUs (at least twice the threads)",
    impls: FREELISTS,
    build: build_steal,
    lists: FREELISTS,
};

/// The pools that `--lists` builds as if the machine had more CPUs.
const FREELISTS: &[&str] = &["hint", "flag", "head", "nohint"];

const PUSHPOP_IMPLS: &[&str] = &[
    "hint",
    "flag",
    "head",
    "nohint",
    "rseq-list",
    "arrayqueue",
    "object-pool",
    "sharded-slab",
];

pub const PUSHPOP: Scenario = Scenario {
    name: "freelist-pushpop",
    about: "seed 004: a prefilled pool, each thread pops one element and pushes it back (the normal case); rseq-list is the floor: bare per-CPU rseq lists as librseq's, one section per push or pop, with no lock word (no remote pop or push), no empty hint, no element handle and no steal path",
    impls: PUSHPOP_IMPLS,
    build: build_pushpop,
    lists: FREELISTS,
};

pub const OVERSUB: Scenario = Scenario {
    name: "freelist-oversub",
    about: "seed 004: freelist-pushpop with 4 threads pinned to each CPU (threads are preempted mid-operation); rows report per CPU",
    impls: PUSHPOP_IMPLS,
    build: build_oversub,
    lists: &[],
};

/// Threads pinned per CPU in `freelist-oversub`.
const OVERSUBSCRIPTION: usize = 4;

/// Elements per list in the prefilled pools (and the peers' capacity).
const PER_LIST: usize = 64;

fn hint_of(imp: &str) -> Option<EmptyHint> {
    match split_lists(imp).0 {
        "hint" => Some(EmptyHint::Summary),
        "flag" => Some(EmptyHint::Flag),
        "head" => Some(EmptyHint::Head),
        "nohint" => Some(EmptyHint::None),
        _ => None,
    }
}

/// The pool `imp` names (`IMPL@N`: as if the machine had N CPUs) holding
/// `PER_LIST` elements per list, spread over its lists.
fn freelist(imp: &str, hint: EmptyHint) -> FreeList<u64> {
    match split_lists(imp).1 {
        Some(cpus) => FreeList::with_lists(vec![0u64; PER_LIST * (cpus + 1)], hint, cpus),
        None => FreeList::with_hint(vec![0u64; capacity()], hint),
    }
}

fn capacity() -> usize {
    PER_LIST * (pcpu::possible_cpus() + 1)
}

/// Every element taken: pops find nothing, walking every list.
enum PopEmpty {
    Freelist(FreeList<u64>),
    ArrayQueue(ArrayQueue<u64>),
}

/// Pops that found an element (must stay 0).
static FOUND: AtomicU64 = AtomicU64::new(0);

impl Workload for PopEmpty {
    fn run(&self, _tid: usize, iters: u64) {
        let mut found = 0;
        match self {
            Self::Freelist(pool) => {
                for _ in 0..iters {
                    found += u64::from(black_box(pool.pop()).is_some());
                }
            }
            Self::ArrayQueue(q) => {
                for _ in 0..iters {
                    found += u64::from(black_box(q.pop()).is_some());
                }
            }
        }
        FOUND.fetch_add(found, Relaxed);
    }

    fn verify(&self, _ops: &[u64]) -> Result<(), String> {
        match FOUND.swap(0, Relaxed) {
            0 => Ok(()),
            n => Err(format!("{n} pops found an element in an empty pool")),
        }
    }
}

#[allow(clippy::unnecessary_wraps)] // the harness's `Build` signature
fn build_pop_empty(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    FOUND.store(0, Relaxed);
    Ok(Box::new(match hint_of(imp) {
        Some(hint) => {
            let pool = freelist(imp, hint);
            // Take everything (through the real transitions, so every flag
            // was set by a pop) and keep it out of the pool.
            let taken: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
            assert_eq!(taken.len(), pool.capacity());
            for e in taken {
                let _ = e.into_index();
            }
            PopEmpty::Freelist(pool)
        }
        None => PopEmpty::ArrayQueue(ArrayQueue::new(capacity())),
    }))
}

/// Every free element on far lists; each operation is a pop that steals
/// and a push back to the thread's far list.
struct Steal(FreeList<u64>);

impl Workload for Steal {
    fn run(&self, _tid: usize, iters: u64) {
        let pool = &self.0;
        // SAFETY: no preconditions; the harness pinned this thread.
        let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).unwrap_or(0);
        let far = pool.lists() - 1 - cpu.min(pool.lists() - 1);
        let mut missed = 0;
        for _ in 0..iters {
            match pool.pop() {
                Some(e) => pool.push_to(black_box(e), far),
                None => missed += 1,
            }
        }
        MISSED.fetch_add(missed, Relaxed);
    }

    fn verify(&self, _ops: &[u64]) -> Result<(), String> {
        let missed = MISSED.swap(0, Relaxed);
        if missed != 0 {
            return Err(format!("{missed} pops found the pool empty"));
        }
        // Kept while counting: a dropped element goes straight back.
        let free = std::iter::from_fn(|| self.0.pop())
            .collect::<Vec<_>>()
            .len();
        if free == self.0.capacity() {
            Ok(())
        } else {
            Err(format!("{free} of {} elements back", self.0.capacity()))
        }
    }
}

fn build_steal(imp: &str, threads: usize) -> Result<Box<dyn Workload>, String> {
    MISSED.store(0, Relaxed);
    let hint = hint_of(imp).expect("a freelist");
    let pool = freelist(imp, hint);
    let lists = pool.lists();
    if lists < 2 * threads {
        return Err(format!(
            "with {lists} lists and {threads} threads a far list would be a thread's own \
             (--lists at least {})",
            2 * threads
        ));
    }
    // Every element to the far lists of the threads' CPUs.
    let all: Vec<_> = std::iter::from_fn(|| pool.pop())
        .map(pcpu_freelist::Element::into_index)
        .collect();
    for (k, index) in all.into_iter().enumerate() {
        // SAFETY: each index came from `into_index` on this pool, once.
        let e = unsafe { pool.from_index(index) };
        pool.push_to(e, lists - 1 - k % threads);
    }
    Ok(Box::new(Steal(pool)))
}

/// A prefilled pool; each operation is one pop and one push.
struct PushPop {
    pool: PoolImpl,
    oversubscription: usize,
}

enum PoolImpl {
    Freelist(FreeList<u64>),
    Bare(BareList),
    ArrayQueue(ArrayQueue<u64>),
    ObjectPool(LinearObjectPool<u64>),
    ShardedSlab(sharded_slab::Pool<Option<u64>>),
}

/// Pops that found the pool empty (must stay 0: each worker holds at
/// most one element and the pool has more than one per worker).
static MISSED: AtomicU64 = AtomicU64::new(0);

impl Workload for PushPop {
    fn run(&self, _tid: usize, iters: u64) {
        let mut missed = 0;
        match &self.pool {
            PoolImpl::Freelist(pool) => {
                for _ in 0..iters {
                    match pool.pop() {
                        Some(e) => pool.push(black_box(e)),
                        None => missed += 1,
                    }
                }
            }
            PoolImpl::Bare(list) => {
                for _ in 0..iters {
                    match list.stack.pop() {
                        Some(node) => {
                            // SAFETY: popped, so ours; pushed back at once.
                            if !unsafe { list.stack.push(black_box(node)) } {
                                missed += 1;
                            }
                        }
                        None => missed += 1,
                    }
                }
            }
            PoolImpl::ArrayQueue(q) => {
                for _ in 0..iters {
                    match q.pop() {
                        Some(v) => q.push(black_box(v)).expect("room for the popped value"),
                        None => missed += 1,
                    }
                }
            }
            PoolImpl::ObjectPool(pool) => {
                for _ in 0..iters {
                    drop(black_box(pool.pull()));
                }
            }
            PoolImpl::ShardedSlab(pool) => {
                for _ in 0..iters {
                    match pool.create_with(|v| *v = Some(1)) {
                        Some(key) => {
                            pool.clear(black_box(key));
                        }
                        None => missed += 1,
                    }
                }
            }
        }
        MISSED.fetch_add(missed, Relaxed);
    }

    fn oversubscription(&self) -> usize {
        self.oversubscription
    }

    fn verify(&self, _ops: &[u64]) -> Result<(), String> {
        let missed = MISSED.swap(0, Relaxed);
        if missed != 0 {
            return Err(format!("{missed} pops found the prefilled pool empty"));
        }
        let (free, capacity) = match &self.pool {
            PoolImpl::Freelist(pool) => (
                std::iter::from_fn(|| pool.pop()).collect::<Vec<_>>().len(),
                pool.capacity(),
            ),
            PoolImpl::ArrayQueue(q) => (q.len(), q.capacity()),
            // Each list can only be emptied from its own CPU.
            PoolImpl::Bare(_) | PoolImpl::ObjectPool(_) | PoolImpl::ShardedSlab(_) => {
                return Ok(());
            }
        };
        if free == capacity {
            Ok(())
        } else {
            Err(format!("{free} of {capacity} elements back in the pool"))
        }
    }
}

/// The floor: bare per-CPU rseq lists of `PER_LIST` nodes each.
struct BareList {
    stack: BareStack,
    /// The nodes (never moved: a boxed slice the lists point into).
    _nodes: Box<[BareNode]>,
}

// SAFETY: the nodes' link words are written only by the lists' rseq
// sections (one CPU's section at a time per list) while the lists hold
// them, and by the thread that popped a node; nothing else reads them.
unsafe impl Sync for BareList {}
// SAFETY: as above; moving the whole pool moves its nodes with it.
unsafe impl Send for BareList {}

#[repr(C)]
struct BareNode {
    next: core::cell::UnsafeCell<usize>,
    _value: u64,
}

fn bare_list() -> Result<BareList, String> {
    let mut stack = BareStack::new(core::mem::offset_of!(BareNode, next))
        .ok_or("rseq-list needs glibc's rseq area on x86-64")?;
    let nodes: Box<[BareNode]> = (0..capacity())
        .map(|_| BareNode {
            next: core::cell::UnsafeCell::new(0),
            _value: 0,
        })
        .collect();
    // A contiguous block of nodes per CPU, as the freelist deals them (no
    // cache line holds nodes of two CPUs' lists).
    let cpus = stack.slots() - 1;
    for (i, node) in nodes.iter().enumerate() {
        // SAFETY: each node is pushed once; the boxed slice outlives the
        // lists (both live in `BareList`) and never moves.
        unsafe { stack.push_slot_mut((i / PER_LIST).min(cpus - 1), NonNull::from(node).cast()) };
    }
    Ok(BareList {
        stack,
        _nodes: nodes,
    })
}

fn build_pushpop_with(imp: &str, oversubscription: usize) -> Result<Box<dyn Workload>, String> {
    MISSED.store(0, Relaxed);
    let pool = match (hint_of(imp), imp) {
        (Some(hint), _) => PoolImpl::Freelist(freelist(imp, hint)),
        (None, "rseq-list") => PoolImpl::Bare(bare_list()?),
        (None, "arrayqueue") => {
            let q = ArrayQueue::new(capacity());
            (0..capacity() as u64).for_each(|v| q.push(v).expect("capacity"));
            PoolImpl::ArrayQueue(q)
        }
        (None, "object-pool") => PoolImpl::ObjectPool(LinearObjectPool::new(|| 0u64, |_| {})),
        (None, "sharded-slab") => PoolImpl::ShardedSlab(sharded_slab::Pool::new()),
        _ => unreachable!("unknown implementation {imp}"),
    };
    Ok(Box::new(PushPop {
        pool,
        oversubscription,
    }))
}

fn build_pushpop(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build_pushpop_with(imp, 1)
}

fn build_oversub(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build_pushpop_with(imp, OVERSUBSCRIPTION)
}
