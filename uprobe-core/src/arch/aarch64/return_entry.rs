//! The aarch64 return trampoline's code: plain code, no trap. A stub's
//! `bl` reaches it (through the region's pad) at a probed function's
//! return; it saves the registers (`super::trampoline::SavedRegs`,
//! `SavedSimd`), hands them to the engine (`uprobe_core_return_hit`, bound with `define_callee!`), which
//! replaces the saved x30 with the original return address, restores
//! everything and returns with `ret`.

core::arch::global_asm!(
    ".pushsection .text.uprobe_core_return_trampoline,\"ax\",@progbits",
    ".p2align 4",
    ".globl uprobe_core_return_trampoline",
    ".hidden uprobe_core_return_trampoline",
    "uprobe_core_return_trampoline:",
    ".cfi_startproc",
    "hint #34", // bti c: entered by `br x16`
    "sub sp, sp, #560",
    ".cfi_def_cfa_offset 560",
    "stp x0, x1, [sp, #0]",
    "stp x2, x3, [sp, #16]",
    "stp x4, x5, [sp, #32]",
    "stp x6, x7, [sp, #48]",
    "stp x8, x9, [sp, #64]",
    "stp x10, x11, [sp, #80]",
    "stp x12, x13, [sp, #96]",
    "stp x14, x15, [sp, #112]",
    "stp x16, x17, [sp, #128]",
    "str x18, [sp, #144]",
    "stp x29, x30, [sp, #152]",
    ".cfi_offset x29, -408",
    ".cfi_offset x30, -400",
    "mrs x9, nzcv",
    "str x9, [sp, #168]",
    "stp q0, q1, [sp, #176]",
    "stp q2, q3, [sp, #208]",
    "stp q4, q5, [sp, #240]",
    "stp q6, q7, [sp, #272]",
    "stp q16, q17, [sp, #304]",
    "stp q18, q19, [sp, #336]",
    "stp q20, q21, [sp, #368]",
    "stp q22, q23, [sp, #400]",
    "stp q24, q25, [sp, #432]",
    "stp q26, q27, [sp, #464]",
    "stp q28, q29, [sp, #496]",
    "stp q30, q31, [sp, #528]",
    "mov x0, sp",
    "add x1, sp, #176",
    "bl uprobe_core_return_hit",
    "ldp q0, q1, [sp, #176]",
    "ldp q2, q3, [sp, #208]",
    "ldp q4, q5, [sp, #240]",
    "ldp q6, q7, [sp, #272]",
    "ldp q16, q17, [sp, #304]",
    "ldp q18, q19, [sp, #336]",
    "ldp q20, q21, [sp, #368]",
    "ldp q22, q23, [sp, #400]",
    "ldp q24, q25, [sp, #432]",
    "ldp q26, q27, [sp, #464]",
    "ldp q28, q29, [sp, #496]",
    "ldp q30, q31, [sp, #528]",
    "ldr x9, [sp, #168]",
    "msr nzcv, x9",
    "ldp x0, x1, [sp, #0]",
    "ldp x2, x3, [sp, #16]",
    "ldp x4, x5, [sp, #32]",
    "ldp x6, x7, [sp, #48]",
    "ldp x8, x9, [sp, #64]",
    "ldp x10, x11, [sp, #80]",
    "ldp x12, x13, [sp, #96]",
    "ldp x14, x15, [sp, #112]",
    "ldp x16, x17, [sp, #128]",
    "ldr x18, [sp, #144]",
    "ldp x29, x30, [sp, #152]",
    "add sp, sp, #560",
    ".cfi_def_cfa_offset 0",
    ".cfi_restore x29",
    ".cfi_restore x30",
    "ret",
    ".cfi_endproc",
    ".popsection",
);

unsafe extern "C" {
    /// The common trampoline above (not callable from Rust: it expects a
    /// stub's `bl`).
    fn uprobe_core_return_trampoline();
}

/// The common trampoline's address, which every stub reaches.
pub(crate) fn routine() -> usize {
    uprobe_core_return_trampoline as *const () as usize
}
