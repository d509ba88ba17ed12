//! The common routine every trampoline calls (see [`super::jump`] for a
//! trampoline's layout). It saves the flags (then clears DF, as the ABI
//! wants; on the way back it restores only the status flags, with `sahf`,
//! unless a handler changed others or DF was set: `popfq` is microcoded
//! and dear), every general-purpose register (in `ucontext_t`'s `gregs`
//! layout, so handlers get the same [`Frame`](super::Frame) as on the
//! trap path) and `xmm0`-`xmm15`, calls the engine's `uprobe_core_jump_hit` (bound with
//! `define_callee!`, its body [`hit`]) with the frame,
//! restores, and returns into the trampoline, or, when a handler moved
//! the instruction pointer, `ret 128`s to the new address with the stack
//! pointer the thread had at the probe. A handler that moved the stack
//! pointer (up, or down by at most [`MAX_SP_DROP`] bytes) gets it too:
//! the new instruction pointer is stored 136 bytes below the new stack
//! pointer (below the red zone there, which nothing may count on), the
//! routine switches to that slot after restoring, and `ret 128`s from it.
//! Not saved: the upper halves of
//! `ymm`/`zmm`, the mask registers, the x87 stack and MXCSR (a full
//! `xsave` would cost several times the rest of the hit; the engine's
//! code uses none of them, and
//! handlers must not either, as for the return trampoline).
//!
//! **What a hit waits on.** Not the routine's instructions so much as
//! its chain of dependent loads: the return address, the trampoline's
//! cell, the consumer, its handler. So the routine finds the
//! trampoline's cell and the probed stack pointer itself, while its
//! `xmm` saves run, and the engine's side keeps to one call level.

use super::trampoline::{restore_xmm, save_xmm};
use crate::arch::CELL_AT;

/// Where the common routine returns to in a trampoline (past its header,
/// its counting prelude and its `call`).
pub(crate) use super::count::RESUME_AT;
/// The trampoline's `lea rsp, [rsp+128]` after its call: where a thread
/// whose stack pointer a handler moved (but not its instruction pointer)
/// resumes, past it, with the new stack pointer.
const RESUME_LEA: u64 = 8;
/// How far below the probed stack pointer a handler may move it: the
/// slot the new instruction pointer goes to (136 bytes below) must lie
/// above the saved registers the routine still restores.
pub(crate) const MAX_SP_DROP: u64 = 40;

/// What the callee returns to the common routine: how to go on (see
/// [`hit`]).
pub(crate) type HitReturn = u32;

/// What the common routine hands its callee (with its cell's address): the saved registers, then
/// the return address of the trampoline's `call` (which names the
/// trampoline, and which a handler's new RIP replaces).
#[repr(C)]
pub(crate) struct JumpFrame {
    pub(crate) regs: super::Frame,
    pub(crate) ret: u64,
}

/// Pops a `JumpFrame`'s registers from `r8` up to `rdx` (the order of
/// `gregs`); `rax` and `rcx` follow.
macro_rules! pop_to_rdx {
    () => {
        concat!(
            "pop r8\n pop r9\n pop r10\n pop r11\n pop r12\n pop r13\n pop r14\n pop r15\n",
            "pop rdi\n pop rsi\n pop rbp\n pop rbx\n pop rdx\n",
        )
    };
}

/// Pops the registers of a `JumpFrame` and restores the status flags
/// from the frame's [`FLAGS_IMAGE`] slot with `sahf` (and `OF` with an
/// `add` that overflows exactly when it was set, before the `sahf`): no
/// `popfq`, which is microcoded. Only for a frame whose other flags are
/// the ones the routine found (see `jump_hit`). Ends at the return slot.
macro_rules! restore_frame_status {
    () => {
        concat!(
            pop_to_rdx!(),
            // The image, 5 slots above rax's.
            "mov rax, [rsp + 40]\n",
            "add al, 0x7f\n",
            "sahf\n",
            "pop rax\n",
            "pop rcx\n",
            "lea rsp, [rsp + 64]\n",
        )
    };
}

/// Pops the registers of a `JumpFrame` (the RSP and RIP slots skipped,
/// `lea`s leaving the restored flags alone), up to its return slot.
macro_rules! restore_frame {
    () => {
        concat!(
            pop_to_rdx!(),
            "pop rax\n",
            "pop rcx\n",
            "lea rsp, [rsp + 16]\n",
            "popfq\n",
            "lea rsp, [rsp + 40]\n",
        )
    };
}

// The common routine. Entered by a trampoline's `call`, with the red zone
// stepped over; builds a `JumpFrame` (gregs indexes 18-22 unused),
// realigns the stack for the xmm saves and the call, and returns through
// the frame's `ret` slot: `ret` when it is the trampoline's own return
// address, `ret 128` (the red zone back) when a handler set RIP.
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_jump_entry,\"ax\",@progbits",
    ".p2align 4",
    ".globl uprobe_core_jump_entry",
    ".hidden uprobe_core_jump_entry",
    "uprobe_core_jump_entry:",
    // `lea`, not `sub`: nothing may touch the flags before they are saved.
    "lea rsp, [rsp - 40]",
    "pushfq",
    "cld",
    "sub rsp, 16",
    "push rcx",
    "push rax",
    "push rdx",
    "push rbx",
    "push rbp",
    "push rsi",
    "push rdi",
    "push r15",
    "push r14",
    "push r13",
    "push r12",
    "push r11",
    "push r10",
    "push r9",
    "push r8",
    // The frame, its cell (the trampoline's first word, found from the
    // `call`'s return address) and the probed stack pointer, loaded and
    // stored while the xmm saves run.
    "mov rdi, rsp",
    "mov rsi, [rsp + {ret}]",
    "mov rsi, [rsi - {resume} + {cell}]",
    "lea rax, [rsp + {probed_sp}]",
    "mov [rsp + {rsp_slot}], rax",
    "mov rbx, rsp",
    "and rsp, -16",
    "sub rsp, 256",
    save_xmm!(),
    "call uprobe_core_jump_hit",
    restore_xmm!(),
    "mov rsp, rbx",
    "cmp eax, 1",
    "jb 4f",
    "je 5f",
    "cmp eax, 3",
    "jb 3f",
    "je 6f",
    restore_frame!(),
    "ret 128",
    "4:",
    restore_frame_status!(),
    "ret",
    "5:",
    restore_frame_status!(),
    "ret 128",
    "6:",
    restore_frame!(),
    "ret",
    // A new stack pointer: the registers, then the flags (`mov` leaves
    // them alone), then the slot stored in the frame's RSP entry (24
    // bytes below, past RIP and EFL), which holds the new RIP.
    "3:",
    pop_to_rdx!(),
    "pop rax",
    "pop rcx",
    "lea rsp, [rsp + 16]",
    "popfq",
    "mov rsp, [rsp - 24]",
    "ret 128",
    ".popsection",
    ret = const core::mem::offset_of!(JumpFrame, ret),
    resume = const RESUME_AT,
    cell = const CELL_AT,
    probed_sp = const size_of::<JumpFrame>() + 128,
    rsp_slot = const 8 * libc::REG_RSP as usize,
);

unsafe extern "C" {
    /// The common routine above (not callable from Rust: it expects a
    /// trampoline's `call`).
    fn uprobe_core_jump_entry();
}

/// The common routine's address (a trampoline's header names it).
pub(crate) fn routine() -> usize {
    uprobe_core_jump_entry as *const () as usize
}

/// The frame's slot (an unused `gregs` entry) that holds the status
/// flags to restore as `sahf` and the `OF` trick want them: `SF ZF AF PF
/// CF` in bits 8-15 (`ah`), `OF` in bit 0 (`al`).
const FLAGS_IMAGE: usize = libc::REG_CSGSFS as usize;
/// The flags `sahf` and the `OF` trick restore.
const STATUS: i64 = 0x8d5;
/// The direction flag (cleared by the routine).
const DF: i64 = 0x400;

/// The body of the common routine's callee: runs the engine's hit
/// (`on_hit`, given the trampoline's cell and the frame's registers:
/// whether a handler moved the instruction pointer), and says how to go
/// on: 0, into the trampoline; 1, a
/// handler moved RIP (now `frame.ret`); 2, a handler moved RSP (the
/// frame's RSP entry is the slot, 136 bytes below it, that holds where
/// to go: the new RIP, or the relocated copy if RIP stayed); 3 and 4, as
/// 0 and 1 with every flag restored by `popfq` (a handler changed flags
/// other than the status flags, or the direction flag was set): 0 and 1
/// restore only the status flags, the others being what the routine
/// found. A move of RSP further down than [`MAX_SP_DROP`] is not
/// honoured. Async-signal-safe.
#[inline(always)]
pub(crate) fn hit(
    frame: &mut JumpFrame,
    cell: usize,
    on_hit: impl FnOnce(usize, &mut super::Frame) -> bool,
) -> HitReturn {
    const RSP: usize = libc::REG_RSP as usize;
    const EFL: usize = libc::REG_EFL as usize;
    let sp = frame.regs[RSP] as u64;
    let found = frame.regs[EFL];
    let moved = on_hit(cell, &mut frame.regs);
    let flags = frame.regs[EFL];
    let status_only = (flags ^ found) & !STATUS == 0 && found & DF == 0;
    let new_sp = frame.regs[RSP] as u64;
    if new_sp != sp && new_sp >= sp - MAX_SP_DROP {
        let to = if moved {
            frame.regs[libc::REG_RIP as usize] as u64
        } else {
            frame.ret + RESUME_LEA
        };
        let slot = new_sp - 136;
        // SAFETY: below the new stack pointer's red zone (no code may
        // count on it), and at or above the frame's unused entries (at
        // most MAX_SP_DROP below the probed stack pointer): not the
        // registers still to restore, nor this function's stack.
        unsafe { (slot as *mut u64).write(to) };
        frame.regs[RSP] = slot as i64;
        return 2;
    }
    if moved {
        frame.ret = frame.regs[libc::REG_RIP as usize] as u64;
    }
    if status_only {
        frame.regs[FLAGS_IMAGE] = ((flags & 0xd5) << 8) | ((flags >> 11) & 1);
        u32::from(moved)
    } else {
        3 + u32::from(moved)
    }
}
