//! aarch64-specific engine behaviour: refused instructions, foreign
//! breakpoints (any `BRK` immediate), unaligned addresses, entry handlers
//! reading and writing the A64 registers, and a probe hit from inside a
//! handler. (The behaviours shared with x86-64 are in the portable test
//! files: `live`, `returns`, `trap_back`, `faults`.)
#![cfg(target_arch = "aarch64")]

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};
use uprobe_core::{AttachError, Reg};

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
    fn e_regs(x: u64) -> u64;
    fn g_inner(x: u64) -> u64;
    fn g_outer(x: u64) -> u64;
    fn e_ldxr(x: u64) -> u64;
    fn e_svc(x: u64) -> u64;
    fn e_msr(x: u64) -> u64;
    fn e_brk(x: u64) -> u64;
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
fn a_probe_hit_from_a_handler_is_missed_and_still_runs() {
    let inner = probe_at(fn_addr(g_inner))
        .on_entry(|_| {})
        .attach()
        .unwrap();
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
    inner.detach().unwrap();
    // A counting probe (no handler) runs nothing there: it counts both.
    let counting = probe_at(fn_addr(g_inner)).attach().unwrap();
    assert_eq!(call(g_outer, 5), 12);
    assert_eq!((counting.hits(), counting.missed()), (2, 1));
}
