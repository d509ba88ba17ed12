//! The update API of a domain: waiting for grace periods, deferring
//! callbacks and waiting for them.

use std::time::Duration;

use super::handle::Srcu;
use crate::reclaim;

impl Srcu {
    /// Waits until every read section that began before this call has
    /// ended. Sleeps (with a growing delay) while readers remain; with
    /// short read sections a grace period costs four `membarrier` calls
    /// and a read of every CPU's counts and every claimed reader slot.
    /// Not async-signal-safe; must not be called inside a read section of
    /// this domain (it would wait for itself).
    pub fn synchronize(&self) {
        self.revive();
        self.inner().synchronize(false, None);
    }

    /// Like [`synchronize`](Self::synchronize), but never sleeps: it polls
    /// and yields, trading CPU time for latency.
    pub fn synchronize_expedited(&self) {
        self.revive();
        self.inner().synchronize(true, None);
    }

    /// Like [`synchronize`](Self::synchronize), but gives up after
    /// `timeout`: returns whether the grace period completed. (A timed-out
    /// attempt leaves the domain consistent; the next grace period waits
    /// for the same readers.)
    pub fn synchronize_timeout(&self, timeout: Duration) -> bool {
        self.revive();
        self.inner().synchronize(false, Some(timeout))
    }

    /// Runs `f` on the domain's reclaimer thread after a grace period that
    /// begins after this call (`call_srcu`). Not async-signal-safe (it
    /// allocates and takes a mutex). If the process cannot start the
    /// reclaimer thread (out of threads or memory), the queued callbacks
    /// run on the calling thread instead, after their grace periods,
    /// before `call` returns: nothing is lost, at the price of a wait. A
    /// callback that panics is caught (see
    /// [`on_callback_panic`](Self::on_callback_panic)). The reclaimer
    /// thread ends after a second with nothing to do; the next callback
    /// starts another.
    pub fn call(&self, f: impl FnOnce() + Send + 'static) {
        self.defer(Box::new(f), 1);
    }

    /// Callbacks of this domain ([`call`](Self::call),
    /// [`retire`](Self::retire), deferred drops) that panicked so far. A
    /// panicking callback is caught; the others keep running.
    #[must_use]
    pub fn callback_panics(&self) -> u64 {
        self.inner().reclaimer.panics()
    }

    /// Calls `hook` with the payload of each callback of this domain that
    /// panics (on the thread that ran it: the reclaimer's, or a caller's
    /// when no thread could be started), replacing any earlier hook. The
    /// process's panic hook has already reported the panic by then
    /// (`std`'s default prints it). Not async-signal-safe.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    ///
    /// static SEEN: AtomicU64 = AtomicU64::new(0);
    /// let domain = srcu::Srcu::new();
    /// domain.on_callback_panic(|_payload| {
    ///     SEEN.fetch_add(1, Relaxed);
    /// });
    /// domain.call(|| panic!("a bug in a callback"));
    /// domain.barrier();
    /// assert_eq!((domain.callback_panics(), SEEN.load(Relaxed)), (1, 1));
    /// ```
    pub fn on_callback_panic(
        &self,
        hook: impl Fn(&(dyn core::any::Any + Send)) + Send + Sync + 'static,
    ) {
        self.inner()
            .reclaimer
            .set_panic_hook(Some(std::sync::Arc::new(hook)));
    }

    /// Queues `f` to run after `grace_periods` grace periods.
    pub(crate) fn defer(&self, f: Box<dyn FnOnce() + Send>, grace_periods: u8) {
        self.revive();
        self.inner().reclaimer.enqueue(
            || self.inner_arc(),
            reclaim::Deferred::new(f, grace_periods),
        );
    }

    /// Drops `value` after a grace period: the usual way to free something
    /// readers may still be looking at.
    pub fn retire<T: Send + 'static>(&self, value: T) {
        self.call(move || drop(value));
    }

    /// Waits until every callback queued before this call has run
    /// (`srcu_barrier`), deferred drops included ([`retire`](Self::retire),
    /// values replaced in an [`SrcuCell`](crate::SrcuCell), which wait for
    /// two grace periods), however many grace periods each needs and
    /// whatever other threads queue meanwhile (callbacks queued after the
    /// call may finish before it returns, but never stand in for earlier
    /// ones). Not async-signal-safe.
    pub fn barrier(&self) {
        self.revive();
        self.inner().reclaimer.barrier(|| self.inner_arc());
    }
}
