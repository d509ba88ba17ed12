//! The x86-64 return trampoline's layout: the registers it saves, the
//! stubs that call it, their unwind rules (the stubs' region and
//! bookkeeping are `crate::code::return_stubs`, the common trampoline's
//! code `super::return_entry`), and the xmm save the jump entry shares.
//!
//! A stub is 16 bytes holding `call [rip + disp]` to the common trampoline
//! through the pointer at the region's start, then `jmp [rip + disp]`
//! through its entry of the table of original return addresses; the
//! `call` pushes the stub's address + 6 where the function's return
//! address was, and the trampoline `ret`s through that slot to the
//! `jmp`, which goes on to the caller.

/// The registers the trampoline saved, lowest address first (the order of
/// its pushes, reversed). `ret` is the slot the stub's `call` pushed, which
/// the trampoline finally `ret`s through.
#[repr(C)]
pub(crate) struct SavedRegs {
    pub(crate) r11: u64,
    pub(crate) r10: u64,
    pub(crate) r9: u64,
    pub(crate) r8: u64,
    pub(crate) rdi: u64,
    pub(crate) rsi: u64,
    pub(crate) rdx: u64,
    pub(crate) rcx: u64,
    pub(crate) rax: u64,
    pub(crate) rflags: u64,
    pub(crate) rbp: u64,
    pub(crate) ret: u64,
}

impl SavedRegs {
    /// The thread's stack pointer once it is back in its caller.
    pub(crate) fn caller_sp(&self) -> usize {
        core::ptr::from_ref(&self.ret) as usize + 8
    }

    /// The stack pointer the function had at its entry (where its return
    /// address was), to match the pending returns recorded then.
    pub(crate) fn entry_sp(&self) -> usize {
        self.caller_sp() - 8
    }

    /// The integer return value (`rax`).
    pub(crate) fn return_value(&self) -> u64 {
        self.rax
    }

    /// The second integer return register (`rdx`).
    pub(crate) fn return_value2(&self) -> u64 {
        self.rdx
    }

    /// Replaces the integer return value.
    pub(crate) fn set_return_value(&mut self, value: u64) {
        self.rax = value;
    }
}

/// The saved `xmm0`-`xmm15`.
pub(crate) type SavedXmm = [u128; 16];

/// What `on_return` gets besides the integer registers.
pub(crate) type SavedVector = SavedXmm;

/// Saves `xmm0`-`xmm15` at `[rsp]` (256 bytes, 16-aligned): one `asm`
/// template line per register, for both trampolines.
macro_rules! save_xmm {
    () => {
        concat!(
            "movaps [rsp + 0], xmm0\n",
            "movaps [rsp + 16], xmm1\n",
            "movaps [rsp + 32], xmm2\n",
            "movaps [rsp + 48], xmm3\n",
            "movaps [rsp + 64], xmm4\n",
            "movaps [rsp + 80], xmm5\n",
            "movaps [rsp + 96], xmm6\n",
            "movaps [rsp + 112], xmm7\n",
            "movaps [rsp + 128], xmm8\n",
            "movaps [rsp + 144], xmm9\n",
            "movaps [rsp + 160], xmm10\n",
            "movaps [rsp + 176], xmm11\n",
            "movaps [rsp + 192], xmm12\n",
            "movaps [rsp + 208], xmm13\n",
            "movaps [rsp + 224], xmm14\n",
            "movaps [rsp + 240], xmm15\n",
        )
    };
}

/// Restores what [`save_xmm`] saved.
macro_rules! restore_xmm {
    () => {
        concat!(
            "movaps xmm0, [rsp + 0]\n",
            "movaps xmm1, [rsp + 16]\n",
            "movaps xmm2, [rsp + 32]\n",
            "movaps xmm3, [rsp + 48]\n",
            "movaps xmm4, [rsp + 64]\n",
            "movaps xmm5, [rsp + 80]\n",
            "movaps xmm6, [rsp + 96]\n",
            "movaps xmm7, [rsp + 112]\n",
            "movaps xmm8, [rsp + 128]\n",
            "movaps xmm9, [rsp + 144]\n",
            "movaps xmm10, [rsp + 160]\n",
            "movaps xmm11, [rsp + 176]\n",
            "movaps xmm12, [rsp + 192]\n",
            "movaps xmm13, [rsp + 208]\n",
            "movaps xmm14, [rsp + 224]\n",
            "movaps xmm15, [rsp + 240]\n",
        )
    };
}

pub(crate) use {restore_xmm, save_xmm};

/// Bytes per stub.
pub(crate) const STUB_SIZE: usize = 16;
/// Where the first stub starts (the trampoline's address comes first).
pub(crate) const FIRST_STUB: usize = 16;
/// DWARF: code alignment, the return address column (RIP), the stack
/// pointer's register number, and the CIE's initial rule (CFA = rsp + 8,
/// as on entry to any function).
pub(crate) const CODE_ALIGN: u8 = 1;
pub(crate) const RA_COLUMN: u8 = 16;
pub(crate) const SP_COLUMN: u8 = 7;
pub(crate) const CIE_INSTRUCTIONS: &[u8] = &[0x0c, 7, 8];

/// Whether the stub region must lie within reach of the targets' table
/// (`rel32` of each stub's `jmp`).
pub(crate) const STUBS_NEAR_TARGETS: bool = true;

/// Writes the stub region: the common trampoline's address
/// (`super::return_entry`), then `stubs` stubs, padded with `int3`. Stub
/// `k` is `call [rip + disp]` to the trampoline, then `jmp [rip + disp]`
/// through `targets`'s entry `k` (the table of original return addresses,
/// within `rel32` reach of `base`): the trampoline `ret`s to that `jmp`,
/// which the return stack buffer predicts (the `call` pushed it), and the
/// `jmp` to the caller is predicted per call site. A trampoline that
/// wrote the original address into its return slot instead would be
/// mispredicted on every return (a quarter of a timed call's cost, as
/// `bench uretprobe-entry` showed).
///
/// # Panics
/// If `targets` is out of `rel32` reach of the region.
pub(crate) fn write_region(
    bytes: &mut [u8],
    base: usize,
    stubs: usize,
    trampoline: usize,
    targets: usize,
) {
    bytes.fill(0xcc);
    bytes[..8].copy_from_slice(&trampoline.to_le_bytes());
    let rel = |from: usize, to: usize| {
        i32::try_from(to as i64 - from as i64).expect("the targets' table within rel32 reach")
    };
    for k in 0..stubs {
        let at = FIRST_STUB + STUB_SIZE * k;
        // call [rip + disp32]: the pointer at offset 0, relative to the
        // end of this 6-byte instruction.
        bytes[at..at + 2].copy_from_slice(&[0xff, 0x15]);
        bytes[at + 2..at + 6].copy_from_slice(&rel(at + 6, 0).to_le_bytes());
        // jmp [rip + disp32]: the stub's entry of the table.
        let entry = targets + 8 * k;
        bytes[at + 6..at + 8].copy_from_slice(&[0xff, 0x25]);
        bytes[at + 8..at + 12].copy_from_slice(&rel(base + at + 12, entry).to_le_bytes());
    }
}

/// Where a thread goes on from the return trampoline: it `ret`s to the
/// stub's `jmp` (`regs.ret` as the stub's `call` left it), which goes on
/// to `original`, the stub's target. Async-signal-safe.
pub(crate) fn return_to(_regs: &mut SavedRegs, _original: usize) {}

/// Whether the calling thread runs with a shadow stack (x86 CET user
/// shadow stacks): a hijacked return would then fault. Not
/// async-signal-safe only in that it is meant for attach time.
pub(crate) fn shadow_stack_enabled() -> bool {
    const ARCH_SHSTK_STATUS: libc::c_int = 0x5005;
    const ARCH_SHSTK_SHSTK: u64 = 1;
    let mut features: u64 = 0;
    // SAFETY: ARCH_SHSTK_STATUS writes one u64 to the address given; older
    // kernels fail with EINVAL (no shadow stacks).
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_SHSTK_STATUS, &raw mut features) };
    rc == 0 && features & ARCH_SHSTK_SHSTK != 0
}
