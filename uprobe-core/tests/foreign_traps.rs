//! Traps that are not the engine's (an `int3` of the program's own,
//! `raise(SIGTRAP)`) reach the handler installed before the engine's. Its
//! own binary: it installs a process-wide SIGTRAP handler.
#![cfg(target_arch = "x86_64")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};

core::arch::global_asm!(
    ".text",
    ".globl f_nop",
    "f_nop:",
    "nop",
    "lea rax, [rdi + 1]",
    "ret",
    ".globl f_int3",
    "f_int3:",
    "int3",
    "mov rax, rdi",
    "ret",
);

unsafe extern "C" {
    fn f_nop(x: u64) -> u64;
    fn f_int3(x: u64) -> u64;
}

static FOREIGN: AtomicUsize = AtomicUsize::new(0);

extern "C" fn foreign_handler(_: libc::c_int) {
    FOREIGN.fetch_add(1, SeqCst);
}

#[test]
fn foreign_traps_reach_the_previous_handler() {
    // The program's own SIGTRAP handler, installed before any probe.
    // SAFETY: a handler that only touches an atomic.
    unsafe {
        libc::signal(
            libc::SIGTRAP,
            foreign_handler as *const () as libc::sighandler_t,
        )
    };
    let probe = probe_at(fn_addr(f_nop)).attach().unwrap();
    // An int3 that is not ours: the old handler runs, execution continues
    // after it.
    assert_eq!(call(f_int3, 5), 5);
    // SAFETY: raising a signal with a handler installed.
    unsafe { libc::raise(libc::SIGTRAP) };
    assert_eq!(FOREIGN.load(SeqCst), 2);
    assert_eq!(call(f_nop, 1), 2);
    assert_eq!(probe.hits(), 1, "our own trap is not passed on");
    assert_eq!(FOREIGN.load(SeqCst), 2);
}
