//! Faults raised by a displaced instruction where it runs relocated (an
//! out-of-line slot, a trampoline's copy): reported to the program at
//! the probed address, as the kernel does, then passed on to the
//! program's own handler or the default action; and a fault of the
//! unwinder's recoverable load, resumed at its exit that says the
//! address is unreadable. Installed once, the first time the engine has
//! made relocated code or made ready to unwind.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

use super::trap::pass_on;
use crate::AttachError;
use crate::base::error::os_error;

/// The synchronous signals an out-of-line instruction can raise.
const FAULTS: [libc::c_int; 4] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL];

/// The handlers installed for [`FAULTS`] before ours, in that order.
struct PreviousFaults(core::cell::UnsafeCell<[core::mem::MaybeUninit<libc::sigaction>; 4]>);
// SAFETY: each is written once, before our handler for that signal is
// installed (the `sigaction` system call orders it before any delivery),
// then only read.
unsafe impl Sync for PreviousFaults {}
static PREVIOUS_FAULTS: PreviousFaults = PreviousFaults(core::cell::UnsafeCell::new(
    [const { core::mem::MaybeUninit::zeroed() }; 4],
));

/// Installs, once, handlers that report a fault raised inside an
/// out-of-line slot at the probed address (as the kernel does), then pass
/// it on to the program's own handler or the default action.
pub(crate) fn install() -> Result<(), AttachError> {
    static ONCE: Once = Once::new();
    static FAILED: AtomicBool = AtomicBool::new(false);
    ONCE.call_once(|| {
        for (i, &sig) in FAULTS.iter().enumerate() {
            // SAFETY: a zeroed sigaction is valid; the handler has the SA_SIGINFO
            // signature; each previous disposition is stored
            // before our handler for that signal exists.
            unsafe {
                let mut sa: libc::sigaction = core::mem::zeroed();
                sa.sa_sigaction = on_fault as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
                libc::sigemptyset(&raw mut sa.sa_mask);
                let prev = (*PREVIOUS_FAULTS.0.get())[i].as_mut_ptr();
                if libc::sigaction(sig, &raw const sa, prev) != 0 {
                    FAILED.store(true, Ordering::Relaxed);
                }
            }
        }
    });
    if FAILED.load(Ordering::Relaxed) {
        return Err(os_error("sigaction(SIGSEGV/SIGBUS/SIGFPE/SIGILL)"));
    }
    Ok(())
}

/// Looks whether our handler is the process's SIGSEGV and SIGBUS handler,
/// and tells `process::safe_load` (whose loads it recovers). Ordinary
/// context.
pub(crate) fn check_handlers() {
    let ours = on_fault as *const () as libc::sighandler_t;
    let all = [libc::SIGSEGV, libc::SIGBUS].into_iter().all(|sig| {
        // SAFETY: a query: `act` null, `old` ours to fill.
        let mut old: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        (unsafe { libc::sigaction(sig, core::ptr::null(), &raw mut old) }) == 0
            && old.sa_sigaction == ours
    });
    crate::process::safe_load::set_handlers_ours(all);
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid ucontext (SA_SIGINFO).
    let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
    // The unwinder's recoverable load: it says "unreadable" instead.
    if crate::process::safe_load::recover(uc) {
        return;
    }
    if let Some(addr) = crate::code::slots::origin_of(crate::arch::pc(uc)) {
        crate::arch::set_pc(uc, addr);
        // A trap-ended slot deferred the thread's signals: give them back
        // before the program's handler (or the default action) runs.
        crate::entry::deferral::restore(uc);
    }
    if let Some((addr, copy)) = crate::code::trampolines::relocated_origin(crate::arch::pc(uc)) {
        // The program's handler sees the original instruction; if it
        // returns to retry it (a handler that maps the page, say), the
        // retry happens in the trampoline: the original bytes may be
        // covered by the jump.
        crate::arch::set_pc(uc, addr);
        let i = FAULTS.iter().position(|&s| s == sig).unwrap_or(0);
        // SAFETY: written before our handler was installed, read-only since.
        let prev = unsafe { (*PREVIOUS_FAULTS.0.get())[i].assume_init_ref() };
        if prev.sa_sigaction != libc::SIG_IGN {
            pass_on(prev, sig, info, ctx);
            // SAFETY: as above.
            let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
            if crate::arch::pc(uc) == addr {
                crate::arch::set_pc(uc, copy);
            }
            return;
        }
    }
    let i = FAULTS.iter().position(|&s| s == sig).unwrap_or(0);
    // SAFETY: written before our handler was installed, read-only since.
    let prev = unsafe { (*PREVIOUS_FAULTS.0.get())[i].assume_init_ref() };
    if prev.sa_sigaction == libc::SIG_IGN {
        // The kernel never lets a fault be ignored (returning would run
        // the faulting instruction again forever): the default action.
        // SAFETY: resetting a disposition and re-raising are
        // async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
        return;
    }
    pass_on(prev, sig, info, ctx);
}
