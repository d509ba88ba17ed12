//! Return probes with no entry handler (`Uprobe::on_return` alone): on
//! x86-64, where the site runs through a jump, the architecture's return
//! entry routine tracks their calls by itself (no register frame, no
//! call into Rust at the entry). Checked here: that it does (and hands
//! the site back to the engine while another probe shares it), that
//! every call is counted and every return handled exactly, from threads
//! that migrate, through recursion and tail calls, from signal handlers
//! that interrupt a tracked call, that a call pending at detach runs
//! nothing, and that every register and flag comes back as the callee
//! left it. On aarch64 the engine tracks them; the same checks hold.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use common::{call, fn_addr, probe_at, waits};
use uprobe_core::testing::{EntryRoute, entry_route};

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    ".globl re_fn",
    ".type re_fn, @function",
    "re_fn:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "lea rax, [rdi + 1]",
    "ret",
    ".size re_fn, . - re_fn",
    // A tail call into `re_fn`: both probes' returns at one return.
    ".globl re_tail",
    ".type re_tail, @function",
    "re_tail:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "jmp re_fn",
    ".size re_tail, . - re_tail",
);

#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".text",
    ".globl re_fn",
    ".type re_fn, %function",
    "re_fn:",
    "nop",
    "add x0, x0, #1",
    "ret",
    ".size re_fn, . - re_fn",
    ".globl re_tail",
    ".type re_tail, %function",
    "re_tail:",
    "nop",
    "b re_fn",
    ".size re_tail, . - re_tail",
);

unsafe extern "C" {
    fn re_fn(x: u64) -> u64;
    fn re_tail(x: u64) -> u64;
}

/// Serialises the tests of this file: several probe the same function.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The route a return probe with no entry handler takes where the
/// architecture has its own routines (x86-64; none on aarch64).
fn lean_route() -> Option<EntryRoute> {
    cfg!(target_arch = "x86_64").then_some(EntryRoute::Returns)
}

/// Returns whose context named another function or had a cookie (none
/// should: the routine pushes the probed function and a zero cookie).
static WRONG_CONTEXT: AtomicU64 = AtomicU64::new(0);

/// A return probe on `f` that adds each return value to `sum` and counts
/// the returns in `seen`.
fn summing_probe(
    f: unsafe extern "C" fn(u64) -> u64,
    sum: &Arc<AtomicU64>,
    seen: &Arc<AtomicU64>,
) -> uprobe_core::Probe {
    let (sum, seen) = (Arc::clone(sum), Arc::clone(seen));
    let func = fn_addr(f);
    probe_at(func)
        .on_return(move |cx| {
            if cx.func_addr() != func || cx.cookie() != 0 {
                WRONG_CONTEXT.fetch_add(1, SeqCst);
            }
            sum.fetch_add(cx.return_value(), SeqCst);
            seen.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap()
}

#[test]
fn calls_and_returns_are_exact_from_threads_that_migrate() {
    let _s = serial();
    let (sum, seen) = (Arc::default(), Arc::default());
    let probe = summing_probe(re_fn, &sum, &seen);
    #[cfg(target_arch = "x86_64")]
    assert!(probe.mode().is_jump(), "{:?}", probe.mode());
    assert_eq!(entry_route(fn_addr(re_fn)), lean_route());
    let (threads, calls) = (4, if common::emulated() { 5_000 } else { 50_000 });
    let made = common::calls_from_migrating_threads(re_fn, threads, calls);
    assert_eq!(probe.hits(), made);
    assert_eq!((probe.returns(), seen.load(SeqCst)), (made, made));
    assert_eq!(probe.missed(), 0);
    // Each thread's calls return 1..=calls.
    assert_eq!(sum.load(SeqCst), threads * calls * (calls + 1) / 2);
    assert_eq!(WRONG_CONTEXT.load(SeqCst), 0);
    assert_eq!(uprobe_core::testing::pending_returns(), 0);
    probe.detach().unwrap();
    assert_eq!(call(re_fn, 1), 2);
    assert_eq!(seen.load(SeqCst), made, "a return handled after detach");
}

#[test]
fn another_probe_on_the_site_sends_its_hits_to_the_engine_and_back() {
    let _s = serial();
    let (sum, seen) = (Arc::default(), Arc::default());
    let probe = summing_probe(re_fn, &sum, &seen);
    assert_eq!(entry_route(fn_addr(re_fn)), lean_route());
    assert_eq!(call(re_fn, 1), 2);
    let entries = Arc::new(AtomicU64::new(0));
    let e = Arc::clone(&entries);
    let other = probe_at(fn_addr(re_fn))
        .on_entry(move |_| {
            e.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    #[cfg(target_arch = "x86_64")]
    assert_eq!(entry_route(fn_addr(re_fn)), Some(EntryRoute::Engine));
    assert_eq!(call(re_fn, 2), 3);
    other.detach().unwrap();
    assert_eq!(entry_route(fn_addr(re_fn)), lean_route());
    assert_eq!(call(re_fn, 3), 4);
    assert_eq!(entries.load(SeqCst), 1);
    assert_eq!((probe.hits(), probe.returns()), (3, 3));
    assert_eq!(sum.load(SeqCst), 2 + 3 + 4);
    drop(probe);
}

#[inline(never)]
extern "C" fn recurses(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    std::hint::black_box(recurses(n - 1)) + 1
}

#[test]
fn recursion_runs_one_return_per_call_innermost_first() {
    let _s = serial();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let o = Arc::clone(&order);
    let probe = probe_at(recurses as *const () as usize)
        .on_return(move |cx| o.lock().unwrap().push(cx.return_value()))
        .attach()
        .unwrap();
    assert_eq!(recurses(std::hint::black_box(9)), 9);
    assert_eq!(*order.lock().unwrap(), (0..=9).collect::<Vec<u64>>());
    assert_eq!(probe.hits(), 10);
    drop(probe);
}

#[test]
fn a_tail_call_runs_both_returns_at_one_return() {
    let _s = serial();
    let (sum, seen) = (Arc::default(), Arc::default());
    let (tail_sum, tail_seen) = (Arc::default(), Arc::default());
    let inner = summing_probe(re_fn, &sum, &seen);
    let outer = summing_probe(re_tail, &tail_sum, &tail_seen);
    assert_eq!(entry_route(fn_addr(re_tail)), lean_route());
    for i in 0..100 {
        assert_eq!(call(re_tail, i), i + 1);
    }
    // The tail-called function's entry finds the stub already there:
    // chained onto the caller's pending return (the engine's path).
    assert_eq!((seen.load(SeqCst), tail_seen.load(SeqCst)), (100, 100));
    assert_eq!(sum.load(SeqCst), tail_sum.load(SeqCst));
    assert_eq!((inner.hits(), outer.hits()), (100, 100));
    drop((inner, outer));
}

/// Calls made by the signal handler below.
static IN_HANDLER: AtomicU64 = AtomicU64::new(0);

extern "C" fn call_in_handler(_: libc::c_int) {
    assert_eq!(call(re_fn, 41), 42);
    IN_HANDLER.fetch_add(1, SeqCst);
}

#[test]
fn signal_handlers_calling_the_function_mid_call_lose_nothing() {
    let _s = serial();
    // SIGUSR2, which nothing else in this test binary uses; the handler
    // only calls the probed function and adds to an atomic.
    common::install(libc::SIGUSR2, call_in_handler, libc::SA_RESTART);
    let (sum, seen) = (Arc::default(), Arc::default());
    let probe = summing_probe(re_fn, &sum, &seen);
    let done = AtomicBool::new(false);
    // SAFETY: pthread_self has no preconditions.
    let target = unsafe { libc::pthread_self() } as usize;
    let made = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(SeqCst) {
                // SAFETY: the calling test's thread is alive until `done`.
                unsafe { libc::pthread_kill(target as libc::pthread_t, libc::SIGUSR2) };
                std::thread::sleep(Duration::from_micros(50));
            }
        });
        let n = if common::emulated() { 20_000 } else { 200_000 };
        for i in 0..n {
            assert_eq!(call(re_fn, i), i + 1);
        }
        done.store(true, SeqCst);
        n
    });
    let in_handler = IN_HANDLER.load(SeqCst);
    assert!(in_handler > 0);
    let total = made + in_handler;
    assert_eq!(probe.hits() + probe.missed(), total);
    // A handler's call while the thread was inside the engine runs no
    // handler (missed); every other return is handled, with its value.
    assert_eq!(seen.load(SeqCst) + probe.missed(), total);
    assert_eq!(probe.returns(), seen.load(SeqCst));
    assert_eq!(uprobe_core::testing::pending_returns(), 0);
    drop(probe);
}

/// A call pending at detach returns normally and runs nothing; the next
/// probe on the site (which may get the same switch) sees only its own.
#[test]
fn a_call_pending_at_detach_runs_nothing_of_it_or_the_next() {
    let _s = serial();
    let (sum, seen) = (Arc::default(), Arc::default());
    let probe = summing_probe(waits, &sum, &seen);
    assert_eq!(entry_route(fn_addr(waits)), lean_route());
    let caller = common::call_waiting(41);
    assert_eq!(probe.hits(), 1);
    probe.detach().unwrap();
    let (next_sum, next_seen) = (Arc::default(), Arc::default());
    let next = summing_probe(waits, &next_sum, &next_seen);
    common::release_waiting();
    assert_eq!(caller.join().unwrap(), 42);
    assert_eq!(seen.load(SeqCst), 0, "a detached probe's handler ran");
    assert_eq!(
        next_seen.load(SeqCst),
        0,
        "the next probe ran for an old call"
    );
    assert_eq!(waits(1), 2);
    assert_eq!((next_seen.load(SeqCst), next_sum.load(SeqCst)), (1, 2));
    drop(next);
}

/// Attached and detached over and over while threads call the function
/// and check every result: no call goes wrong, and no return is handled
/// by a probe that was not attached when its call entered.
#[test]
fn return_probes_attach_and_detach_under_callers() {
    let _s = serial();
    let stop = AtomicBool::new(false);
    let rounds = if common::emulated() { 30 } else { 300 };
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut i = 0;
                while !stop.load(SeqCst) {
                    assert_eq!(call(re_fn, i), i + 1);
                    i += 1;
                }
            });
        }
        // Checked once the callers stop: a failed check must not leave
        // them running.
        let mut wrong = Vec::new();
        for _ in 0..rounds {
            let (sum, seen) = (Arc::default(), Arc::default());
            let probe = summing_probe(re_fn, &sum, &seen);
            let own = call(re_fn, 7);
            std::thread::yield_now();
            // A return is handled after its entry is counted.
            let handled = seen.load(SeqCst);
            let hits = probe.hits();
            probe.detach().unwrap();
            // None once detached.
            let at_detach = seen.load(SeqCst);
            for i in 0..100 {
                assert_eq!(call(re_fn, i), i + 1);
            }
            let after = seen.load(SeqCst);
            if own != 8 || handled == 0 || handled > hits || after != at_detach {
                wrong.push((own, handled, hits, at_detach, after));
            }
        }
        stop.store(true, SeqCst);
        assert_eq!(
            wrong,
            [],
            "(own call's result, returns handled, hits, handled at detach, after)"
        );
    });
}
