//! What generated code and the architectures' assembly routines share with
//! the engine's Rust: the offsets into the engine's structures that the
//! routines read, and the table the return stubs jump through.
//!
//! Declared here, below both sides, so that an architecture reads them
//! without knowing the types; each type checks, where it is defined, that
//! it has exactly this layout (a `const` assertion: a change to one side
//! alone does not compile). The kernel's `asm-offsets` play this part.

use std::sync::atomic::AtomicUsize;

/// `site::jump::JumpCell` (`#[repr(C)]`): where its `counter` pointer (a
/// counting probe's per-CPU counter, or null) and its `timed` pointer (a
/// timing probe's switch, or null) are.
pub(crate) const JUMP_CELL_COUNTER_AT: usize = 24;
/// See [`JUMP_CELL_COUNTER_AT`].
pub(crate) const JUMP_CELL_TIMED_AT: usize = 32;
/// `site::jump::JumpCell`: where its `returns` pointer (a return probe's
/// switch, for the return entry routine, or null) and its `return_hits`
/// pointer (that probe's per-CPU hit counters, slot 0) are. The probed
/// address is its first word.
pub(crate) const JUMP_CELL_RETURNS_AT: usize = 48;
/// See [`JUMP_CELL_RETURNS_AT`].
pub(crate) const JUMP_CELL_RETURN_HITS_AT: usize = 56;

/// Buckets of a latency histogram: bucket `k` counts calls of `[2^k,
/// 2^(k+1))` nanoseconds (bucket 0 also counts 0).
pub(crate) const LATENCY_BUCKETS: usize = 64;
/// `site::timing::LatencyCell` (`#[repr(C)]`, one per CPU): where its
/// buckets start, and its size.
pub(crate) const LATENCY_BUCKETS_AT: usize = 8;
/// See [`LATENCY_BUCKETS_AT`].
pub(crate) const LATENCY_CELL_SIZE: usize = 640;

/// Timed calls a thread may have pending; a call past it is counted but
/// not timed.
pub(crate) const MAX_TIMED_DEPTH: usize = 32;
/// `hit::timing::TimedStack` (`#[repr(C)]`): its depth, its entries, and
/// the size of one (its slot, start, switch and generation words).
pub(crate) const TIMED_DEPTH_AT: usize = 0;
/// See [`TIMED_DEPTH_AT`].
pub(crate) const TIMED_ENTRIES_AT: usize = 8;
/// See [`TIMED_DEPTH_AT`].
pub(crate) const TIMED_ENTRY_SIZE: usize = 32;

/// Pending returns a thread may have (the kernel's `max_uretprobe_depth`);
/// a return probe hit past it is not tracked and counts as missed.
pub(crate) const MAX_RETURN_DEPTH: usize = 64;
/// `hit::returns::ThreadReturns` (`#[repr(C)]`): a thread's stack of
/// pending returns. Its timed calls (a `TimedStack`) come first, then the
/// depth and the pending returns of its other probes, each
/// [`RETURN_SIZE`] bytes: the slot of its return address, the probed
/// function, the original return address, the cookie, the switch and
/// generation it names (a null switch: it names nothing, or holds a
/// lease), then a byte each for "charged" and "pinned".
pub(crate) const RETURNS_TIMED_AT: usize = 0;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURNS_DEPTH_AT: usize = TIMED_ENTRIES_AT + TIMED_ENTRY_SIZE * MAX_TIMED_DEPTH;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURNS_AT: usize = RETURNS_DEPTH_AT + 8;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_SIZE: usize = 80;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_SLOT_AT: usize = 0;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_FUNC_AT: usize = 8;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_RET_AT: usize = 16;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_COOKIE_AT: usize = 24;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_SWITCH_AT: usize = 32;
/// See [`RETURNS_TIMED_AT`].
pub(crate) const RETURN_GENERATION_AT: usize = 40;
/// See [`RETURNS_TIMED_AT`]: `charged`, then `pinned`, one byte each.
pub(crate) const RETURN_CHARGED_AT: usize = 48;

/// Call sites a process can have return stubs for.
pub(crate) const MAX_STUBS: usize = 16 * 1024;
/// The multiplier of the hash that picks the first stub tried for a
/// return address: `(ret * STUB_HASH >> 40) % MAX_STUBS`.
pub(crate) const STUB_HASH: usize = 0x9e37_79b9_7f4a_7c15;
/// The original return address of each return stub (0: unused). Assigned
/// by hashing the return address; entries are never removed, so a stub's
/// target never changes once set. Each stub jumps through its entry.
pub(crate) static STUB_TARGETS: [AtomicUsize; MAX_STUBS] =
    [const { AtomicUsize::new(0) }; MAX_STUBS];
