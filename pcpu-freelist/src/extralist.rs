//! The extralist: a lock-free LIFO of element indexes, where pushes go when
//! they could not take their CPU's list (the kernel's NMI path).
//!
//! A Treiber stack over the pool's indexes. The head word packs a 32-bit
//! *version* above the index plus one (0: empty); every successful push and
//! pop bumps the version, so a pop whose compare-and-swap succeeds knows
//! that nothing was pushed or popped since it read the head and the next
//! index it read is current (no ABA). Because the nodes are preallocated
//! and live as long as the pool, a racing pop may read a node's link that
//! has just been rewritten: its compare-and-swap then fails and it retries.
//!
//! Lock-free rather than locked, unlike the kernel's: a push here never
//! fails and never waits, so [`FreeList::try_push`](crate::FreeList::try_push)
//! (and dropping an element, even in a signal handler) always succeeds.
//! ABA would need 2^32 successful operations while one pop sits between its
//! load and its compare-and-swap.

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Head word: `version << 32 | (index + 1)`, 0 in the low half when empty.
pub(crate) struct ExtraList {
    head: CachePadded<AtomicU64>,
}

const INDEX_MASK: u64 = 0xffff_ffff;

fn pack(version: u64, link: u32) -> u64 {
    (version << 32) | u64::from(link)
}

impl ExtraList {
    pub(crate) fn new() -> Self {
        Self {
            head: CachePadded::new(AtomicU64::new(0)),
        }
    }

    /// Whether the list looks empty (one load). Async-signal-safe.
    pub(crate) fn looks_empty(&self) -> bool {
        self.head.load(Ordering::Relaxed) & INDEX_MASK == 0
    }

    /// Pushes element `index`, whose link is `link_of(index)`. Lock-free;
    /// async-signal-safe. Release: the element's contents written before
    /// the push are visible to the thread that pops it.
    pub(crate) fn push<'a>(&self, index: u32, link_of: impl Fn(u32) -> &'a AtomicU32) {
        let link = link_of(index);
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            link.store((head & INDEX_MASK) as u32, Ordering::Relaxed);
            let new = pack((head >> 32).wrapping_add(1), index + 1);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Pops an index, or `None` if the list is empty. Lock-free;
    /// async-signal-safe.
    pub(crate) fn pop<'a>(&self, link_of: impl Fn(u32) -> &'a AtomicU32) -> Option<u32> {
        // Acquire on every read of the head: the link read next must be the
        // one the head's pusher wrote (its Release).
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let top = (head & INDEX_MASK) as u32;
            if top == 0 {
                return None;
            }
            let next = link_of(top - 1).load(Ordering::Relaxed);
            let new = pack((head >> 32).wrapping_add(1), next);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => return Some(top - 1),
                Err(now) => head = now,
            }
        }
    }
}

#[cfg(all(test, pcpu_loom))]
mod loom_tests {
    use super::ExtraList;
    use loom::sync::Arc;
    use pcpu::unstable::sync::atomic::AtomicU32;

    struct Fixture {
        list: ExtraList,
        links: [AtomicU32; 3],
    }

    impl Fixture {
        fn push(&self, i: u32) {
            self.list.push(i, |j| &self.links[j as usize]);
        }
        fn pop(&self) -> Option<u32> {
            self.list.pop(|j| &self.links[j as usize])
        }
    }

    /// The ABA schedule: T1 reads the head (0) and its next (1), T2 pops 0
    /// and 1 and pushes 0 back; T1's compare-and-swap must then fail (the
    /// version moved), or 1 would be both T2's and on the list. Removing
    /// the version bumps fails this model.
    #[test]
    fn versions_prevent_aba() {
        loom::model(|| {
            let f = Arc::new(Fixture {
                list: ExtraList::new(),
                links: Default::default(),
            });
            f.push(1);
            f.push(0);
            let f2 = Arc::clone(&f);
            let t1 = loom::thread::spawn(move || f2.pop());
            let a = f.pop();
            let b = f.pop();
            if let Some(a) = a {
                f.push(a);
            }
            let mut seen = vec![t1.join().unwrap(), b];
            seen.extend(std::iter::from_fn(|| f.pop()).map(Some));
            let mut held: Vec<u32> = seen.into_iter().flatten().collect();
            held.sort_unstable();
            assert_eq!(held, [0, 1], "an index lost or duplicated");
        });
    }
}
