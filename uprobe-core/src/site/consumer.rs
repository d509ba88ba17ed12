//! A site's consumers: one per attached probe, with its handler, its
//! return side and its counters; the list a site publishes to the hit
//! path is replaced whole (see [`Site::publish_list`](super::Site::publish_list)).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use pcpu::PerCpuCounter;

use crate::context::EntryContext;
use crate::usdt::arg::UsdtArg;

/// The handler of one consumer: the closure, behind a function made for
/// its type ([`Handler::run`]) that builds the [`EntryContext`], calls the
/// closure and reports what it asked for. The closure's body inlines
/// there, so a context that does not escape it stays in registers: a hit
/// through a jump is bound by its stores (the frame, the read section,
/// the counters), and a `dyn` call with the context in memory would add
/// a dozen.
pub(crate) struct Handler {
    /// The boxed closure.
    data: *mut (),
    /// Runs it (monomorphised for its type).
    run: unsafe fn(*const (), &mut crate::arch::Frame, usize, Option<&[UsdtArg]>) -> Outcome,
    /// Drops and frees it.
    drop: unsafe fn(*mut ()),
}

// SAFETY: built only from closures that are `Send + Sync` (`Handler::new`).
unsafe impl Send for Handler {}
// SAFETY: as above.
unsafe impl Sync for Handler {}

/// What a handler asked for on one hit (the [`EntryContext`] fields the
/// hit path acts on), returned in registers.
#[derive(Clone, Copy)]
pub(crate) struct Outcome {
    /// The cookie for the return handler.
    pub(crate) cookie: u64,
    /// [`Outcome::IP_CHANGED`], [`Outcome::REMOVE`], [`Outcome::SKIP_RETURN`].
    flags: u32,
}

impl Outcome {
    const IP_CHANGED: u32 = 1;
    const REMOVE: u32 = 2;
    const SKIP_RETURN: u32 = 4;

    /// The handler moved the instruction pointer.
    pub(crate) fn ip_changed(self) -> bool {
        self.flags & Self::IP_CHANGED != 0
    }

    /// The handler asked not to run again.
    pub(crate) fn remove(self) -> bool {
        self.flags & Self::REMOVE != 0
    }

    /// The handler asked not to track this call's return.
    pub(crate) fn skip_return(self) -> bool {
        self.flags & Self::SKIP_RETURN != 0
    }
}

impl Handler {
    /// Boxes `f`. Not async-signal-safe (allocates).
    pub(crate) fn new<F>(f: F) -> Self
    where
        F: Fn(&mut EntryContext<'_>) + Send + Sync + 'static,
    {
        /// # Safety
        /// `data` is a live `Box<F>`'s pointer.
        unsafe fn run<F: Fn(&mut EntryContext<'_>)>(
            data: *const (),
            frame: &mut crate::arch::Frame,
            addr: usize,
            usdt: Option<&[UsdtArg]>,
        ) -> Outcome {
            // SAFETY: the caller's contract.
            let f = unsafe { &*data.cast::<F>() };
            let mut cx = EntryContext::new(frame, addr);
            cx.usdt = usdt;
            f(&mut cx);
            let flag = |on: bool, bit: u32| if on { bit } else { 0 };
            Outcome {
                cookie: cx.cookie,
                flags: flag(cx.ip_changed, Outcome::IP_CHANGED)
                    | flag(cx.remove, Outcome::REMOVE)
                    | flag(cx.skip_return, Outcome::SKIP_RETURN),
            }
        }
        /// # Safety
        /// `data` is a live `Box<F>`'s pointer, not used again.
        unsafe fn drop<F>(data: *mut ()) {
            // SAFETY: the caller's contract.
            core::mem::drop(unsafe { Box::from_raw(data.cast::<F>()) });
        }
        Self {
            data: Box::into_raw(Box::new(f)).cast(),
            run: run::<F>,
            drop: drop::<F>,
        }
    }

    /// A handler that does nothing (a counting probe's).
    pub(crate) fn none() -> Self {
        Self::new(|_| {})
    }

    /// Runs the handler on a hit of `addr` with the registers `frame`
    /// (and the USDT arguments of the probe it was made on).
    /// Async-signal-safe as the closure is (its contract).
    #[inline]
    pub(crate) fn run(
        &self,
        frame: &mut crate::arch::Frame,
        addr: usize,
        usdt: Option<&[UsdtArg]>,
    ) -> Outcome {
        // SAFETY: `data` is the live box `run` was made for.
        unsafe { (self.run)(self.data, frame, addr, usdt) }
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        // SAFETY: the box `drop` was made for, dropped once.
        unsafe { (self.drop)(self.data) };
    }
}

/// One consumer of a site: its handlers and counters.
pub(crate) struct Consumer {
    pub(crate) handler: Handler,
    /// The return handler's side, for a return probe.
    pub(crate) ret: Option<super::returns::ReturnProbe>,
    /// Only hits of this thread run the handler (0: every thread).
    pub(crate) only_tid: i32,
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
    /// A counting probe's counts taken by trampolines themselves (see
    /// [`super::count`]); `None` for a probe with a handler, or where
    /// trampolines do not count.
    pub(crate) fast: Option<super::count::FastCount>,
}

impl Consumer {
    /// Hits counted: by the full path and by the trampolines' own
    /// counting. Async-signal-safe.
    pub(crate) fn hits(&self) -> u64 {
        let fast = self.fast.as_ref().map_or(0, super::count::FastCount::sum);
        self.hits.sum().wrapping_add(fast)
    }
}
