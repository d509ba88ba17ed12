//! In-process uprobes: breakpoints patched over instructions of the running
//! process, handled by a SIGTRAP engine assembled from the workspace's
//! primitives.
//!
//! **Status.** This is the first part of the engine: entry probes on
//! x86-64 by address, with the displaced instruction *emulated* in the
//! trap handler (every `nop` form, `endbr64`, `push reg`, `jmp`/`call`/`jcc`
//! with relative targets, `ret`). Other instructions are refused at attach
//! with the instruction and the reason; out-of-line execution, symbol
//! lookup, return probes and aarch64 are being built (see the workspace's
//! issues).
//!
//! # How a hit works
//! `attach` analyses the instruction, publishes it in a probe table, then
//! writes `int3` over its first byte (keeping the page executable, then
//! `membarrier(SYNC_CORE)`). A thread that executes it traps; the engine's
//! SIGTRAP handler (installed once, `SA_SIGINFO | SA_NODEFER`, chaining
//! every trap that is not its own to the handler installed before it) finds
//! the site in an SRCU-protected table, runs the consumers' handlers with
//! the thread's registers ([`EntryContext`]), then applies the displaced
//! instruction to the registers and returns: one trap per hit.
//!
//! Handlers run **inside the signal handler, on the interrupted thread's
//! stack** (not an alternate stack: Rust threads' are small, and a signal
//! frame is ~3.4 KB), so they must be async-signal-safe. A probe hit while
//! the thread is already inside the engine (a handler calling a probed
//! function) runs no handler, is counted as missed, and still executes.
//! A handler that panics aborts the process with a message.
//!
//! Threads that block SIGTRAP must not run probed code: the kernel turns
//! such a trap into the default action (the process dies).
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

// The engine is x86-64 only so far; elsewhere the crate builds with just
// its error type.
#[cfg(target_arch = "x86_64")]
mod checks;
#[cfg(target_arch = "x86_64")]
mod deferral;
#[cfg(target_arch = "x86_64")]
mod engine;
mod error;
#[cfg(target_arch = "x86_64")]
mod lookup;
#[cfg(target_arch = "x86_64")]
mod maps;
#[cfg(target_arch = "x86_64")]
mod probe;
#[cfg(target_arch = "x86_64")]
mod symbols;
#[cfg(target_arch = "x86_64")]
mod x86_64;
#[cfg(target_arch = "x86_64")]
use x86_64 as arch;

#[cfg(target_arch = "x86_64")]
pub use arch::{EntryContext, Reg};
pub use error::AttachError;
#[cfg(target_arch = "x86_64")]
pub use probe::{Probe, Uprobe};

/// Switches for the workspace's benchmarks; not part of the stable API.
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub mod bench_only {
    pub use crate::lookup::Lookup;

    /// Chooses how the trap handler protects its table lookup. Only call
    /// it while no probe is attached (it is not synchronised with hits
    /// in flight). With a lock, a handler may wait for attach/detach: the
    /// SRCU default never does.
    pub fn set_lookup(lookup: Lookup) {
        crate::lookup::set_mode(lookup);
    }

    /// The lookup in use.
    #[must_use]
    pub fn lookup() -> Lookup {
        crate::lookup::mode()
    }

    /// Makes out-of-line slots created from now on end in a trap (two
    /// traps per hit, asynchronous signals deferred in between) instead
    /// of a jump back: the path used where no slot can be had near the
    /// code, forced everywhere to measure it.
    pub fn force_trap_back_slots(on: bool) {
        crate::arch::force_trap_back(on);
    }

    /// Whether `ip` is inside an out-of-line slot (for tests that check
    /// where signals find a thread). Async-signal-safe.
    #[must_use]
    pub fn in_xol_slot(ip: usize) -> bool {
        crate::arch::origin_of(ip).is_some()
    }
}
