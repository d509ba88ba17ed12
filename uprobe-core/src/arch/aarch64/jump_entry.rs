//! The common routine every trampoline calls (see [`super::jump`] for a
//! trampoline's layout). It builds a `ucontext_t` on the stack, so that
//! handlers get the same [`Frame`](super::Frame) as on the trap path:
//! x0-x30, sp, the NZCV flags, and an FPSIMD record with all of
//! `q0`-`q31`, FPSR and FPCR. It restores the integer and SIMD registers,
//! NZCV and FPSR from it (not FPCR: the engine and handlers must not
//! change the rounding mode). SVE's `z` registers beyond their low 128
//! bits are not saved, and any SIMD write zeroes them: on a CPU with SVE
//! vectors longer than 128 bits, or with SME (a thread in streaming mode
//! cannot run the saves), sites stay on their breakpoints
//! ([`NotOptimized::VectorState`], decided with the vector length of the
//! attaching thread; a thread that raises its own with `PR_SVE_SET_VL`
//! later is not covered). When a handler moved the PC or the
//! stack pointer, the routine resumes the thread with `rt_sigreturn` on
//! that frame, which restores every register exactly (two system calls
//! on that path only).

use super::{HWCAP_DIT, HWCAP_SSBS, HWCAP2_MTE, hwcaps};
use crate::arch::CELL_AT;

/// Offsets in a trampoline past the common header (`crate::arch::CELL_AT`):
/// where the routine returns to, and the relocated copy.
pub(crate) const RESUME_AT: usize = 32;
pub(crate) const COPY_AT: usize = 36;

/// Where a thread that trapped at the site continues after the consumers
/// ran (past the call into the engine: the re-signing after `paciasp`,
/// then the copy).
pub(crate) fn copy_start(base: usize) -> usize {
    base + COPY_AT
}

// `ucontext_t` as the kernel lays it out for a signal (and reads it back
// in `rt_sigreturn`), which the common routine below builds.
const UC_MCONTEXT: usize = 176;
const MC_REGS: usize = 8;
const MC_SP: usize = 256;
const MC_PC: usize = 264;
const MC_PSTATE: usize = 272;
const _: () = {
    assert!(core::mem::offset_of!(libc::ucontext_t, uc_mcontext) == UC_MCONTEXT);
    assert!(core::mem::offset_of!(libc::mcontext_t, regs) == MC_REGS);
    assert!(core::mem::offset_of!(libc::mcontext_t, sp) == MC_SP);
    assert!(core::mem::offset_of!(libc::mcontext_t, pc) == MC_PC);
    assert!(core::mem::offset_of!(libc::mcontext_t, pstate) == MC_PSTATE);
    assert!(size_of::<libc::ucontext_t>() == 4560);
};

/// `rt_sigreturn`'s frame: a `siginfo_t` (unused), then the context.
#[repr(C, align(16))]
struct SigFrame {
    _info: [u8; 128],
    uc: libc::ucontext_t,
}

// The common routine. Entered by a trampoline's `blr x16` with the
// thread's x16 and x30 pushed; x30 is the trampoline's resume address.
// Stack, from the new sp: [0, 16) scratch (x0/x1 while saving, then the
// resume address), [16, 4704) a `SigFrame`; above it the trampoline's
// pushed pair (sp + 4704), then the probed code's stack.
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_jump_entry,\"ax\",@progbits",
    ".p2align 4",
    ".globl uprobe_core_jump_entry",
    ".hidden uprobe_core_jump_entry",
    "uprobe_core_jump_entry:",
    "hint #34", // bti c: entered by `blr x16`
    "sub sp, sp, #4096",
    "sub sp, sp, #608",
    "stp x0, x1, [sp]",
    "add x0, sp, #(16 + 128)", // the ucontext
    "stp x2, x3, [x0, #(176 + 8 + 16)]",
    "stp x4, x5, [x0, #(176 + 8 + 32)]",
    "stp x6, x7, [x0, #(176 + 8 + 48)]",
    "stp x8, x9, [x0, #(176 + 8 + 64)]",
    "stp x10, x11, [x0, #(176 + 8 + 80)]",
    "stp x12, x13, [x0, #(176 + 8 + 96)]",
    "stp x14, x15, [x0, #(176 + 8 + 112)]",
    "stp x17, x18, [x0, #(176 + 8 + 136)]",
    "stp x19, x20, [x0, #(176 + 8 + 152)]",
    "stp x21, x22, [x0, #(176 + 8 + 168)]",
    "stp x23, x24, [x0, #(176 + 8 + 184)]",
    "stp x25, x26, [x0, #(176 + 8 + 200)]",
    "stp x27, x28, [x0, #(176 + 8 + 216)]",
    "str x29, [x0, #(176 + 8 + 232)]",
    "ldp x2, x3, [sp]",
    "stp x2, x3, [x0, #(176 + 8)]",
    "ldr x2, [sp, #4704]", // the thread's x16 and x30, pushed by the trampoline
    "ldr x3, [sp, #4712]",
    "str x2, [x0, #(176 + 8 + 128)]",
    "str x3, [x0, #(176 + 8 + 240)]",
    "add x2, sp, #4096",
    "add x2, x2, #(608 + 16)", // the stack pointer at the probe
    "str x2, [x0, #(176 + 256)]",
    "mrs x2, nzcv",
    "str x2, [x0, #(176 + 272)]",
    "str x30, [sp]",
    // The FPSIMD record: magic 0x46508001, size 528; then a null record.
    "add x1, x0, #(176 + 288)",
    "movz x2, #0x8001",
    "movk x2, #0x4650, lsl #16",
    "movk x2, #528, lsl #32",
    "str x2, [x1]",
    "mrs x2, fpsr",
    "mrs x3, fpcr",
    "stp w2, w3, [x1, #8]",
    "stp q0, q1, [x1, #16]",
    "stp q2, q3, [x1, #48]",
    "stp q4, q5, [x1, #80]",
    "stp q6, q7, [x1, #112]",
    "stp q8, q9, [x1, #144]",
    "stp q10, q11, [x1, #176]",
    "stp q12, q13, [x1, #208]",
    "stp q14, q15, [x1, #240]",
    "stp q16, q17, [x1, #272]",
    "stp q18, q19, [x1, #304]",
    "stp q20, q21, [x1, #336]",
    "stp q22, q23, [x1, #368]",
    "stp q24, q25, [x1, #400]",
    "stp q26, q27, [x1, #432]",
    "stp q28, q29, [x1, #464]",
    "stp q30, q31, [x1, #496]",
    "str xzr, [x1, #528]",
    "mov x1, x30",
    "bl uprobe_core_jump_hit",
    "add x0, sp, #(16 + 128)",
    "add x1, x0, #(176 + 288)",
    "ldr w2, [x1, #8]",
    "msr fpsr, x2",
    "ldp q0, q1, [x1, #16]",
    "ldp q2, q3, [x1, #48]",
    "ldp q4, q5, [x1, #80]",
    "ldp q6, q7, [x1, #112]",
    "ldp q8, q9, [x1, #144]",
    "ldp q10, q11, [x1, #176]",
    "ldp q12, q13, [x1, #208]",
    "ldp q14, q15, [x1, #240]",
    "ldp q16, q17, [x1, #272]",
    "ldp q18, q19, [x1, #304]",
    "ldp q20, q21, [x1, #336]",
    "ldp q22, q23, [x1, #368]",
    "ldp q24, q25, [x1, #400]",
    "ldp q26, q27, [x1, #432]",
    "ldp q28, q29, [x1, #464]",
    "ldp q30, q31, [x1, #496]",
    "ldr x2, [x0, #(176 + 272)]",
    "msr nzcv, x2",
    // x16 and x30 go back through the trampoline's pushed pair.
    "ldr x2, [x0, #(176 + 8 + 128)]",
    "ldr x3, [x0, #(176 + 8 + 240)]",
    "str x2, [sp, #4704]",
    "str x3, [sp, #4712]",
    "ldp x2, x3, [x0, #(176 + 8 + 16)]",
    "ldp x4, x5, [x0, #(176 + 8 + 32)]",
    "ldp x6, x7, [x0, #(176 + 8 + 48)]",
    "ldp x8, x9, [x0, #(176 + 8 + 64)]",
    "ldp x10, x11, [x0, #(176 + 8 + 80)]",
    "ldp x12, x13, [x0, #(176 + 8 + 96)]",
    "ldp x14, x15, [x0, #(176 + 8 + 112)]",
    "ldp x17, x18, [x0, #(176 + 8 + 136)]",
    "ldp x19, x20, [x0, #(176 + 8 + 152)]",
    "ldp x21, x22, [x0, #(176 + 8 + 168)]",
    "ldp x23, x24, [x0, #(176 + 8 + 184)]",
    "ldp x25, x26, [x0, #(176 + 8 + 200)]",
    "ldp x27, x28, [x0, #(176 + 8 + 216)]",
    "ldr x29, [x0, #(176 + 8 + 232)]",
    "ldr x16, [sp]",
    "ldp x0, x1, [x0, #(176 + 8)]",
    "add sp, sp, #4096",
    "add sp, sp, #608",
    "ret x16",
    ".popsection",
);

const _: () = assert!(size_of::<SigFrame>() + 16 == 4096 + 608);

unsafe extern "C" {
    /// The common routine above (not callable from Rust: it expects a
    /// trampoline's `blr`).
    fn uprobe_core_jump_entry();
}

/// The common routine's address (a trampoline's header names it).
pub(crate) fn routine() -> usize {
    uprobe_core_jump_entry as *const () as usize
}

/// What the common routine hands its callee: the context it built.
pub(crate) type JumpFrame = libc::ucontext_t;

/// What the callee returns to the common routine: nothing (a thread a
/// handler moved is resumed from here).
pub(crate) type HitReturn = ();

/// The body of the common routine's callee, given the context it built
/// and the trampoline's resume address: runs the engine's hit (`on_hit`,
/// given the trampoline's cell and the frame: whether a handler moved the
/// PC; the PC reads as the probed address), and resumes the thread
/// exactly where a handler moved it, if one did (then it does not
/// return). Async-signal-safe if `on_hit` is.
#[inline(always)]
pub(crate) fn hit(
    uc: &mut JumpFrame,
    resume: usize,
    on_hit: impl FnOnce(usize, &mut super::Frame) -> bool,
) -> HitReturn {
    let sp = uc.uc_mcontext.sp;
    // SAFETY: the trampoline's first word is its cell pointer, written
    // before any jump to it and never changed.
    let cell = unsafe { ((resume - RESUME_AT + CELL_AT) as *const usize).read() };
    let moved = on_hit(cell, uc);
    if moved || uc.uc_mcontext.sp != sp {
        if !moved {
            // Only the stack pointer changed: on with the displaced
            // instruction (from the re-signing after a landing pad), as
            // on the trap path.
            uc.uc_mcontext.pc = copy_start(resume - RESUME_AT) as u64;
        }
        // SAFETY: `uc` is the `uc` of the `SigFrame` the routine built on
        // the stack, all of whose registers it filled in.
        unsafe { resume_exactly(uc) }
    }
}

/// The thread's PSTATE.DIT, SSBS and TCO, where the CPU has them (read
/// from their system registers, in their PSTATE positions).
/// Async-signal-safe.
fn el0_pstate_bits() -> u64 {
    let (hwcap, hwcap2) = hwcaps();
    let mut bits = 0;
    if hwcap & HWCAP_DIT != 0 {
        let v: u64;
        // SAFETY: DIT is readable at EL0 where the CPU has it.
        unsafe { core::arch::asm!("mrs {}, s3_3_c4_c2_5", out(reg) v, options(nomem, nostack)) };
        bits |= v;
    }
    if hwcap & HWCAP_SSBS != 0 {
        let v: u64;
        // SAFETY: SSBS is readable at EL0 where the CPU has it.
        unsafe { core::arch::asm!("mrs {}, s3_3_c4_c2_6", out(reg) v, options(nomem, nostack)) };
        bits |= v;
    }
    if hwcap2 & HWCAP2_MTE != 0 {
        let v: u64;
        // SAFETY: TCO is readable at EL0 where the CPU has MTE.
        unsafe { core::arch::asm!("mrs {}, s3_3_c4_c2_7", out(reg) v, options(nomem, nostack)) };
        bits |= v;
    }
    bits
}

/// Resumes the thread with the registers of `uc` (every one of them:
/// the PC and stack pointer a handler set included) through
/// `rt_sigreturn`, as if returning from a signal. Async-signal-safe.
///
/// # Safety
/// `uc` is the context of a [`SigFrame`], with every register filled in.
unsafe fn resume_exactly(uc: &mut libc::ucontext_t) -> ! {
    uc.uc_flags = 0;
    uc.uc_link = core::ptr::null_mut();
    // SAFETY: queries into the frame's own fields (the mask and the
    // alternate stack `rt_sigreturn` restores: the current ones).
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, core::ptr::null(), &raw mut uc.uc_sigmask);
        libc::sigaltstack(core::ptr::null(), &raw mut uc.uc_stack);
    }
    // NZCV as saved (or set by a handler), BTYPE 0 as after a plain
    // branch, and the PSTATE bits EL0 can change (DIT, SSBS, TCO) as the
    // thread has them now: the engine's code does not change them.
    uc.uc_mcontext.pstate = uc.uc_mcontext.pstate & 0xf000_0000 | el0_pstate_bits();
    let frame = (core::ptr::from_mut(uc) as usize) - 128;
    // SAFETY: the stack moves onto the frame (16-aligned, with the
    // context `rt_sigreturn` reads right after the unused siginfo); the
    // system call does not return.
    unsafe {
        core::arch::asm!(
            "mov sp, {frame}",
            "mov x8, #139", // rt_sigreturn
            "svc #0",
            frame = in(reg) frame,
            options(noreturn),
        )
    }
}
