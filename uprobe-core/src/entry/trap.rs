//! The trap way in: the engine's SIGTRAP handler. A breakpoint of ours
//! traps; the handler looks its address up in the table (inside a read
//! section), runs the hit (`crate::hit`), then does what the displaced
//! instruction would have done: emulated or simulated on the signal frame,
//! sent to its out-of-line slot, or to the trampoline's relocated copy
//! once the site has one. A trap that is not ours goes to the handler
//! installed before ours ([`pass_on`]); one whose breakpoint a detach
//! removed meanwhile runs the restored instruction.
//!
//! Async-signal-safe throughout (it is a signal handler): no allocation,
//! no lock, no system call on a hit.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering, fence};

use crate::AttachError;
use crate::arch::apply;
use crate::base::error::os_error;
use crate::base::thread::in_trap;
use crate::code::slots::{self, SlotEnd};
use crate::hit::run_consumers;
use crate::process::maps::code_writes;
use crate::site::Site;
use crate::table::lookup::with_read_side;
use crate::table::site_at;

/// The handler that was installed for SIGTRAP before ours.
struct Previous(core::cell::UnsafeCell<core::mem::MaybeUninit<libc::sigaction>>);
// SAFETY: written once, before our handler is installed (the `sigaction`
// system call orders it before any delivery), then only read.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(core::cell::UnsafeCell::new(core::mem::MaybeUninit::zeroed()));

/// Installs the SIGTRAP handler, once. Not async-signal-safe.
pub(crate) fn install() -> Result<(), AttachError> {
    static ONCE: Once = Once::new();
    static FAILED: AtomicBool = AtomicBool::new(false);
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is valid; the handler has the
        // SA_SIGINFO signature; PREVIOUS is written before our handler can
        // run (it is installed by this very call).
        unsafe {
            let mut sa: libc::sigaction = core::mem::zeroed();
            sa.sa_sigaction = on_sigtrap as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER | libc::SA_RESTART;
            // Asynchronous signals wait until the handler is done (the
            // kernel restores the thread's own mask at sigreturn), so a
            // program's signal handlers never nest inside the engine's:
            // only the engine's own recursion through probed code can
            // deepen it, which is what the depth guard looks for. The
            // synchronous ones stay open (a trap or fault raised while
            // blocked kills the process).
            libc::sigfillset(&raw mut sa.sa_mask);
            for sig in SYNCHRONOUS {
                libc::sigdelset(&raw mut sa.sa_mask, sig);
            }
            let prev = (*PREVIOUS.0.get()).as_mut_ptr();
            if libc::sigaction(libc::SIGTRAP, &raw const sa, prev) != 0 {
                FAILED.store(true, Ordering::Relaxed);
            }
        }
    });
    if FAILED.load(Ordering::Relaxed) {
        return Err(os_error("sigaction(SIGTRAP)"));
    }
    Ok(())
}

/// Whether the engine's handler is still the one installed for SIGTRAP
/// (a program may replace it with `sigaction` or `signal`). Not
/// async-signal-safe only in that it is meant for attach and detach.
pub(crate) fn is_installed() -> bool {
    // SAFETY: a query only; `now` is written by the call.
    let now = unsafe {
        let mut now: libc::sigaction = core::mem::zeroed();
        libc::sigaction(libc::SIGTRAP, core::ptr::null(), &raw mut now);
        now.sa_sigaction
    };
    now == on_sigtrap as *const () as libc::sighandler_t
}

/// The signals the kernel raises for the instruction a thread runs: never
/// blocked in the engine's handler.
pub(crate) const SYNCHRONOUS: [libc::c_int; 6] = [
    libc::SIGTRAP,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGSYS,
];

extern "C" fn on_sigtrap(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    in_trap(|| handle_sigtrap(sig, info, ctx));
}

fn handle_sigtrap(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo and ucontext (SA_SIGINFO).
    let (info_ref, uc) = unsafe { (&*info, &mut *ctx.cast::<libc::ucontext_t>()) };
    let Some(addr) = crate::arch::breakpoint_address(info_ref, uc) else {
        // raise(), kill(), a debugger's trap flag: not a breakpoint.
        return chain(sig, info, ctx);
    };
    if let Some((origin, len, SlotEnd::TrapBack)) = slots::slot_info(addr) {
        // The second trap of a trap-ended slot: on to the instruction after
        // the probed one, and signals back.
        crate::arch::set_pc(uc, origin + len);
        crate::entry::deferral::restore(uc);
        return;
    }
    loop {
        let writes = code_writes();
        let found = with_read_side(|| {
            site_at(addr).map(|site| hit(site, uc)).or_else(|| {
                landing_site(addr).map(|site| match site.landing_entry.load(Ordering::Acquire) {
                    0 => hit(site, uc),
                    entry => crate::arch::set_pc(uc, entry),
                })
            })
        });
        if found.is_some() {
            return;
        }
        // SAFETY: `addr` is the breakpoint the thread just executed, so it
        // is mapped code.
        if !unsafe { crate::arch::is_breakpoint_at(addr) } {
            // A detach restored the instruction after this thread trapped:
            // run it.
            crate::arch::set_pc(uc, addr);
            return;
        }
        fence(Ordering::SeqCst);
        if code_writes() == writes {
            // A breakpoint no site claims, and no write of the engine's
            // since we looked: someone else's.
            return chain(sig, info, ctx);
        }
        // The engine wrote code meanwhile: a detach removed the site this
        // thread trapped on, and an attach wrote its own breakpoint here
        // (after publishing its site). Look again.
    }
}

/// The site whose jump, placed after its landing pad, starts at `addr`,
/// while a breakpoint there is the site's. Async-signal-safe.
fn landing_site(addr: usize) -> Option<&'static Site> {
    // `endbr64` and every A64 instruction.
    const LANDING_PAD_LEN: usize = 4;
    addr.checked_sub(LANDING_PAD_LEN)
        .and_then(site_at)
        .filter(|s| s.landing.load(Ordering::Acquire) == addr)
}

/// One trap hit on `site`: consumers, then the displaced instruction.
fn hit(site: &Site, uc: &mut libc::ucontext_t) {
    if run_consumers(site, crate::arch::frame_of(uc)) {
        return;
    }
    let resume_at = site.resume_at.load(Ordering::Acquire);
    if resume_at != 0 {
        // The trampoline's relocated copy of the replaced instructions.
        crate::arch::set_pc(uc, resume_at);
    } else {
        // SAFETY: the thread trapped on this very instruction.
        unsafe { apply(&site.emulation, uc) };
        if site.emulation.traps_back() {
            super::deferral::defer(uc);
        }
    }
}

/// Passes a trap that is not ours to the handler installed before ours, or
/// to the default action.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: written before our handler was installed, read-only since.
    let prev = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    pass_on(prev, sig, info, ctx);
}

/// Runs disposition `prev` for a signal our handler received.
pub(crate) fn pass_on(
    prev: &libc::sigaction,
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    match prev.sa_sigaction {
        libc::SIG_IGN => {}
        libc::SIG_DFL => {
            // The default action (terminate with a core dump), as if we
            // had never been installed.
            // SAFETY: resetting a disposition and re-raising are
            // async-signal-safe.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
        }
        handler if prev.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: the previous handler has the SA_SIGINFO signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { core::mem::transmute(handler) };
            f(sig, info, ctx);
        }
        handler => {
            // SAFETY: a plain handler.
            let f: extern "C" fn(libc::c_int) = unsafe { core::mem::transmute(handler) };
            f(sig);
        }
    }
}
