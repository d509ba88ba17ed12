//! aarch64: the engine's behaviour as on x86-64: probes on code other
//! threads run (attach/detach churn), refused instructions, foreign
//! breakpoints, the process's own `malloc`, `free` and
//! `pthread_mutex_lock`, a fork child, slots that end in a second trap,
//! and entry handlers reading and writing registers.
#![cfg(target_arch = "aarch64")]

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};
use uprobe_core::{AttachError, Reg, Uprobe};

core::arch::global_asm!(
    ".text",
    // hot(x) = x + 1, through a frame like a real function's.
    ".globl e_hot",
    "e_hot:",
    "stp x29, x30, [sp, #-16]!",
    "mov x29, sp",
    "add x0, x0, #1",
    "ldp x29, x30, [sp], #16",
    "ret",
    ".globl e_fork",
    "e_fork:",
    "nop",
    "add x0, x0, #2",
    "ret",
    ".globl e_trapback",
    "e_trapback:",
    "eor x0, x0, #0xff",
    "ret",
    ".globl e_regs",
    "e_regs:",
    "add x0, x0, x1",
    "ret",
    // Refused instructions, each at the start of its function.
    ".globl e_ldxr",
    "e_ldxr:",
    "ldxr x1, [x0]",
    "ret",
    ".globl e_svc",
    "e_svc:",
    "svc #0",
    "ret",
    ".globl e_msr",
    "e_msr:",
    "msr nzcv, x0",
    "ret",
    ".globl e_brk",
    "e_brk:",
    "brk #0x3e8",
    "ret",
);

unsafe extern "C" {
    fn e_hot(x: u64) -> u64;
    fn e_fork(x: u64) -> u64;
    fn e_trapback(x: u64) -> u64;
    fn e_regs(x: u64) -> u64;
    fn e_ldxr(x: u64) -> u64;
    fn e_svc(x: u64) -> u64;
    fn e_msr(x: u64) -> u64;
    fn e_brk(x: u64) -> u64;
}

#[test]
fn attach_and_detach_while_threads_run_the_code() {
    common::churn_under_callers(e_hot, |x| x + 1, 3, 100);
}

#[test]
fn refused_instructions_and_foreign_breakpoints() {
    let refused: [(unsafe extern "C" fn(u64) -> u64, &str); 3] =
        [(e_ldxr, "ldxr"), (e_svc, "svc"), (e_msr, "msr")];
    for (f, name) in refused {
        match probe_at(fn_addr(f)).attach() {
            Err(AttachError::Unsupported { .. }) => {}
            other => panic!("{name}: expected Unsupported, got {other:?}"),
        }
    }
    match probe_at(fn_addr(e_brk)).attach() {
        Err(AttachError::ForeignBreakpoint { .. }) => {}
        other => panic!("brk: expected ForeignBreakpoint, got {other:?}"),
    }
    // Inside an instruction: not 4-byte aligned.
    assert!(probe_at(fn_addr(e_hot) + 2).attach().is_err());
}

#[test]
fn entry_handlers_read_and_write_registers() {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let probe = probe_at(fn_addr(e_regs))
        .on_entry(|cx| {
            SEEN.store(cx.arg(0).unwrap() << 32 | cx.reg(Reg::X(1)), SeqCst);
            assert_eq!(cx.reg(Reg::Pc), cx.probe_addr() as u64);
            assert_ne!(cx.reg(Reg::Sp), 0);
            if cx.arg(0) == Some(100) {
                cx.set_reg(Reg::X(1), 1000);
            }
        })
        .attach()
        .unwrap();
    let f: unsafe extern "C" fn(u64, u64) -> u64 =
        // SAFETY: e_regs takes two integers.
        unsafe { core::mem::transmute(e_regs as *const ()) };
    // SAFETY: an asm function of this file.
    assert_eq!(unsafe { f(5, 6) }, 11);
    assert_eq!(SEEN.load(SeqCst), 5 << 32 | 6);
    // SAFETY: as above.
    assert_eq!(unsafe { f(100, 1) }, 1100);
    assert_eq!(probe.hits(), 2);
}

#[test]
#[cfg(feature = "bench-variants")]
fn slots_that_end_in_a_second_trap() {
    uprobe_core::bench_only::force_trap_back_slots(true);
    let probe = probe_at(fn_addr(e_trapback)).attach().unwrap();
    uprobe_core::bench_only::force_trap_back_slots(false);
    for x in [0u64, 1, 0xff, 12_345] {
        assert_eq!(call(e_trapback, x), x ^ 0xff);
    }
    assert_eq!(probe.hits(), 4);
}

fn tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

#[test]
fn probing_malloc_free_and_pthread_mutex_lock() {
    static SIZES: AtomicU64 = AtomicU64::new(0);
    let me = tid();
    let malloc = Uprobe::in_object("libc.so.6", "malloc")
        .unwrap()
        .only_thread(me)
        .on_entry(|cx| {
            SIZES.fetch_add(cx.arg(0).unwrap(), SeqCst);
        })
        .attach()
        .unwrap();
    let others: Vec<_> = ["free", "pthread_mutex_lock"]
        .into_iter()
        .map(|name| {
            Uprobe::in_object("libc.so.6", name)
                .unwrap()
                .only_thread(me)
                .attach()
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        })
        .collect();
    let v: Vec<u8> = std::hint::black_box(Vec::with_capacity(12_345));
    drop(v);
    let mut mutex = libc::PTHREAD_MUTEX_INITIALIZER;
    for _ in 0..20 {
        let p = probe_at(fn_addr(e_fork)).attach().unwrap();
        // SAFETY: a statically initialised mutex, this thread only.
        unsafe {
            assert_eq!(libc::pthread_mutex_lock(&raw mut mutex), 0);
            assert_eq!(libc::pthread_mutex_unlock(&raw mut mutex), 0);
        }
        p.detach().unwrap();
    }
    assert!(malloc.hits() >= 1 && SIZES.load(SeqCst) >= 12_345);
    assert!(others.iter().all(|p| p.hits() >= 20));
    std::thread::spawn(|| drop(vec![1u8; 4096])).join().unwrap();
}

#[test]
fn a_forked_child_runs_probed_code() {
    let probe = probe_at(fn_addr(e_fork)).attach().unwrap();
    // SAFETY: the child only calls an asm function and _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = call(e_fork, 40) == 42;
        // SAFETY: leaving the child at once.
        unsafe { libc::_exit(i32::from(!ok)) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    assert_eq!(call(e_fork, 1), 3);
    assert_eq!(probe.hits(), 1);
}
