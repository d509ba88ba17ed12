//! Applying an [`Emulation`] to the interrupted thread's registers.

use super::insn::{Emulation, LoopKind, Operand, condition_holds};

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

/// Does what the displaced instruction would have done, on the registers
/// of the signal frame (for one run out of line: sends the thread to its
/// slot; the caller defers signals if the slot traps back, see
/// [`Emulation::traps_back`]). Async-signal-safe.
///
/// Takes the emulation by reference: copying it (it holds a decoded
/// instruction) would be a `memcpy` call in unoptimised builds, and a probe
/// on `memcpy` would then recurse through this very function.
///
/// # Safety
/// `uc` is the frame of a thread that trapped on this instruction; for
/// `push`/`call`, `[rsp - 8]` is that thread's stack (the signal frame lies
/// below the 128-byte red zone, so it is not overwritten), and for `ret`
/// `[rsp]` is readable, as executing the instruction would require.
pub(crate) unsafe fn apply(e: &Emulation, uc: &mut libc::ucontext_t) {
    let g = &mut uc.uc_mcontext.gregs;
    let rsp = libc::REG_RSP as usize;
    let rip = libc::REG_RIP as usize;
    let push = |g: &mut [i64; 23], value: u64| {
        let sp = (g[rsp] as u64).wrapping_sub(8);
        // SAFETY: the caller's contract: the thread's own stack slot.
        unsafe { store(sp, value) };
        g[rsp] = sp as i64;
    };
    // Matching the place `*e` binds fields one by one (no copy of `e`).
    match *e {
        Emulation::Nop { next } => g[rip] = next as i64,
        Emulation::Push { reg, next } => {
            // `push rsp` pushes the value before the decrement.
            let value = g[reg.0] as u64;
            push(g, value);
            g[rip] = next as i64;
        }
        Emulation::Jmp { target } => g[rip] = target as i64,
        Emulation::Call { target, next } => {
            push(g, next);
            g[rip] = target as i64;
        }
        Emulation::Jcc { cond, target, next } => {
            let taken = condition_holds(cond, g[libc::REG_EFL as usize] as u64);
            g[rip] = if taken { target } else { next } as i64;
        }
        Emulation::Indirect { target, call_next } => {
            let to = match target {
                Operand::Register(r) => g[r] as u64,
                Operand::Memory {
                    base,
                    index,
                    scale,
                    disp,
                } => {
                    let reg = |r: Option<usize>| r.map_or(0, |i| g[i] as u64);
                    let ea = reg(base)
                        .wrapping_add(reg(index).wrapping_mul(scale))
                        .wrapping_add(disp);
                    // SAFETY: the caller's contract: executing the branch
                    // reads this operand.
                    unsafe { load(ea) }
                }
            };
            if let Some(next) = call_next {
                push(g, next);
            }
            g[rip] = to as i64;
        }
        Emulation::Loop { kind, target, next } => {
            let rcx_i = libc::REG_RCX as usize;
            let zf = (g[libc::REG_EFL as usize] >> 6) & 1 == 1;
            let mut rcx = g[rcx_i] as u64;
            if kind != LoopKind::Jrcxz {
                rcx = rcx.wrapping_sub(1);
                g[rcx_i] = rcx as i64;
            }
            let taken = match kind {
                LoopKind::Loop => rcx != 0,
                LoopKind::LoopE => rcx != 0 && zf,
                LoopKind::LoopNe => rcx != 0 && !zf,
                LoopKind::Jrcxz => rcx == 0,
            };
            g[rip] = if taken { target } else { next } as i64;
        }
        Emulation::OutOfLine { slot, .. } => g[rip] = slot as i64,
        Emulation::Ret { pop } => {
            let sp = g[rsp] as u64;
            // SAFETY: the caller's contract: `ret` reads `[rsp]`.
            let to = unsafe { load(sp) };
            g[rsp] = sp.wrapping_add(8 + u64::from(pop)) as i64;
            g[rip] = to as i64;
        }
    }
}

/// The 8 bytes at `addr`, read as the emulated instruction reads them:
/// any address, aligned or not, and a fault is the thread's own, as the
/// instruction's would have been (raised here instead). A Rust read of a
/// null or dangling pointer is undefined behaviour (a debug build stops
/// on it), so the load is the machine's. One difference remains: a
/// non-canonical address formed from `rsp` or `rbp` raises #SS (SIGBUS)
/// in the instruction and #GP (SIGSEGV) here, the base register being
/// this load's own.
///
/// # Safety
/// `addr` is what the interrupted thread's instruction reads.
unsafe fn load(addr: u64) -> u64 {
    let value: u64;
    // SAFETY: the caller's promise; one load, no other effect.
    unsafe {
        core::arch::asm!(
            "mov {v}, qword ptr [{a}]",
            a = in(reg) addr,
            v = lateout(reg) value,
            options(nostack, preserves_flags, readonly),
        );
    }
    value
}

/// Stores `value` at `addr` as the emulated `push` or `call` does (see
/// [`load`]).
///
/// # Safety
/// `addr` is what the interrupted thread's instruction writes.
unsafe fn store(addr: u64, value: u64) {
    // SAFETY: the caller's promise; one store, no other effect.
    unsafe {
        core::arch::asm!(
            "mov qword ptr [{a}], {v}",
            a = in(reg) addr,
            v = in(reg) value,
            options(nostack, preserves_flags),
        );
    }
}
