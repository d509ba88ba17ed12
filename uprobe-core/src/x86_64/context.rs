//! x86-64 registers as handlers see them: [`Reg`], and the register
//! accessors of [`EntryContext`] and [`ReturnContext`].

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

/// The System V integer argument registers, in order.
const ARGS: [Reg; 6] = [Reg::Rdi, Reg::Rsi, Reg::Rdx, Reg::Rcx, Reg::R8, Reg::R9];

use crate::context::{EntryContext, ReturnContext};

impl EntryContext<'_> {
    /// A register's value (for `Rip`: the probed address, where the
    /// instruction starts).
    #[must_use]
    pub fn reg(&self, reg: Reg) -> u64 {
        if reg == Reg::Rip && !self.ip_changed {
            return self.addr as u64;
        }
        self.frame[reg.greg()] as u64
    }

    /// Sets a register. Setting `Rip` redirects the thread: the probed
    /// instruction is then **not** executed (as with kernel uprobes).
    /// On a probe that runs through a jump ([`Mode::Jump`](crate::Mode)),
    /// a new `Rsp` is honoured if it is above the probed one or at most
    /// 40 bytes below it (the trampoline's saved registers lie further
    /// down); for a lower one, keep the probe
    /// [`trap_only`](crate::Uprobe::trap_only).
    pub fn set_reg(&mut self, reg: Reg, value: u64) {
        if reg == Reg::Rip {
            self.ip_changed = true;
        }
        self.frame[reg.greg()] = value as i64;
    }

    /// The `n`th integer argument (0-based) of the System V calling
    /// convention, for a probe at a function's entry; `None` past the six
    /// register arguments.
    #[must_use]
    pub fn arg(&self, n: usize) -> Option<u64> {
        ARGS.get(n).map(|&r| self.reg(r))
    }
}

/// Where the function just entered keeps its return address: the stack
/// pointer (the slot's address, which orders frames) and the slot.
pub(crate) fn return_address_at(frame: &mut super::Frame) -> (usize, *mut usize) {
    let sp = frame[libc::REG_RSP as usize] as usize;
    (sp, sp as *mut usize)
}

impl ReturnContext<'_> {
    /// The integer return value (`rax`).
    #[must_use]
    pub fn return_value(&self) -> u64 {
        self.regs.rax
    }

    /// The second integer return register (`rdx`: the high half of a
    /// 128-bit value, the second word of a small struct).
    #[must_use]
    pub fn return_value2(&self) -> u64 {
        self.regs.rdx
    }

    /// Replaces the integer return value the caller sees.
    pub fn set_return_value(&mut self, value: u64) {
        self.regs.rax = value;
    }

    /// All 128 bits of `xmm0`.
    #[must_use]
    pub fn float_return_bits(&self) -> u128 {
        self.vector[0]
    }

    /// Replaces the floating-point return value (`xmm0`'s low 64 bits).
    pub fn set_float_return(&mut self, value: f64) {
        self.vector[0] = (self.vector[0] & !u128::from(u64::MAX)) | u128::from(value.to_bits());
    }
}
