//! The program's own signals and the engine: asynchronous signals wait
//! until the trap handler is done, so the program's handlers (nested ones
//! too) never run inside it, and they may call probed code themselves.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use uprobe_core::Uprobe;

#[inline(never)]
extern "C" fn probed_square(x: u64) -> u64 {
    std::hint::black_box(x) * x
}

#[inline(never)]
extern "C" fn probed_triple(x: u64) -> u64 {
    std::hint::black_box(x) * 3
}

fn install(sig: libc::c_int, handler: extern "C" fn(libc::c_int), flags: libc::c_int) {
    // SAFETY: a plain handler that only touches atomics and probed code.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as libc::sighandler_t;
        sa.sa_flags = flags;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(libc::sigaction(sig, &raw const sa, std::ptr::null_mut()), 0);
    }
}

static USR1_RAN: AtomicBool = AtomicBool::new(false);
static RAN_INSIDE: AtomicBool = AtomicBool::new(true);
static BLOCKED_INSIDE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    USR1_RAN.store(true, SeqCst);
}

#[test]
fn a_signal_raised_in_a_handler_is_delivered_after_it() {
    install(libc::SIGUSR1, on_usr1, 0);
    let f: extern "C" fn(u64) -> u64 = probed_square;
    // SAFETY: a function's address starts an instruction.
    // On the trap path: a trampoline's handlers run with the thread's
    // own signal mask.
    let probe = unsafe { Uprobe::address(f as *const () as usize) }
        .trap_only()
        .on_entry(|_| {
            // SAFETY: querying the mask and raising are async-signal-safe.
            unsafe {
                let mut now: libc::sigset_t = std::mem::zeroed();
                libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &raw mut now);
                BLOCKED_INSIDE.store(
                    libc::sigismember(&raw const now, libc::SIGUSR1) == 1,
                    SeqCst,
                );
                libc::raise(libc::SIGUSR1);
            }
            RAN_INSIDE.store(USR1_RAN.load(SeqCst), SeqCst);
        })
        .attach()
        .unwrap();
    assert_eq!(f(7), 49);
    assert_eq!(probe.hits(), 1);
    assert!(
        BLOCKED_INSIDE.load(SeqCst),
        "SIGUSR1 open inside the handler"
    );
    assert!(
        !RAN_INSIDE.load(SeqCst),
        "the program's handler ran inside the engine's"
    );
    assert!(USR1_RAN.load(SeqCst), "the raised signal was lost");
}

static ALARMS: AtomicU64 = AtomicU64::new(0);
static NESTED: AtomicU64 = AtomicU64::new(0);
static MAX_NESTED: AtomicU64 = AtomicU64::new(0);
static BAD_RESULTS: AtomicU64 = AtomicU64::new(0);
/// Calls the alarm handlers made.
static HANDLER_CALLS: AtomicU64 = AtomicU64::new(0);

/// `SA_NODEFER`: a timer tick arriving while an earlier tick's handler runs
/// nests another one, each calling the probed function. The program
/// bounds its own nesting (a handler slower than its timer would
/// otherwise nest until the stack runs out, probes or not).
extern "C" fn on_alarm(_: libc::c_int) {
    let depth = NESTED.fetch_add(1, SeqCst) + 1;
    MAX_NESTED.fetch_max(depth, SeqCst);
    ALARMS.fetch_add(1, SeqCst);
    if depth <= 16 {
        for x in 0..2 {
            HANDLER_CALLS.fetch_add(1, SeqCst);
            if probed_triple(x) != 3 * x {
                BAD_RESULTS.fetch_add(1, SeqCst);
            }
        }
    }
    NESTED.fetch_sub(1, SeqCst);
}

/// Sets SIGALRM's blocking on the calling thread.
fn block_alarm(block: bool) {
    // SAFETY: plain signal-mask calls on this thread.
    unsafe {
        let mut set: libc::sigset_t = core::mem::zeroed();
        libc::sigemptyset(&raw mut set);
        libc::sigaddset(&raw mut set, libc::SIGALRM);
        let how = if block {
            libc::SIG_BLOCK
        } else {
            libc::SIG_UNBLOCK
        };
        assert_eq!(
            libc::pthread_sigmask(how, &raw const set, core::ptr::null_mut()),
            0
        );
    }
}

#[test]
fn nested_program_signal_handlers_may_call_probed_code() {
    // Ticks nest: each one a signal frame and, where it lands inside a
    // probe hit, that hit's frames (tens of KB per level in a debug build;
    // under an emulator, whose clock runs fast against the code, ticks
    // nest deeper). A test thread's 2 MiB ran out under qemu: the run
    // gets a thread with a stack of its own, SIGALRM blocked here.
    block_alarm(true);
    let run = std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(|| {
            block_alarm(false);
            nested_ticks_calling_probed_code();
        })
        .expect("spawn the run's thread")
        .join();
    block_alarm(false);
    if let Err(panic) = run {
        std::panic::resume_unwind(panic);
    }
}

fn nested_ticks_calling_probed_code() {
    install(libc::SIGALRM, on_alarm, libc::SA_NODEFER | libc::SA_RESTART);
    let f: extern "C" fn(u64) -> u64 = probed_triple;
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { Uprobe::address(f as *const () as usize) }
        .on_entry(|cx| {
            std::hint::black_box(cx.arg(0));
        })
        .attach()
        .unwrap();
    // A 20 us timer: ticks land in the trap handler, in the program's
    // handler and in plain code alike.
    let tick = libc::timeval {
        tv_sec: 0,
        tv_usec: 20,
    };
    let timer = libc::itimerval {
        it_interval: tick,
        it_value: tick,
    };
    // SAFETY: setitimer with a valid value.
    let set = unsafe { libc::setitimer(libc::ITIMER_REAL, &raw const timer, std::ptr::null_mut()) };
    assert_eq!(set, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut calls = 0u64;
    while (ALARMS.load(SeqCst) < 500 || calls < 2_000) && Instant::now() < deadline {
        assert_eq!(f(calls % 1000), 3 * (calls % 1000));
        calls += 1;
    }
    let off = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
    };
    // SAFETY: as above.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &raw const off, std::ptr::null_mut()) };
    // The last tick may have gone to another thread: let its handler end.
    while NESTED.load(SeqCst) != 0 {
        assert!(Instant::now() < deadline + Duration::from_secs(10));
        std::thread::yield_now();
    }
    println!(
        "{calls} calls, {} ticks, deepest nesting {}, {} hits, {} missed",
        ALARMS.load(SeqCst),
        MAX_NESTED.load(SeqCst),
        probe.hits(),
        probe.missed()
    );
    assert_eq!(BAD_RESULTS.load(SeqCst), 0);
    assert!(ALARMS.load(SeqCst) > 0, "the timer never fired");
    // Every call from the handlers and from plain code ran the handler or
    // was counted as missed.
    assert_eq!(
        probe.hits() + probe.missed(),
        calls + HANDLER_CALLS.load(SeqCst)
    );
}
