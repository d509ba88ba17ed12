//! Deferred callbacks (`call_srcu`) and `srcu_barrier`: a reclaimer thread
//! per domain, started on first use.

// Under loom callbacks run inline (see `enqueue`): the thread, its queue and
// its loop are not built for models.
#![cfg_attr(pcpu_loom, allow(dead_code))]

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::domain::Inner;

/// A callback, how many more grace periods it waits for, and its place in
/// the order of queueing (what `barrier` waits by).
pub(crate) struct Deferred {
    f: Box<dyn FnOnce() + Send>,
    grace_periods: u8,
    seq: u64,
}

impl Deferred {
    /// `f`, to run after `grace_periods` grace periods.
    pub(crate) fn new(f: Box<dyn FnOnce() + Send>, grace_periods: u8) -> Self {
        Self {
            f,
            grace_periods,
            seq: 0,
        }
    }
}

#[derive(Default)]
pub(crate) struct State {
    /// Callbacks waiting for the next batch.
    queue: Vec<Deferred>,
    /// The batch whose grace period is in progress. Kept here rather than
    /// on the reclaimer's stack so that a fork child, which has no
    /// reclaimer thread, finds it and queues it again.
    in_flight: Vec<Deferred>,
    /// The sequence number of the next callback queued.
    next_seq: u64,
    /// Sequence numbers of the callbacks queued and not finished yet (run,
    /// or panicked). Callbacks finish out of order (they wait for different
    /// numbers of grace periods), so `barrier` waits until none below its
    /// target is left, not for a count.
    unfinished: BTreeSet<u64>,
    /// The reclaimer thread and the process it was started in (a fork
    /// child has no such thread and starts its own).
    thread: Option<(u32, JoinHandle<()>)>,
    shutting_down: bool,
    /// Threads inside `barrier` (tests park a queueing thread on it).
    #[cfg(test)]
    barrier_waiters: usize,
}

/// The callback queue of one domain.
#[derive(Default)]
pub(crate) struct Reclaimer {
    state: Mutex<State>,
    work: Condvar,
    finished: Condvar,
}

impl Reclaimer {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `d` and makes sure this process has a reclaimer thread
    /// (`inner` provides the shared state it needs).
    /// loom cannot model a real thread: the grace periods and the callback
    /// run inline.
    #[cfg(pcpu_loom)]
    pub(crate) fn enqueue(&self, inner: impl FnOnce() -> Arc<Inner>, d: Deferred) {
        let inner = inner();
        for _ in 0..d.grace_periods {
            inner.synchronize(false, None);
        }
        (d.f)();
    }

    #[cfg(not(pcpu_loom))]
    pub(crate) fn enqueue(&self, inner: impl FnOnce() -> Arc<Inner>, mut d: Deferred) {
        let mut st = self.lock();
        d.seq = st.next_seq;
        st.next_seq += 1;
        st.unfinished.insert(d.seq);
        st.queue.push(d);
        Self::ensure_thread(&mut st, inner);
        self.work.notify_one();
    }

    /// Starts a reclaimer thread if this process has none (the first
    /// callback, or the first use in a fork child). In a child, the batch
    /// the parent's reclaimer was waiting a grace period for is queued
    /// again, and callbacks the parent's reclaimer had already taken out to
    /// run are the parent's alone: `barrier` in the child does not wait for
    /// them.
    #[cfg(not(pcpu_loom))]
    fn ensure_thread(st: &mut State, inner: impl FnOnce() -> Arc<Inner>) {
        let pid = std::process::id();
        if st.thread.as_ref().is_some_and(|(p, _)| *p == pid) {
            return;
        }
        if let Some((_, inherited)) = st.thread.take() {
            // The parent's thread does not exist here: not ours to join
            // or detach.
            core::mem::forget(inherited);
            let in_flight = std::mem::take(&mut st.in_flight);
            st.queue.extend(in_flight);
            st.unfinished = st.queue.iter().map(|d| d.seq).collect();
            st.shutting_down = false;
        }
        let inner = inner();
        let handle = std::thread::Builder::new()
            .name("srcu-reclaim".into())
            .spawn(move || reclaim_loop(&inner))
            .expect("spawn the srcu reclaimer thread");
        st.thread = Some((pid, handle));
    }

    /// In a fork child: restarts the reclaimer if callbacks are pending.
    #[cfg(not(pcpu_loom))]
    pub(crate) fn revive(&self, inner: impl FnOnce() -> Arc<Inner>) {
        let mut st = self.lock();
        if !st.unfinished.is_empty() {
            Self::ensure_thread(&mut st, inner);
        }
    }

    /// The state lock, for the fork handlers (held across `fork` so that
    /// the child inherits a consistent queue).
    #[cfg(not(pcpu_loom))]
    pub(crate) fn state_lock(&self) -> &Mutex<State> {
        &self.state
    }

    /// Waits until every callback queued before this call has finished,
    /// however many grace periods each needs and whatever is queued after
    /// it (`inner`: for starting a fork child's reclaimer).
    pub(crate) fn barrier(&self, inner: impl FnOnce() -> Arc<Inner>) {
        let mut st = self.lock();
        #[cfg(not(pcpu_loom))]
        if !st.unfinished.is_empty() {
            Self::ensure_thread(&mut st, inner);
        }
        #[cfg(pcpu_loom)]
        let _ = inner;
        let target = st.next_seq;
        #[cfg(test)]
        {
            st.barrier_waiters += 1;
        }
        while st.unfinished.first().is_some_and(|&seq| seq < target) {
            st = self
                .finished
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        #[cfg(test)]
        {
            st.barrier_waiters -= 1;
        }
    }

    /// Threads waiting in `barrier` now (test hook).
    #[cfg(test)]
    pub(crate) fn barrier_waiters(&self) -> usize {
        self.lock().barrier_waiters
    }

    /// Runs the remaining callbacks, then stops the thread (domain drop).
    pub(crate) fn shut_down(&self, inner: impl FnOnce() -> Arc<Inner>) {
        self.barrier(inner);
        let thread = {
            let mut st = self.lock();
            st.shutting_down = true;
            st.thread.take()
        };
        self.work.notify_all();
        if let Some((pid, handle)) = thread {
            if pid == std::process::id() {
                let _ = handle.join();
            } else {
                core::mem::forget(handle);
            }
        }
    }
}

fn reclaim_loop(inner: &Inner) {
    let r = &inner.reclaimer;
    loop {
        {
            let mut st = r.lock();
            while st.queue.is_empty() && !st.shutting_down {
                st = r.work.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.queue.is_empty() {
                return; // shutting down, nothing left
            }
            debug_assert!(st.in_flight.is_empty());
            st.in_flight = std::mem::take(&mut st.queue);
        }
        // One grace period serves the whole batch.
        inner.synchronize(false, None);
        let batch = std::mem::take(&mut r.lock().in_flight);
        let mut again = Vec::new();
        let mut done = Vec::new();
        for mut d in batch {
            d.grace_periods = d.grace_periods.saturating_sub(1);
            if d.grace_periods > 0 {
                again.push(d);
                continue;
            }
            done.push(d.seq);
            if catch_unwind(AssertUnwindSafe(d.f)).is_err() {
                eprintln!("srcu: a deferred callback panicked (the reclaimer continues)");
            }
        }
        let mut st = r.lock();
        st.queue.extend(again);
        for seq in done {
            st.unfinished.remove(&seq);
        }
        drop(st);
        r.finished.notify_all();
    }
}

#[cfg(all(test, not(pcpu_loom)))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::mpsc::channel;
    use std::time::Duration;

    use crate::{Srcu, SrcuCell};

    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }

    /// `barrier` waits for a deferred drop that needs two grace periods
    /// even when callbacks queued after the barrier began finish first.
    /// The batches are lined up deterministically: the reclaimer is parked
    /// inside a callback while the drop (two grace periods), the barrier and
    /// a later callback (one) line up in one batch; that callback queues
    /// another one, which runs just before the drop's second turn and holds
    /// the drop back until the barrier has returned (or a second has
    /// passed: only a correct barrier is still waiting then).
    #[test]
    fn barrier_waits_for_a_two_grace_period_drop_whatever_is_queued_after_it() {
        let domain: &'static Srcu = Box::leak(Box::new(Srcu::new()));
        let dropped = Arc::new(AtomicBool::new(false));
        let cell = SrcuCell::new(domain, Some(Flag(Arc::clone(&dropped))));
        let (started_tx, started_rx) = channel();
        let (go_tx, go_rx) = channel::<()>();
        domain.call(move || {
            started_tx.send(()).unwrap();
            go_rx.recv().unwrap();
        });
        started_rx.recv().unwrap(); // the reclaimer is inside that callback
        cell.replace(Some(Flag(Arc::new(AtomicBool::new(false)))));
        let (returned_tx, returned_rx) = channel::<()>();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                domain.barrier();
                let was_dropped = dropped.load(SeqCst);
                let _ = returned_tx.send(());
                was_dropped
            });
            while domain.inner().reclaimer.barrier_waiters() == 0 {
                std::thread::yield_now();
            }
            // Queued after the barrier began; queues the drop's blocker.
            domain.call(move || {
                domain.call(move || {
                    let _ = returned_rx.recv_timeout(Duration::from_secs(1));
                });
            });
            go_tx.send(()).unwrap();
            assert!(
                waiter.join().unwrap(),
                "barrier returned before the replaced value was dropped"
            );
        });
    }
}
