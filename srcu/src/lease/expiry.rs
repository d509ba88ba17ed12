//! Expiry: the state a lease set shares with its blocks and its expiry
//! thread, the rounds that turn old leases into strong references, and
//! the thread that runs a round every tick.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use super::slot::{GONE, LEASED, STABLE, Slot, Slots, state_of, word};
use crate::cell::Node;
use crate::domain::Inner;

/// Ticks a parked expiry thread waits with nothing to do before it ends.
#[cfg_attr(pcpu_loom, allow(dead_code))]
const PARKED_IDLE_TICKS: u32 = 8;

/// How many expiry ticks make one timeout: a lease expires between
/// `timeout` and `timeout * (1 + 1/TICKS)` after it was taken.
#[cfg_attr(pcpu_loom, allow(dead_code))]
pub(super) const TICKS: u64 = 4;

/// State shared by a lease set, its blocks and its expiry thread.
pub(super) struct Shared<T> {
    pub(super) domain: Arc<Inner>,
    /// Expiry ticks so far (the expiry thread advances it every
    /// `timeout / TICKS`); leases record it instead of reading a clock.
    pub(super) tick: CachePadded<AtomicU64>,
    pub(super) blocks: Mutex<Vec<Arc<Slots<T>>>>,
    /// `expire`'s copy of `blocks`, reused round after round.
    pub(super) expiry_scratch: Mutex<Vec<Arc<Slots<T>>>>,
    /// Expiry rounds in progress. A consumer that sees none takes the
    /// fence-free path (see `Lease::take`).
    pub(super) expiring: CachePadded<AtomicU64>,
    pub(super) expired: AtomicU64,
    /// Strong references handed over by `drop_later`, dropped by the
    /// expiry thread (`deferred_drop`).
    pub(super) owing: AtomicPtr<Node<T>>,
    /// The expiry thread's control (stop flag, its handle), and its wake-up.
    pub(super) ctl: (Mutex<Ctl>, Condvar),
    /// Time between expiry ticks (`timeout / TICKS`).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    pub(super) period: Duration,
}

/// Whether the set is being dropped, whether its expiry thread may end
/// once no lease is held ([`LeaseSet::park_expiry`](super::LeaseSet::park_expiry)),
/// and the thread with the fork generation it was started in (a fork
/// child starts its own).
#[derive(Default)]
pub(super) struct Ctl {
    pub(super) stopped: bool,
    pub(super) parked: bool,
    pub(super) thread: Option<(u64, JoinHandle<()>)>,
}

/// Starts the expiry thread of `shared`.
#[cfg(not(pcpu_loom))]
pub(super) fn spawn_expiry<T: Send + Sync + 'static>(
    shared: &Arc<Shared<T>>,
) -> std::io::Result<JoinHandle<()>> {
    let s = Arc::clone(shared);
    std::thread::Builder::new()
        .name("srcu-lease-expiry".into())
        .spawn(move || expiry_loop(&s, s.period))
}

impl<T> Shared<T> {
    /// Expires the leases of every block whose age is at least `min_age`
    /// ticks; returns how many it expired.
    pub(super) fn expire(&self, min_age: u64) -> u64 {
        let now = self.tick.load(Ordering::Relaxed);
        // The blocks, copied into a buffer kept across rounds: an expiry
        // tick allocates nothing (a program tracing `malloc` sees no call
        // of ours), and `blocks` is not held across the heavy fence.
        let mut blocks = self
            .expiry_scratch
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        blocks.clear();
        blocks.extend(
            self.blocks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .cloned(),
        );
        // Our own read section: a value we look at cannot be freed while
        // we hold it (see the module docs of `lease`).
        let bank = self.domain.read_lock();
        // Announce the round, then the heavy fence: a consumer either sees
        // the announcement (and arbitrates with a swap) or its claim is
        // visible to us (and we leave the slot alone).
        self.expiring.fetch_add(1, Ordering::Relaxed);
        pcpu::fence::heavy();
        let mut n = 0;
        for slots in blocks.iter() {
            for slot in slots.iter() {
                n += u64::from(self.expire_slot(slot, now, min_age));
            }
        }
        // The references go now, the buffer stays.
        blocks.clear();
        // Release: a consumer that reads the end of the round sees our CASes.
        self.expiring.fetch_sub(1, Ordering::Release);
        self.domain.read_unlock(bank);
        n
    }

    /// Whether some slot holds a lease not consumed yet (a read section,
    /// or the reference it expired into: its release hands that to the
    /// expiry thread).
    #[cfg(not(pcpu_loom))]
    fn any_held(&self) -> bool {
        self.blocks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|slots| {
                slots.iter().any(|slot| {
                    matches!(
                        state_of(slot.word.load(Ordering::Acquire)),
                        LEASED | STABLE | GONE
                    )
                })
            })
    }

    fn expire_slot(&self, slot: &Slot<T>, now: u64, min_age: u64) -> bool {
        let w = slot.word.load(Ordering::Acquire);
        if state_of(w) != LEASED
            || slot.claimed.load(Ordering::Relaxed) != 0
            || now.wrapping_sub(slot.tick.load(Ordering::Relaxed)) < min_age
        {
            return false;
        }
        let node = slot.node.load(Ordering::Relaxed);
        let bank = slot.bank.load(Ordering::Relaxed);
        // SAFETY: our read section plus the two-grace-period retirement
        // keep `node` allocated (module docs of `lease`), even if the slot
        // has been consumed or reused since we read `w`.
        let retired = unsafe { (*node).retired.load(Ordering::Acquire) };
        let next = if retired {
            GONE
        } else {
            // SAFETY: as above; the cell's own count keeps the strong
            // count above zero until its deferred drop, which waits for us.
            unsafe { Arc::increment_strong_count(node) };
            STABLE
        };
        let generation = w >> 8;
        if slot
            .word
            .compare_exchange(
                w,
                word(generation, next),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            // We won: the lease's section is ours to end. Counted first:
            // a grace period that ending the section lets finish sees the
            // count (`LeaseSet::expired`) that includes it.
            self.expired.fetch_add(1, Ordering::Relaxed);
            self.domain.read_unlock(usize::from(bank));
            true
        } else {
            if next == STABLE {
                // The owner consumed (or reused) the slot first.
                // SAFETY: we took this count just above.
                unsafe { Arc::decrement_strong_count(node) };
            }
            false
        }
    }
}

#[cfg(not(pcpu_loom))]
fn expiry_loop<T>(shared: &Shared<T>, period: Duration) {
    crate::service::started();
    let (ctl, cv) = &shared.ctl;
    let mut guard = ctl.lock().unwrap_or_else(PoisonError::into_inner);
    // Parked: consecutive ticks with nothing held and nothing to drop.
    let mut idle = 0;
    loop {
        guard = cv
            .wait_timeout(guard, period)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
        if guard.stopped {
            return;
        }
        shared.tick.fetch_add(1, Ordering::Relaxed);
        drop(guard);
        shared.expire(TICKS);
        let dropped = crate::deferred_drop::drain(&shared.owing);
        guard = ctl.lock().unwrap_or_else(PoisonError::into_inner);
        // Parked, and for a while nothing held and nothing handed over to
        // drop (a lease consumed just now hands its reference over right
        // after): this thread ends (its handle is dropped, detaching it);
        // `resume_expiry` starts another.
        idle = if guard.parked && dropped == 0 && !shared.any_held() {
            idle + 1
        } else {
            0
        };
        if idle >= PARKED_IDLE_TICKS {
            drop(guard.thread.take());
            return;
        }
    }
}
