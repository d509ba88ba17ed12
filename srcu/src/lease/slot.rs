//! A lease slot: the words its owner thread publishes a lease in, and the
//! state word (a state and a generation) that expiry and consumption
//! race on.

use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64};

use crossbeam_utils::CachePadded;

use crate::cell::Node;

pub(super) const FREE: u64 = 0;
pub(super) const LEASED: u64 = 1;
pub(super) const STABLE: u64 = 2;
pub(super) const GONE: u64 = 3;
pub(super) const CONSUMED: u64 = 4;

pub(super) fn word(generation: u64, state: u64) -> u64 {
    generation << 8 | state
}

pub(super) fn state_of(w: u64) -> u64 {
    w & 0xff
}

/// One lease slot. The owner thread writes `node`, `bank` and `tick`, then
/// publishes with `word` (Release); expiry reads `word` (Acquire) first.
pub(super) struct Slot<T> {
    pub(super) word: AtomicU64,
    pub(super) node: AtomicPtr<Node<T>>,
    pub(super) bank: AtomicU8,
    pub(super) tick: AtomicU64,
    /// Set by the owner when it starts consuming (see `Lease::take`),
    /// cleared when the slot is leased again (`LeaseBlock::lease`).
    pub(super) claimed: AtomicU8,
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self {
            word: AtomicU64::new(word(0, FREE)),
            node: AtomicPtr::new(core::ptr::null_mut()),
            bank: AtomicU8::new(0),
            tick: AtomicU64::new(0),
            claimed: AtomicU8::new(0),
        }
    }
}

/// A block's slots, each on its own cache line.
pub(super) type Slots<T> = Box<[CachePadded<Slot<T>>]>;
