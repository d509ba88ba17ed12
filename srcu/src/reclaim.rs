//! Deferred callbacks (`call_srcu`) and `srcu_barrier`: a reclaimer thread
//! per domain, started on first use.

// Under loom callbacks run inline (see `enqueue`): the thread, its queue and
// its loop are not built for models.
#![cfg_attr(loom, allow(dead_code))]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::domain::Inner;

/// A callback and how many more grace periods it waits for.
pub(crate) struct Deferred {
    pub(crate) f: Box<dyn FnOnce() + Send>,
    pub(crate) grace_periods: u8,
}

#[derive(Default)]
struct State {
    queue: Vec<Deferred>,
    /// Callbacks ever queued / ever finished (run, or panicked).
    queued: u64,
    finished: u64,
    /// The reclaimer thread and the process it was started in (a fork
    /// child has no such thread and starts its own).
    thread: Option<(u32, JoinHandle<()>)>,
    shutting_down: bool,
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
    #[cfg(loom)]
    pub(crate) fn enqueue(&self, inner: impl FnOnce() -> Arc<Inner>, d: Deferred) {
        let inner = inner();
        for _ in 0..d.grace_periods {
            inner.synchronize(false, None);
        }
        (d.f)();
    }

    #[cfg(not(loom))]
    pub(crate) fn enqueue(&self, inner: impl FnOnce() -> Arc<Inner>, d: Deferred) {
        let mut st = self.lock();
        st.queue.push(d);
        st.queued += 1;
        let pid = std::process::id();
        if st.thread.as_ref().is_none_or(|(p, _)| *p != pid) {
            let inner = inner();
            let handle = std::thread::Builder::new()
                .name("srcu-reclaim".into())
                .spawn(move || reclaim_loop(&inner))
                .expect("spawn the srcu reclaimer thread");
            // A thread inherited from the parent (fork) is not ours to join.
            if let Some((p, old)) = st.thread.replace((pid, handle))
                && p == pid
            {
                drop(old);
            }
        }
        self.work.notify_one();
    }

    /// Waits until every callback queued so far has finished.
    pub(crate) fn barrier(&self) {
        let mut st = self.lock();
        let target = st.queued;
        while st.finished < target {
            st = self
                .finished
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Runs the remaining callbacks, then stops the thread (domain drop).
    pub(crate) fn shut_down(&self) {
        self.barrier();
        let thread = {
            let mut st = self.lock();
            st.shutting_down = true;
            st.thread.take()
        };
        self.work.notify_all();
        if let Some((pid, handle)) = thread
            && pid == std::process::id()
        {
            let _ = handle.join();
        }
    }
}

fn reclaim_loop(inner: &Inner) {
    let r = &inner.reclaimer;
    loop {
        let batch = {
            let mut st = r.lock();
            while st.queue.is_empty() && !st.shutting_down {
                st = r.work.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.queue.is_empty() {
                return; // shutting down, nothing left
            }
            std::mem::take(&mut st.queue)
        };
        // One grace period serves the whole batch.
        inner.synchronize(false, None);
        let mut again = Vec::new();
        let mut done = 0u64;
        for mut d in batch {
            d.grace_periods = d.grace_periods.saturating_sub(1);
            if d.grace_periods > 0 {
                again.push(d);
                continue;
            }
            if catch_unwind(AssertUnwindSafe(d.f)).is_err() {
                eprintln!("srcu: a deferred callback panicked (the reclaimer continues)");
            }
            done += 1;
        }
        let mut st = r.lock();
        st.queue.extend(again);
        st.finished += done;
        drop(st);
        r.finished.notify_all();
    }
}
