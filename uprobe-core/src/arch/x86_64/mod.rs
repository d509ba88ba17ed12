//! x86-64: instruction analysis, emulation and relocation, trap-free
//! jumps (punned where an instruction is shorter than the jump) into
//! trampolines that count and time by themselves, the return trampoline,
//! and the handler's view of the registers. Implements `super`'s
//! interface.

mod analyze;
mod branches;
mod context;
mod count;
mod emulate;
mod insn;
pub(super) mod jump;
pub(super) mod jump_entry;
mod lean_return;
mod pun;
mod relocate;
pub(super) mod return_entry;
mod stack_depth;
mod timing;
pub(super) mod trampoline;
pub(super) mod usdt;
mod xol;

pub(crate) use analyze::analyze;
pub use context::Reg;
pub(crate) use context::{
    ARGS, PC, float_return_bits, reg, return_address_at, set_float_return, set_reg,
};
pub(crate) use emulate::apply;
pub(crate) use insn::{Emulation, is_boundary};
pub(crate) use trampoline::{SavedRegs, SavedVector};

/// Punned jumps: x86-64 instructions can be shorter than the jump.
pub(crate) const PUNNING: Option<super::Punning> = Some(super::Punning {
    puns: pun::puns,
    pun_bytes: pun::pun_bytes,
    stub: pun::stub,
    padding_after_code: pun::padding_after_code,
});

/// Trampolines count a counting probe's hits in a restartable sequence
/// of their own (`count`).
pub(crate) const TRAMPOLINE_COUNTING: Option<super::TrampolineCounting> =
    Some(super::TrampolineCounting {
        enabled: count::enabled,
        fits: count::fits,
    });

/// Timing probes timed, and return probes without an entry handler
/// tracked, by assembly routines alone (`timing`, `lean_return`).
pub(crate) const TIMED_ROUTINES: Option<super::TimedRoutines> = Some(super::TimedRoutines {
    enable: |first_stub| {
        timing::enable(first_stub).map(|timed| super::OwnEntries {
            timed,
            returns: lean_return::routine(),
        })
    },
});

/// Binds `$symbol` (called by an assembly routine) to `$function`: a
/// hidden symbol holding one `jmp`.
macro_rules! define_callee {
    ($symbol:literal, $function:path) => {
        core::arch::global_asm!(
            concat!(".pushsection .text.", $symbol, ",\"ax\",@progbits"),
            ".p2align 4",
            concat!(".globl ", $symbol),
            concat!(".hidden ", $symbol),
            concat!($symbol, ":"),
            "jmp {function}",
            ".popsection",
            function = sym $function,
        );
    };
}
pub(crate) use define_callee;

/// Bytes per slot: the longest instruction relocated (15 bytes, longer when
/// a branch is widened) plus a 5-byte jump back fits easily.
pub(crate) const SLOT_SIZE: usize = 64;
/// How far an out-of-line slot or trampoline region may be from the code it serves: a rel32 displacement.
pub(crate) const REACH_LIMIT: usize = 1 << 31;
/// The `jmp rel32` written over a site.
pub(crate) const JUMP_LEN: usize = 5;

/// The longest instruction.
pub(crate) const MAX_INSN_LEN: usize = 15;

/// `int3`, written over the first byte of a probed instruction.
pub(crate) const BREAKPOINT: [u8; 1] = [0xcc];

/// The probed address a SIGTRAP reports, if it comes from a breakpoint
/// instruction (`int3` traps with RIP after it, `si_code` `SI_KERNEL`).
/// Async-signal-safe.
pub(crate) fn breakpoint_address(info: &libc::siginfo_t, uc: &libc::ucontext_t) -> Option<usize> {
    (info.si_code == libc::SI_KERNEL).then(|| pc(uc).wrapping_sub(1))
}

/// Whether the code at `addr` is a breakpoint instruction (ours or
/// anyone's). Async-signal-safe.
///
/// # Safety
/// `addr` is mapped code.
pub(crate) unsafe fn is_breakpoint_at(addr: usize) -> bool {
    // SAFETY: the caller's contract.
    unsafe { core::ptr::read_volatile(addr as *const u8) == BREAKPOINT[0] }
}

/// The registers a handler reads and writes, in `ucontext_t`'s `gregs`
/// layout: the signal frame's own (a trap), or the copy an optimized
/// probe's trampoline saved on the stack in the same layout.
pub(crate) type Frame = [libc::greg_t; 23];

/// The register frame of a signal's context.
pub(crate) fn frame_of(uc: &mut libc::ucontext_t) -> &mut Frame {
    &mut uc.uc_mcontext.gregs
}

/// The instruction pointer of a register frame.
pub(crate) fn frame_pc(frame: &Frame) -> usize {
    frame[libc::REG_RIP as usize] as usize
}

/// Sets the instruction pointer of a register frame.
pub(crate) fn set_frame_pc(frame: &mut Frame, addr: usize) {
    frame[libc::REG_RIP as usize] = addr as i64;
}

/// Whether `code` starts with a breakpoint instruction (`int3`).
pub(crate) fn is_breakpoint(code: &[u8]) -> bool {
    code.first() == Some(&BREAKPOINT[0])
}

/// The interrupted thread's instruction pointer.
pub(crate) fn pc(uc: &libc::ucontext_t) -> usize {
    uc.uc_mcontext.gregs[libc::REG_RIP as usize] as usize
}

/// Moves the interrupted thread to `addr`.
pub(crate) fn set_pc(uc: &mut libc::ucontext_t, addr: usize) {
    uc.uc_mcontext.gregs[libc::REG_RIP as usize] = addr as i64;
}

/// Makes code just written visible to instruction fetch: nothing to do on
/// x86 (the caller's `membarrier(SYNC_CORE)` serialises other threads).
pub(crate) fn flush_code(_addr: usize, _len: usize) {}
