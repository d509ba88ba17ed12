//! `PerCpuStack` never loses or duplicates a node, with local rseq
//! operations, remote pops and oversubscribed threads all mixed.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pcpu::PerCpuStack;

#[repr(C)]
struct Node {
    /// Written by the stack through raw pointers while it holds the node.
    next: std::cell::UnsafeCell<usize>,
    /// Set while some thread owns the node (popped, not yet pushed back).
    owned: AtomicBool,
    /// How many times the node was taken.
    takes: AtomicU64,
}

fn pool(n: usize) -> Vec<Node> {
    (0..n)
        .map(|_| Node {
            next: std::cell::UnsafeCell::new(0),
            owned: AtomicBool::new(false),
            takes: AtomicU64::new(0),
        })
        .collect()
}

fn take(stack: &PerCpuStack, round: usize) -> Option<NonNull<Node>> {
    let slots = stack.slots();
    let node = if round.is_multiple_of(3) {
        // Remote pops: start at some other list.
        (0..slots).find_map(|i| stack.pop_slot((round + i) % slots))
    } else {
        stack
            .pop()
            .or_else(|| (0..slots).find_map(|s| stack.pop_slot(s)))
    }?;
    let node = node.cast::<Node>();
    // SAFETY: nodes come from the pool, which outlives the stack's use.
    let n = unsafe { node.as_ref() };
    assert!(
        !n.owned.swap(true, Ordering::AcqRel),
        "node handed out twice"
    );
    n.takes.fetch_add(1, Ordering::Relaxed);
    Some(node)
}

fn give(stack: &PerCpuStack, node: NonNull<Node>, round: usize) {
    // SAFETY: as above.
    unsafe { node.as_ref() }
        .owned
        .store(false, Ordering::Release);
    // SAFETY: we own the node (taken above), it outlives the test, and its
    // link word is at offset 0.
    unsafe {
        if round.is_multiple_of(5) {
            stack.push_slot(round % stack.slots(), node.cast());
        } else {
            stack.push(node.cast());
        }
    }
}

fn churn(threads: usize, rounds: usize, empty_flags: bool) {
    let nodes = pool(64);
    let next = std::mem::offset_of!(Node, next);
    let stack = if empty_flags {
        PerCpuStack::with_empty_flags(next)
    } else {
        PerCpuStack::new(next)
    };
    assert_eq!(
        stack.uses_rseq(),
        pcpu::rseq::available() && pcpu::fence::register_rseq_fence()
    );
    for (i, n) in nodes.iter().enumerate() {
        // SAFETY: each node is pushed once and outlives the stack's use.
        unsafe { stack.push_slot(i % stack.slots(), NonNull::from(n).cast()) };
    }
    let total = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stack, total) = (&stack, &total);
            s.spawn(move || {
                let mut held = Vec::new();
                for round in 0..rounds {
                    let r = round + t;
                    if let Some(n) = take(stack, r) {
                        held.push(n);
                        total.fetch_add(1, Ordering::Relaxed);
                    }
                    if held.len() > 2 || (r % 2 == 0 && !held.is_empty()) {
                        give(stack, held.remove(0), r);
                    }
                }
                for n in held {
                    give(stack, n, 1);
                }
            });
        }
    });
    // Between operations a set empty flag means an empty list, and a list
    // that holds nodes has its summary bit.
    for s in 0..stack.slots() {
        assert!(
            !stack.flagged_empty(s) || stack.looks_empty(s),
            "list {s} flagged empty while holding nodes"
        );
        assert!(
            !empty_flags || stack.looks_empty(s) || summary_bit(&stack, s),
            "list {s} holds nodes without its summary bit"
        );
    }
    // Every node is back, exactly once.
    let mut back = 0;
    for s in 0..stack.slots() {
        while let Some(n) = stack.pop_slot(s) {
            // SAFETY: pool node.
            let node = unsafe { n.cast::<Node>().as_ref() };
            assert!(!node.owned.load(Ordering::Relaxed));
            back += 1;
        }
    }
    assert_eq!(back, nodes.len(), "nodes lost or duplicated");
    let takes: u64 = nodes.iter().map(|n| n.takes.load(Ordering::Relaxed)).sum();
    assert_eq!(takes, total.load(Ordering::Relaxed));
}

#[test]
fn conserves_nodes_with_one_thread_per_cpu() {
    churn(
        std::thread::available_parallelism().map_or(2, usize::from),
        test_support::scaled(100_000),
        false,
    );
}

#[test]
fn conserves_nodes_oversubscribed() {
    churn(
        4 * std::thread::available_parallelism().map_or(2, usize::from),
        test_support::scaled(30_000),
        false,
    );
}

#[test]
fn conserves_nodes_with_empty_flags() {
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    churn(cpus, test_support::scaled(100_000), true);
    churn(4 * cpus, test_support::scaled(30_000), true);
}

fn summary_bit(stack: &PerCpuStack, list: usize) -> bool {
    stack.summary(list / 64) & (1 << (list % 64)) != 0
}

/// The summary of a stack built for many more CPUs than the machine has:
/// a bit per list, across words, set while the list holds nodes.
#[test]
fn the_summary_follows_every_list_across_words() {
    let nodes = pool(3);
    let stack = PerCpuStack::with_cpus(0, true, 200);
    assert_eq!((stack.slots(), stack.summary_words()), (201, 4));
    assert!((0..4).all(|w| stack.summary(w) == 0), "lists start empty");
    let lists = [0, 130, 200];
    for (n, &list) in nodes.iter().zip(&lists) {
        // SAFETY: pool nodes, each pushed once.
        unsafe { stack.push_slot(list, NonNull::from(n).cast()) };
    }
    for list in 0..stack.slots() {
        assert_eq!(
            summary_bit(&stack, list),
            lists.contains(&list),
            "list {list}"
        );
    }
    for &list in &lists {
        assert!(stack.pop_slot(list).is_some());
        assert!(!summary_bit(&stack, list), "list {list} emptied");
        assert!(stack.flagged_empty(list));
    }
    assert!(PerCpuStack::new(0).summary_words() == 0, "no summary kept");
}

#[test]
fn empty_flags_follow_transitions() {
    let nodes = pool(2);
    let stack = PerCpuStack::with_empty_flags(0);
    assert!(stack.keeps_empty_flags());
    assert!(
        (0..stack.slots()).all(|s| stack.flagged_empty(s)),
        "lists start empty"
    );
    let (a, b) = (
        NonNull::from(&nodes[0]).cast(),
        NonNull::from(&nodes[1]).cast(),
    );
    // SAFETY: pool nodes, each in at most one list at a time.
    unsafe {
        stack.push_slot(0, a);
        stack.push_slot(0, b);
    }
    assert!(!stack.flagged_empty(0));
    assert!(summary_bit(&stack, 0));
    assert_eq!(stack.pop_slot(0), Some(b));
    assert!(!stack.flagged_empty(0), "one node left");
    assert_eq!(stack.pop_slot(0), Some(a));
    assert!(stack.flagged_empty(0), "the last pop sets the flag");
    assert!(!summary_bit(&stack, 0), "and clears the summary bit");
    // The current CPU's list through the rseq (or locked) path.
    // SAFETY: as above.
    unsafe { stack.push(a) };
    let popped = stack
        .pop()
        .or_else(|| (0..stack.slots()).find_map(|s| stack.pop_slot(s)));
    assert_eq!(popped, Some(a));
    // The thread may have migrated between its pop and the flag step,
    // which then leaves the flag clear: only "flagged means empty" holds.
    assert!((0..stack.slots()).all(|s| !stack.flagged_empty(s) || stack.looks_empty(s)));
    assert!(!PerCpuStack::new(0).flagged_empty(0), "no flags kept");
}

#[test]
fn try_variants_report_a_held_lock() {
    let nodes = pool(2);
    let stack = PerCpuStack::new(0);
    let a = NonNull::from(&nodes[0]).cast();
    // SAFETY: pool node, pushed once.
    unsafe { stack.push_slot(0, a) };
    assert_eq!(stack.try_pop_slot(0), Ok(Some(a)));
    assert_eq!(stack.try_pop_slot(0), Ok(None));
    assert!(stack.looks_empty(0));
}

/// The `try_` operations refuse only a list whose lock is held: never a
/// free one, whatever a weak compare-and-swap does (it may fail
/// spuriously on aarch64 without LSE, and under Miri, which emulates such
/// failures: a refusal there was once reported for a free list).
#[test]
fn try_operations_never_refuse_a_free_lock() {
    let nodes = pool(1);
    let stack = PerCpuStack::new(0);
    let a = NonNull::from(&nodes[0]).cast();
    for slot in 0..stack.slots() {
        for _ in 0..50 {
            // SAFETY: a pool node, in one list at a time (popped below).
            assert_eq!(unsafe { stack.try_push_slot(slot, a) }, Ok(()));
            assert_eq!(stack.try_pop_slot(slot), Ok(Some(a)));
            assert_eq!(stack.try_pop_slot(slot), Ok(None));
        }
    }
}

/// The bare lists (the benchmarks' floor): pinned to CPU 0, a thread pops
/// what was put on CPU 0's list, last in first out, and gets back what it
/// pushes.
#[test]
fn bare_lists_push_and_pop_on_the_current_cpu() {
    use pcpu::unstable::bare_stack::BareStack;
    let Some(mut stack) = BareStack::new(std::mem::offset_of!(Node, next)) else {
        eprintln!("skipped: no rseq on this machine");
        return;
    };
    let nodes = pool(16);
    for node in &nodes {
        // SAFETY: each node is pushed once and outlives the stack's use.
        unsafe { stack.push_slot_mut(0, NonNull::from(node).cast()) };
    }
    let popped = std::thread::scope(|s| {
        s.spawn(|| {
            pin_to_cpu0();
            let first: Vec<_> = std::iter::from_fn(|| stack.pop()).collect();
            for &node in first.iter().rev() {
                // SAFETY: popped, so ours; pushed back once.
                assert!(unsafe { stack.push(node) });
            }
            let second: Vec<_> = std::iter::from_fn(|| stack.pop()).collect();
            assert_eq!(
                first, second,
                "pushed back in reverse, popped in the same order"
            );
            first
                .iter()
                .map(|n| n.as_ptr() as usize)
                .collect::<Vec<_>>()
        })
        .join()
        .unwrap()
    });
    let expected: Vec<usize> = nodes
        .iter()
        .rev()
        .map(|n| core::ptr::from_ref(n) as usize)
        .collect();
    assert_eq!(popped, expected);
}

/// Pins the calling thread to CPU 0.
fn pin_to_cpu0() {
    // SAFETY: pins the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set),
            0
        );
    }
}

/// `pop_local`, pinned to CPU 0: the node on CPU 0's list comes back in
/// one section; then the list is reported empty, by its slot, with and
/// without the look first, for both kinds of stack (without rseq every
/// list takes the locked path).
#[test]
fn pop_local_pops_and_reports_empty() {
    use pcpu::LocalPop;
    for flags in [false, true] {
        let nodes = pool(1);
        let stack = if flags {
            PerCpuStack::with_empty_flags(0)
        } else {
            PerCpuStack::new(0)
        };
        // An address: nodes are not `Sync` (their link word is written
        // through raw pointers).
        let addr = core::ptr::from_ref(&nodes[0]) as usize;
        std::thread::scope(|s| {
            s.spawn(|| {
                let a = NonNull::new(addr as *mut u8).unwrap();
                pin_to_cpu0();
                // SAFETY: a pool node, in one list at a time.
                unsafe { stack.push_slot(0, a) };
                if !stack.uses_rseq() {
                    assert_eq!(stack.pop_local(true), LocalPop::Locked);
                    return;
                }
                assert_eq!(stack.pop_local(true), LocalPop::Popped(a));
                for look in [true, false] {
                    assert_eq!(stack.pop_local(look), LocalPop::Empty { slot: 0 });
                }
                assert_eq!(
                    stack.flagged_empty(0),
                    flags,
                    "flag set by the emptying pop"
                );
            });
        });
    }
}
