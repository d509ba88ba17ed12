//! Switches and queries for the workspace's benchmarks and tests; no part
//! of the stable API (feature `test-hooks`). The switches that select a
//! "before" variant of a mechanism (`set_*`, `force_trap_back_slots`)
//! exist only with the `bench-variants` feature; without it each
//! mechanism is a constant, so the default build pays nothing for them.

pub mod code;
pub mod objects;

/// The aarch64 classifier (its file built on its own on this host), for
/// the tests and the fuzz target that check it against an independent
/// decoder.
#[cfg(not(uprobe_arch = "aarch64"))]
pub use crate::arch::a64_decode::{Class, classify, has_hbc};
/// The aarch64 classifier, for the tests and the fuzz target that check
/// it against an independent decoder.
#[cfg(uprobe_arch = "aarch64")]
pub use crate::arch::{Class, classify, has_hbc};
pub use crate::site::returns::{Pinning, ReturnHold};
pub use crate::table::lookup::Lookup;

/// Chooses how the trap handler protects its table lookup. Only call
/// it while no probe is attached (it is not synchronised with hits
/// in flight). With a lock, a handler may wait for attach/detach: the
/// SRCU default never does.
#[cfg(feature = "bench-variants")]
pub fn set_lookup(lookup: Lookup) {
    crate::table::lookup::set_mode(lookup);
}

/// Chooses what pending returns hold of their probe: nothing where they
/// owe nothing at their end (the default: they name the probe's switch),
/// an SRCU lease (as the kernel has since 2024) or a reference count
/// (the kernel before it). Applies to probes attached from now on; only
/// call it while no return is pending.
#[cfg(feature = "bench-variants")]
pub fn set_return_hold(hold: ReturnHold) {
    crate::site::returns::set_hold(hold);
}

/// Chooses how an in-flight charge ([`Uprobe::max_active`](crate::Uprobe::max_active))
/// keeps its probe alive: a reference taken by the account on 0 -> 1
/// (the default, as the kernel has since 2020) or one per charge (the kernel before it).
/// Applies to probes attached from now on.
#[cfg(feature = "bench-variants")]
pub fn set_in_flight_pinning(pinning: Pinning) {
    crate::site::returns::set_pinning(pinning);
}

/// Makes the signal deferral of trap-ended slots take one process-wide
/// lock around its flag operations (the kernel's `siglock` before its 2025
/// single-step patch) instead of none. Only while no probe is hit.
#[cfg(feature = "bench-variants")]
pub fn set_locked_deferral(on: bool) {
    crate::entry::deferral::set_locked(on);
}

/// The calling thread's pending returns (for tests).
/// Async-signal-safe.
#[must_use]
pub fn pending_returns() -> usize {
    crate::hit::returns::pending()
}

/// Per-thread stacks of pending returns made so far (the pool grows
/// as threads need them; for tests). Not async-signal-safe.
#[must_use]
pub fn return_stacks() -> usize {
    crate::hit::returns::stacks()
}

/// The lookup in use.
#[must_use]
#[cfg(feature = "bench-variants")]
pub fn lookup() -> Lookup {
    crate::table::lookup::mode()
}

/// Makes out-of-line slots created from now on end in a trap (two
/// traps per hit, asynchronous signals deferred in between) instead
/// of a jump back: the path used where no slot can be had near the
/// code, forced everywhere to measure it.
#[cfg(feature = "bench-variants")]
pub fn force_trap_back_slots(on: bool) {
    crate::code::slots::force_trap_back(on);
}

/// The file and file offset that executable address `addr` of this
/// process was mapped from (what a kernel uprobe on the same code is
/// attached to), if any.
#[must_use]
pub fn file_offset_of(addr: usize) -> Option<(std::path::PathBuf, u64)> {
    crate::process::maps::file_offset_of(addr)
}

/// Makes trampolines made from now on fail as if no free gap were
/// within reach of the probed code (`on`): the probes stay on their
/// breakpoints ([`NotOptimized::NoTrampolineRoom`](crate::NotOptimized::NoTrampolineRoom)).
/// Sites that already have a trampoline keep it. Not
/// async-signal-safe.
pub fn no_trampoline_room(on: bool) {
    crate::code::trampolines::refuse_room(on);
}

/// Whether `ip` is inside an out-of-line slot (for tests that check
/// where signals find a thread). Async-signal-safe.
#[must_use]
pub fn in_xol_slot(ip: usize) -> bool {
    crate::code::slots::origin_of(ip).is_some()
}

/// Which routine an optimized probe's trampoline calls on its way to the
/// probed code (for tests that check which path hits take).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryRoute {
    /// The engine's: registers saved, handlers run in Rust.
    Engine,
    /// The timed entry: a timing probe's calls timed by the routine alone.
    Timed,
    /// The return entry: a return probe's calls tracked by the routine
    /// alone (no entry handler).
    Returns,
}

/// The routine the trampoline of the jump at `addr` calls: `None` if the
/// address does not run through a jump, or the architecture (aarch64)
/// or this process has no routines of its own. Not async-signal-safe.
#[must_use]
pub fn entry_route(addr: usize) -> Option<EntryRoute> {
    use crate::site::jump::Route;
    crate::attach::queries::route(addr).map(|r| match r {
        Route::Engine => EntryRoute::Engine,
        Route::Timed => EntryRoute::Timed,
        Route::Returns => EntryRoute::Returns,
    })
}
