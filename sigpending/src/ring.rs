//! A bounded lock-free FIFO whose operations never wait.
//!
//! Dmitry Vyukov's bounded MPMC queue: each slot carries a sequence number
//! saying whose turn it is. A producer claims position `p` by advancing the
//! tail from `p` once slot `p % cap` shows sequence `p` (free), writes, and
//! publishes `p + 1`; a consumer claims `p` once the slot shows `p + 1`,
//! reads, and frees it for the next lap with `p + cap`.
//!
//! Unlike the usual implementations, neither side ever spins waiting for
//! another thread: a producer that finds its slot not yet freed reports
//! "full", a consumer that finds it not yet published reports "empty". A
//! signal handler that interrupted a producer or consumer between its claim
//! and its publish therefore never waits for it (it sees one slot as
//! busy), which is what makes both operations async-signal-safe.

use core::mem::MaybeUninit;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicUsize, Ordering};
use pcpu::unstable::sync::cell::UnsafeCell;

struct Slot<T> {
    seq: AtomicUsize,
    value: UnsafeCell<MaybeUninit<T>>,
}

pub(crate) struct Ring<T> {
    slots: Box<[Slot<T>]>,
    head: CachePadded<AtomicUsize>,
    tail: CachePadded<AtomicUsize>,
}

// SAFETY: values move between threads through the ring, one owner at a time
// (the sequence protocol hands each slot to one thread).
unsafe impl<T: Send> Sync for Ring<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for Ring<T> {}

impl<T> Ring<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            slots: (0..capacity)
                .map(|i| Slot {
                    seq: AtomicUsize::new(i),
                    value: UnsafeCell::new(MaybeUninit::uninit()),
                })
                .collect(),
            head: CachePadded::new(AtomicUsize::new(0)),
            tail: CachePadded::new(AtomicUsize::new(0)),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Appends `value`, or gives it back if no slot is free now.
    pub(crate) fn push(&self, value: T) -> Result<(), T> {
        let cap = self.slots.len();
        if cap == 0 {
            return Err(value);
        }
        let mut pos = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[pos % cap];
            let seq = slot.seq.load(Ordering::Acquire);
            match seq.wrapping_sub(pos) as isize {
                0 => match self.tail.compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: the claim makes this slot ours until the
                        // sequence store below publishes it.
                        slot.value.with_mut(|v| unsafe { (*v).write(value) });
                        slot.seq.store(pos.wrapping_add(1), Ordering::Release);
                        return Ok(());
                    }
                    Err(now) => pos = now,
                },
                // The slot still holds last lap's value (full), or its
                // consumer has not freed it yet: never wait for it.
                d if d < 0 => return Err(value),
                _ => pos = self.tail.load(Ordering::Relaxed),
            }
        }
    }

    /// Takes the oldest published value, or `None` if there is none now.
    pub(crate) fn pop(&self) -> Option<T> {
        let cap = self.slots.len();
        if cap == 0 {
            return None;
        }
        let mut pos = self.head.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[pos % cap];
            let seq = slot.seq.load(Ordering::Acquire);
            match seq.wrapping_sub(pos.wrapping_add(1)) as isize {
                0 => match self.head.compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: published (sequence `pos + 1`, Acquire)
                        // and now claimed by us alone.
                        let value = slot.value.with(|v| unsafe { (*v).assume_init_read() });
                        slot.seq.store(pos.wrapping_add(cap), Ordering::Release);
                        return Some(value);
                    }
                    Err(now) => pos = now,
                },
                // Empty, or its producer has not published yet.
                d if d < 0 => return None,
                _ => pos = self.head.load(Ordering::Relaxed),
            }
        }
    }

    /// Values published and not yet taken (a racy snapshot).
    pub(crate) fn len(&self) -> usize {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Relaxed);
        tail.wrapping_sub(head).min(self.slots.len())
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        while self.pop().is_some() {}
    }
}
