//! aarch64: signals and the engine. Asynchronous signals are deferred
//! while a thread runs a trap-ended slot (seed 000's deferral), a fault
//! raised out of line reaches the program's handler at the probed
//! address, and a probe hit from inside a handler is counted as missed.
//! Its own binary: the SIGUSR1/SIGSEGV handlers and the slot switch are
//! process-wide.
#![cfg(target_arch = "aarch64")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};
#[cfg(feature = "bench-variants")]
use uprobe_core::bench_only::{force_trap_back_slots, in_xol_slot};

core::arch::global_asm!(
    ".text",
    ".globl g_load",
    "g_load:",
    "ldr x1, [x1]",
    "add x0, x0, x1",
    "ret",
    ".globl g_deref",
    "g_deref:",
    "ldr x0, [x0]",
    "ret",
    ".globl g_inner",
    "g_inner:",
    "add x0, x0, #7",
    "ret",
    // outer(x) = inner(x)
    ".globl g_outer",
    "g_outer:",
    "stp x29, x30, [sp, #-16]!",
    "bl g_inner",
    "ldp x29, x30, [sp], #16",
    "ret",
);

unsafe extern "C" {
    fn g_load(x: u64, p: *const u64) -> u64;
    fn g_deref(p: u64) -> u64;
    fn g_inner(x: u64) -> u64;
    fn g_outer(x: u64) -> u64;
}

static DELIVERED: AtomicU64 = AtomicU64::new(0);
static IN_SLOT: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_usr1(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: SA_SIGINFO handlers get the interrupted context.
    let uc = unsafe { &*ctx.cast::<libc::ucontext_t>() };
    if in_xol_slot(uc.uc_mcontext.pc as usize) {
        IN_SLOT.fetch_add(1, SeqCst);
    }
    DELIVERED.fetch_add(1, SeqCst);
}

fn install(
    sig: libc::c_int,
    f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void),
) {
    // SAFETY: installing an SA_SIGINFO handler that only edits the frame.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = f as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(libc::sigaction(sig, &raw const sa, std::ptr::null_mut()), 0);
    }
}

#[test]
#[cfg(feature = "bench-variants")]
fn trap_ended_slots_defer_asynchronous_signals() {
    force_trap_back_slots(true);
    let probe = probe_at(g_load as *const () as usize).attach().unwrap();
    force_trap_back_slots(false);
    install(libc::SIGUSR1, on_usr1);
    let value = 500u64;
    let stop = AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            let mut x = 0;
            while !stop.load(SeqCst) {
                // SAFETY: reads `value`.
                assert_eq!(unsafe { g_load(x, &raw const value) }, 500 + x);
                x = (x + 1) % 1000;
            }
        });
        let target = rx.recv().unwrap();
        for _ in 0..5_000 {
            // SAFETY: the target thread runs until `stop`.
            unsafe { libc::pthread_kill(target, libc::SIGUSR1) };
            std::thread::yield_now();
        }
        stop.store(true, SeqCst);
    });
    assert!(probe.hits() > 0);
    assert!(DELIVERED.load(SeqCst) > 0, "signals were lost");
    assert_eq!(
        IN_SLOT.load(SeqCst),
        0,
        "a signal was handled inside a slot"
    );
}

static FAULT_PC: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_segv(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: SA_SIGINFO handlers get the interrupted context.
    let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
    FAULT_PC.store(uc.uc_mcontext.pc as usize, SeqCst);
    // Skip the load, returning a marker, as a JIT's handler might.
    uc.uc_mcontext.pc += 4;
    uc.uc_mcontext.regs[0] = 0xdead;
}

#[test]
fn a_fault_out_of_line_is_reported_at_the_probed_address() {
    install(libc::SIGSEGV, on_segv);
    assert_eq!(call(g_deref, 0), 0xdead);
    assert_eq!(FAULT_PC.load(SeqCst), fn_addr(g_deref));
    let probe = probe_at(fn_addr(g_deref)).attach().unwrap();
    let value = 77u64;
    assert_eq!(call(g_deref, (&raw const value) as u64), 77);
    FAULT_PC.store(0, SeqCst);
    assert_eq!(call(g_deref, 0), 0xdead);
    assert_eq!(FAULT_PC.load(SeqCst), fn_addr(g_deref));
    assert_eq!(probe.hits(), 2);
}

#[test]
fn a_probe_hit_from_a_handler_is_missed_and_still_runs() {
    let inner = probe_at(fn_addr(g_inner)).attach().unwrap();
    static FROM_HANDLER: AtomicU64 = AtomicU64::new(0);
    let outer = probe_at(fn_addr(g_outer))
        .on_entry(|_| {
            FROM_HANDLER.store(call(g_inner, 1), SeqCst);
        })
        .attach()
        .unwrap();
    assert_eq!(call(g_outer, 5), 12);
    assert_eq!(FROM_HANDLER.load(SeqCst), 8, "the nested call ran");
    assert_eq!(outer.hits(), 1);
    // The direct call from outer hit; the one from the handler was missed.
    assert_eq!((inner.hits(), inner.missed()), (1, 1));
}
