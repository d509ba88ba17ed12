//! A thread's lease block: its slots, taking a lease ([`LeaseBlock::lease`])
//! and consuming it ([`Lease::consume`]), the owner's side of the race
//! with expiry.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::{Arc, PoisonError};

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::Ordering;

use super::expiry::Shared;
use super::held::{Held, LeasedValue};
use super::set::LeaseSet;
use super::slot::{CONSUMED, FREE, GONE, LEASED, STABLE, Slots, state_of, word};
use crate::Srcu;
use crate::cell::{SrcuCell, Strong};
use crate::domain::Inner;

/// Why no lease was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    /// Every slot of the block holds a lease (capacity is at most 64).
    BlockFull,
    /// The cell holds no value.
    Empty,
}

impl std::fmt::Display for LeaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::BlockFull => "every lease slot of this block is in use",
            Self::Empty => "the cell holds no value to lease",
        })
    }
}

impl std::error::Error for LeaseError {}

/// One thread's lease slots (at most 64). Not `Sync`: the owner thread
/// takes and consumes its leases; only the expiry thread looks at the
/// slots concurrently, through atomics. Dropping the block ends every
/// lease still in it (a thread that exits with leases pending releases
/// them).
pub struct LeaseBlock<'s, 'd, T: Send + Sync + 'static> {
    set: &'s LeaseSet<'d, T>,
    /// What taking and consuming a lease read, one load away (not
    /// through the set, its shared state and the domain in turn: on a
    /// probe hit each step is a load the next one waits for).
    srcu: &'d Srcu,
    shared: &'s Shared<T>,
    domain: &'s Inner,
    slots: Arc<Slots<T>>,
    /// Bit `i` set: slot `i` is free (owner-local bookkeeping).
    free: Cell<u64>,
    _not_sync: PhantomData<Cell<()>>,
}

impl<'s, 'd, T: Send + Sync + 'static> LeaseBlock<'s, 'd, T> {
    /// Takes a lease on the value `cell` holds now: an SRCU read section
    /// of the cell's domain and a few plain stores, no atomic
    /// read-modify-write. **Async-signal-safe** (interrupting the owner
    /// between its own block operations is fine only if the handler uses a
    /// different block).
    ///
    /// # Panics
    /// If `cell` belongs to another domain than the set.
    pub fn lease(&self, cell: &SrcuCell<'_, T>) -> Result<Lease<'_, 's, 'd, T>, LeaseError> {
        let shared = self.shared;
        // The same `Srcu`, the same state: a domain's state is made once
        // and kept until it is dropped.
        assert!(
            core::ptr::eq(cell.domain(), self.srcu),
            "cell of another SRCU domain than the lease set"
        );
        let free = self.free.get();
        if free == 0 {
            return Err(LeaseError::BlockFull);
        }
        let index = free.trailing_zeros() as usize;
        let bank = self.domain.read_lock();
        let Some(node) = cell.node_ptr() else {
            self.domain.read_unlock(bank);
            return Err(LeaseError::Empty);
        };
        self.free.set(free & !(1 << index));
        let slot = &self.slots[index];
        let generation = slot.word.load(Ordering::Relaxed) >> 8;
        // The previous lease of this slot was claimed by its consumer: the
        // new one is unclaimed. Published with the word (Release), so an
        // expiry that reads the new generation also reads this reset, and
        // a claim on the old lease can never make the new one unexpirable.
        slot.claimed.store(0, Ordering::Relaxed);
        slot.node.store(node.cast_mut(), Ordering::Relaxed);
        slot.bank.store(bank as u8, Ordering::Relaxed);
        slot.tick
            .store(shared.tick.load(Ordering::Relaxed), Ordering::Relaxed);
        slot.word.store(word(generation, LEASED), Ordering::Release);
        Ok(Lease {
            block: self,
            index,
            generation,
        })
    }

    /// Turns a [`RawLease`] of this block back into its lease.
    ///
    /// # Safety
    /// `raw` came from [`Lease::into_raw`] on a lease of **this** block,
    /// and each `RawLease` is turned back at most once (it is not `Clone`,
    /// so passing it by value ensures that). Async-signal-safe.
    #[allow(clippy::needless_pass_by_value)] // by value: used once
    pub unsafe fn from_raw(&self, raw: RawLease) -> Lease<'_, 's, 'd, T> {
        let RawLease { index, generation } = raw;
        debug_assert!(index < self.slots.len());
        Lease {
            block: self,
            index,
            generation,
        }
    }

    /// How many leases this block holds now.
    #[must_use]
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.get().count_ones() as usize
    }
}

impl<T: Send + Sync + 'static> Drop for LeaseBlock<'_, '_, T> {
    fn drop(&mut self) {
        // Leases borrow the block, so none is alive here; unregister.
        let mut blocks = self
            .set
            .shared
            .blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        blocks.retain(|b| !Arc::ptr_eq(b, &self.slots));
    }
}

impl<'d, T: Send + Sync + 'static> LeaseSet<'d, T> {
    /// A block of `capacity` lease slots for one thread (e.g. one per
    /// thread in a thread-local). Not async-signal-safe (allocates, locks).
    ///
    /// # Panics
    /// If `capacity` is not in `1..=64`.
    #[must_use]
    pub fn block(&self, capacity: usize) -> LeaseBlock<'_, 'd, T> {
        assert!(
            (1..=64).contains(&capacity),
            "a lease block holds 1 to 64 slots, not {capacity}"
        );
        self.srcu.revive();
        let slots: Arc<Slots<T>> =
            Arc::new((0..capacity).map(|_| CachePadded::default()).collect());
        self.shared
            .blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&slots));
        LeaseBlock {
            set: self,
            srcu: self.srcu,
            shared: &self.shared,
            domain: &self.shared.domain,
            slots,
            free: Cell::new(u64::MAX >> (64 - capacity)),
            _not_sync: PhantomData,
        }
    }
}

/// A lease on one value: an SRCU read section that the expiry thread may
/// turn into a strong reference. [`consume`](Self::consume) it (or drop it)
/// exactly once.
#[must_use = "a lease holds a read section (or a reference) until consumed or dropped"]
pub struct Lease<'b, 's, 'd, T: Send + Sync + 'static> {
    block: &'b LeaseBlock<'s, 'd, T>,
    index: usize,
    generation: u64,
}

/// A lease without the borrow of its block: for storing a lease in a data
/// structure next to the block it belongs to (a return-instance stack, say).
/// Made by [`Lease::into_raw`], turned back by [`LeaseBlock::from_raw`].
/// Forgetting one leaks what the lease holds (its read section, until the
/// expiry turns it into a reference that is never dropped).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a raw lease still holds a read section (or a reference)"]
pub struct RawLease {
    index: usize,
    generation: u64,
}

impl<'b, T: Send + Sync + 'static> Lease<'b, '_, '_, T> {
    /// Forgets the borrow of the block, keeping the lease (see
    /// [`RawLease`]). Async-signal-safe.
    pub fn into_raw(self) -> RawLease {
        let this = core::mem::ManuallyDrop::new(self);
        RawLease {
            index: this.index,
            generation: this.generation,
        }
    }

    /// Ends the lease and hands over what it holds: the value under the
    /// lease's read section (`LEASED`), under a strong reference
    /// (`STABLE`), or nothing if the value was retired before the lease
    /// expired (`GONE`). Plain stores and a compiler fence (an atomic swap
    /// while an expiry round runs). **Async-signal-safe**, except
    /// that dropping a [`Held::Stable`] may free the value.
    #[must_use = "dropping what a lease hands over ends it at once"]
    pub fn consume(self) -> Option<Held<'b, T>> {
        let this = core::mem::ManuallyDrop::new(self);
        this.take()
    }

    fn take(&self) -> Option<Held<'b, T>> {
        let block = self.block;
        let slot = &block.slots[self.index];
        let node = slot.node.load(Ordering::Relaxed);
        let bank = slot.bank.load(Ordering::Relaxed);
        let shared = block.shared;
        // Claim, light fence, look for an expiry round (pairs with the
        // round's announcement and heavy fence). No round: no expiry can
        // touch the slot before we are done, and every earlier round's
        // outcome is visible through `expiring`'s Acquire, so plain
        // accesses do. A round in progress: arbitrate with a swap against
        // its compare-and-swap.
        slot.claimed.store(1, Ordering::Relaxed);
        pcpu::fence::light();
        let prev = if shared.expiring.load(Ordering::Acquire) == 0 {
            let prev = slot.word.load(Ordering::Acquire);
            slot.word
                .store(word(self.generation, CONSUMED), Ordering::Relaxed);
            prev
        } else {
            slot.word
                .swap(word(self.generation, CONSUMED), Ordering::AcqRel)
        };
        // Free the slot for reuse under a new generation.
        slot.word
            .store(word(self.generation + 1, FREE), Ordering::Release);
        block.free.set(block.free.get() | 1 << self.index);
        let node = NonNull::new(node)?;
        match state_of(prev) {
            LEASED => Some(Held::Leased({
                // A guard section of this thread from now on (see
                // `fork::SECTIONS_HELD`; `LeasedValue` is not `Send`).
                crate::fork::held_add(1);
                LeasedValue {
                    domain: block.domain,
                    bank: usize::from(bank),
                    node,
                }
            })),
            // SAFETY: the expiry took one strong count for this lease and
            // handed it over by moving to STABLE; we own it now.
            STABLE => Some(Held::Stable(Strong(unsafe {
                Arc::from_raw(node.as_ptr().cast_const())
            }))),
            _ => None,
        }
    }

    /// Whether the lease has been expired into a reference or found gone
    /// (a snapshot, for diagnostics and tests).
    #[must_use]
    pub fn is_expired(&self) -> bool {
        matches!(
            state_of(self.block.slots[self.index].word.load(Ordering::Acquire)),
            STABLE | GONE
        )
    }
}

impl<T: Send + Sync + 'static> Drop for Lease<'_, '_, '_, T> {
    fn drop(&mut self) {
        drop(self.take());
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for LeaseBlock<'_, '_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseBlock")
            .field("capacity", &self.slots.len())
            .field("free", &self.free.get().count_ones())
            .finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for Lease<'_, '_, '_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("slot", &self.index)
            .field("expired", &self.is_expired())
            .finish_non_exhaustive()
    }
}
