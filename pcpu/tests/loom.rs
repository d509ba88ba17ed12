//! loom models of the foundation's protocols (`RUSTFLAGS="--cfg pcpu_loom"`).
//! Under loom the rseq operations take their atomic/locked fallbacks, the
//! CPU id is set per model thread, and both fence sides are `fence(SeqCst)`.
#![cfg(pcpu_loom)]

use std::ptr::NonNull;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use loom::thread;
use pcpu::unstable::loom_cpu;
use pcpu::{PerCpu, PerCpuStack};

#[test]
fn counter_sum_is_exact_when_threads_migrate() {
    loom::model(|| {
        let counts = Arc::new(PerCpu::<AtomicU64>::default());
        let c2 = Arc::clone(&counts);
        let t = thread::spawn(move || {
            loom_cpu::set_current(1);
            pcpu::rseq::add(&c2, 1);
            loom_cpu::set_current(0); // migrated
            pcpu::rseq::add(&c2, 1);
        });
        pcpu::rseq::add(&counts, 1);
        pcpu::rseq::add(&counts, 1u64.wrapping_neg());
        pcpu::rseq::add(&counts, 1);
        t.join().unwrap();
        let sum = counts
            .iter()
            .fold(0u64, |s, c| s.wrapping_add(c.load(Relaxed)));
        assert_eq!(sum, 3);
    });
}

#[repr(C)]
struct Node {
    /// Written by the stack through raw pointers while it holds the node.
    next: std::cell::UnsafeCell<usize>,
    id: usize,
}

/// Two nodes (ids 1 and 2), leaked: a model's stack may keep them past it.
fn two_nodes() -> &'static [Node; 2] {
    let node = |id| Node {
        next: std::cell::UnsafeCell::new(0),
        id,
    };
    Box::leak(Box::new([node(1), node(2)]))
}

#[test]
fn stack_local_and_remote_pops_conserve_nodes() {
    loom::model(|| {
        let nodes = two_nodes();
        let stack = Arc::new(PerCpuStack::new(0));
        // One node on CPU 0's list, one on CPU 1's.
        for (i, n) in nodes.iter().enumerate() {
            // SAFETY: leaked nodes, each pushed once.
            unsafe { stack.push_slot(i, NonNull::from(n).cast()) };
        }
        let s2 = Arc::clone(&stack);
        let taken = Arc::new(AtomicUsize::new(0));
        let t2 = Arc::clone(&taken);
        let t = thread::spawn(move || {
            loom_cpu::set_current(1);
            // Remote pop of CPU 0's list, racing CPU 0's own pop and push.
            if let Some(n) = s2.pop_slot(0) {
                // SAFETY: leaked node.
                t2.fetch_add(unsafe { n.cast::<Node>().as_ref() }.id, Relaxed);
            }
        });
        if let Some(n) = stack.pop() {
            // SAFETY: leaked node; we own it now and push it back once.
            taken.fetch_add(unsafe { n.cast::<Node>().as_ref() }.id * 10, Relaxed);
            unsafe { stack.push(n) };
        }
        t.join().unwrap();
        // Whatever interleaving: node 1 was taken by at most one side at a
        // time, and both nodes are still somewhere unless thread 2 kept one.
        let remaining: usize = (0..stack.slots())
            .map(|s| std::iter::from_fn(|| stack.pop_slot(s)).count())
            .sum();
        let by_remote = taken.load(Relaxed) % 10;
        assert_eq!(remaining + usize::from(by_remote != 0), 2);
        assert!(
            by_remote == 0 || by_remote == 1,
            "remote pop saw node {by_remote}"
        );
    });
}

#[test]
fn gated_add_after_the_grace_period_sees_the_gate() {
    use loom::sync::atomic::AtomicU32;
    use pcpu::rseq::{GatedAdd, add_if_zero, fence_all};
    loom::model(|| {
        let counts = Arc::new(PerCpu::<AtomicU64>::default());
        let gate = Arc::new(AtomicU32::new(0));
        let (c2, g2) = (Arc::clone(&counts), Arc::clone(&gate));
        let reader = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            add_if_zero(&c2, &g2, 1)
        });
        gate.store(1, Relaxed);
        fence_all();
        // After the grace period: every add that committed is visible...
        let sum_after_fence = counts.iter().map(|c| c.load(Relaxed)).sum::<u64>();
        let outcome = reader.join().unwrap();
        let final_sum = counts.iter().map(|c| c.load(Relaxed)).sum::<u64>();
        // ...and none commits later: the sum cannot grow after the fence.
        assert_eq!(
            sum_after_fence, final_sum,
            "an add committed after the grace period"
        );
        assert_eq!(final_sum, u64::from(outcome == GatedAdd::Added));
    });
}

#[test]
fn asymmetric_fence_forbids_store_buffering() {
    loom::model(|| {
        let a = Arc::new(AtomicUsize::new(0));
        let b = Arc::new(AtomicUsize::new(0));
        let (a2, b2) = (Arc::clone(&a), Arc::clone(&b));
        let reader = thread::spawn(move || {
            a2.store(1, Relaxed);
            pcpu::fence::light();
            b2.load(Relaxed)
        });
        b.store(1, Relaxed);
        pcpu::fence::heavy();
        let seen_a = a.load(Relaxed);
        let seen_b = reader.join().unwrap();
        assert!(
            seen_a == 1 || seen_b == 1,
            "both sides missed the other's store"
        );
    });
}

/// An object for the owed-list model: its count and link, and how many
/// units were handed over for it.
struct Debtor {
    owed: AtomicUsize,
    next: loom::sync::atomic::AtomicPtr<Debtor>,
}

impl pcpu::unstable::owed::Owing for Debtor {
    fn owed(&self) -> &AtomicUsize {
        &self.owed
    }
    fn next_owed(&self) -> &loom::sync::atomic::AtomicPtr<Self> {
        &self.next
    }
}

/// Two threads owe units of two objects while a third drains: every unit
/// is handed over exactly once and to the right object, whatever the
/// interleaving of a first `owe`'s listing, a later one's count and the
/// drain's swap (the drain walks two objects while one is listed again).
#[test]
fn owed_units_are_drained_exactly_once() {
    loom::model(|| {
        let debtor = || Debtor {
            owed: AtomicUsize::new(0),
            next: loom::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
        };
        let objects: &'static [Debtor; 2] = Box::leak(Box::new([debtor(), debtor()]));
        let head: &'static loom::sync::atomic::AtomicPtr<Debtor> = Box::leak(Box::new(
            loom::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
        ));
        let tally = |counts: &mut [usize; 2], ptr: *mut Debtor, units: usize| {
            let i = usize::from(!std::ptr::eq(ptr, &objects[0]));
            counts[i] += units;
        };
        let a = &raw const objects[0];
        let b = &raw const objects[1];
        let (a, b) = (a as usize, b as usize);
        let ower = thread::spawn(move || {
            // SAFETY: the objects are leaked: valid for ever.
            unsafe { pcpu::unstable::owed::owe(head, a as *const Debtor, || {}) };
        });
        // SAFETY: as above.
        unsafe { pcpu::unstable::owed::owe(head, b as *const Debtor, || {}) };
        let drainer = thread::spawn(move || {
            let mut counts = [0usize; 2];
            pcpu::unstable::owed::drain(head, |p, n| tally(&mut counts, p, n));
            counts
        });
        // SAFETY: as above.
        unsafe { pcpu::unstable::owed::owe(head, a as *const Debtor, || {}) };
        ower.join().unwrap();
        let mut counts = drainer.join().unwrap();
        pcpu::unstable::owed::drain(head, |p, n| tally(&mut counts, p, n));
        assert_eq!(counts, [2, 1], "a unit was lost or handed over twice");
    });
}

/// The summary of a stack with empty flags: CPU 1's list holds one node;
/// a thread on CPU 0 pops it remotely (under the lock: the pop that
/// empties the list clears its bit) while CPU 1 pushes a second node into
/// the list (in its critical section: a push into the empty list sets the
/// bit). Whatever the interleaving, once both are done a list that holds
/// a node has its bit set, and an empty one with its flag set has not.
#[test]
fn the_summary_bit_follows_a_list_through_racing_pop_and_push() {
    for rseq in [true, false] {
        loom_cpu::set_rseq_modelled(rseq);
        loom::model(|| {
            let nodes = two_nodes();
            let stack = Arc::new(PerCpuStack::with_empty_flags(0));
            // SAFETY: leaked nodes, each pushed once.
            unsafe { stack.push_slot(1, NonNull::from(&nodes[0]).cast()) };
            let s2 = Arc::clone(&stack);
            let remote = thread::spawn(move || {
                loom_cpu::set_current(0);
                s2.pop_slot(1).is_some()
            });
            loom_cpu::set_current(1);
            // SAFETY: as above.
            unsafe { stack.push(NonNull::from(&nodes[1]).cast()) };
            assert!(
                remote.join().unwrap(),
                "the remote pop found the first node"
            );
            let bit = stack.summary(0) & (1 << 1) != 0;
            assert!(!stack.looks_empty(1), "the second node is in");
            assert!(bit, "a list holding a node has its summary bit");
            assert!(stack.pop_slot(1).is_some());
            assert!(stack.flagged_empty(1) && stack.summary(0) & (1 << 1) == 0);
        });
    }
}
