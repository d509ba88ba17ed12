//! loom models of the freelist (`RUSTFLAGS="--cfg pcpu_loom"`), each run with
//! rseq modelled (this CPU's list popped and pushed in critical sections,
//! other CPUs' lists under their lock plus a fence aimed at their CPU) and
//! in the fallback world (every list spinlocked).
#![cfg(pcpu_loom)]

use std::sync::Arc;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use pcpu::unstable::loom_cpu;
use pcpu_freelist::{EmptyHint, FreeList};

/// Checks `f` in both worlds with at most `preemptions` preemptions per
/// execution.
fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let f = Arc::new(f);
    for rseq in [true, false] {
        loom_cpu::set_rseq_modelled(rseq);
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(preemptions);
        let f = Arc::clone(&f);
        b.check(move || f());
    }
}

fn leak<T>(v: T) -> &'static T {
    Box::leak(Box::new(v))
}

/// Pops until exhausted, keeping every element.
fn free_count<T>(pool: &FreeList<T>) -> usize {
    std::iter::from_fn(|| pool.pop()).collect::<Vec<_>>().len()
}

/// Two threads on two CPUs pop and push back; one pop walks to the other
/// CPU's list while that CPU pops and pushes its own. No element is handed
/// to two owners (the `held` flags and loom's cell tracking both check),
/// none is lost.
#[test]
fn concurrent_pop_and_push_never_lose_or_duplicate() {
    for hint in [EmptyHint::Summary, EmptyHint::Flag, EmptyHint::Head] {
        model(2, move || {
            loom_cpu::set_current(0);
            let pool = leak(FreeList::with_hint(
                [AtomicBool::new(false), AtomicBool::new(false)],
                hint,
            ));
            // Both elements on CPU 0's list.
            let both: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
            drop(both);
            let remote = thread::spawn(move || {
                loom_cpu::set_current(1);
                // CPU 1's list is empty: this pop walks to CPU 0's.
                if let Some(e) = pool.pop() {
                    assert!(!e.swap(true, Ordering::Relaxed), "two owners");
                    e.store(false, Ordering::Relaxed);
                    pool.try_push(e); // onto CPU 1's list
                }
            });
            if let Some(e) = pool.pop() {
                assert!(!e.swap(true, Ordering::Relaxed), "two owners");
                e.store(false, Ordering::Relaxed);
                pool.push(e);
            }
            remote.join().unwrap();
            assert_eq!(free_count(pool), 2, "{hint:?}: element lost or duplicated");
        });
    }
}

/// The hint's guarantee: a push that happens-before a pop, with no other
/// pop running concurrently with it, is found, even when the push raced
/// the pop that emptied the list (and would set its flag).
///
/// CPU 0's list holds `e`; thread C (CPU 0) pops it, emptying the list,
/// while thread A (CPU 0 too, i.e. preempting C anywhere) pushes `f` there.
/// Once both are done, B pops: it must find `f` on CPU 0's list, from
/// CPU 1 (the walk) and from CPU 0 (its own list, where the pop looks at
/// the flag before its critical section). (Setting the flag without
/// re-checking the head after the emptying pop fails this model.)
#[test]
fn a_completed_push_is_never_hidden_by_the_hint() {
    for (hint, last_cpu) in [
        EmptyHint::Summary,
        EmptyHint::Flag,
        EmptyHint::Head,
        EmptyHint::None,
    ]
    .into_iter()
    .flat_map(|h| [(h, 1), (h, 0)])
    {
        model(3, move || {
            loom_cpu::set_current(0);
            let pool = leak(FreeList::with_hint([0u8, 1], hint));
            let both: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
            let [e, f]: [_; 2] = both.try_into().ok().unwrap();
            drop(e); // on CPU 0's list
            let f = f.into_index();
            let popper = thread::spawn(move || {
                loom_cpu::set_current(0);
                pool.pop().map(pcpu_freelist::Element::into_index)
            });
            let pusher = thread::spawn(move || {
                loom_cpu::set_current(0);
                // SAFETY: `f` came from `into_index` on this pool, once.
                pool.push(unsafe { pool.from_index(f) });
            });
            let taken = popper.join().unwrap();
            pusher.join().unwrap();
            loom_cpu::set_current(last_cpu);
            let found = pool.pop();
            assert!(
                found.is_some(),
                "{hint:?}: pop on CPU {last_cpu} missed a free element (C took {taken:?})"
            );
        });
    }
}
