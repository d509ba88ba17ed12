//! The pool's API: exhaustion, handles, indexes, the four hints, pools
//! built for more CPUs than the machine has.

use std::collections::HashSet;

use pcpu_freelist::{EmptyHint, FreeList};

mod common;
use common::HINTS;

/// Pops until the pool is exhausted, keeping every element (a dropped
/// element would go straight back).
fn take_all<T>(pool: &FreeList<T>) -> Vec<pcpu_freelist::Element<'_, T>> {
    std::iter::from_fn(|| pool.pop()).collect()
}

/// Takes every element out of `pool`, then gives each back from one of
/// several threads (eight elements a thread) through `give(element,
/// index)`.
fn give_back_from_threads<'p, T: Send>(
    pool: &'p FreeList<T>,
    give: impl Fn(pcpu_freelist::Element<'p, T>, usize) + Sync,
) {
    let all: Vec<usize> = take_all(pool)
        .into_iter()
        .map(pcpu_freelist::Element::into_index)
        .collect();
    std::thread::scope(|s| {
        for chunk in all.chunks(8) {
            let give = &give;
            s.spawn(move || {
                for &i in chunk {
                    // SAFETY: each index came from `into_index` on this pool
                    // and is turned back once.
                    give(unsafe { pool.from_index(i) }, i);
                }
            });
        }
    });
}

#[test]
fn hands_out_every_element_once_then_none() {
    for &hint in HINTS {
        let pool = FreeList::with_hint(0..100u32, hint);
        assert_eq!((pool.capacity(), pool.hint()), (100, hint));
        let taken = take_all(&pool);
        assert_eq!(taken.len(), 100, "{hint:?}: every element is found");
        let values: HashSet<u32> = taken.iter().map(|e| **e).collect();
        assert_eq!(values.len(), 100, "{hint:?}: no element twice");
        assert!(
            taken.iter().all(|e| **e as usize == e.index()),
            "an element's index is its position at construction"
        );
        assert!(pool.pop().is_none(), "{hint:?}: exhausted pool");
        assert!(pool.try_pop().is_none(), "{hint:?}: exhausted pool");
        drop(taken);
        assert_eq!(take_all(&pool).len(), 100);
    }
}

#[test]
fn values_persist_across_push_and_pop() {
    let pool = FreeList::new(vec![String::new(); 3]);
    for e in take_all(&pool) {
        let mut e = e;
        let text = format!("element {}", e.index());
        e.push_str(&text);
        pool.push(e);
    }
    let mut seen: Vec<String> = take_all(&pool).iter().map(|e| (**e).clone()).collect();
    seen.sort();
    assert_eq!(seen, ["element 0", "element 1", "element 2"]);
}

#[test]
fn try_push_and_drop_return_elements() {
    let pool = FreeList::new([1, 2]);
    let a = pool.try_pop().unwrap();
    let b = pool.try_pop().unwrap();
    assert!(pool.try_pop().is_none());
    pool.try_push(a);
    drop(b);
    assert_eq!(
        std::iter::from_fn(|| pool.try_pop())
            .collect::<Vec<_>>()
            .len(),
        2
    );
}

#[test]
fn into_index_keeps_the_element_out_until_from_index() {
    let pool = FreeList::new([10u8, 20]);
    let i = pool.pop().unwrap().into_index();
    let j = pool.pop().unwrap().into_index();
    assert!(pool.pop().is_none(), "indexed elements stay taken");
    // SAFETY: each index came from `into_index` on this pool, once.
    let (a, b) = unsafe { (pool.from_index(i), pool.from_index(j)) };
    assert_eq!(*a + *b, 30);
    drop((a, b));
    assert_eq!(take_all(&pool).len(), 2);
}

#[test]
#[should_panic(expected = "did not come from")]
fn pushing_into_another_pool_panics() {
    let (p, q) = (FreeList::new([0]), FreeList::new([0]));
    let e = p.pop().unwrap();
    q.push(e);
}

#[test]
#[should_panic(expected = "out of range")]
fn from_index_checks_the_range() {
    let pool = FreeList::new([0]);
    // SAFETY: the index is out of range, which `from_index` checks first.
    let _ = unsafe { pool.from_index(1) };
}

/// A pool built as if the machine had many more CPUs than it has (several
/// summary words): every element is found from the machine's CPUs, by the
/// walk over lists no thread owns, and found again once pushed back; the
/// last element, alone in whichever list the walk reaches last, is found
/// too.
#[test]
fn a_pool_for_more_cpus_than_the_machine_has_finds_every_element() {
    // Under Miri, fewer lists (still two summary words), an element per
    // list, and the summary's walk alone: the hints before it look at
    // every list on every pop.
    let cpus: u32 = if cfg!(miri) { 64 } else { 300 };
    let n = if cfg!(miri) { cpus + 1 } else { 2 * (cpus + 1) };
    for &hint in HINTS
        .iter()
        .filter(|&&h| !cfg!(miri) || h == EmptyHint::Summary)
    {
        let pool = FreeList::with_lists(0..n, hint, cpus as usize);
        let taken = take_all(&pool);
        assert_eq!(taken.len(), n as usize, "{hint:?}: every element is found");
        let values: HashSet<u32> = taken.iter().map(|e| **e).collect();
        assert_eq!(values.len(), n as usize, "{hint:?}: no element twice");
        assert!(pool.pop().is_none(), "{hint:?}: exhausted");
        drop(taken);
        assert_eq!(
            take_all(&pool).len(),
            n as usize,
            "{hint:?}: pushed back, found again"
        );
        let fresh = FreeList::with_lists(0..n, hint, cpus as usize);
        let held: Vec<_> = (1..n).map(|_| fresh.pop().expect("free")).collect();
        let last = fresh.pop().expect("the one element left");
        assert!(held.iter().all(|e| **e != *last), "{hint:?}");
        assert!(fresh.pop().is_none(), "{hint:?}: exhausted");
    }
}

/// Elements pushed to lists of their own choosing, from threads on any
/// CPU (the far lists of a pool built for more CPUs than the machine has
/// included), are found by pops on every CPU, each once; a list out of
/// range is refused.
#[test]
fn elements_pushed_to_a_chosen_list_are_found() {
    // Under Miri (which runs this with many seeds), fewer lists and
    // elements.
    let (cpus, n) = if cfg!(miri) { (8, 16) } else { (64, 32) };
    for &hint in HINTS {
        let pool = FreeList::with_lists(0..n, hint, cpus);
        assert_eq!(pool.lists(), cpus);
        // To the last lists, far from every CPU's own.
        give_back_from_threads(&pool, |e, i| pool.push_to(e, cpus - 1 - i % 3));
        let found = take_all(&pool);
        let values: HashSet<u32> = found.iter().map(|e| **e).collect();
        assert_eq!(values.len(), n as usize, "{hint:?}: each found once");
        assert!(pool.pop().is_none(), "{hint:?}: exhausted");
    }
    let pool = FreeList::with_lists(0..2u8, EmptyHint::Summary, 4);
    let e = pool.pop().expect("free");
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pool.push_to(e, 4)));
    assert!(refused.is_err(), "list 4 of a pool of 4 lists");
}

#[test]
fn an_empty_pool_is_always_exhausted() {
    let pool = FreeList::<u8>::new([]);
    assert_eq!(pool.capacity(), 0);
    assert!(pool.pop().is_none() && pool.try_pop().is_none());
    assert!(format!("{pool:?}").contains("capacity: 0"));
}

#[test]
fn elements_are_found_wherever_they_were_pushed() {
    // Pushes from many threads (so on several CPUs' lists and, when the
    // lists were locked, the extralist), then one thread finds them all.
    for &hint in HINTS {
        let pool = FreeList::with_hint(0..64u32, hint);
        give_back_from_threads(&pool, |e, i| {
            if i % 2 == 0 {
                pool.push(e);
            } else {
                pool.try_push(e);
            }
        });
        assert_eq!(take_all(&pool).len(), 64, "{hint:?}");
    }
}

#[test]
fn elements_move_between_threads() {
    let pool = FreeList::new((0..4).map(|i| vec![i]));
    let e = pool.pop().unwrap();
    std::thread::scope(|s| {
        s.spawn(move || assert_eq!(e.len(), 1));
    });
    assert_eq!(take_all(&pool).len(), 4);
}
