//! aarch64 registers as handlers see them: [`Reg`], and reading and
//! writing them in a frame.

/// A general-purpose register (`X(0)` to `X(30)`; `X(31)` reads as zero
/// and ignores writes, as `xzr`), the stack pointer, the program counter
/// or PSTATE (NZCV flags, BTYPE, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reg {
    /// `x0` to `x30` (`X(29)` is the frame pointer, `X(30)` the link
    /// register).
    X(u8),
    /// `sp`.
    Sp,
    /// `pc`.
    Pc,
    /// PSTATE as saved in the signal frame.
    Pstate,
}

impl Reg {
    /// The frame pointer, `x29`.
    pub const FP: Self = Self::X(29);
    /// The link register, `x30`.
    pub const LR: Self = Self::X(30);
}

/// The program counter.
pub(crate) const PC: Reg = Reg::Pc;

/// The AAPCS64 integer argument registers: `x0` to `x7`.
pub(crate) const ARGS: [Reg; 8] = [
    Reg::X(0),
    Reg::X(1),
    Reg::X(2),
    Reg::X(3),
    Reg::X(4),
    Reg::X(5),
    Reg::X(6),
    Reg::X(7),
];

/// A register of a frame (`X(31)` reads as zero). Async-signal-safe.
pub(crate) fn reg(frame: &super::Frame, reg: Reg) -> u64 {
    let m = &frame.uc_mcontext;
    match reg {
        Reg::X(n) if n < 31 => m.regs[n as usize],
        Reg::X(_) => 0,
        Reg::Sp => m.sp,
        Reg::Pc => m.pc,
        Reg::Pstate => m.pstate,
    }
}

/// Sets a register of a frame (`X(31)` ignores writes).
/// Async-signal-safe.
pub(crate) fn set_reg(frame: &mut super::Frame, reg: Reg, value: u64) {
    let m = &mut frame.uc_mcontext;
    match reg {
        Reg::X(n) if n < 31 => m.regs[n as usize] = value,
        Reg::X(_) => {}
        Reg::Sp => m.sp = value,
        Reg::Pc => m.pc = value,
        Reg::Pstate => m.pstate = value,
    }
}

/// Where the function just entered keeps its return address: the stack
/// pointer at entry (which orders frames) and the link register in the
/// signal frame.
pub(crate) fn return_address_at(uc: &mut super::Frame) -> (usize, *mut usize) {
    let sp = uc.uc_mcontext.sp as usize;
    (sp, (&raw mut uc.uc_mcontext.regs[30]).cast())
}

/// All 128 bits of `v0`.
pub(crate) fn float_return_bits(vector: &super::SavedVector) -> u128 {
    vector.low[0]
}

/// Replaces the floating-point return value (`d0`; the rest of `v0` is
/// zeroed, as a scalar write does).
pub(crate) fn set_float_return(vector: &mut super::SavedVector, value: f64) {
    vector.low[0] = u128::from(value.to_bits());
}

/// Signal frame records holding the SIMD registers: `FPSIMD_MAGIC` (the
/// 128-bit V registers, always present) and `SVE_MAGIC` (the Z registers,
/// with data when the thread's SVE state is live, which qemu-user always
/// makes it; `sigreturn` then restores the Z registers from it).
const FPSIMD_MAGIC: u32 = 0x4650_8001;
const SVE_MAGIC: u32 = 0x5356_4501;
/// Where `__reserved` starts in the kernel's `struct sigcontext`
/// (`fault_address`, `regs[31]`, `sp`, `pc`, `pstate`, then 16-aligned).
const RESERVED_OFFSET: usize = 288;
const RESERVED_SIZE: usize = 4096;

/// Sets SIMD register `n` to `value` in the signal frame, as a load into
/// `Vn` does (the rest of `Zn`, if SVE state is in the frame, becomes
/// zero). Async-signal-safe: plain loads and stores, index loops.
pub(crate) fn set_vreg(uc: &mut libc::ucontext_t, n: u8, value: u128) {
    if n >= 32 {
        return;
    }
    let reserved = (&raw mut uc.uc_mcontext)
        .cast::<u8>()
        .wrapping_add(RESERVED_OFFSET);
    let mut at = 0;
    while at + 16 <= RESERVED_SIZE {
        // SAFETY: records lie inside `__reserved`, each starting with
        // (magic, size) u32s; the walk stops at its end or a zero record.
        let (magic, size) = unsafe {
            (
                reserved.add(at).cast::<u32>().read(),
                reserved.add(at + 4).cast::<u32>().read() as usize,
            )
        };
        if magic == 0 || size == 0 || at + size > RESERVED_SIZE {
            return;
        }
        if magic == FPSIMD_MAGIC {
            // fpsimd_context: head (8), fpsr (4), fpcr (4), vregs[32].
            // SAFETY: inside the record, 16-aligned (records are).
            unsafe {
                reserved
                    .add(at + 16 + 16 * n as usize)
                    .cast::<u128>()
                    .write(value)
            };
        } else if magic == SVE_MAGIC && size > 16 {
            // sve_context: head (8), vl (2), flags (2), reserved (4); then
            // Z0..Z31 of vl bytes each.
            // SAFETY: inside the record.
            let vl = usize::from(unsafe { reserved.add(at + 8).cast::<u16>().read() });
            let z = at + 16 + vl * n as usize;
            if vl >= 16 && z + vl <= at + size {
                // SAFETY: Zn lies inside the record (checked above).
                unsafe {
                    reserved.add(z).cast::<u128>().write_unaligned(value);
                    for i in 16..vl {
                        reserved.add(z + i).write(0);
                    }
                }
            }
        }
        at += size;
    }
}
