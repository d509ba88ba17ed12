//! A consumer's return side: its return handler, counters and in-flight
//! account, and the cell that pending returns lease it through (in
//! [`RETURN_DOMAIN`], apart from the table's). The pending returns
//! themselves are `crate::hit::returns`'s.

use std::num::NonZeroUsize;
use std::sync::Arc;
#[cfg(feature = "bench-variants")]
use std::sync::atomic::AtomicU8;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sigpending::{Account, Owner, Release};
use srcu::{Srcu, SrcuCell};

use super::handler::ReturnHandler;

/// Counters of one consumer's returns, shared by its [`ReturnProbe`] and
/// the leased [`ReturnPart`].
#[derive(Default)]
pub(crate) struct ReturnCounters {
    /// Return handlers run, per CPU (no line shared by the threads
    /// returning).
    pub(crate) returns: pcpu::PerCpuCounter,
    /// Returns that could not be tracked (depth, in-flight limit, no
    /// per-thread stack, no stub) or whose instance was abandoned.
    pub(crate) missed: AtomicU64,
}

/// What a pending return leases: a consumer's return handler.
pub(crate) struct ReturnPart {
    pub(crate) handler: ReturnHandler,
    pub(crate) detached: AtomicBool,
    pub(crate) counters: Arc<ReturnCounters>,
    pub(crate) in_flight: Option<Arc<Account>>,
}

/// The return side of one consumer, owned by the consumer.
pub(crate) struct ReturnProbe {
    pub(crate) cell: SrcuCell<'static, ReturnPart>,
    pub(crate) counters: Arc<ReturnCounters>,
    pub(crate) in_flight: Option<Arc<Account>>,
}

/// Leases of pending returns live in this domain, apart from the table's:
/// a grace period of the table (attach, detach) never waits for them.
pub(crate) static RETURN_DOMAIN: Srcu = Srcu::new();

impl ReturnProbe {
    /// A return side for `handler`, with at most `max_active` returns in
    /// flight across threads. Not async-signal-safe.
    pub(crate) fn new(handler: ReturnHandler, max_active: Option<NonZeroUsize>) -> Self {
        let counters = Arc::new(ReturnCounters::default());
        let in_flight =
            max_active.map(|n| Account::with_release(n.get(), Owner::none(), Release::Deferred));
        let part = ReturnPart {
            handler,
            detached: AtomicBool::new(false),
            counters: Arc::clone(&counters),
            in_flight: in_flight.clone(),
        };
        Self {
            cell: SrcuCell::new(&RETURN_DOMAIN, Some(part)),
            counters,
            in_flight,
        }
    }

    /// Marks the handler detached (no return handler runs once the
    /// caller's grace period of the table domain is over) and lets go of
    /// it: it is freed once no pending return leases it. Not
    /// async-signal-safe.
    pub(crate) fn detach(&self) {
        if let Some(part) = self.cell.read() {
            part.detached.store(true, Ordering::Release);
        }
        self.cell.replace(None);
    }
}

/// How a pending return keeps its consumer alive (a benchmark switch: the
/// kernel's before and after its 2024 patch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReturnHold {
    /// An SRCU lease that expires into a reference (the default).
    Lease,
    /// A reference count taken per pending return (the kernel before
    /// the 2024 patch).
    #[cfg_attr(not(feature = "bench-variants"), allow(dead_code))]
    Refcount,
}

#[cfg(feature = "bench-variants")]
static HOLD: AtomicU8 = AtomicU8::new(0);

/// How an in-flight charge keeps the probe's counters alive (a benchmark
/// switch: the kernel's after and before its 2020 patch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pinning {
    /// The account pins them while it is non-zero (the default).
    OnTransition,
    /// Each charge takes a reference and its uncharge drops it (`get_uid`
    /// / `free_uid` per signal, before the 2024 patch).
    PerReturn,
}

#[cfg(feature = "bench-variants")]
static PINNING: AtomicU8 = AtomicU8::new(0);

#[cfg(feature = "bench-variants")]
pub(crate) fn set_pinning(p: Pinning) {
    PINNING.store(u8::from(p == Pinning::PerReturn), Ordering::Relaxed);
}

#[cfg(not(feature = "bench-variants"))]
pub(crate) fn pinning() -> Pinning {
    Pinning::OnTransition
}

#[cfg(feature = "bench-variants")]
pub(crate) fn pinning() -> Pinning {
    if PINNING.load(Ordering::Relaxed) == 0 {
        Pinning::OnTransition
    } else {
        Pinning::PerReturn
    }
}

#[cfg(feature = "bench-variants")]
pub(crate) fn set_hold(hold: ReturnHold) {
    HOLD.store(u8::from(hold == ReturnHold::Refcount), Ordering::Relaxed);
}

#[cfg(not(feature = "bench-variants"))]
pub(crate) fn hold_mode() -> ReturnHold {
    ReturnHold::Lease
}

#[cfg(feature = "bench-variants")]
pub(crate) fn hold_mode() -> ReturnHold {
    if HOLD.load(Ordering::Relaxed) == 0 {
        ReturnHold::Lease
    } else {
        ReturnHold::Refcount
    }
}
