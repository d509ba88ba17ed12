//! Trap-ended out-of-line slots (two traps per hit, forced here through
//! the bench-only switch): results identical, and asynchronous signals are
//! deferred while a thread is inside a slot, then delivered, never lost.
//! Its own binary: the switch and the SIGUSR1 handler are process-wide.
// The switches exist with the `bench-variants` feature (enabled in the
// workspace by the benches package).
#![cfg(all(
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "bench-variants"
))]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};
use uprobe_core::testing::{force_trap_back_slots, in_xol_slot};

// load(x) = x + 500 (a load from data), add(x) = x + 3.
#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".data",
    ".balign 8",
    "tb_data:",
    ".quad 500",
    ".text",
    ".globl tb_load",
    "tb_load:",
    "mov rax, [rip + tb_data]",
    "add rax, rdi",
    "ret",
    ".globl tb_add",
    "tb_add:",
    "add rdi, 3",
    "mov rax, rdi",
    "ret",
);
// On aarch64 the first instruction of each must run out of line (a
// literal load would be simulated): the address is formed first, the load
// from it is probed.
#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".data",
    ".balign 8",
    "tb_data:",
    ".quad 500",
    ".text",
    ".globl tb_load",
    "tb_load:",
    "eor x1, x1, x1",
    "adrp x1, tb_data",
    "add x1, x1, :lo12:tb_data",
    "ldr x1, [x1]",
    "add x0, x0, x1",
    "ret",
    ".globl tb_add",
    "tb_add:",
    "add x0, x0, #3",
    "ret",
);

unsafe extern "C" {
    fn tb_load(x: u64) -> u64;
    fn tb_add(x: u64) -> u64;
}

static DELIVERED: AtomicU64 = AtomicU64::new(0);
static IN_SLOT: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_usr1(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: SA_SIGINFO handlers get the interrupted context.
    let uc = unsafe { &*ctx.cast::<libc::ucontext_t>() };
    #[cfg(target_arch = "x86_64")]
    let pc = uc.uc_mcontext.gregs[libc::REG_RIP as usize] as usize;
    #[cfg(target_arch = "aarch64")]
    let pc = uc.uc_mcontext.pc as usize;
    if in_xol_slot(pc) {
        IN_SLOT.fetch_add(1, SeqCst);
    }
    DELIVERED.fetch_add(1, SeqCst);
}

#[test]
fn trap_ended_slots_run_right_and_defer_signals() {
    force_trap_back_slots(true);
    for f in [tb_load, tb_add] {
        let plain: Vec<u64> = (0..5).map(|x| call(f, x)).collect();
        let probe = probe_at(fn_addr(f)).attach().unwrap();
        let probed: Vec<u64> = (0..5).map(|x| call(f, x)).collect();
        assert_eq!(probed, plain);
        assert_eq!(probe.hits(), 5);
    }

    // A thread calls the probed function in a loop while SIGUSR1 rains on
    // it: the handler must never find it inside a slot, and signals keep
    // arriving.
    // SAFETY: installing an SA_SIGINFO handler that only reads the frame.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &raw const sa, std::ptr::null_mut()),
            0
        );
    }
    let probe = probe_at(fn_addr(tb_load)).attach().unwrap();
    let stop = AtomicBool::new(false);
    let calls = AtomicU64::new(0);
    let (tx, rx) = std::sync::mpsc::channel();
    // Waits (bounded) until the target has made `n` more calls: signals
    // are sent while it runs, however slowly (qemu, a loaded machine).
    let progress = |n: u64| {
        let target = calls.load(SeqCst) + n;
        let deadline = std::time::Instant::now() + std::time::Duration::from_mins(1);
        while calls.load(SeqCst) < target {
            assert!(std::time::Instant::now() < deadline, "the caller stopped");
            std::thread::yield_now();
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            let mut x = 0;
            while !stop.load(SeqCst) {
                assert_eq!(call(tb_load, x), 500 + x);
                calls.fetch_add(1, SeqCst);
                x = (x + 1) % 1000;
            }
        });
        let _stop = common::StopOnDrop(&stop);
        let target = rx.recv().unwrap();
        progress(10);
        for i in 0..20_000 {
            // SAFETY: the target thread runs until `stop`.
            unsafe { libc::pthread_kill(target, libc::SIGUSR1) };
            std::thread::yield_now();
            if i % 1000 == 999 {
                progress(1);
            }
        }
        progress(10);
    });
    assert!(probe.hits() >= 30);
    assert!(DELIVERED.load(SeqCst) > 0, "signals were lost");
    assert_eq!(
        IN_SLOT.load(SeqCst),
        0,
        "a signal was handled inside a slot"
    );
}

/// `memcpy` probed with a trap-ended slot: the handler's own path (mask
/// save and restore included) never calls it, so nothing recurses.
#[test]
fn memcpy_with_a_trap_ended_slot() {
    force_trap_back_slots(true);
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
    // memcpy is on the posix_spawn child's path (ENOEXEC): this test
    // spawns no process.
    let probe = match uprobe_core::Uprobe::in_object("libc.so.6", "memcpy")
        .unwrap()
        .allow_blocked_signal_paths()
        .only_thread(me)
        .attach()
    {
        Ok(p) => p,
        Err(uprobe_core::AttachError::Unsupported { insn, .. }) => {
            println!("memcpy starts with `{insn}`, not probed here");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (src, mut dst) = ([9u8; 100], [0u8; 100]);
    let f: unsafe extern "C" fn(
        *mut libc::c_void,
        *const libc::c_void,
        usize,
    ) -> *mut libc::c_void = std::hint::black_box(libc::memcpy);
    // SAFETY: two distinct 100-byte buffers.
    unsafe { f(dst.as_mut_ptr().cast(), src.as_ptr().cast(), 100) };
    assert_eq!(dst, src);
    assert!(probe.hits() >= 1);
}
