//! What the engine's generated code takes: [`code_memory`].
//!
//! Generated code is never unmapped (a thread may be inside any of it,
//! however long ago its probe was detached), and every piece is reused
//! by later attaches of the same site and bytes: these figures grow with
//! the number of distinct sites ever probed, never with attach and detach
//! rounds. Per probed site:
//!
//! - an out-of-line slot (64 bytes) for a site on its breakpoint whose
//!   instruction is not emulated;
//! - a trampoline (256 bytes: on x86-64 its counting prelude and the call
//!   into the engine take 115 of them, and its restartable sequence's
//!   descriptor 32) for a trap-free site;
//! - for a punned jump (`Tactic::Pun`), a stub of 5 or 14 bytes at an
//!   address the code's bytes choose: stubs whose windows overlap share a
//!   page, but a 1-byte instruction (or a one-byte patch) fixes the exact
//!   address, so such a site may take a page (4 KiB of address space, and
//!   of memory once written) of its own.
//!
//! Regions of slots and trampolines are 64 KiB of address space each, a
//! page of memory each once used. A stub page at an address no other
//! page of ours is next to is a mapping of its own: thousands of punned
//! probes can add thousands of entries to the process's memory map (far
//! below the kernel's default limit of 65,530), which makes each look at
//! `/proc/self/maps` (one per attach, and per probe built by name) longer.

use crate::code::{pinned, slots, trampolines};

/// Address space taken by the engine's generated code, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CodeMemory {
    /// Regions of out-of-line slots.
    pub slots: usize,
    /// Regions of trampolines.
    pub trampolines: usize,
    /// Pages of punned jumps' stubs.
    pub stubs: usize,
}

impl CodeMemory {
    /// All of it.
    #[must_use]
    pub fn total(&self) -> usize {
        self.slots + self.trampolines + self.stubs
    }
}

/// What the engine's generated code takes now. Async-signal-safe: loads
/// only.
#[must_use]
pub fn code_memory() -> CodeMemory {
    CodeMemory {
        slots: slots::mapped_bytes(),
        trampolines: trampolines::mapped_bytes(),
        stubs: pinned::mapped_bytes(),
    }
}
