//! A consumer's return side: its return handler, counters and in-flight
//! account, and how its pending returns reach it: by its [`Switch`]
//! (the default: a pending return owes nothing at its end, so it holds
//! nothing), or by a lease on the cell that holds it (in
//! [`RETURN_DOMAIN`], apart from the table's) where a pending return
//! must keep it alive. The pending returns themselves are
//! `crate::hit::returns`'s.

use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::Arc;
#[cfg(feature = "bench-variants")]
use std::sync::atomic::AtomicU8;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sigpending::{Account, Owner, Release};
use srcu::{Srcu, SrcuCell};

use super::handler::ReturnHandler;
use super::switch::Switch;

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

/// A consumer's return handler, as its pending returns reach it.
pub(crate) struct ReturnPart {
    pub(crate) handler: ReturnHandler,
    /// Set by detach (leased parts only): no return handler runs from
    /// then on, unless `after_detach`.
    pub(crate) detached: AtomicBool,
    /// Returns pending at detach still run the handler (leased parts
    /// only: [`Uprobe::return_after_detach`](crate::Uprobe::return_after_detach)).
    pub(crate) after_detach: bool,
    pub(crate) counters: Arc<ReturnCounters>,
    pub(crate) in_flight: Option<Arc<Account>>,
}

/// How a consumer's pending returns reach its [`ReturnPart`].
pub(crate) enum Reach {
    /// By its switch, inside a read section of the table's domain: a
    /// pending return holds nothing, and reaches nothing once the consumer
    /// is detached. The part lives as long as the consumer (freed after
    /// the grace period that follows its detach).
    Switched {
        #[expect(dead_code, reason = "owned here, reached through the switch")]
        part: Box<ReturnPart>,
        switch: &'static Switch,
    },
    /// By a lease on this cell (or a reference, in the benchmarks'
    /// refcount mode): a pending return keeps the part alive, because it
    /// owes it something at its end (an in-flight charge), or the handler
    /// runs after detach.
    Leased(SrcuCell<'static, ReturnPart>),
}

/// The return side of one consumer, owned by the consumer.
pub(crate) struct ReturnProbe {
    pub(crate) reach: Reach,
    pub(crate) counters: Arc<ReturnCounters>,
    pub(crate) in_flight: Option<Arc<Account>>,
}

/// Leases of pending returns live in this domain, apart from the table's:
/// a grace period of the table (attach, detach) never waits for them.
pub(crate) static RETURN_DOMAIN: Srcu = Srcu::new();

impl ReturnProbe {
    /// A return side for `handler`, with at most `max_active` returns in
    /// flight across threads; its pending returns lease it if they charge
    /// the in-flight account or run the handler `after_detach`, else they
    /// name its switch. Not async-signal-safe.
    pub(crate) fn new(
        handler: ReturnHandler,
        max_active: Option<NonZeroUsize>,
        after_detach: bool,
    ) -> Self {
        let counters = Arc::new(ReturnCounters::default());
        let in_flight =
            max_active.map(|n| Account::with_release(n.get(), Owner::none(), Release::Deferred));
        let part = ReturnPart {
            handler,
            detached: AtomicBool::new(false),
            after_detach,
            counters: Arc::clone(&counters),
            in_flight: in_flight.clone(),
        };
        let reach = if in_flight.is_some() || after_detach || hold_mode() != ReturnHold::Nothing {
            Reach::Leased(SrcuCell::new(&RETURN_DOMAIN, Some(part)))
        } else {
            let part = Box::new(part);
            let switch = Switch::on(NonNull::from(&*part).cast());
            Reach::Switched { part, switch }
        };
        Self {
            reach,
            counters,
            in_flight,
        }
    }

    /// The switch its pending returns name, if they hold nothing.
    pub(crate) fn switch(&self) -> Option<&'static Switch> {
        match self.reach {
            Reach::Switched { switch, .. } => Some(switch),
            Reach::Leased(_) => None,
        }
    }

    /// Detaches the return handler: no return reaches it once the
    /// caller's grace period of the table domain is over (unless it runs
    /// after detach); a leased part is let go of, and freed once no
    /// pending return leases it. Not async-signal-safe.
    pub(crate) fn detach(&self) {
        match &self.reach {
            Reach::Switched { switch, .. } => switch.off(),
            Reach::Leased(cell) => {
                if let Some(part) = cell.read() {
                    part.detached.store(true, Ordering::Release);
                }
                cell.replace(None);
            }
        }
    }
}

impl Drop for ReturnProbe {
    fn drop(&mut self) {
        // Dropped with its consumer, after the grace period that follows
        // its detach (or never attached): no return reaches the part, and
        // the switch may serve another probe.
        if let Reach::Switched { switch, .. } = self.reach {
            switch.give_back();
        }
    }
}

impl Switch {
    /// The return part of a return probe whose switch this is, while it
    /// is on for the generation a pending return was made in.
    /// Async-signal-safe.
    ///
    /// # Safety
    /// The caller is inside a read section of the table's domain, and
    /// keeps the reference within it; the switch is a return probe's.
    pub(crate) unsafe fn part_of(&self, generation: u64) -> Option<&ReturnPart> {
        let p = self.target_of(generation)?;
        // SAFETY: a return probe's switch holds its boxed part, freed only
        // after a grace period that follows the switch's turning off
        // (the caller's read section is older, or sees it off).
        Some(unsafe { p.cast::<ReturnPart>().as_ref() })
    }
}

/// What a pending return holds of its probe (a benchmark switch: the
/// engine's default, and the kernel's after and before its 2024 patch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReturnHold {
    /// Nothing, where it owes nothing at its end: it names its probe's
    /// switch and generation, and reaches the probe at its return inside
    /// a read section of the table's domain (the default). A probe with
    /// an in-flight limit, or whose handler runs after detach, still
    /// holds a lease.
    Nothing,
    /// An SRCU lease that expires into a reference, for every pending
    /// return (the kernel since its 2024 patch).
    #[cfg_attr(not(feature = "bench-variants"), allow(dead_code))]
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
    HOLD.store(
        match hold {
            ReturnHold::Nothing => 0,
            ReturnHold::Lease => 1,
            ReturnHold::Refcount => 2,
        },
        Ordering::Relaxed,
    );
}

#[cfg(not(feature = "bench-variants"))]
pub(crate) fn hold_mode() -> ReturnHold {
    ReturnHold::Nothing
}

#[cfg(feature = "bench-variants")]
pub(crate) fn hold_mode() -> ReturnHold {
    match HOLD.load(Ordering::Relaxed) {
        0 => ReturnHold::Nothing,
        1 => ReturnHold::Lease,
        _ => ReturnHold::Refcount,
    }
}
