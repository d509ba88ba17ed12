//! The lease set: one domain's leases over the values of its cells, with
//! the expiry thread that bounds how long a lease can stall a grace
//! period, and what a consumed lease's holder hands back to it.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

#[cfg(not(pcpu_loom))]
use super::expiry::spawn_expiry;
use super::expiry::{Ctl, Shared, TICKS};
use super::held::Held;
use crate::Srcu;
use crate::cell::Strong;

/// The kernel's lease timeout (uprobes: `RI_TIMER_PERIOD`, 100 ms).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

/// The leases of one SRCU domain over values of [`SrcuCell<T>`](crate::SrcuCell)s, with an
/// expiry thread that converts leases older than the timeout into strong
/// references, so [`Srcu::synchronize`] never waits on a lease for longer
/// than about `timeout * 1.25`.
///
/// ```
/// static DOMAIN: srcu::Srcu = srcu::Srcu::new();
/// let cell = srcu::SrcuCell::new(&DOMAIN, Some(42u32));
/// let set = srcu::LeaseSet::new(&DOMAIN);
/// let block = set.block(4);
///
/// let lease = block.lease(&cell).unwrap();   // an SRCU read section
/// // ... a long time may pass (the function runs) ...
/// DOMAIN.synchronize();                      // returns once the lease expires (100 ms)
/// assert_eq!(lease.consume().as_deref(), Some(&42));
/// ```
pub struct LeaseSet<'d, T: Send + Sync + 'static> {
    pub(super) shared: Arc<Shared<T>>,
    timeout: Duration,
    /// The set must not outlive its domain: leases point at values of the
    /// domain's cells.
    pub(super) srcu: &'d Srcu,
}

impl<'d, T: Send + Sync + 'static> LeaseSet<'d, T> {
    /// A lease set of `srcu` with the kernel's timeout (100 ms). Starts the
    /// expiry thread. Not async-signal-safe.
    ///
    /// # Panics
    /// If the expiry thread cannot be started; [`try_new`](Self::try_new)
    /// returns the error instead.
    #[must_use]
    pub fn new(srcu: &'d Srcu) -> Self {
        Self::with_timeout(srcu, DEFAULT_TIMEOUT)
    }

    /// Like [`new`](Self::new), or the error of starting the expiry thread
    /// (the process is out of threads or memory).
    pub fn try_new(srcu: &'d Srcu) -> std::io::Result<Self> {
        Self::try_with_timeout(srcu, DEFAULT_TIMEOUT)
    }

    /// Like [`new`](Self::new) with another timeout.
    ///
    /// # Panics
    /// If `timeout` is zero, or the expiry thread cannot be started
    /// ([`try_with_timeout`](Self::try_with_timeout) returns that error).
    #[must_use]
    pub fn with_timeout(srcu: &'d Srcu, timeout: Duration) -> Self {
        match Self::try_with_timeout(srcu, timeout) {
            Ok(set) => set,
            Err(e) => panic!("srcu: cannot start the lease expiry thread: {e}"),
        }
    }

    /// Like [`with_timeout`](Self::with_timeout), or the error of starting
    /// the expiry thread.
    ///
    /// # Panics
    /// If `timeout` is zero.
    pub fn try_with_timeout(srcu: &'d Srcu, timeout: Duration) -> std::io::Result<Self> {
        assert!(!timeout.is_zero(), "lease timeout must be positive");
        let shared = Arc::new(Shared {
            domain: srcu.inner_arc(),
            tick: CachePadded::new(AtomicU64::new(0)),
            blocks: Mutex::new(Vec::new()),
            expiry_scratch: Mutex::new(Vec::new()),
            expiring: CachePadded::new(AtomicU64::new(0)),
            expired: AtomicU64::new(0),
            owing: AtomicPtr::new(core::ptr::null_mut()),
            ctl: (Mutex::new(Ctl::default()), Condvar::new()),
            period: timeout / TICKS as u32,
        });
        // A fork child restarts the thread on first use (its threads
        // started before the fork are the parent's).
        srcu.revive();
        {
            let hooks: Arc<dyn crate::fork::ForkHooks> = shared.clone();
            shared.domain.lease_sets.add(&hooks);
        }
        // loom cannot model a real thread: models call `expire_all`.
        #[cfg(not(pcpu_loom))]
        {
            let handle = spawn_expiry(&shared)?;
            shared
                .ctl
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .thread = Some((crate::fork::generation(), handle));
        }
        Ok(Self {
            shared,
            timeout,
            srcu,
        })
    }

    /// The timeout after which leases expire.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Expires every lease now, whatever its age, and returns how many.
    /// For a child after `fork()` (the parent's expiry thread does not
    /// exist there, and the kernel too expires a child's leases at fork),
    /// and for shutting down. Not async-signal-safe.
    #[allow(clippy::must_use_candidate)] // the count is informational
    pub fn expire_all(&self) -> u64 {
        self.srcu.revive();
        let n = self.shared.expire(0);
        self.drop_deferred();
        n
    }

    /// Hands `strong` to the expiry thread, which drops it at its next
    /// tick (at most `timeout / 4` later), instead of dropping it here.
    /// For a signal handler that consumed a lease which had expired into a
    /// reference ([`Held::Stable`]): dropping that reference may free the
    /// value. Lock-free, no allocation: **async-signal-safe**.
    pub fn drop_later(&self, strong: Strong<T>) {
        crate::deferred_drop::push(&self.shared.owing, strong.0);
    }

    /// Ends what a consumed lease handed over without freeing anything
    /// here: a read section ends at once, a strong reference goes to
    /// [`drop_later`](Self::drop_later). **Async-signal-safe.**
    pub fn release(&self, held: Held<'_, T>) {
        match held {
            Held::Leased(value) => drop(value),
            Held::Stable(strong) => self.drop_later(strong),
        }
    }

    /// Drops the references handed to [`drop_later`](Self::drop_later)
    /// so far, now, and returns how many (the expiry thread does this
    /// every tick). Not async-signal-safe.
    #[allow(clippy::must_use_candidate)] // the count is informational
    pub fn drop_deferred(&self) -> usize {
        crate::deferred_drop::drain(&self.shared.owing)
    }

    /// Lets the expiry thread end once no lease is held (nor the reference
    /// an expired one became) and nothing is left to drop, for two
    /// timeouts in a row: for a program done taking leases for a while (a
    /// tracer that detached its return probes), so that no thread of the
    /// set stays behind. A lease taken while parked is not expired (a
    /// grace period waits for it like for a read section) until
    /// [`resume_expiry`](Self::resume_expiry). Not async-signal-safe.
    pub fn park_expiry(&self) {
        let (ctl, cv) = &self.shared.ctl;
        ctl.lock().unwrap_or_else(PoisonError::into_inner).parked = true;
        cv.notify_all();
    }

    /// Undoes [`park_expiry`](Self::park_expiry): the expiry thread runs
    /// again (started anew if it ended). Not async-signal-safe.
    ///
    /// # Errors
    /// The error of starting the thread (the process is out of threads or
    /// memory); the set stays parked then.
    pub fn resume_expiry(&self) -> std::io::Result<()> {
        // What was handed over while no thread ran goes now.
        self.drop_deferred();
        let mut ctl = self
            .shared
            .ctl
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !ctl.parked {
            return Ok(());
        }
        #[cfg(not(pcpu_loom))]
        {
            let generation = crate::fork::generation();
            if ctl.stopped || ctl.thread.as_ref().is_some_and(|(g, _)| *g == generation) {
                ctl.parked = false;
                return Ok(());
            }
            if let Some((_, inherited)) = ctl.thread.take() {
                // A parent's thread (we are a fork child): not ours.
                core::mem::forget(inherited);
            }
            ctl.thread = Some((generation, spawn_expiry(&self.shared)?));
        }
        ctl.parked = false;
        Ok(())
    }

    /// Whether the expiry thread runs now (it may have ended, parked).
    #[must_use]
    pub fn expiry_running(&self) -> bool {
        self.shared
            .ctl
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .thread
            .is_some()
    }

    /// How many leases have been expired so far.
    ///
    /// A lease is counted before its read section ends, so once a grace
    /// period that the lease held up has finished, the count includes it.
    /// Async-signal-safe (one atomic load).
    #[must_use]
    pub fn expired(&self) -> u64 {
        self.shared.expired.load(Ordering::Relaxed)
    }
}

impl<T: Send + Sync + 'static> Drop for LeaseSet<'_, T> {
    fn drop(&mut self) {
        let (ctl, cv) = &self.shared.ctl;
        let thread = {
            let mut ctl = ctl.lock().unwrap_or_else(PoisonError::into_inner);
            ctl.stopped = true;
            ctl.thread.take()
        };
        cv.notify_all();
        if let Some((generation, t)) = thread {
            #[cfg(not(pcpu_loom))]
            if generation == crate::fork::generation() {
                let _ = t.join();
            } else {
                // Started before a fork: that thread is not in this process.
                core::mem::forget(t);
            }
            #[cfg(pcpu_loom)]
            let _ = (generation, t);
        }
        self.drop_deferred();
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for LeaseSet<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseSet")
            .field("timeout", &self.timeout)
            .field("expired", &self.expired())
            .finish_non_exhaustive()
    }
}
