//! How a probe runs: [`Mode`], and why a site is not optimized
//! ([`NotOptimized`]).

/// How hits of a probe reach the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Trap-free: the site holds a jump (`jmp rel32` on x86-64, `B` on
    /// aarch64) into a trampoline of its own, which saves the registers,
    /// runs the handlers and the displaced instructions, and jumps back.
    /// No signal, no system call (on aarch64, a handler that moves the PC
    /// or the stack pointer is honoured through `rt_sigreturn`).
    Jump,
    /// A breakpoint (`int3` / `BRK`) and the SIGTRAP handler, for the
    /// reason given.
    Trap(NotOptimized),
}

impl Mode {
    /// Whether the probe is trap-free.
    #[must_use]
    pub fn is_jump(&self) -> bool {
        matches!(self, Self::Jump)
    }
}

/// Why a probe's site runs on the trap path instead of a jump.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotOptimized {
    /// [`Uprobe::trap_only`](crate::Uprobe::trap_only) asked for it (by
    /// this probe or another one at the same address).
    TrapOnly,
    /// The instructions a jump would replace are shorter than the jump
    /// (5 bytes on x86-64), or there are none after a landing pad.
    TooShort {
        /// Bytes available.
        len: usize,
        /// Why no longer range could be taken.
        why: &'static str,
    },
    /// The function has an indirect jump (a jump table could land inside
    /// the replaced bytes), at `at`.
    IndirectJump {
        /// The indirect jump.
        at: usize,
    },
    /// A branch at `from` lands on `target`, inside the bytes the jump
    /// would replace.
    BranchIntoRange {
        /// The branch instruction.
        from: usize,
        /// Its target.
        target: usize,
    },
    /// An instruction of the range other than the last one branches,
    /// calls or returns (at `at`): a thread could come back into the
    /// middle of the jump.
    ControlFlowInRange {
        /// The instruction.
        at: usize,
    },
    /// The function does not decode from its start to its end (data in
    /// code?), at `at`.
    Undecodable {
        /// Where decoding failed.
        at: usize,
    },
    /// An instruction of the range cannot run relocated.
    NotRelocatable {
        /// Why.
        why: &'static str,
    },
    /// No trampoline could be placed within reach of the site (+-2 GB
    /// on x86-64, +-128 MB on aarch64).
    NoTrampolineRoom,
    /// The jump would cross into another mapping.
    CrossesMapping,
    /// Another probe's site lies inside the bytes the jump would replace
    /// (at `at`), or was attached inside them later (the site then went
    /// back to its breakpoint).
    OtherProbeInRange {
        /// The other site.
        at: usize,
    },
    /// Not every thread could be checked for being stopped inside the
    /// range (a thread blocked signals, or stayed inside the engine's
    /// trap handler) before the jump was written.
    ThreadsUnchecked {
        /// Threads that did not answer (or stayed busy) in the last round.
        threads: usize,
    },
    /// The thread runs with a shadow stack (CET): the trampoline's
    /// displaced `call` and the handlers' redirections would not match
    /// it.
    ShadowStack,
    /// The code changed under the engine while it was being patched.
    CodeChanged,
    /// The site is a landing pad (`bti`, `paciasp`, `pacibsp` on
    /// aarch64), which stays in place, and the jump cannot go after it.
    LandingPad {
        /// Why.
        why: &'static str,
    },
    /// The trampoline would not preserve the thread's vector state
    /// (aarch64: SVE vectors longer than 128 bits, or SME).
    VectorState {
        /// Why.
        why: &'static str,
    },
    /// Trap-free probes are not implemented for this architecture (not
    /// reported on x86-64 and aarch64).
    Architecture,
}

impl core::fmt::Display for NotOptimized {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::TrapOnly => write!(f, "trap-only was asked for"),
            Self::TooShort { len, why } => write!(f, "{len} bytes: {why}"),
            Self::IndirectJump { at } => {
                write!(f, "the function has an indirect jump at {at:#x}")
            }
            Self::BranchIntoRange { from, target } => write!(
                f,
                "the branch at {from:#x} lands at {target:#x}, inside the replaced bytes"
            ),
            Self::ControlFlowInRange { at } => write!(
                f,
                "the instruction at {at:#x} branches, calls or returns inside the replaced bytes"
            ),
            Self::Undecodable { at } => write!(f, "the function does not decode at {at:#x}"),
            Self::NotRelocatable { why } => write!(f, "not relocatable: {why}"),
            Self::NoTrampolineRoom => write!(f, "no room for a trampoline within reach"),
            Self::CrossesMapping => write!(f, "the jump would cross into another mapping"),
            Self::OtherProbeInRange { at } => {
                write!(f, "another probe at {at:#x} lies inside the replaced bytes")
            }
            Self::ThreadsUnchecked { threads } => write!(
                f,
                "{threads} thread(s) could not be checked for being inside the replaced bytes"
            ),
            Self::ShadowStack => write!(f, "the thread runs with a shadow stack"),
            Self::CodeChanged => write!(f, "the code changed while it was being patched"),
            Self::LandingPad { why } => write!(f, "a landing pad: {why}"),
            Self::VectorState { why } => write!(f, "vector registers: {why}"),
            Self::Architecture => {
                write!(
                    f,
                    "trap-free probes are not implemented on this architecture"
                )
            }
        }
    }
}
