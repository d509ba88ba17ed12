//! Deferred callbacks (`call_srcu`) and `srcu_barrier`: a reclaimer thread
//! per domain, started on first use.
//!
//! This module owns the callback queue, the reclaimer thread and its
//! fallbacks. It knows its domain only through `Domain`, which the
//! domain implements (its reclaimer, and a grace period), so it sits below
//! `domain` and uses no other module.

// Under loom callbacks run inline (see `enqueue`): the thread, its queue and
// its loop are not built for models.
#![cfg_attr(pcpu_loom, allow(dead_code))]

use std::any::Any;
use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// What the reclaimer needs of the domain that owns it.
pub(crate) trait Domain: Send + Sync + 'static {
    /// The domain's callback queue.
    fn reclaimer(&self) -> &Reclaimer;
    /// Waits for an ordinary grace period of the domain.
    fn grace_period(&self);
}

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

/// What a domain's owner wants done with a panicking callback's payload.
pub(crate) type PanicHook = Arc<dyn Fn(&(dyn Any + Send)) + Send + Sync>;

/// The callback queue of one domain.
#[derive(Default)]
pub(crate) struct Reclaimer {
    state: Mutex<State>,
    work: Condvar,
    finished: Condvar,
    /// Callbacks that panicked (the reclaimer carries on).
    panics: AtomicU64,
    /// Called with each panicking callback's payload.
    on_panic: Mutex<Option<PanicHook>>,
}

impl Reclaimer {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `d` and makes sure this process has a reclaimer thread
    /// (`inner` provides the domain the thread needs).
    /// loom cannot model a real thread: the grace periods and the callback
    /// run inline.
    #[cfg(pcpu_loom)]
    pub(crate) fn enqueue<D: Domain>(&self, inner: impl FnOnce() -> Arc<D>, d: Deferred) {
        let inner = inner();
        for _ in 0..d.grace_periods {
            inner.grace_period();
        }
        (d.f)();
    }

    #[cfg(not(pcpu_loom))]
    pub(crate) fn enqueue<D: Domain>(&self, inner: impl FnOnce() -> Arc<D>, mut d: Deferred) {
        let mut st = self.lock();
        d.seq = st.next_seq;
        st.next_seq += 1;
        st.unfinished.insert(d.seq);
        st.queue.push(d);
        let mut domain = None;
        if Self::ensure_thread(&mut st, || domain.insert(inner()).clone()).is_err() {
            drop(st);
            let inner = domain.expect("made for the spawn");
            self.run_inline(&*inner);
            return;
        }
        self.work.notify_one();
    }

    /// Runs every queued callback on the calling thread, grace periods
    /// included: what happens instead of the reclaimer thread when the
    /// process cannot start one (out of threads or memory), so that no
    /// callback is lost and `barrier` still returns.
    #[cfg(not(pcpu_loom))]
    fn run_inline<D: Domain>(&self, inner: &D) {
        loop {
            let batch = std::mem::take(&mut self.lock().queue);
            if batch.is_empty() {
                return;
            }
            self.run_batch(inner, batch);
        }
    }

    /// Starts a reclaimer thread if this process has none (the first
    /// callback, or the first use in a fork child). In a child, the batch
    /// the parent's reclaimer was waiting a grace period for is queued
    /// again, and callbacks the parent's reclaimer had already taken out to
    /// run are the parent's alone: `barrier` in the child does not wait for
    /// them.
    #[cfg(not(pcpu_loom))]
    fn ensure_thread<D: Domain>(
        st: &mut State,
        inner: impl FnOnce() -> Arc<D>,
    ) -> std::io::Result<()> {
        let pid = std::process::id();
        if st.thread.as_ref().is_some_and(|(p, _)| *p == pid) {
            return Ok(());
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
            .spawn(move || reclaim_loop(&*inner))?;
        st.thread = Some((pid, handle));
        Ok(())
    }

    /// In a fork child: restarts the reclaimer if callbacks are pending.
    #[cfg(not(pcpu_loom))]
    pub(crate) fn revive<D: Domain>(&self, inner: impl FnOnce() -> Arc<D>) {
        let mut st = self.lock();
        let mut domain = None;
        if !st.unfinished.is_empty()
            && Self::ensure_thread(&mut st, || domain.insert(inner()).clone()).is_err()
        {
            drop(st);
            self.run_inline(&*domain.expect("made for the spawn"));
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
    pub(crate) fn barrier<D: Domain>(&self, inner: impl FnOnce() -> Arc<D>) {
        let mut st = self.lock();
        #[cfg(not(pcpu_loom))]
        {
            let mut domain = None;
            if !st.unfinished.is_empty()
                && Self::ensure_thread(&mut st, || domain.insert(inner()).clone()).is_err()
            {
                drop(st);
                self.run_inline(&*domain.expect("made for the spawn"));
                st = self.lock();
            }
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
    pub(crate) fn shut_down<D: Domain>(&self, inner: impl FnOnce() -> Arc<D>) {
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

/// How long a reclaimer thread waits for work before it ends (the next
/// callback starts another): a program that stopped deferring frees keeps
/// no thread of the domain.
const IDLE_EXIT: std::time::Duration = std::time::Duration::from_secs(1);

fn reclaim_loop<D: Domain>(inner: &D) {
    crate::service::started();
    let r = inner.reclaimer();
    loop {
        {
            let mut st = r.lock();
            while st.queue.is_empty() && !st.shutting_down {
                let (next, waited) = r
                    .work
                    .wait_timeout(st, IDLE_EXIT)
                    .unwrap_or_else(PoisonError::into_inner);
                st = next;
                if waited.timed_out() && st.queue.is_empty() && !st.shutting_down {
                    // Idle: end, dropping (detaching) our own handle, under
                    // the lock `ensure_thread` takes to start the next.
                    if st
                        .thread
                        .as_ref()
                        .is_some_and(|(_, h)| h.thread().id() == std::thread::current().id())
                    {
                        drop(st.thread.take());
                    }
                    return;
                }
            }
            if st.queue.is_empty() {
                return; // shutting down, nothing left
            }
            debug_assert!(st.in_flight.is_empty());
            // Kept in the state while its grace period runs, for a fork
            // child (see `State::in_flight`).
            st.in_flight = std::mem::take(&mut st.queue);
        }
        // One grace period serves the whole batch.
        inner.grace_period();
        let batch = std::mem::take(&mut r.lock().in_flight);
        r.finish_batch(batch);
    }
}

impl Reclaimer {
    /// One grace period for `batch`, then its callbacks whose last grace
    /// period that was.
    fn run_batch<D: Domain>(&self, inner: &D, batch: Vec<Deferred>) {
        inner.grace_period();
        self.finish_batch(batch);
    }

    /// Counts one grace period for each callback of `batch` (whose grace
    /// period just ended): runs those that need no more, queues the others
    /// again, and wakes `barrier`.
    fn finish_batch(&self, batch: Vec<Deferred>) {
        let mut again = Vec::new();
        let mut done = Vec::new();
        for mut d in batch {
            d.grace_periods = d.grace_periods.saturating_sub(1);
            if d.grace_periods > 0 {
                again.push(d);
                continue;
            }
            done.push(d.seq);
            if let Err(payload) = catch_unwind(AssertUnwindSafe(d.f)) {
                self.panics.fetch_add(1, Ordering::Relaxed);
                let hook = self
                    .on_panic
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if let Some(hook) = hook {
                    hook(&*payload);
                }
            }
        }
        let mut st = self.lock();
        st.queue.extend(again);
        for seq in done {
            st.unfinished.remove(&seq);
        }
        drop(st);
        self.finished.notify_all();
        // Callbacks queued again need the reclaimer's next round.
        self.work.notify_one();
    }

    /// Callbacks that panicked so far.
    pub(crate) fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// Sets the hook called with each panicking callback's payload.
    pub(crate) fn set_panic_hook(&self, hook: Option<PanicHook>) {
        *self.on_panic.lock().unwrap_or_else(PoisonError::into_inner) = hook;
    }
}
