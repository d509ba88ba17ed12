//! The aarch64 return trampoline: plain code, no trap (the stubs and their
//! bookkeeping are `crate::return_stubs`).
//!
//! The region starts with a pad (`ldr x16, 8; br x16; .quad trampoline`:
//! the trampoline may be beyond a `bl`'s reach), then 8-byte stubs of
//! `bl pad; brk #5`. A hijacked function returns (`ret`) into its stub,
//! whose `bl` leaves the stub's address + 4 in x30; the trampoline saves
//! the registers, calls `on_return`, which replaces the saved x30 with the
//! original return address, restores everything and returns with `ret`
//! (not `br`, so BTI's landing-pad rules hold as for the real return).
//! x16 is clobbered on the way, as a linker veneer may do at any call or
//! return boundary (AAPCS64's IP0).

/// The registers the trampoline saved, from the stack pointer up.
#[repr(C)]
pub(crate) struct SavedRegs {
    pub(crate) x: [u64; 19],
    pub(crate) x29: u64,
    /// The saved x30: on entry the stub's address + 4, on exit the
    /// original return address.
    pub(crate) ret: u64,
    pub(crate) nzcv: u64,
}

/// The saved caller-saved SIMD registers: `q0`-`q7` and `q16`-`q31`.
#[repr(C)]
pub(crate) struct SavedSimd {
    pub(crate) low: [u128; 8],
    pub(crate) high: [u128; 16],
}

/// What `on_return` gets besides the integer registers.
pub(crate) type SavedVector = SavedSimd;

/// Bytes the trampoline's frame takes: 176 of integer registers, 384 of
/// SIMD registers.
const FRAME: usize = 560;

impl SavedRegs {
    /// The thread's stack pointer once it is back in its caller.
    pub(crate) fn caller_sp(&self) -> usize {
        core::ptr::from_ref(self) as usize + FRAME
    }

    /// The stack pointer the function had at its entry, to match the
    /// instances recorded then (the same: the return address was in x30).
    pub(crate) fn entry_sp(&self) -> usize {
        self.caller_sp()
    }
}

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
    "bl {on_return}",
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
    on_return = sym trampoline_entry,
);

unsafe extern "C" {
    /// The common trampoline above (not callable from Rust: it expects a
    /// stub's `bl`).
    fn uprobe_core_return_trampoline();
}

/// What the trampoline calls: hands the saved registers to the engine,
/// which writes the original return address into `regs.ret`.
extern "C" fn trampoline_entry(regs: &mut SavedRegs, simd: &mut SavedSimd) {
    crate::returns::on_return(regs, simd);
}

/// Bytes per stub.
pub(crate) const STUB_SIZE: usize = 8;
/// Where the first stub starts (after the pad).
pub(crate) const FIRST_STUB: usize = 16;
/// DWARF: code alignment, the return address column (x30), the stack
/// pointer's register number, and the CIE's initial rule (CFA = sp).
pub(crate) const CODE_ALIGN: u8 = 4;
pub(crate) const RA_COLUMN: u8 = 30;
pub(crate) const SP_COLUMN: u8 = 31;
pub(crate) const CIE_INSTRUCTIONS: &[u8] = &[0x0c, 31, 0];

/// Writes the stub region: the pad, then `stubs` stubs.
pub(crate) fn write_region(bytes: &mut [u8], _base: usize, stubs: usize) {
    const LDR_X16_PC_8: u32 = 0x5800_0050;
    const BR_X16: u32 = 0xd61f_0200;
    let brk = u32::from_le_bytes(super::BREAKPOINT);
    bytes[0..4].copy_from_slice(&LDR_X16_PC_8.to_le_bytes());
    bytes[4..8].copy_from_slice(&BR_X16.to_le_bytes());
    let trampoline = uprobe_core_return_trampoline as *const () as u64;
    bytes[8..16].copy_from_slice(&trampoline.to_le_bytes());
    for k in 0..stubs {
        let at = FIRST_STUB + STUB_SIZE * k;
        // bl pad: a negative word offset back to the region's start.
        let words = -((at / 4) as i32);
        let bl = 0x9400_0000 | (words as u32 & 0x03ff_ffff);
        bytes[at..at + 4].copy_from_slice(&bl.to_le_bytes());
        bytes[at + 4..at + 8].copy_from_slice(&brk.to_le_bytes());
    }
}

/// Whether the calling thread runs with a guarded control stack (arm64
/// GCS): a hijacked return would then fault.
pub(crate) fn shadow_stack_enabled() -> bool {
    const PR_GET_SHADOW_STACK_STATUS: libc::c_int = 74;
    const PR_SHADOW_STACK_ENABLE: u64 = 1;
    let mut status: u64 = 0;
    // SAFETY: the prctl writes one u64; older kernels fail with EINVAL.
    let rc = unsafe { libc::prctl(PR_GET_SHADOW_STACK_STATUS, &raw mut status, 0, 0, 0) };
    rc == 0 && status & PR_SHADOW_STACK_ENABLE != 0
}
