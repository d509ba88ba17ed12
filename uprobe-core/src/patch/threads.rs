//! Where the other threads are, before a jump covers a range of several
//! instructions (step 2 of `super::jump`'s protocol): every other thread
//! is sent a real-time signal queued with a marker
//! (`rt_tgsigqueueinfo`), and its handler looks at where the thread
//! stopped. One stopped at an instruction boundary inside a range being
//! optimized is moved to the matching instruction of the trampoline's
//! relocated copy. A thread that does not answer in time, or is inside
//! the engine's trap handler in every round, leaves the site on its
//! breakpoint ([`NotOptimized::ThreadsUnchecked`]).

use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::base::mode::NotOptimized;
use crate::base::thread::{current_tid, in_trap_handler};
use crate::process::threads::thread_ids;
use crate::site::jump::{Jump, Trampoline};

/// The marker in a thread check's `si_value` (the round number is added).
const CHECK_MARKER: u64 = 0x7570_7262_0000_0000;
const ROUND_MASK: u64 = 0xffff_ffff;
/// Rounds of signals before giving up on a busy or silent thread.
const ROUNDS: usize = 4;
/// How long a round waits for every thread to answer.
const ROUND_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The ranges being checked, sorted by start (null between checks).
static RANGES: AtomicPtr<Vec<(usize, usize, &'static Trampoline)>> =
    AtomicPtr::new(core::ptr::null_mut());
/// Signal handlers reading `RANGES` now.
static READING: AtomicUsize = AtomicUsize::new(0);
static ROUND: AtomicU64 = AtomicU64::new(0);
static ANSWERED: AtomicUsize = AtomicUsize::new(0);
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// The layout of `siginfo_t` for a queued signal on x86-64 and aarch64.
#[repr(C)]
struct QueuedInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    pid: i32,
    uid: u32,
    value: u64,
    _rest: [u64; 12],
}

/// The signal thread checks use (0: none chosen yet; -1: none free).
static CHECK_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// The signal of thread checks, chosen and its handler installed on
/// first use: the highest real-time signal whose disposition is the
/// default one. Not SIGTRAP: a standard signal does not queue behind
/// itself, so a thread that executed a breakpoint while a SIGTRAP check
/// was pending would lose its trap, and resume past the displaced
/// instruction without running it. `None` if every real-time signal is
/// taken, or the program has since replaced the handler (no thread can
/// be checked then). Not async-signal-safe.
fn check_signal() -> Option<i32> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in (libc::SIGRTMIN()..=libc::SIGRTMAX()).rev() {
            // SAFETY: querying, then installing a handler with the
            // SA_SIGINFO signature for a signal nobody handles.
            unsafe {
                let mut old: libc::sigaction = core::mem::zeroed();
                if libc::sigaction(sig, core::ptr::null(), &raw mut old) != 0
                    || old.sa_sigaction != libc::SIG_DFL
                {
                    continue;
                }
                let mut sa: libc::sigaction = core::mem::zeroed();
                sa.sa_sigaction = on_check_signal as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&raw mut sa.sa_mask);
                if libc::sigaction(sig, &raw const sa, core::ptr::null_mut()) == 0 {
                    CHECK_SIGNAL.store(sig, Ordering::Relaxed);
                    return;
                }
            }
        }
        CHECK_SIGNAL.store(-1, Ordering::Relaxed);
    });
    let sig = CHECK_SIGNAL.load(Ordering::Relaxed);
    // SAFETY: a query only.
    let ours = sig > 0
        && unsafe {
            let mut now: libc::sigaction = core::mem::zeroed();
            libc::sigaction(sig, core::ptr::null(), &raw mut now);
            now.sa_sigaction == on_check_signal as *const () as libc::sighandler_t
        };
    ours.then_some(sig)
}

extern "C" fn on_check_signal(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo and ucontext (SA_SIGINFO).
    let (info, uc) = unsafe { (&*info, &mut *ctx.cast::<libc::ucontext_t>()) };
    if is_check(info) {
        on_check(info, uc, in_trap_handler());
    } else {
        // Someone else's: what the default disposition would have done.
        // SAFETY: resetting a disposition and re-raising are
        // async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

/// Whether a signal is a thread check of the engine's. Async-signal-safe.
fn is_check(info: &libc::siginfo_t) -> bool {
    if info.si_code != libc::SI_QUEUE {
        return false;
    }
    // SAFETY: a queued signal's siginfo has the `QueuedInfo` layout.
    let q = unsafe { &*core::ptr::from_ref(info).cast::<QueuedInfo>() };
    // SAFETY: getpid has no preconditions.
    q.value & !ROUND_MASK == CHECK_MARKER && q.pid == unsafe { libc::getpid() }
}

/// A thread check, on the thread checked: if it stopped at an
/// instruction boundary inside a range being optimized, moves it to the
/// relocated copy; `in_trap_handler` says it was interrupted inside the
/// engine's trap handler (it must be asked again). Async-signal-safe.
fn on_check(info: &libc::siginfo_t, uc: &mut libc::ucontext_t, in_trap_handler: bool) {
    // SAFETY: `is_check` said so.
    let q = unsafe { &*core::ptr::from_ref(info).cast::<QueuedInfo>() };
    READING.fetch_add(1, Ordering::SeqCst);
    let ranges = RANGES.load(Ordering::SeqCst);
    if !ranges.is_null() && q.value & ROUND_MASK == ROUND.load(Ordering::SeqCst) & ROUND_MASK {
        if in_trap_handler {
            BUSY.fetch_add(1, Ordering::SeqCst);
        } else {
            // SAFETY: published by `check_threads`, freed only once no
            // handler reads it.
            let ranges = unsafe { &*ranges };
            let pc = crate::arch::pc(uc);
            let i = ranges.partition_point(|&(start, _, _)| start <= pc);
            if i > 0 {
                let (start, len, t) = ranges[i - 1];
                if pc > start && pc < start + len {
                    match t.moves.iter().find(|&&(at, _)| at == pc) {
                        Some(&(_, to)) => crate::arch::set_pc(uc, to),
                        None => {
                            BUSY.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            }
        }
        ANSWERED.fetch_add(1, Ordering::SeqCst);
    }
    READING.fetch_sub(1, Ordering::SeqCst);
}

/// Makes sure no thread but the caller is stopped at an instruction
/// boundary inside one of `jumps`' ranges (moving those that are), by
/// asking each thread where it is. Not async-signal-safe.
pub(crate) fn check_threads(jumps: &[&Jump]) -> Result<(), NotOptimized> {
    let mut ranges: Vec<(usize, usize, &'static Trampoline)> = jumps
        .iter()
        .map(|j| (j.start, j.len, j.trampoline))
        .collect();
    ranges.sort_unstable_by_key(|r| r.0);
    RANGES.store(Box::into_raw(Box::new(ranges)), Ordering::SeqCst);
    let mut result = Err(NotOptimized::ThreadsUnchecked { threads: 0 });
    for _ in 0..ROUNDS {
        match check_round() {
            Ok(()) => {
                result = Ok(());
                break;
            }
            Err(threads) => result = Err(NotOptimized::ThreadsUnchecked { threads }),
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let ranges = RANGES.swap(core::ptr::null_mut(), Ordering::SeqCst);
    while READING.load(Ordering::SeqCst) != 0 {
        std::hint::spin_loop();
    }
    // SAFETY: unpublished, and no handler reads it any more.
    drop(unsafe { Box::from_raw(ranges) });
    result
}

/// One round: signals every other thread and waits for the answers.
/// `Err(n)`: `n` threads did not answer or were busy.
fn check_round() -> Result<(), usize> {
    let Some(signal) = check_signal() else {
        return Err(thread_ids().len().saturating_sub(1));
    };
    let round = ROUND.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
    ANSWERED.store(0, Ordering::SeqCst);
    BUSY.store(0, Ordering::SeqCst);
    // SAFETY: getpid/getuid have no preconditions.
    let (pid, uid) = unsafe { (libc::getpid(), libc::getuid()) };
    let me = current_tid();
    let mut sent = 0;
    for tid in thread_ids() {
        if tid == me {
            continue;
        }
        let info = QueuedInfo {
            signo: signal,
            errno: 0,
            code: libc::SI_QUEUE,
            _pad: 0,
            pid,
            uid,
            value: CHECK_MARKER | (round & ROUND_MASK),
            _rest: [0; 12],
        };
        // SAFETY: a queued signal with a siginfo of ours to a thread of
        // this process.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                pid,
                tid,
                signal,
                &raw const info,
            )
        };
        if rc == 0 {
            sent += 1;
        }
    }
    let deadline = std::time::Instant::now() + ROUND_WAIT;
    while ANSWERED.load(Ordering::SeqCst) < sent && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    let answered = ANSWERED.load(Ordering::SeqCst);
    let busy = BUSY.load(Ordering::SeqCst);
    let bad = sent.saturating_sub(answered) + busy;
    if bad == 0 { Ok(()) } else { Err(bad) }
}
