//! `PendingQueue`: a bounded FIFO whose items are charged to an account.

use std::sync::Arc;

use pcpu::unstable::sync::atomic::{AtomicU64, Ordering};

use crate::ring::Ring;
use crate::{Account, ChargeError};

/// How a [`PendingQueue`] charges its items. Implemented for
/// `Arc<`[`Account`]`>` (one charge per queued item); implement it to
/// queue against another accounting scheme (the workspace's benchmark
/// implements the pre-patch kernel's this way).
pub trait Accounting: Send + Sync {
    /// Charges one item; an error refuses it.
    fn charge(&self) -> Result<(), ChargeError>;

    /// Undoes one charge.
    ///
    /// # Safety
    /// Balances one earlier successful [`charge`](Self::charge).
    unsafe fn uncharge(&self);
}

impl Accounting for Arc<Account> {
    #[inline]
    fn charge(&self) -> Result<(), ChargeError> {
        Account::charge(self).map(crate::Charge::forget)
    }

    #[inline]
    unsafe fn uncharge(&self) {
        // SAFETY: forwarded (the queue holds one forgotten charge per item).
        unsafe { self.uncharge_unchecked() };
    }
}

/// Why [`PendingQueue::enqueue`] refused an item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The account (or an ancestor) refused the charge.
    Charge(ChargeError),
    /// Every slot of the queue is taken (or its oldest slot is still being
    /// read by a concurrent dequeue).
    Full {
        /// The queue's capacity.
        capacity: usize,
    },
}

/// An item [`PendingQueue::enqueue`] refused, given back with the reason.
/// The refusal was counted in [`PendingQueue::dropped`].
#[derive(Debug, PartialEq, Eq)]
pub struct Refused<T> {
    /// The item, untouched.
    pub value: T,
    /// Why it was refused.
    pub reason: Refusal,
}

impl<T> core::fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match &self.reason {
            Refusal::Charge(e) => write!(f, "pending item refused: {e}"),
            Refusal::Full { capacity } => {
                write!(f, "pending item refused: queue full ({capacity} slots)")
            }
        }
    }
}

impl<T: core::fmt::Debug> std::error::Error for Refused<T> {}

/// A bounded FIFO of pending items, each charged to an account while it is
/// queued: the kernel's signal queue with its per-user limit, and what
/// `uprobe-core` uses for per-consumer in-flight limits (kprobes'
/// `maxactive`, with refusals counted like `nmissed`).
///
/// [`enqueue`](Self::enqueue) charges, then queues (undoing the charge if
/// the queue is full); [`dequeue`](Self::dequeue) unqueues, then
/// uncharges. A refusal hands the item back with its reason and counts in
/// [`dropped`](Self::dropped). Dropping the queue uncharges what is left.
///
/// **Async-signal-safe**: `enqueue`, `dequeue`, `len`, `dropped`, for an
/// account with [`Release::Deferred`](crate::Release::Deferred) (or an
/// owner whose release is signal-safe). Neither side ever waits for
/// another thread: a dequeue that finds the next item still being written
/// returns `None` for now.
///
/// ```
/// use sigpending::{Account, Owner, PendingQueue, Refusal, ChargeError};
/// let account = Account::new(2, Owner::none());
/// let q = PendingQueue::new(8, account.clone());
/// q.enqueue("a")?;
/// q.enqueue("b")?;
/// let refused = q.enqueue("c").unwrap_err();
/// assert_eq!(refused.value, "c");
/// assert_eq!(refused.reason, Refusal::Charge(ChargeError::OverLimit { depth: 0, limit: 2 }));
/// assert_eq!((q.dropped(), account.charged()), (1, 2));
/// assert_eq!(q.dequeue(), Some("a"));
/// assert_eq!(account.charged(), 1);
/// # Ok::<(), sigpending::Refused<&str>>(())
/// ```
pub struct PendingQueue<T, A: Accounting = Arc<Account>> {
    ring: Ring<T>,
    account: A,
    dropped: AtomicU64,
}

impl<T, A: Accounting> PendingQueue<T, A> {
    /// A queue of `capacity` slots charging `account`. Not
    /// async-signal-safe (allocates the slots).
    #[must_use]
    pub fn new(capacity: usize, account: A) -> Self {
        Self {
            ring: Ring::new(capacity),
            account,
            dropped: AtomicU64::new(0),
        }
    }

    /// Charges and queues `value`, or gives it back with the reason.
    pub fn enqueue(&self, value: T) -> Result<(), Refused<T>> {
        if let Err(e) = self.account.charge() {
            return Err(self.refuse(value, Refusal::Charge(e)));
        }
        self.ring.push(value).map_err(|value| {
            // SAFETY: undoes the charge just taken.
            unsafe { self.account.uncharge() };
            self.refuse(
                value,
                Refusal::Full {
                    capacity: self.ring.capacity(),
                },
            )
        })
    }

    /// Takes the oldest item and uncharges it; `None` if there is none
    /// (or the next one is still being written).
    pub fn dequeue(&self) -> Option<T> {
        let value = self.ring.pop()?;
        // SAFETY: every queued item holds one charge.
        unsafe { self.account.uncharge() };
        Some(value)
    }

    fn refuse(&self, value: T, reason: Refusal) -> Refused<T> {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        Refused { value, reason }
    }

    /// Items refused so far (over a limit, or queue full).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Items queued now (a racy snapshot).
    #[must_use]
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    /// Whether no item is queued now (a racy snapshot).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of slots.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    /// The accounting the items are charged to.
    #[must_use]
    pub fn account(&self) -> &A {
        &self.account
    }
}

impl<T, A: Accounting> Drop for PendingQueue<T, A> {
    fn drop(&mut self) {
        while self.dequeue().is_some() {}
    }
}

impl<T, A: Accounting> core::fmt::Debug for PendingQueue<T, A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PendingQueue")
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}
