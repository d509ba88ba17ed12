//! The program's own signals and the engine: asynchronous signals wait
//! until the trap handler is done, so the program's handlers (nested ones
//! too) never run inside it, and they may call probed code themselves.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering::SeqCst};
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

static USR1_RAN: AtomicBool = AtomicBool::new(false);
static RAN_INSIDE: AtomicBool = AtomicBool::new(true);
static BLOCKED_INSIDE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    USR1_RAN.store(true, SeqCst);
}

#[test]
fn a_signal_raised_in_a_handler_is_delivered_after_it() {
    common::install(libc::SIGUSR1, on_usr1, 0);
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
/// bounds its own nesting: each tick is armed by the handler of the one
/// before (inside it, so that it nests, up to 16 deep; at its end beyond
/// that). A periodic timer faster than the kernel sets up signal frames
/// (a slow or loaded machine) would nest frames until the stack runs out
/// before any handler runs, probes or not.
extern "C" fn on_alarm(_: libc::c_int) {
    let depth = NESTED.fetch_add(1, SeqCst) + 1;
    MAX_NESTED.fetch_max(depth, SeqCst);
    ALARMS.fetch_add(1, SeqCst);
    if depth <= 16 {
        next_tick();
        for x in 0..2 {
            HANDLER_CALLS.fetch_add(1, SeqCst);
            if probed_triple(x) != 3 * x {
                BAD_RESULTS.fetch_add(1, SeqCst);
            }
        }
    }
    NESTED.fetch_sub(1, SeqCst);
    if depth > 16 {
        next_tick();
    }
}

/// The ticks' timer, while `TICKING` (the first timer of a process is
/// number 0: a null `timer_t`).
static TIMER: AtomicPtr<libc::c_void> = AtomicPtr::new(core::ptr::null_mut());
static TICKING: AtomicBool = AtomicBool::new(false);

/// Between ticks.
const TICK: Duration = Duration::from_micros(20);
/// Ticks in all: where a handler takes longer than `TICK` (under an
/// emulator, each probed call in it traps through the emulated signal
/// path), the ticks alone would keep the thread in its handlers and the
/// run's loop would never get back to its deadline.
const MAX_TICKS: u64 = 2_000;

/// Arms the next tick, `TICK` from now, if the timer exists and fewer
/// than `MAX_TICKS` came.
/// Async-signal-safe.
fn next_tick() {
    if !TICKING.load(SeqCst) || ALARMS.load(SeqCst) >= MAX_TICKS {
        return;
    }
    let timer = TIMER.load(SeqCst);
    let once = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: 0,
            tv_nsec: TICK.as_nanos() as _,
        },
    };
    // SAFETY: arming a timer of ours (timer_settime is async-signal-safe);
    // the ticks and its deletion happen on one thread, so it exists here.
    unsafe { libc::timer_settime(timer, 0, &raw const once, core::ptr::null_mut()) };
}

/// The ticks: a timer that sends SIGALRM to the thread that made it (not
/// to the process: that signal goes to the main thread first, whatever
/// this thread blocks), first in `TICK`, then each after the one before
/// was handled ([`on_alarm`]); stopped when dropped.
struct Ticks;

impl Ticks {
    fn start() -> Self {
        // SAFETY: a zeroed sigevent is valid; gettid has no
        // preconditions; the timer is created with valid arguments.
        let timer = unsafe {
            let mut event: libc::sigevent = core::mem::zeroed();
            event.sigev_notify = libc::SIGEV_THREAD_ID;
            event.sigev_signo = libc::SIGALRM;
            event.sigev_notify_thread_id = libc::syscall(libc::SYS_gettid) as i32;
            let mut timer: libc::timer_t = core::ptr::null_mut();
            let made = libc::timer_create(libc::CLOCK_MONOTONIC, &raw mut event, &raw mut timer);
            assert_eq!(made, 0, "timer_create");
            timer
        };
        TIMER.store(timer, SeqCst);
        TICKING.store(true, SeqCst);
        next_tick();
        Self
    }
}

impl Drop for Ticks {
    fn drop(&mut self) {
        TICKING.store(false, SeqCst);
        // SAFETY: the timer made by `start`, deleted once (which disarms
        // it); handlers run on this thread, none is running now.
        unsafe { libc::timer_delete(TIMER.load(SeqCst)) };
    }
}

#[test]
fn nested_program_signal_handlers_may_call_probed_code() {
    // Ticks nest: each one a signal frame and, where it lands inside a
    // probe hit, that hit's frames (tens of KB per level in a debug
    // build). A test thread's 2 MiB ran out under qemu: the run gets a
    // thread with a stack of its own, and the ticks go to that thread.
    let run = std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(nested_ticks_calling_probed_code)
        .expect("spawn the run's thread")
        .join();
    if let Err(panic) = run {
        std::panic::resume_unwind(panic);
    }
}

fn nested_ticks_calling_probed_code() {
    common::install(libc::SIGALRM, on_alarm, libc::SA_NODEFER | libc::SA_RESTART);
    let f: extern "C" fn(u64) -> u64 = probed_triple;
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { Uprobe::address(f as *const () as usize) }
        .on_entry(|cx| {
            std::hint::black_box(cx.arg(0));
        })
        .attach()
        .unwrap();
    // Ticks 20 us apart: they land in the trap handler, in the program's
    // handler and in plain code alike.
    let ticks = Ticks::start();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut calls = 0u64;
    while (ALARMS.load(SeqCst) < 500 || calls < 2_000) && Instant::now() < deadline {
        assert_eq!(f(calls % 1000), 3 * (calls % 1000));
        calls += 1;
    }
    // Between ticks: every handler has ended.
    drop(ticks);
    assert_eq!(NESTED.load(SeqCst), 0);
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
