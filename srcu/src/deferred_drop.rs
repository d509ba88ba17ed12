//! Strong references dropped later, in ordinary context: what a signal
//! handler does with a lease that had expired into a reference
//! ([`LeaseSet::drop_later`](crate::LeaseSet::drop_later)).
//!
//! Dropping a [`Strong`](crate::Strong) may free its value, which a signal
//! handler must not do. Instead the handler hands the reference to a list
//! that the lease set's expiry thread drains. The list is intrusive (the
//! value's node carries the link) so that handing over never allocates:
//! each node has an `owed` count and a link. The first reference owed
//! (`owed` 0 -> 1) pushes the node on a Treiber stack; later ones only
//! count. The drain takes the whole stack with one swap (no pop ever races
//! a push: no ABA), and for each node reads its link, takes its `owed`
//! count and drops that many references. (The same scheme as
//! `sigpending`'s deferred owner releases.)

use std::sync::Arc;

use pcpu::sync::atomic::{AtomicPtr, Ordering};

use crate::cell::Node;

/// Hands one strong reference of `node` to the list at `head`, to be
/// dropped by [`drain`]. Lock-free, no allocation: async-signal-safe.
pub(crate) fn push<T>(head: &AtomicPtr<Node<T>>, node: Arc<Node<T>>) {
    let ptr = Arc::into_raw(node).cast_mut();
    // SAFETY: we own the strong count just turned into `ptr`; the list
    // takes it over (one count per unit of `owed`).
    let n = unsafe { &*ptr };
    if n.owed.fetch_add(1, Ordering::AcqRel) != 0 {
        return; // already listed: the drain drops this count too
    }
    let mut top = head.load(Ordering::Relaxed);
    loop {
        n.next_owed.store(top, Ordering::Relaxed);
        match head.compare_exchange_weak(top, ptr, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(now) => top = now,
        }
    }
}

/// Drops every reference handed to the list at `head` so far; returns how
/// many. Ordinary context only (a drop may free the value). Concurrent
/// drains are fine: each takes what was listed when it started.
pub(crate) fn drain<T>(head: &AtomicPtr<Node<T>>) -> usize {
    let mut ptr = head.swap(core::ptr::null_mut(), Ordering::Acquire);
    let mut dropped = 0;
    while !ptr.is_null() {
        // SAFETY: a listed node holds `owed >= 1` strong counts, so it is
        // alive until we drop them below.
        let n = unsafe { &*ptr };
        // Read the link before clearing `owed`: from then on the node may
        // be listed again, which rewrites it.
        let next = n.next_owed.load(Ordering::Relaxed);
        let owed = n.owed.swap(0, Ordering::AcqRel);
        for _ in 0..owed {
            // SAFETY: one of the counts handed over in `push`.
            unsafe { Arc::decrement_strong_count(ptr.cast_const()) };
        }
        dropped += owed;
        ptr = next;
    }
    dropped
}
