//! Applying an [`Emulation`] to the interrupted thread's registers.

use super::decode::{Emulation, LiteralKind, RegisterBranch, condition_holds};

impl Emulation {
    /// Whether the instruction runs in an out-of-line slot that ends in a
    /// second trap. Async-signal-safe.
    pub(crate) fn traps_back(&self) -> bool {
        matches!(
            self,
            Self::OutOfLine {
                trap_back: true,
                ..
            }
        )
    }
}

/// The `bytes` (4, 8 or 16) at the 4-aligned `addr`, little-endian: an 8-
/// or 16-byte literal need only be 4-aligned, and a wider Rust read must
/// be aligned (or be a `memcpy` call in an unoptimised build, which could
/// be the very function probed). An aligned 8-byte literal is read in one
/// access, as the instruction reads it; otherwise a 32-bit word at a
/// time. Async-signal-safe.
///
/// # Safety
/// The bytes are readable, and `addr` is 4-aligned.
unsafe fn load_words(addr: u64, bytes: usize) -> u128 {
    if bytes == 8 && addr.is_multiple_of(8) {
        // SAFETY: the caller's contract, and aligned.
        return u128::from(unsafe { (addr as *const u64).read_volatile() });
    }
    let mut value = 0u128;
    for i in 0..bytes / 4 {
        // SAFETY: the caller's contract.
        let word = unsafe { (addr as *const u32).add(i).read_volatile() };
        value |= u128::from(word) << (32 * i);
    }
    value
}

/// PSTATE.BTYPE, bits 11:10.
const BTYPE_MASK: u64 = 0b11 << 10;

/// Does what the displaced instruction would have done, on the registers
/// of the signal frame (for one run out of line: sends the thread to its
/// slot; the caller defers signals if the slot traps back, see
/// [`Emulation::traps_back`]). Async-signal-safe.
///
/// Takes the emulation by reference (no copy: a `memcpy` call in an
/// unoptimised build could be the very function probed).
///
/// # Safety
/// `uc` is the frame of a thread that trapped on this instruction; a
/// literal load's address is readable, as executing it would require.
pub(crate) unsafe fn apply(e: &Emulation, uc: &mut libc::ucontext_t) {
    let m = &mut uc.uc_mcontext;
    // Register 31 reads as zero (xzr) in every simulated form.
    let read = |m: &libc::mcontext_t, r: u8| if r < 31 { m.regs[r as usize] } else { 0 };
    let write = |m: &mut libc::mcontext_t, r: u8, v: u64| {
        if r < 31 {
            m.regs[r as usize] = v;
        }
    };
    // Direct branches and non-branches leave BTYPE 0; register branches
    // set it as the real one would.
    let mut btype = 0;
    match *e {
        Emulation::Nop { next } => m.pc = next,
        Emulation::Branch { target, link } => {
            if let Some(next) = link {
                m.regs[30] = next;
            }
            m.pc = target;
        }
        Emulation::CondBranch { cond, target, next } => {
            m.pc = if condition_holds(cond, m.pstate) {
                target
            } else {
                next
            };
        }
        Emulation::CompareBranch {
            reg,
            wide,
            nonzero,
            target,
            next,
        } => {
            let mut v = read(m, reg);
            if !wide {
                v &= 0xffff_ffff;
            }
            m.pc = if (v != 0) == nonzero { target } else { next };
        }
        Emulation::TestBranch {
            reg,
            bit,
            nonzero,
            target,
            next,
        } => {
            let set = read(m, reg) >> bit & 1 == 1;
            m.pc = if set == nonzero { target } else { next };
        }
        Emulation::Address { rd, value, next } => {
            write(m, rd, value);
            m.pc = next;
        }
        Emulation::Register { rn, kind, next } => {
            let target = read(m, rn);
            match kind {
                // Whether the real `br` sets 0b01 or 0b11 depends on the
                // page being guarded and on the register: 0b01 is what
                // every landing pad accepts that accepts 0b11.
                RegisterBranch::Br => btype = 0b01,
                RegisterBranch::Blr => {
                    m.regs[30] = next;
                    btype = 0b10;
                }
                RegisterBranch::Ret => {}
            }
            m.pc = target;
        }
        Emulation::Literal {
            rt,
            kind,
            addr,
            next,
        } => {
            // SAFETY: the caller's contract: the load's own address, which
            // is 4-aligned (the PC plus a multiple of 4).
            let load = |bytes: usize| unsafe { load_words(addr, bytes) };
            match kind {
                LiteralKind::W => write(m, rt, load(4) as u64),
                LiteralKind::X => write(m, rt, load(8) as u64),
                LiteralKind::Sw => write(m, rt, i64::from(load(4) as u32 as i32) as u64),
                LiteralKind::Prefetch => {}
                LiteralKind::Simd { bytes } => {
                    super::context::set_vreg(uc, rt, load(usize::from(bytes)));
                }
            }
            uc.uc_mcontext.pc = next;
            uc.uc_mcontext.pstate &= !BTYPE_MASK;
            return;
        }
        Emulation::OutOfLine { slot, .. } => {
            m.pc = slot;
            m.pstate &= !BTYPE_MASK;
            return;
        }
    }
    m.pstate = m.pstate & !BTYPE_MASK | btype << 10;
}
