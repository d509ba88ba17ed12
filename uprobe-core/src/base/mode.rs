//! How a probe runs: [`Mode`], which way a jump was written
//! ([`Tactic`]), and why a site is not optimized ([`NotOptimized`]).

/// How hits of a probe reach the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Trap-free: the site holds a jump (`jmp rel32` on x86-64, `B` on
    /// aarch64) into a trampoline of its own, which saves the registers,
    /// runs the handlers and the displaced instructions, and jumps back.
    /// No signal, no system call (on aarch64, a handler that moves the PC
    /// or the stack pointer is honoured through `rt_sigreturn`). The
    /// [`Tactic`] says how the jump was fitted in.
    Jump(Tactic),
    /// A breakpoint (`int3` / `BRK`) and the SIGTRAP handler, for the
    /// reason given.
    Trap(NotOptimized),
}

impl Mode {
    /// Whether the probe is trap-free.
    #[must_use]
    pub fn is_jump(&self) -> bool {
        matches!(self, Self::Jump(_))
    }

    /// How the jump was fitted in, if the probe is trap-free.
    #[must_use]
    pub fn tactic(&self) -> Option<Tactic> {
        match self {
            Self::Jump(t) => Some(*t),
            Self::Trap(_) => None,
        }
    }
}

/// How a trap-free probe's jump was fitted over the code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tactic {
    /// The jump replaces whole instructions: the probed one when it is at
    /// least as long as the jump (5 bytes on x86-64; every instruction on
    /// aarch64), or a function's first instructions, relocated together.
    Replace,
    /// x86-64 *instruction punning* (`E9Patch`'s tactic): only the probed
    /// instruction's own bytes change; the `jmp rel32` written there is
    /// longer than the instruction, and the last bytes of its
    /// displacement are the bytes that follow, left as they are. Those
    /// bytes choose (within a window of 1, 256, 65,536 or 16 Mi
    /// addresses) where the jump lands, so a small stub that jumps on to
    /// the probe's trampoline is placed there. Because no other
    /// instruction changes, a branch or a jump table that lands after
    /// the probed instruction still finds its original code. An
    /// instruction of 5 bytes or more whose bytes the jump of the
    /// instruction before it ends in gets its whole jump written this way
    /// (5 bytes, nothing fixed): its stub is placed where those bytes
    /// give that jump room, at the cost of one more `jmp` per hit. After
    /// a return or jump, the alignment padding that follows (which no
    /// thread runs) is written too: a `ret` before 4 bytes of padding
    /// takes a whole jump. Where a one-byte patch's one target (a
    /// `jmp rel32` over the next four bytes, or a `jmp rel8` over the
    /// next one) lies in padding of loaded code, its stub is written
    /// there (a landing pad).
    Pun {
        /// Bytes the patch changes (the probed instruction's length, with
        /// the padding after it if any, 5 where the whole jump goes over
        /// a longer instruction, or 1 where one byte suffices).
        written: u8,
        /// Redundant prefixes in front of the `jmp` (padding that moves
        /// the window the fixed bytes choose).
        prefixes: u8,
    },
}

impl Tactic {
    /// How many of a punned jump's displacement bytes it chose itself
    /// (its stub may move within their window); 0 for a jump that
    /// replaces whole instructions.
    pub(crate) fn free_bytes(self) -> usize {
        match self {
            Self::Replace => 0,
            Self::Pun { written, prefixes } => usize::from(written.saturating_sub(prefixes + 1)),
        }
    }
}

impl core::fmt::Display for Tactic {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Replace => write!(f, "replace"),
            Self::Pun {
                written,
                prefixes: 0,
            } => write!(f, "pun ({written} byte(s) written)"),
            Self::Pun { written, prefixes } => {
                write!(f, "pun ({written} byte(s) written, {prefixes} prefix(es))")
            }
        }
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
    /// The function has an indirect jump at `at` that could land inside
    /// the replaced bytes (a jump table): it leaves from a stack depth
    /// that an instruction there has, or one the engine cannot follow.
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
    /// The jump does not fit over whole instructions (`instead` says
    /// why), and a jump punned over the probed instruction's `len` bytes
    /// (see [`Tactic::Pun`]) could only land where nothing can be mapped:
    /// other mappings, the heap's or the stack's room to grow, or outside
    /// the address space.
    NoPunTarget {
        /// The probed instruction's length.
        len: usize,
        /// Why whole instructions could not be replaced.
        instead: Box<NotOptimized>,
    },
    /// The jump would cross into another mapping.
    CrossesMapping,
    /// Another probe's site lies inside the bytes the jump would replace
    /// (at `at`), or inside a punned jump's bytes while its own jump is
    /// planned but not written. (A site whose bytes a later probe
    /// changes goes back to its breakpoint with this reason, then takes a
    /// jump again over the new bytes where it can.)
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
                write!(
                    f,
                    "the function has an indirect jump at {at:#x} that could land inside"
                )
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
            Self::NoPunTarget { len, instead } => write!(
                f,
                "{instead}; and a jump punned over the {len}-byte instruction could only land where nothing can be mapped"
            ),
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
