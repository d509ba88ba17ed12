//! x86-64 registers as handlers see them: [`Reg`], and reading and
//! writing them in a frame.

/// A general-purpose register, the instruction pointer or the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the register names are their documentation
pub enum Reg {
    Rax,
    Rbx,
    Rcx,
    Rdx,
    Rsi,
    Rdi,
    Rbp,
    Rsp,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
    Rip,
    Rflags,
}

impl Reg {
    fn greg(self) -> usize {
        (match self {
            Self::Rax => libc::REG_RAX,
            Self::Rbx => libc::REG_RBX,
            Self::Rcx => libc::REG_RCX,
            Self::Rdx => libc::REG_RDX,
            Self::Rsi => libc::REG_RSI,
            Self::Rdi => libc::REG_RDI,
            Self::Rbp => libc::REG_RBP,
            Self::Rsp => libc::REG_RSP,
            Self::R8 => libc::REG_R8,
            Self::R9 => libc::REG_R9,
            Self::R10 => libc::REG_R10,
            Self::R11 => libc::REG_R11,
            Self::R12 => libc::REG_R12,
            Self::R13 => libc::REG_R13,
            Self::R14 => libc::REG_R14,
            Self::R15 => libc::REG_R15,
            Self::Rip => libc::REG_RIP,
            Self::Rflags => libc::REG_EFL,
        }) as usize
    }
}

/// The instruction pointer.
pub(crate) const PC: Reg = Reg::Rip;

/// The System V integer argument registers, in order.
pub(crate) const ARGS: [Reg; 6] = [Reg::Rdi, Reg::Rsi, Reg::Rdx, Reg::Rcx, Reg::R8, Reg::R9];

/// A register of a frame. Async-signal-safe.
pub(crate) fn reg(frame: &super::Frame, reg: Reg) -> u64 {
    frame[reg.greg()] as u64
}

/// Sets a register of a frame. Async-signal-safe.
pub(crate) fn set_reg(frame: &mut super::Frame, reg: Reg, value: u64) {
    frame[reg.greg()] = value as i64;
}

/// Where the function just entered keeps its return address: the stack
/// pointer (the slot's address, which orders frames) and the slot.
pub(crate) fn return_address_at(frame: &mut super::Frame) -> (usize, *mut usize) {
    let sp = frame[libc::REG_RSP as usize] as usize;
    (sp, sp as *mut usize)
}

/// All 128 bits of `xmm0`.
pub(crate) fn float_return_bits(vector: &super::SavedVector) -> u128 {
    vector[0]
}

/// Replaces the floating-point return value (`xmm0`'s low 64 bits).
pub(crate) fn set_float_return(vector: &mut super::SavedVector, value: f64) {
    vector[0] = (vector[0] & !u128::from(u64::MAX)) | u128::from(value.to_bits());
}
