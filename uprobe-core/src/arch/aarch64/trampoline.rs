//! The aarch64 return trampoline's layout: the registers it saves and the
//! stubs that reach it, with their unwind rules (the stubs' region and
//! bookkeeping are `crate::code::return_stubs`, the common trampoline's
//! code `super::return_entry`).
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
    /// pending returns recorded then (the same: the return address was
    /// in x30).
    pub(crate) fn entry_sp(&self) -> usize {
        self.caller_sp()
    }

    /// The integer return value (`x0`).
    pub(crate) fn return_value(&self) -> u64 {
        self.x[0]
    }

    /// The second integer return register (`x1`).
    pub(crate) fn return_value2(&self) -> u64 {
        self.x[1]
    }

    /// Replaces the integer return value.
    pub(crate) fn set_return_value(&mut self, value: u64) {
        self.x[0] = value;
    }
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

/// Whether the stub region must lie within reach of the targets' table:
/// no, a stub branches to the pad only.
pub(crate) const STUBS_NEAR_TARGETS: bool = false;

/// Where a thread goes on from the return trampoline: to `original`, the
/// return address the trampoline returns through. Async-signal-safe.
pub(crate) fn return_to(regs: &mut SavedRegs, original: usize) {
    regs.ret = original as u64;
}

/// Writes the stub region: the pad (to the common trampoline at
/// `trampoline`), then `stubs` stubs (`targets`, the table of original
/// return addresses, is not needed).
pub(crate) fn write_region(
    bytes: &mut [u8],
    _base: usize,
    stubs: usize,
    trampoline: usize,
    _targets: usize,
) {
    const LDR_X16_PC_8: u32 = 0x5800_0050;
    const BR_X16: u32 = 0xd61f_0200;
    let brk = u32::from_le_bytes(super::BREAKPOINT);
    bytes[0..4].copy_from_slice(&LDR_X16_PC_8.to_le_bytes());
    bytes[4..8].copy_from_slice(&BR_X16.to_le_bytes());
    bytes[8..16].copy_from_slice(&(trampoline as u64).to_le_bytes());
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
