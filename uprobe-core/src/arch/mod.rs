//! The interface between the engine and an architecture: every item an
//! architecture provides, documented here once, as the kernel's
//! `arch_uprobe_*` hooks are in `<linux/uprobes.h>`.
//!
//! An architecture is a folder (`x86_64/`, `aarch64/`) that implements
//! this interface and imports nothing of the engine above the foundations
//! (`crate::base`): it knows instructions, registers, the layout of the
//! code it generates and its assembly routines, and nothing of sites,
//! tables or probes. Where it needs the engine, the engine hands it what
//! it needs: the out-of-line slots analysis asks for ([`SlotFor`]), the
//! Rust functions its assembly routines call ([`define_callee!`] binds
//! them from the engine's side), and the offsets of the structures its
//! routines read (`crate::base::abi`, checked against the engine's types
//! where they are defined). An architecture without a feature says so
//! here with a constant ([`PUNNING`], [`TRAMPOLINE_COUNTING`],
//! [`TIMED_ROUTINES`]: `None`), never with a stub.
//!
//! The groups, in the order an attach and a hit use them:
//! - **Breakpoints and frames**: [`BREAKPOINT`], [`breakpoint_address`],
//!   [`is_breakpoint`], [`is_breakpoint_at`], [`Frame`], [`frame_of`],
//!   [`frame_pc`], [`set_frame_pc`], [`pc`], [`set_pc`], [`flush_code`].
//! - **Registers as handlers see them**: [`Reg`], [`PC`], [`ARGS`],
//!   [`reg`], [`set_reg`], [`return_address_at`], and the return side's
//!   [`SavedRegs`] / [`SavedVector`] with their return-value accessors.
//! - **Instructions**: [`MAX_INSN_LEN`], [`is_boundary`], [`analyze`]
//!   (emulate, or run out of line in a [`SLOT_SIZE`] slot within
//!   [`REACH_LIMIT`]), [`Emulation`], [`apply`].
//! - **Jumps**: [`JUMP_LEN`], [`Function`], [`jump`] (plan a range,
//!   build its trampoline, the jump's bytes), [`Pun`] and [`PUNNING`],
//!   [`TRAMPOLINE_COUNTING`], the common entry routine
//!   ([`jump_entry`]).
//! - **Returns**: the return trampoline's stubs and unwind rules
//!   ([`trampoline`]), its routine ([`return_entry`]), and the routines
//!   that time a timing probe's calls and track a return probe's by
//!   themselves ([`TIMED_ROUTINES`]).
//! - **USDT**: an argument's location as `<sys/sdt.h>` writes it
//!   ([`usdt`]).

/// The A64 classifier on every other host, for the fuzz target that
/// checks it against an independent decoder (it depends on nothing of
/// the engine).
#[cfg(all(feature = "test-hooks", not(uprobe_arch = "aarch64")))]
#[path = "aarch64/decode.rs"]
#[allow(dead_code)]
pub(crate) mod a64_decode;
#[cfg(uprobe_arch = "aarch64")]
mod aarch64;
pub(crate) mod usdt;
#[cfg(uprobe_arch = "x86_64")]
mod x86_64;

#[cfg(uprobe_arch = "aarch64")]
use aarch64 as imp;
#[cfg(uprobe_arch = "x86_64")]
use x86_64 as imp;

use crate::base::error::AttachError;

// ---- Breakpoints and frames ----------------------------------------------

/// The breakpoint instruction written over a probed instruction's first
/// bytes: `int3` (x86-64), `BRK #5` (aarch64, the kernel's uprobe `BRK`).
pub(crate) use imp::BREAKPOINT;
/// The registers a handler reads and writes: `gregs` (x86-64, the
/// signal frame's or the jump entry's copy in the same layout), the
/// signal frame (aarch64).
pub(crate) use imp::Frame;
/// The probed address a SIGTRAP reports, if a breakpoint instruction
/// raised it. Async-signal-safe.
pub(crate) use imp::breakpoint_address;
/// Makes code just written visible to this CPU's instruction fetch (the
/// caller's `membarrier(SYNC_CORE)` covers the other CPUs).
/// Async-signal-safe.
pub(crate) use imp::flush_code;
/// The [`Frame`] of a signal's context.
pub(crate) use imp::frame_of;
/// Whether bytes start with a breakpoint instruction (ours or anyone's).
pub(crate) use imp::is_breakpoint;
/// Whether the mapped code at an address is a breakpoint instruction.
/// Async-signal-safe.
pub(crate) use imp::is_breakpoint_at;
/// The instruction pointer of a [`Frame`], and setting it.
pub(crate) use imp::{frame_pc, set_frame_pc};
/// The interrupted thread's instruction pointer in a signal's context,
/// and setting it.
pub(crate) use imp::{pc, set_pc};

// ---- Registers -----------------------------------------------------------

/// The integer argument registers of the calling convention, in order
/// (System V: `rdi rsi rdx rcx r8 r9`; AAPCS64: `x0`-`x7`).
pub(crate) use imp::ARGS;
/// The instruction pointer as a [`Reg`] (`Rip`, `Pc`).
pub(crate) use imp::PC;
/// A register as handlers name it.
pub use imp::Reg;
/// Where the function just entered keeps its return address: the stack
/// pointer at entry (which orders frames) and the slot. Async-signal-safe.
pub(crate) use imp::return_address_at;
/// The registers the return trampoline saved (with the return value's
/// accessors), and the vector registers besides them.
pub(crate) use imp::{SavedRegs, SavedVector};
/// The first vector register as a function returns it, and replacing
/// its floating-point value. Async-signal-safe.
pub(crate) use imp::{float_return_bits, set_float_return};
/// A register of a [`Frame`], and setting one. Async-signal-safe.
pub(crate) use imp::{reg, set_reg};

// ---- Instructions ----------------------------------------------------------

/// How a displaced instruction runs at a hit: emulated on the signal
/// frame, or out of line in a slot.
pub(crate) use imp::Emulation;
/// The longest instruction, in bytes.
pub(crate) use imp::MAX_INSN_LEN;
/// How far generated code (slots, trampolines) may lie from the code it
/// serves and still be reached by a direct branch.
pub(crate) use imp::REACH_LIMIT;
/// Bytes per out-of-line slot.
pub(crate) use imp::SLOT_SIZE;
/// Decides how the instruction at an address runs ([`Emulation`]), or
/// why it cannot be probed; a slot comes from the [`SlotFor`] given. Not
/// async-signal-safe.
pub(crate) use imp::analyze;
/// Applies an [`Emulation`] to a signal's context (a thread sent to a
/// slot that ends in a second trap, `Emulation::traps_back`, has its
/// asynchronous signals deferred by the engine). Async-signal-safe.
pub(crate) use imp::apply;
/// Whether an address starts an instruction of the code that starts at
/// another (for ranges a jump may cover).
pub(crate) use imp::is_boundary;

/// How an out-of-line slot ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum SlotEnd {
    /// A branch back to the instruction after the probed one (the slot
    /// lies within [`REACH_LIMIT`] of it).
    JumpBack,
    /// A breakpoint: a second trap takes the thread back (a slot
    /// anywhere).
    TrapBack,
}

/// What the code of a slot at `slot` ending as `end` is, made by the
/// architecture for [`SlotFor`].
pub(crate) type SlotCode<'a> = &'a dyn Fn(usize, SlotEnd) -> Result<Vec<u8>, AttachError>;

/// Where [`analyze`] gets an out-of-line slot: the engine's slot regions
/// (`crate::code::slots::slot_for`). Arguments: the probed address, the
/// instruction's bytes, whether it must lie within reach (it addresses
/// relative to the PC), and its code; returns the slot and how it ends.
pub(crate) type SlotFor =
    fn(usize, &[u8], bool, SlotCode<'_>) -> Result<(usize, SlotEnd), AttachError>;

// ---- Jumps -----------------------------------------------------------------

/// The length of the jump written over a site (`jmp rel32`, `B`).
pub(crate) use imp::JUMP_LEN;

/// The function around a site, as far as the engine knows it: where it
/// starts, its code (the original bytes), and whether its entry is the
/// only way in (no other code branches into its interior, as far as its
/// symbols and unwind tables say).
pub(crate) struct Function<'a> {
    pub(crate) start: usize,
    pub(crate) code: &'a [u8],
    pub(crate) sole_entry: bool,
}

/// A trampoline's header: the address of the cell that names its site
/// (at `CELL_AT`), then the entry routine its full path calls through
/// (at `ENTRY_PTR_AT`); its code starts at `CODE_AT`. Every trampoline
/// is `TRAMPOLINE_SIZE` bytes.
pub(crate) const CELL_AT: usize = 0;
/// See [`CELL_AT`].
pub(crate) const ENTRY_PTR_AT: usize = 8;
/// See [`CELL_AT`].
pub(crate) const CODE_AT: usize = 16;
/// See [`CELL_AT`].
pub(crate) const TRAMPOLINE_SIZE: usize = 256;

/// (address of a copied instruction, its relocated copy), for each
/// instruction a trampoline runs a copy of.
pub(crate) type Moves = Vec<(usize, usize)>;

/// Planning a range for a jump and building its trampoline.
pub(crate) mod jump {
    /// Where a jump into a trampoline lands (past its header).
    pub(crate) use super::imp::jump::ENTRY_AT;
    /// Builds a trampoline at a base address for a plan, with its cell;
    /// returns its code and its [`Moves`](super::Moves).
    pub(crate) use super::imp::jump::build;
    /// Where a trampoline's copy of the probed instruction starts.
    pub(crate) use super::imp::jump::copy_start;
    /// The bytes of the jump from a site into its trampoline.
    pub(crate) use super::imp::jump::jump_bytes;
    /// Where a thread sent to a trampoline by a trap (not its jump)
    /// enters it.
    pub(crate) use super::imp::jump::landing_entry;
    /// Why this thread's vector state makes trampolines unsafe (state the
    /// entry routine does not save), if it does.
    pub(crate) use super::imp::jump::unsaved_vector_state;
    /// The range a jump covers (its instructions, where it starts, what
    /// its trampoline must copy), and making one: over whole instructions
    /// at a site ([`plan`]), or over the probed instruction alone when a
    /// punned jump needs the rest ([`single`]).
    pub(crate) use super::imp::jump::{Plan, plan, single};
}

/// One way to pun a jump over the probed instruction at `start` (see
/// `crate::base::mode::Tactic::Pun`): `prefixes` redundant prefixes, the
/// opcode, and the displacement's low bytes are written (`written` bytes
/// in all, no more than the instruction's); the displacement's high
/// bytes are `fixed`, the bytes already in the code after the written
/// ones. So the jump can only land in `[lo, lo + size)`. Over an
/// instruction at least as long as the jump, the whole jump may be
/// written: nothing fixed, a window as wide as the jump reaches.
pub(crate) struct Pun {
    pub(crate) start: usize,
    pub(crate) prefixes: usize,
    pub(crate) written: usize,
    pub(crate) fixed: Vec<u8>,
    pub(crate) lo: usize,
    pub(crate) size: usize,
}

/// What an architecture that puns jumps (one whose instructions can be
/// shorter than its jump) provides.
pub(crate) struct Punning {
    /// The ways to pun a jump over `len` bytes at `start` whose code is
    /// `code` (one-byte jumps only, if asked; over the padding after
    /// them too, if `padding`).
    pub(crate) puns:
        fn(start: usize, len: usize, code: &[u8], one_byte: bool, padding: bool) -> Vec<Pun>,
    /// The bytes of a punned jump whose stub is at `target`.
    pub(crate) pun_bytes: fn(pun: &Pun, target: usize) -> [u8; JUMP_LEN],
    /// A stub at `at` that goes on to `target`.
    pub(crate) stub: fn(at: usize, target: usize) -> Vec<u8>,
    /// How many bytes after the code from `start` to `end` (`code`, and
    /// what follows) are alignment padding that nothing runs.
    pub(crate) padding_after_code: fn(start: usize, end: usize, code: &[u8]) -> usize,
}

/// How this architecture puns jumps: x86-64 does; on aarch64 every
/// instruction is as long as the `B` that replaces it, so a jump always
/// replaces whole instructions (`None`).
pub(crate) const PUNNING: Option<Punning> = imp::PUNNING;

/// What an architecture whose trampolines count a counting probe's hits
/// themselves (a restartable sequence in the trampoline, no call into
/// the engine) provides.
pub(crate) struct TrampolineCounting {
    /// Whether this process and processor allow it (decided once; not
    /// async-signal-safe the first time).
    pub(crate) enabled: fn() -> bool,
    /// Whether a counter whose CPU slots are `stride` bytes apart,
    /// `cpus` of them, is what the trampolines index.
    pub(crate) fits: fn(stride: usize, cpus: usize) -> bool,
}

/// How trampolines count by themselves: on x86-64; on aarch64 every
/// hit of a counting probe runs the common entry (`None`).
pub(crate) const TRAMPOLINE_COUNTING: Option<TrampolineCounting> = imp::TRAMPOLINE_COUNTING;

/// The common routine a trampoline calls for a hit (in assembly). It
/// saves the registers into a [`jump_entry::JumpFrame`] and calls the
/// hidden symbol `uprobe_core_jump_hit`, which the engine binds with
/// [`define_callee!`] to an `extern "C" fn(&mut JumpFrame, usize) ->
/// HitReturn` whose body is [`jump_entry::hit`].
pub(crate) mod jump_entry {
    /// The callee's body, given the frame and the routine's second
    /// argument: finds the trampoline's cell, runs the engine's hit
    /// (`on_hit(cell, frame)`: whether a handler moved the instruction
    /// pointer) and says how the routine goes on. Async-signal-safe if
    /// `on_hit` is.
    pub(crate) use super::imp::jump_entry::hit;
    /// The routine's address (a trampoline's header names it).
    pub(crate) use super::imp::jump_entry::routine;
    /// What the routine hands its callee (the saved registers, a
    /// [`Frame`](super::Frame) within), and what the callee returns.
    pub(crate) use super::imp::jump_entry::{HitReturn, JumpFrame};
}

// ---- Returns ---------------------------------------------------------------

/// The return trampoline's layout: its stubs, their unwind rules.
pub(crate) mod trampoline {
    /// Whether the stubs' region must lie within reach of the table of
    /// original return addresses.
    pub(crate) use super::imp::trampoline::STUBS_NEAR_TARGETS;
    /// Where a thread goes on from the return trampoline to the original
    /// return address. Async-signal-safe.
    pub(crate) use super::imp::trampoline::return_to;
    /// Whether the calling thread runs with a shadow stack (a hijacked
    /// return would fault).
    pub(crate) use super::imp::trampoline::shadow_stack_enabled;
    /// Writes the stubs' region.
    pub(crate) use super::imp::trampoline::write_region;
    /// DWARF: code alignment, the return address column, the stack
    /// pointer's register, the CIE's initial rule.
    pub(crate) use super::imp::trampoline::{CIE_INSTRUCTIONS, CODE_ALIGN, RA_COLUMN, SP_COLUMN};
    /// Bytes per stub, and where the first starts in the stubs' region.
    pub(crate) use super::imp::trampoline::{FIRST_STUB, STUB_SIZE};
}

/// The return trampoline's routine (in assembly). It saves the
/// registers and calls the hidden symbol `uprobe_core_return_hit`, which
/// the engine binds with [`define_callee!`] to an `extern "C" fn(&mut
/// SavedRegs, &mut SavedVector)`.
pub(crate) mod return_entry {
    /// What every stub calls: the timed return routine where there is
    /// one (it goes on to the return trampoline for whatever it does not
    /// handle itself), else the return trampoline.
    pub(crate) use super::imp::return_entry::routine;
}

/// What an architecture whose timing probes are timed, and whose return
/// probes without an entry handler are tracked, by assembly routines
/// alone (no register frame, no call into Rust) provides.
pub(crate) struct TimedRoutines {
    /// Turns the routines on, given the first return stub's address;
    /// returns the entries a trampoline's header may name, or `None` if
    /// this process and processor do not allow them. Not
    /// async-signal-safe the first time.
    pub(crate) enable: fn(first_stub: usize) -> Option<OwnEntries>,
}

/// The entry routines of [`TimedRoutines`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct OwnEntries {
    /// Times a timing probe's call (the cell's `timed` switch).
    pub(crate) timed: usize,
    /// Tracks a return probe's call (the cell's `returns` switch).
    pub(crate) returns: usize,
}

/// How timing probes are timed, and return probes without an entry
/// handler tracked, without the engine: on x86-64; on aarch64 the
/// engine's path does both (`None`).
pub(crate) const TIMED_ROUTINES: Option<TimedRoutines> = imp::TIMED_ROUTINES;

/// Binds a symbol an architecture's assembly routine calls
/// (`uprobe_core_jump_hit`, `uprobe_core_return_hit`) to a function of
/// the engine: `define_callee!("symbol", path::to::function)`. The
/// engine names its callees; the architecture names no engine code. The
/// symbol is a hidden one-instruction branch to the function.
pub(crate) use imp::define_callee;

// ---- Tests -----------------------------------------------------------------

/// The aarch64 classifier, for the tests that check it against an
/// independent decoder.
#[cfg(uprobe_arch = "aarch64")]
pub use imp::{Class, classify, has_hbc};
