//! A site's consumers: one per attached probe, with its handler, its
//! return side and its counters; the list a site publishes to the hit
//! path is replaced whole (see [`Site::publish_list`](super::Site::publish_list)).

use std::num::NonZeroI32;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use pcpu::PerCpuCounter;

use super::handler::Handler;
use crate::arch::usdt::UsdtArg;

/// One consumer of a site: its handlers and counters.
// Each flag is what one check on the hit path or at attach reads, a
// load away (a bit set would cost a mask on every hit).
#[allow(clippy::struct_excessive_bools)]
pub(crate) struct Consumer {
    pub(crate) handler: Handler,
    /// The return handler's side, for a return probe.
    pub(crate) ret: Option<super::returns::ReturnProbe>,
    /// Only hits of this thread run the handler (`None`: every thread).
    pub(crate) only_thread: Option<NonZeroI32>,
    /// Hits that ran the handler, counted per CPU (no cache line shared
    /// by the threads hitting the probe).
    pub(crate) hits: PerCpuCounter,
    pub(crate) removed: AtomicBool,
    /// The extent of the function the probe was made for, which the
    /// multi-instruction jump needs.
    pub(crate) function: Option<crate::process::symbols::Extent>,
    /// Keep the address on the trap path.
    pub(crate) trap_only: bool,
    /// The address lies where glibc runs with signals blocked (and the
    /// probe did not opt out): only a one-byte jump written with no
    /// breakpoint may go there, and this is the error when none fits.
    pub(crate) blocked: Option<crate::AttachError>,
    /// The arguments of the USDT probe the consumer was made on.
    pub(crate) usdt_args: Option<Arc<[UsdtArg]>>,
    /// That probe's semaphore, held while the consumer is attached.
    pub(crate) semaphore: Option<usize>,
    /// A counting probe (no handler, no return side, no thread filter):
    /// its hits are counted even where no handler may run (a hit nested
    /// in the engine).
    pub(crate) counting: bool,
    /// Where trampolines count a counting probe's hits (see
    /// [`super::count`]) or a lean return probe's entries, and where
    /// every hit of a probe made with
    /// [`Uprobe::count_into`](crate::Uprobe::count_into) is counted;
    /// `None` for a probe with a handler and the engine's counters, or
    /// where trampolines do not count.
    pub(crate) counter: Option<super::count::TrampolineCounter>,
    /// A timing probe with no handler and no thread filter: its calls may
    /// be timed without the engine (see [`super::timing`]).
    pub(crate) only_times: bool,
    /// A timing probe's switch: what its pending calls name.
    pub(crate) switch: Option<&'static super::timing::Switch>,
    /// A return probe or a timing probe: hits track the function's
    /// return (one flag for the hit path to test).
    pub(crate) returns: bool,
    /// A return probe with no entry handler and no thread filter whose
    /// returns hold nothing: its switch. Its entries may be taken by the
    /// architecture's return entry routine (see [`super::returns`]),
    /// which counts them in `counter`.
    pub(crate) lean_return: Option<&'static super::switch::Switch>,
}

impl Drop for Consumer {
    fn drop(&mut self) {
        // Dropped after the grace period that follows its detach (or
        // never attached): its switch may serve another probe.
        if let Some(switch) = self.switch {
            switch.give_back();
        }
    }
}

impl Consumer {
    /// Counts a hit the engine saw (in the caller's cells, or the
    /// consumer's own counter). Async-signal-safe.
    #[inline]
    pub(crate) fn count_hit(&self) {
        if !self
            .counter
            .as_ref()
            .is_some_and(super::count::TrampolineCounter::count_in_caller_cells)
        {
            self.hits.add(1);
        }
    }

    /// Hits counted: by the full path and by the trampolines' own
    /// counting. Async-signal-safe.
    pub(crate) fn hits(&self) -> u64 {
        let in_trampolines = self
            .counter
            .as_ref()
            .map_or(0, super::count::TrampolineCounter::sum);
        self.hits.sum().wrapping_add(in_trampolines)
    }
}

/// Increments (`+1`) or decrements (`-1`) the USDT semaphore at `addr`
/// (a consumer made on a USDT probe holds it while attached).
///
/// # Safety
/// `addr` is a USDT semaphore of a loaded object: a writable, aligned
/// `u16`.
pub(crate) unsafe fn adjust_semaphore(addr: usize, delta: i16) {
    // SAFETY: the caller's contract; programs only read it.
    let sem = unsafe { core::sync::atomic::AtomicU16::from_ptr(addr as *mut u16) };
    if delta > 0 {
        sem.fetch_add(delta.unsigned_abs(), core::sync::atomic::Ordering::Relaxed);
    } else {
        sem.fetch_sub(delta.unsigned_abs(), core::sync::atomic::Ordering::Relaxed);
    }
}
