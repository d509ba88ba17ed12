//! aarch64: instruction classification, simulation, out-of-line slots,
//! trap-free jumps, the return trampoline, and the handler's view of the
//! registers. Implements `super`'s interface; no punned jumps (every
//! instruction is as long as a `B`), no counting or timing in
//! trampolines (the engine's path does both).

mod context;
mod decode;
mod insn;
pub(super) mod jump;
pub(super) mod jump_entry;
pub(super) mod return_entry;
mod simulate;
pub(super) mod trampoline;
pub(super) mod usdt;
mod xol;

pub use context::Reg;
pub(crate) use context::{
    ARGS, PC, float_return_bits, reg, return_address_at, set_float_return, set_reg,
};
pub use decode::{Class, classify, has_hbc};
pub(crate) use decode::{Emulation, is_boundary};
pub(crate) use insn::analyze;
pub(crate) use simulate::apply;
pub(crate) use trampoline::{SavedRegs, SavedVector};

/// No punned jumps: a jump always replaces whole instructions
/// (`crate::base::mode::Tactic::Replace`).
pub(crate) const PUNNING: Option<super::Punning> = None;

/// No counting in trampolines: every hit of a counting probe runs the
/// common entry.
pub(crate) const TRAMPOLINE_COUNTING: Option<super::TrampolineCounting> = None;

/// No timing routines: the engine's path times timing probes.
pub(crate) const TIMED_ROUTINES: Option<super::TimedRoutines> = None;

/// Binds `$symbol` (called by an assembly routine) to `$function`: a
/// hidden symbol holding one `b`.
macro_rules! define_callee {
    ($symbol:literal, $function:path) => {
        core::arch::global_asm!(
            concat!(".pushsection .text.", $symbol, ",\"ax\",@progbits"),
            ".p2align 2",
            concat!(".globl ", $symbol),
            concat!(".hidden ", $symbol),
            concat!($symbol, ":"),
            "b {function}",
            ".popsection",
            function = sym $function,
        );
    };
}
pub(crate) use define_callee;

/// Bytes per out-of-line slot (two instructions are used).
pub(crate) const SLOT_SIZE: usize = 64;
/// How far an out-of-line slot or trampoline region may be from the code
/// it serves: `B`'s 26-bit word offset.
pub(crate) const REACH_LIMIT: usize = 1 << 27;
/// The `B` written over a site.
pub(crate) const JUMP_LEN: usize = 4;

// The CPU features the jump code asks about (`AT_HWCAP`, `AT_HWCAP2`).
pub(crate) const HWCAP_SVE: libc::c_ulong = 1 << 22;
pub(crate) const HWCAP_DIT: libc::c_ulong = 1 << 24;
pub(crate) const HWCAP_SSBS: libc::c_ulong = 1 << 28;
pub(crate) const HWCAP2_MTE: libc::c_ulong = 1 << 18;
pub(crate) const HWCAP2_SME: libc::c_ulong = 1 << 23;

/// `AT_HWCAP` and `AT_HWCAP2`. Async-signal-safe (getauxval reads a
/// copy made at start-up).
pub(crate) fn hwcaps() -> (libc::c_ulong, libc::c_ulong) {
    // SAFETY: plain queries.
    unsafe {
        (
            libc::getauxval(libc::AT_HWCAP),
            libc::getauxval(libc::AT_HWCAP2),
        )
    }
}

/// Every A64 instruction is 4 bytes.
pub(crate) const MAX_INSN_LEN: usize = 4;

/// `BRK #5` (the kernel's uprobe breakpoint), written over a probed
/// instruction.
pub(crate) const BREAKPOINT: [u8; 4] = 0xd420_00a0_u32.to_le_bytes();

/// `si_code` of a SIGTRAP raised by a `BRK` (`TRAP_BRKPT`).
const TRAP_BRKPT: i32 = 1;

/// The probed address a SIGTRAP reports, if it comes from a breakpoint
/// instruction (`BRK` traps with PC at itself, `si_code` `TRAP_BRKPT`).
/// Async-signal-safe.
pub(crate) fn breakpoint_address(info: &libc::siginfo_t, uc: &libc::ucontext_t) -> Option<usize> {
    (info.si_code == TRAP_BRKPT).then(|| pc(uc))
}

/// Whether the code at `addr` is a breakpoint instruction: any `BRK`
/// (ours is `#5`; Rust's `abort` is `#0x3e8`, a debugger's `#0`).
/// Async-signal-safe.
///
/// # Safety
/// `addr` is mapped code (an unaligned address is no instruction: `false`).
pub(crate) unsafe fn is_breakpoint_at(addr: usize) -> bool {
    if !addr.is_multiple_of(4) {
        return false;
    }
    // SAFETY: the caller's contract; aligned.
    let insn = unsafe { core::ptr::read_volatile(addr as *const u32) };
    is_breakpoint(&insn.to_le_bytes())
}

/// Whether `code` starts with a breakpoint instruction (any `BRK`).
pub(crate) fn is_breakpoint(code: &[u8]) -> bool {
    code.first_chunk::<4>()
        .is_some_and(|b| u32::from_le_bytes(*b) & 0xffe0_001f == 0xd420_0000)
}

/// The registers a handler reads and writes: the signal frame.
pub(crate) type Frame = libc::ucontext_t;

/// The register frame of a signal's context.
pub(crate) fn frame_of(uc: &mut libc::ucontext_t) -> &mut Frame {
    uc
}

/// The program counter of a register frame.
pub(crate) fn frame_pc(frame: &Frame) -> usize {
    pc(frame)
}

/// Sets the program counter of a register frame.
pub(crate) fn set_frame_pc(frame: &mut Frame, addr: usize) {
    set_pc(frame, addr);
}

/// The interrupted thread's program counter.
pub(crate) fn pc(uc: &libc::ucontext_t) -> usize {
    uc.uc_mcontext.pc as usize
}

/// Moves the interrupted thread to `addr`.
pub(crate) fn set_pc(uc: &mut libc::ucontext_t, addr: usize) {
    uc.uc_mcontext.pc = addr as u64;
}

/// Makes code just written at `[addr, addr + len)` visible to instruction
/// fetch on this CPU (the caller's `membarrier(SYNC_CORE)` then covers the
/// others): clean the data cache to the point of unification, invalidate
/// the instruction cache, as `CTR_EL0` says is needed (`IDC`: no clean,
/// `DIC`: no invalidate). Async-signal-safe.
pub(crate) fn flush_code(addr: usize, len: usize) {
    let ctr: u64;
    // SAFETY: reading CTR_EL0 is allowed at EL0 on Linux (trapped and
    // emulated where the hardware does not allow it).
    unsafe { core::arch::asm!("mrs {}, ctr_el0", out(reg) ctr, options(nomem, nostack)) };
    let dline = 4usize << ((ctr >> 16) & 0xf);
    let iline = 4usize << (ctr & 0xf);
    let end = addr + len;
    if ctr >> 28 & 1 == 0 {
        let mut p = addr & !(dline - 1);
        while p < end {
            // SAFETY: cache maintenance by address on our own mapping.
            unsafe { core::arch::asm!("dc cvau, {}", in(reg) p, options(nostack)) };
            p += dline;
        }
    }
    // SAFETY: a barrier.
    unsafe { core::arch::asm!("dsb ish", options(nostack)) };
    if ctr >> 29 & 1 == 0 {
        let mut p = addr & !(iline - 1);
        while p < end {
            // SAFETY: as above.
            unsafe { core::arch::asm!("ic ivau, {}", in(reg) p, options(nostack)) };
            p += iline;
        }
    }
    // SAFETY: barriers.
    unsafe { core::arch::asm!("dsb ish", "isb", options(nostack)) };
}
