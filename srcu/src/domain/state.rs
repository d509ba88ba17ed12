//! A domain's shared state (`Inner`): its per-CPU counts, its reader
//! slots, the grace-period counter and the helpers it owns, and their
//! construction.

use pcpu::PerCpu;
use pcpu::unstable::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::gp_lock::GpLock;
use crate::fork::LeaseSets;
use crate::readers::Readers;
use crate::reclaim::Reclaimer;

/// Words of a CPU's counts: `LOCK + bank`, `UNLOCK + bank`.
pub(super) const LOCK: usize = 0;
pub(super) const UNLOCK: usize = 2;

/// One domain's state. Guard sections are counted in per-thread slots
/// (`readers`, see `crate::readers`); sections that may end on another
/// thread (raw ones, leases) in the per-CPU `counts`, all four in one
/// cache line per CPU: word `LOCK + b` counts read sections that began on
/// bank `b`, word `UNLOCK + b` those that ended. They only grow, so a
/// section may begin on one CPU and end on another.
pub(crate) struct Inner {
    /// The per-CPU counts' rseq add: present only where rseq is
    /// registered *and* the light fence is a compiler fence.
    pub(super) fast: Option<pcpu::rseq::Adder>,
    pub(crate) readers: Readers,
    pub(super) counts: PerCpu<[AtomicU64; 4]>,
    /// Grace periods started; the active bank is `completed & 1`.
    pub(super) completed: AtomicU64,
    /// `readers.hot(completed & 1)`, stored at each flip: what the guard
    /// path checks its cached slot against and stores there for an
    /// outermost section.
    pub(super) hot: AtomicU64,
    /// Serialises grace periods (ordinary context only).
    pub(super) gp_lock: GpLock,
    /// Set when the `Srcu` is dropped: no guard can exist any more and raw
    /// sections can no longer be ended, so grace periods complete at once
    /// (the queued callbacks run instead of waiting forever).
    pub(super) dead: AtomicBool,
    pub(crate) reclaimer: Reclaimer,
    /// The lease sets of this domain, for the fork handlers (expired in a
    /// child, their expiry threads restarted there).
    pub(crate) lease_sets: LeaseSets,
    /// The fork generation (`fork::generation`) the helper threads were
    /// last checked in: a child restarts them on its first use of the
    /// domain (`Srcu::revive`).
    #[cfg_attr(pcpu_loom, allow(dead_code))]
    pub(super) helpers_gen: AtomicU64,
}

impl Inner {
    /// A domain's state, its counts for the machine's CPUs or as if it
    /// had `cpus` (`Some`).
    pub(super) fn new(cpus: Option<usize>) -> Self {
        let light_is_compiler = pcpu::fence::light_is_compiler_only();
        let this = Self {
            fast: pcpu::rseq::Adder::get().filter(|_| light_is_compiler),
            // Slots rely on membarrier (their fence is a compiler fence);
            // loom models them with full fences, and so does Miri where
            // pcpu models membarrier as available.
            readers: Readers::new(
                light_is_compiler
                    || cfg!(pcpu_loom)
                    || (cfg!(miri) && pcpu::fence::mode() == pcpu::fence::Mode::Membarrier),
            ),
            counts: cpus.map_or_else(PerCpu::default, |n| {
                PerCpu::with_cpus(n, |_| Default::default())
            }),
            completed: AtomicU64::new(0),
            hot: AtomicU64::new(0),
            gp_lock: GpLock {
                owner: AtomicU64::new(0),
            },
            dead: AtomicBool::new(false),
            reclaimer: Reclaimer::default(),
            lease_sets: LeaseSets::default(),
            helpers_gen: AtomicU64::new(0),
        };
        this.hot.store(this.readers.hot(0), Ordering::Relaxed);
        this
    }

    /// Grace periods started so far (for `barrier` bookkeeping and tests).
    pub(crate) fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }
}
