//! Threads pop and push back at random; afterwards every element is in the
//! pool exactly once, and while running no element had two owners.
//! Bounded in iterations, not time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pcpu_freelist::{Element, EmptyHint, FreeList};

mod common;
use common::HINTS;

#[derive(Default)]
struct Slot {
    /// Set while a handle to the element is alive.
    held: AtomicBool,
    takes: AtomicU64,
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

/// A small xorshift per thread, so the mix differs between threads.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

fn claim(e: &Element<'_, Slot>) {
    assert!(
        !e.held.swap(true, Ordering::Relaxed),
        "element {} handed out twice",
        e.index()
    );
    e.takes.fetch_add(1, Ordering::Relaxed);
}

fn churn(hint: EmptyHint, threads: usize, capacity: usize, rounds: usize) {
    let pool = FreeList::with_hint((0..capacity).map(|_| Slot::default()), hint);
    let taken = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (pool, taken) = (&pool, &taken);
            s.spawn(move || {
                let mut next = rng(t as u64 + 1);
                let mut held: Vec<Element<'_, Slot>> = Vec::new();
                for _ in 0..rounds {
                    let r = next();
                    // Hold up to 3 elements, so lists empty and refill and
                    // pops walk to other CPUs' lists and the extralist.
                    if held.len() < 3 && !r.is_multiple_of(4) {
                        let e = if r.is_multiple_of(3) {
                            pool.try_pop()
                        } else {
                            pool.pop()
                        };
                        if let Some(e) = e {
                            claim(&e);
                            taken.fetch_add(1, Ordering::Relaxed);
                            held.push(e);
                        }
                    } else if !held.is_empty() {
                        let e = held.swap_remove((r as usize / 7) % held.len());
                        e.held.store(false, Ordering::Relaxed);
                        match r % 3 {
                            0 => pool.push(e),
                            1 => pool.try_push(e),
                            _ => drop(e),
                        }
                    }
                }
                for e in held {
                    e.held.store(false, Ordering::Relaxed);
                }
            });
        }
    });
    let back: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
    assert_eq!(
        back.len(),
        capacity,
        "{hint:?}: elements lost or duplicated"
    );
    assert!(back.iter().all(|e| !e.held.load(Ordering::Relaxed)));
    let take_count: u64 = back.iter().map(|e| e.takes.load(Ordering::Relaxed)).sum();
    assert_eq!(take_count, taken.load(Ordering::Relaxed), "{hint:?}");
}

#[test]
fn conserves_elements_one_thread_per_cpu() {
    for &hint in HINTS {
        churn(
            hint,
            cpus(),
            2 * cpus() + 1,
            test_support::scaled(1_000_000),
        );
    }
}

#[test]
fn conserves_elements_oversubscribed() {
    for &hint in HINTS {
        churn(hint, 4 * cpus(), 3 * cpus(), test_support::scaled(250_000));
    }
}

#[test]
fn conserves_elements_when_the_pool_runs_dry() {
    // Fewer elements than threads want: most pops find nothing, and the
    // lists go empty and non-empty all the time (the flags' and the
    // summary's transitions).
    for hint in [EmptyHint::Summary, EmptyHint::Flag] {
        churn(hint, 2 * cpus(), 2, test_support::scaled(250_000));
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts a child process; .ci/miri runs the child's part (FREELIST_CHILD=1)"
)]
fn conserves_elements_without_rseq() {
    // The spinlocked lists (aarch64, qemu-user, old glibc): a child process
    // with glibc's rseq registration turned off.
    if std::env::var_os("FREELIST_CHILD").is_some() {
        let pool = FreeList::new([0u8]);
        assert!(!pool.uses_rseq(), "GLIBC_TUNABLES did not turn rseq off");
        for &hint in HINTS {
            churn(hint, 4 * cpus(), 3 * cpus(), test_support::scaled(100_000));
        }
        println!("child: spinlocked lists conserve elements");
        return;
    }
    let out = test_support::rerun_in_child(
        "conserves_elements_without_rseq",
        &[
            ("FREELIST_CHILD", "1"),
            ("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
        ],
    );
    assert!(test_support::printed(
        &out,
        "child: spinlocked lists conserve elements"
    ));
}
