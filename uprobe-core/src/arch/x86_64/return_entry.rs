//! The x86-64 return trampoline's code: plain code, no trap. A stub's
//! `call` enters it at a probed function's return (through
//! `super::timing`'s return routine, which handles a timing probe's
//! return itself and jumps here for every other); it saves the
//! caller-saved registers (`super::trampoline::SavedRegs`) and
//! `xmm0`-`xmm15`, hands them to the engine (`uprobe_core_return_hit`, bound with `define_callee!`),
//! restores them (the flags without `popfq`, as the jump entry does) and
//! `ret`s through the slot the stub's `call` pushed, back to the stub,
//! whose `jmp` goes on to the original return address.

use super::trampoline::{restore_xmm, save_xmm};

// The common trampoline. Entered by a stub's `call`, so its frame
// description is the ordinary one of a called function (CFA = rsp + 8 on
// entry); `rbp` then anchors the frame while the stack is realigned.
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_return_trampoline,\"ax\",@progbits",
    ".p2align 4",
    ".globl uprobe_core_return_trampoline",
    ".hidden uprobe_core_return_trampoline",
    "uprobe_core_return_trampoline:",
    ".cfi_startproc",
    "push rbp",
    ".cfi_adjust_cfa_offset 8",
    ".cfi_rel_offset rbp, 0",
    "mov rbp, rsp",
    ".cfi_def_cfa_register rbp",
    "pushfq",
    "push rax",
    "push rcx",
    "push rdx",
    "push rsi",
    "push rdi",
    "push r8",
    "push r9",
    "push r10",
    "push r11",
    "mov rdi, rsp",
    "and rsp, -16",
    "sub rsp, 256",
    save_xmm!(),
    "mov rsi, rsp",
    "call uprobe_core_return_hit",
    restore_xmm!(),
    "lea rsp, [rbp - 80]",
    "pop r11",
    "pop r10",
    "pop r9",
    "pop r8",
    "pop rdi",
    "pop rsi",
    "pop rdx",
    // The status flags back without `popfq` (microcoded): `SF ZF AF PF
    // CF` through `sahf`, `OF` through an `add` that overflows exactly
    // when it was set. The others (DF, TF, AC, IF) are as they were: the
    // code in between never changes them, and no return handler can.
    "mov rax, [rsp + 16]",
    "mov ecx, eax",
    "shr ecx, 11",
    "and ecx, 1",
    "mov ah, al",
    "mov al, cl",
    "add al, 0x7f",
    "sahf",
    "pop rcx",
    "pop rax",
    "lea rsp, [rsp + 8]",
    "pop rbp",
    ".cfi_def_cfa rsp, 8",
    "ret",
    ".cfi_endproc",
    ".popsection",
);

unsafe extern "C" {
    /// The common trampoline above (not callable from Rust: it expects a
    /// stub's `call`).
    fn uprobe_core_return_trampoline();
}

/// What every stub calls: the timed return (`super::timing`), which
/// comes here (`uprobe_core_return_trampoline`) for whatever it does not
/// handle itself.
pub(crate) fn routine() -> usize {
    let _ = uprobe_core_return_trampoline;
    super::timing::return_routine()
}
