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
//! count; the drain drops as many references as each node owed
//! (`pcpu::unstable::owed`, shared with `sigpending`'s deferred owner releases).

use std::sync::Arc;

use pcpu::unstable::owed::{Owing, drain as drain_owed, owe};
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicUsize};

use crate::cell::Node;

impl<T> Owing for Node<T> {
    fn owed(&self) -> &AtomicUsize {
        &self.owed
    }
    fn next_owed(&self) -> &AtomicPtr<Self> {
        &self.next_owed
    }
}

/// Hands one strong reference of `node` to the list at `head`, to be
/// dropped by [`drain`]. Lock-free, no allocation: async-signal-safe.
pub(crate) fn push<T>(head: &AtomicPtr<Node<T>>, node: Arc<Node<T>>) {
    // The list takes over this strong count (one per unit owed), which
    // keeps the node alive until drained.
    let ptr = Arc::into_raw(node);
    // SAFETY: as above.
    unsafe { owe(head, ptr, || {}) };
}

/// Drops every reference handed to the list at `head` so far; returns how
/// many. Ordinary context only (a drop may free the value). Concurrent
/// drains are fine: each takes what was listed when it started.
pub(crate) fn drain<T>(head: &AtomicPtr<Node<T>>) -> usize {
    let mut dropped = 0;
    drain_owed(head, |ptr, units| {
        for _ in 0..units {
            // SAFETY: one of the counts handed over in `push`.
            unsafe { Arc::decrement_strong_count(ptr.cast_const()) };
        }
        dropped += units;
    });
    dropped
}
