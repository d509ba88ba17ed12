//! Grace periods: checking that every section of a bank has ended, and
//! the two-bank algorithm that waits for the readers that began before a
//! call.

use std::time::{Duration, Instant};

use pcpu::unstable::sync::atomic::Ordering;

use super::backoff::backoff;
use super::state::{Inner, LOCK, UNLOCK};
use crate::reclaim::{self, Reclaimer};

impl Inner {
    fn sum(&self, word: usize) -> u64 {
        self.counts
            .iter()
            .fold(0u64, |s, c| s.wrapping_add(c[word].load(Ordering::Relaxed)))
    }

    /// Whether every read section that began on `bank` has ended. Per
    /// CPU, unlocks are summed before locks, with a heavy fence between
    /// (A): a section whose unlock is counted also has its lock counted,
    /// so an unbalanced sum can only overestimate the readers. The
    /// threads' slots are read after the fence: each is one word that
    /// only its owner writes, open on `bank` while its outermost guard
    /// section that began there lasts.
    fn drained(&self, bank: usize) -> bool {
        let unlocks = self.sum(UNLOCK + bank);
        pcpu::fence::heavy();
        let locks = self.sum(LOCK + bank);
        locks == unlocks && !self.readers.open_on(bank)
    }

    /// Waits until `bank` drains: polls, then yields, then sleeps with a
    /// growing delay (`expedited`: never sleeps). With `deadline`, gives up
    /// at that time and returns `false`.
    fn wait_drained(&self, bank: usize, expedited: bool, deadline: Option<Instant>) -> bool {
        let mut round = 0u32;
        loop {
            // A dead domain's grace periods are over (see `dead`), also for
            // a reclaimer that was already waiting when the domain died.
            if self.drained(bank) || self.dead.load(Ordering::Acquire) {
                return true;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            round += 1;
            backoff(round, expedited);
        }
    }

    /// A grace period: returns once every read section that began before
    /// the call has ended (the kernel's classic SRCU algorithm).
    pub(crate) fn synchronize(&self, expedited: bool, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let _gp = self.gp_lock.lock();
        if self.dead.load(Ordering::Acquire) {
            return true;
        }
        // No fence is needed before the first check: the heavy fence (A)
        // inside it separates the caller's updates (unlinking) from the
        // first read of any lock count, which is all a reader's
        // "count, then load" needs to pair with (the loom models check
        // this).
        let active = (self.completed.load(Ordering::Relaxed) & 1) as usize;
        // Readers that fetched the inactive index during the previous grace
        // period but incremented late: this grace period must wait for them.
        if !self.wait_drained(active ^ 1, expedited, deadline) {
            return false;
        }
        // Flip: new readers use the other bank.
        let started = self.completed.fetch_add(1, Ordering::Relaxed);
        self.hot.store(
            self.readers.hot(((started + 1) & 1) as usize),
            Ordering::Relaxed,
        );
        pcpu::fence::heavy();
        // Every reader of the bank that was active when we started.
        if !self.wait_drained(active, expedited, deadline) {
            return false;
        }
        // D: the readers' loads are done before the caller frees anything.
        pcpu::fence::heavy();
        true
    }
}

/// The reclaimer's view: its queue, and ordinary grace periods.
impl reclaim::Domain for Inner {
    fn reclaimer(&self) -> &Reclaimer {
        &self.reclaimer
    }

    fn grace_period(&self) {
        self.synchronize(false, None);
    }
}
