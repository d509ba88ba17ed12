//! Handlers as the hit path calls them: the boxed closure, behind a
//! function made for its type that builds the context, calls the closure
//! and reports what it asked for. The closure's body inlines there, so a
//! context that does not escape it stays in registers: a `dyn` call
//! with the context in memory would add a dozen stores and loads to a
//! hit through a jump. [`Handler`] for entries, [`ReturnHandler`] for returns.

use crate::arch::usdt::UsdtArg;
use crate::arch::{Frame, SavedRegs, SavedVector};
use crate::site::context::{EntryContext, ReturnContext};

/// A boxed closure of a type known only to the functions made for it.
struct Erased {
    /// The box's pointer.
    data: *mut (),
    /// Drops and frees it (made for its type).
    drop: unsafe fn(*mut ()),
}

// SAFETY: made only from closures that are `Send + Sync` (`Erased::new`).
unsafe impl Send for Erased {}
// SAFETY: as above.
unsafe impl Sync for Erased {}

impl Erased {
    /// Boxes `f`. Not async-signal-safe (allocates).
    fn new<F: Send + Sync + 'static>(f: F) -> Self {
        /// # Safety
        /// `data` is a live `Box<F>`'s pointer, not used again.
        unsafe fn drop<F>(data: *mut ()) {
            // SAFETY: the caller's contract.
            core::mem::drop(unsafe { Box::from_raw(data.cast::<F>()) });
        }
        Self {
            data: Box::into_raw(Box::new(f)).cast(),
            drop: drop::<F>,
        }
    }
}

impl Drop for Erased {
    fn drop(&mut self) {
        // SAFETY: the box `drop` was made for, dropped once.
        unsafe { (self.drop)(self.data) };
    }
}

/// An entry handler.
pub(crate) struct Handler {
    closure: Erased,
    /// Runs it (made for its type).
    run: unsafe fn(*const (), &mut Frame, usize, Option<&[UsdtArg]>) -> Outcome,
}

/// What an entry handler asked for on one hit (the [`EntryContext`]
/// fields the hit path acts on), returned in registers.
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
            frame: &mut Frame,
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
        Self {
            closure: Erased::new(f),
            run: run::<F>,
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
    pub(crate) fn run(&self, frame: &mut Frame, addr: usize, usdt: Option<&[UsdtArg]>) -> Outcome {
        // SAFETY: `data` is the live box `run` was made for.
        unsafe { (self.run)(self.closure.data, frame, addr, usdt) }
    }
}

/// A return handler.
pub(crate) struct ReturnHandler {
    closure: Erased,
    /// Runs it (made for its type).
    run: unsafe fn(*const (), &mut SavedRegs, &mut SavedVector, Returned),
}

/// Where a call that returns came from and what its entry stored: the
/// [`ReturnContext`] fields besides the registers.
#[derive(Clone, Copy)]
pub(crate) struct Returned {
    /// The probed function's entry.
    pub(crate) func: usize,
    /// The address it returns to.
    pub(crate) ret: usize,
    /// Its entry handler's cookie.
    pub(crate) cookie: u64,
}

impl ReturnHandler {
    /// Boxes `f`. Not async-signal-safe (allocates).
    pub(crate) fn new<F>(f: F) -> Self
    where
        F: Fn(&mut ReturnContext<'_>) + Send + Sync + 'static,
    {
        /// # Safety
        /// `data` is a live `Box<F>`'s pointer.
        unsafe fn run<F: Fn(&mut ReturnContext<'_>)>(
            data: *const (),
            regs: &mut SavedRegs,
            vector: &mut SavedVector,
            call: Returned,
        ) {
            // SAFETY: the caller's contract.
            let f = unsafe { &*data.cast::<F>() };
            f(&mut ReturnContext::new(
                regs,
                vector,
                call.func,
                call.ret,
                call.cookie,
            ));
        }
        Self {
            closure: Erased::new(f),
            run: run::<F>,
        }
    }

    /// Runs the handler for the return of `call` with the registers the
    /// function returned with. Async-signal-safe as the closure is (its
    /// contract).
    #[inline]
    pub(crate) fn run(&self, regs: &mut SavedRegs, vector: &mut SavedVector, call: Returned) {
        // SAFETY: `data` is the live box `run` was made for.
        unsafe { (self.run)(self.closure.data, regs, vector, call) }
    }
}
