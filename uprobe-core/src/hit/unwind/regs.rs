//! The registers an unwind tracks, by DWARF number, and where they come
//! from at a hit.

use crate::EntryContext;

/// Registers tracked: x86-64's 16 and its return address column (16);
/// aarch64's `x0`-`x30` and `sp` (31).
#[cfg(uprobe_arch = "x86_64")]
const COUNT: usize = 17;
#[cfg(uprobe_arch = "aarch64")]
const COUNT: usize = 32;

/// The stack pointer's DWARF number.
#[cfg(uprobe_arch = "x86_64")]
pub(super) const SP: u16 = 7;
#[cfg(uprobe_arch = "aarch64")]
pub(super) const SP: u16 = 31;

/// The frame pointer's DWARF number.
#[cfg(uprobe_arch = "x86_64")]
pub(super) const FP: u16 = 6;
#[cfg(uprobe_arch = "aarch64")]
pub(super) const FP: u16 = 29;

/// The return address column: x86-64's virtual one, aarch64's link
/// register.
#[cfg(uprobe_arch = "x86_64")]
pub(super) const RA: u16 = 16;
#[cfg(uprobe_arch = "aarch64")]
pub(super) const RA: u16 = 30;

/// Whether a return address column without a rule means the register
/// still holds it: aarch64's link register at a function's entry (its
/// outermost frames set it to 0); on x86-64 the column is virtual, and a
/// frame without a rule for it (`_start`, a thread's start) is the last.
#[cfg(uprobe_arch = "x86_64")]
pub(super) const RA_WITHOUT_RULE_IS_KEPT: bool = false;
#[cfg(uprobe_arch = "aarch64")]
pub(super) const RA_WITHOUT_RULE_IS_KEPT: bool = true;

/// Register values of one frame (`None`: not known).
#[derive(Clone)]
pub(super) struct Regs([Option<usize>; COUNT]);

impl Regs {
    /// No register known.
    pub(super) fn unknown() -> Self {
        Self([None; COUNT])
    }

    pub(super) fn get(&self, n: u16) -> Option<usize> {
        self.0.get(usize::from(n)).copied().flatten()
    }

    pub(super) fn set(&mut self, n: u16, value: Option<usize>) {
        if let Some(r) = self.0.get_mut(usize::from(n)) {
            *r = value;
        }
    }
}

/// The registers at the probed instruction.
#[cfg(uprobe_arch = "x86_64")]
pub(super) fn at_hit(cx: &EntryContext<'_>) -> Regs {
    use crate::Reg;
    // DWARF order: rax, rdx, rcx, rbx, rsi, rdi, rbp, rsp, r8-r15.
    let order = [
        Reg::Rax,
        Reg::Rdx,
        Reg::Rcx,
        Reg::Rbx,
        Reg::Rsi,
        Reg::Rdi,
        Reg::Rbp,
        Reg::Rsp,
        Reg::R8,
        Reg::R9,
        Reg::R10,
        Reg::R11,
        Reg::R12,
        Reg::R13,
        Reg::R14,
        Reg::R15,
    ];
    let mut regs = Regs([None; COUNT]);
    for (n, r) in order.into_iter().enumerate() {
        regs.0[n] = Some(cx.reg(r) as usize);
    }
    regs
}

/// The registers at the probed instruction.
#[cfg(uprobe_arch = "aarch64")]
pub(super) fn at_hit(cx: &EntryContext<'_>) -> Regs {
    use crate::Reg;
    let mut regs = Regs([None; COUNT]);
    for n in 0..31u8 {
        regs.0[usize::from(n)] = Some(cx.reg(Reg::X(n)) as usize);
    }
    regs.0[31] = Some(cx.reg(Reg::Sp) as usize);
    regs
}

/// A return address as code branches to it: on aarch64 without the
/// pointer authentication code a signed one carries above the 48 bits of
/// a user address.
pub(super) fn strip_return_address(ra: usize) -> usize {
    if cfg!(uprobe_arch = "aarch64") {
        ra & 0x0000_ffff_ffff_ffff
    } else {
        ra
    }
}
