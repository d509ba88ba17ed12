//! `Probe`: an attached probe, what it counted, and detaching it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::attach::{self, queries};
use crate::base::error::DetachError;
use crate::site::consumer::Consumer;

/// An attached probe; dropping it detaches (see [`detach`](Self::detach)).
pub struct Probe {
    addr: usize,
    consumer: Arc<Consumer>,
    attached: bool,
}

impl Probe {
    /// The handle of a consumer just attached at `addr`.
    pub(super) fn attached(addr: usize, consumer: Arc<Consumer>) -> Self {
        Self {
            addr,
            consumer,
            attached: true,
        }
    }

    /// The probed address.
    #[must_use]
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Hits that ran this probe's handler; for a probe with no handler (a
    /// *counting probe*), every hit, counted by the trampoline itself where
    /// it can (see the crate docs' "Counting probes"). Exact, a sum over
    /// per-CPU counters. Async-signal-safe.
    #[must_use]
    pub fn hits(&self) -> u64 {
        self.consumer.hits()
    }

    /// How hits of this probe reach the engine: through a jump into a
    /// trampoline ([`Mode::Jump`](crate::Mode::Jump), no signal), or a breakpoint and the
    /// SIGTRAP handler, with the reason ([`Mode::Trap`](crate::Mode::Trap)). The mode belongs
    /// to the address (every probe there shares it). Not
    /// async-signal-safe.
    #[must_use]
    pub fn mode(&self) -> crate::Mode {
        queries::mode(self.addr).unwrap_or(crate::Mode::Trap(crate::NotOptimized::CodeChanged))
    }

    /// Return handlers of this probe run so far; for a timing probe
    /// ([`Uprobe::time_into`](crate::Uprobe::time_into)), the returns timed into its cells (their
    /// histogram's total). Async-signal-safe.
    #[must_use]
    pub fn returns(&self) -> u64 {
        if let Some(cells) = self
            .consumer
            .counter
            .as_ref()
            .and_then(crate::site::count::TrampolineCounter::latency_cells)
        {
            return crate::LatencyCell::histogram(cells).iter().sum();
        }
        self.consumer
            .ret
            .as_ref()
            .map_or(0, |r| r.counters.returns.sum())
    }

    /// Returns of this probe that ran no return handler: not tracked (the
    /// thread's 64 pending returns, [`Uprobe::max_active`](crate::Uprobe::max_active), a thread that
    /// found the pool of per-thread stacks empty, more than 16384 call
    /// sites) or left
    /// without returning (`longjmp`, unwinding). The program ran correctly
    /// in every case.
    #[must_use]
    pub fn missed_returns(&self) -> u64 {
        self.consumer
            .ret
            .as_ref()
            .map_or(0, |r| r.counters.missed.load(Ordering::Relaxed))
    }

    /// Returns of this probe pending now, across threads, if it has a
    /// [`max_active`](crate::Uprobe::max_active) limit (`None` otherwise: without
    /// a limit nothing shared counts them).
    #[must_use]
    pub fn in_flight(&self) -> Option<usize> {
        self.consumer
            .ret
            .as_ref()?
            .in_flight
            .as_ref()
            .map(|a| a.charged())
    }

    /// Whether the probe's breakpoint is in the code. False once the
    /// engine disarmed every probe because the program replaced the
    /// SIGTRAP handler (see [`AttachError::TrapHandlerReplaced`](crate::AttachError::TrapHandlerReplaced)), or
    /// the code was unloaded. Not async-signal-safe.
    #[must_use]
    pub fn is_armed(&self) -> bool {
        queries::armed(self.addr)
    }

    /// Hits at this address that ran no handler because the thread was
    /// already inside the engine (a probed function called from a
    /// handler), shared by every probe on the address. A counting probe
    /// (no handler) counts these hits in [`hits`](Self::hits) too.
    #[must_use]
    pub fn missed(&self) -> u64 {
        queries::missed(self.addr)
    }

    /// Removes the probe; the last one at an address restores the original
    /// byte. Returns once no handler of this probe, entry or return, runs
    /// or will run (one SRCU grace period). It does not wait for pending
    /// returns: a thread still inside the function returns normally later,
    /// without running the return handler. The handlers themselves (the
    /// closures) are dropped on a background thread once no pending return
    /// of this probe remains (a call that never returns keeps them alive,
    /// but never blocks the detach). Not async-signal-safe;
    /// must not be called from a probe handler.
    pub fn detach(self) -> Result<(), DetachError> {
        Self::detach_all([self])
    }

    /// Detaches several probes with one SRCU grace period for the batch;
    /// returns once none of their handlers runs or will run. Reports the
    /// first error (the others are detached regardless). Not
    /// async-signal-safe.
    pub fn detach_all(probes: impl IntoIterator<Item = Self>) -> Result<(), DetachError> {
        let items: Vec<(usize, Arc<Consumer>)> = probes
            .into_iter()
            .map(|mut p| {
                p.attached = false;
                (p.addr, Arc::clone(&p.consumer))
            })
            .collect();
        let result = attach::detach_many(&items);
        for (_, c) in &items {
            release_semaphore(c);
        }
        result
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if self.attached {
            let _ = attach::detach_many(&[(self.addr, Arc::clone(&self.consumer))]);
            release_semaphore(&self.consumer);
        }
    }
}

/// Gives back the USDT semaphore a detached consumer held.
fn release_semaphore(consumer: &Consumer) {
    // An object unloaded meanwhile (`dlclose`) took its semaphore along.
    if let Some(sem) = consumer
        .semaphore
        .filter(|&s| crate::process::maps::path_of(s).is_some())
    {
        // SAFETY: the semaphore incremented at attach, still mapped.
        unsafe { crate::site::consumer::adjust_semaphore(sem, -1) };
    }
}

impl core::fmt::Debug for Probe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Probe")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("hits", &self.hits())
            .finish_non_exhaustive()
    }
}
