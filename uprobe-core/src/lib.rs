//! In-process uprobes: breakpoints patched over instructions of the running
//! process, handled by a SIGTRAP engine assembled from the workspace's
//! primitives (`srcu`, `percpu-rwsem`, `pcpu-freelist`, `sigpending`).
//!
//! ```no_run
//! # #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
//! # fn main() -> Result<(), uprobe_core::AttachError> {
//! use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
//! use uprobe_core::Uprobe;
//!
//! static BYTES: AtomicU64 = AtomicU64::new(0);
//! let probe = Uprobe::in_object("libc.so.6", "malloc")?
//!     .on_entry(|cx| {
//!         BYTES.fetch_add(cx.arg(0).unwrap_or(0), Relaxed);
//!     })
//!     .attach()?;
//! let v = std::hint::black_box(Vec::<u8>::with_capacity(4096));
//! drop(v);
//! println!("{} mallocs, {} bytes", probe.hits(), BYTES.load(Relaxed));
//! # Ok(())
//! # }
//! # #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
//! # fn main() {}
//! ```
//!
//! **Status**: entry, return and timing probes on x86-64 and aarch64
//! ([what differs there](docs::aarch64)); on both, probes run without a
//! trap wherever the site allows ([`Probe::mode`], [how](docs::hits)); on
//! other architectures the crate builds with its error type only.
//!
//! **What a hit costs**: a probe on a breakpoint costs a signal round trip
//! (microseconds, as the kernel's uprobes do); one that runs through a jump
//! into its trampoline costs a call with a register frame (tens of
//! nanoseconds); a counting probe's trampoline counts by itself (a few
//! nanoseconds). The repository's README has the figures, with the command
//! that measures them on your machine.
//!
//! # Attaching
//! [`Uprobe::function`] (the executable, then every loaded library),
//! [`Uprobe::in_object`] (`"libc.so.6"`, or a path), [`Uprobe::file_offset`]
//! (as kernel uprobes take it) and [`Uprobe::at`] look the code up in the
//! ELF symbol tables and check that the address starts an instruction
//! (decoding from the function's start); exported names are resolved
//! through the dynamic linker, so an IFUNC like `memcpy` reaches the
//! implementation the program calls. The `unsafe` [`Uprobe::address`] is
//! the opt-in for code no symbol covers. [`Uprobe::attach_all`] and
//! [`Probe::detach_all`] pay one grace period for a batch, one look at
//! the memory map, the threads and the loaded objects, and one
//! instruction-stream sync (breakpoints are written page by page). The
//! probe table grows as needed (readers never lock and never see a
//! half-built table; an outgrown table is freed after a grace period).
//!
//! **Code that goes away.** Detaching a probe whose code was unmapped
//! (`dlclose`) succeeds: there is nothing to restore. A probe attached
//! where other code has been loaded since finds its own breakpoint
//! missing and starts afresh, so an old probe never swallows a new one.
//!
//! **The SIGTRAP handler is the engine's.** A program that replaces it
//! after probes are attached (`sigaction`, `signal`) would have hits
//! reach its handler and resume in the middle of the probed
//! instruction. The engine checks the disposition at every attach and
//! detach: if it was replaced, every probe is disarmed (original bytes
//! restored; [`Probe::is_armed`] turns false) and attach fails with
//! [`AttachError::TrapHandlerReplaced`] until the engine's handler is
//! back. Hits between the replacement and the next check still reach
//! the program's handler: a program that manages SIGTRAP itself should
//! do so before attaching, or detach first.
//!
//! Refused at attach, with a typed [`AttachError`]: addresses outside
//! executable mappings, inside an instruction, inside an rseq critical
//! section (the kernel would move a trapping thread to the abort handler),
//! over someone else's breakpoint; instructions from the kernel's refusal
//! tables (and transactional memory, far branches), except where the
//! instruction runs unchanged at another address (x86-64: `lock`-prefixed
//! read-modify-writes, the segment overrides 64-bit mode ignores, fences,
//! `stmxcsr`, `xgetbv` and `rdtscp` are probed; aarch64: exclusive loads
//! and stores stay refused, since a trap between the pair breaks it); any
//! attach while a
//! thread of the process blocks SIGTRAP; and, in the functions glibc runs
//! with every signal blocked (thread start and exit, `posix_spawn` and its
//! child, among them `free`, `madvise`, `strlen`, `dup2` and `execve`),
//! where a breakpoint hit would kill the process or the child being
//! spawned, the sites that take no one-byte jump (x86-64: see
//! [`docs::hits`])
//! ([`AttachError::SignalsBlocked`]); [`Uprobe::allow_blocked_signal_paths`]
//! says how they were found and is the opt-out.
//!
//! # Many functions at once
//! [`functions::matching`] lists the functions of a loaded object (or of
//! all of them) whose names a filter accepts, as `bpftrace`'s
//! `uprobe:libc:str*` does; [`functions::Function::uprobe`] probes one.
//!
//! # Stacks
//! [`EntryContext::user_stack`] walks the calling frames of a hit with
//! the objects' call-frame information (no frame pointers needed), through
//! the engine's trampolines and return stubs, without allocating: see
//! [`unwind`].
//!
//! # USDT probes
//! The [`usdt`] module lists the statically defined tracepoints of a
//! loaded object (`.note.stapsdt`, as `<sys/sdt.h>` declares them);
//! [`Uprobe::usdt`] probes them, holding each probe's semaphore while
//! attached, and handlers read the arguments with
//! [`EntryContext::usdt_arg`]. A USDT site is a 1-byte `nop` (a punned
//! jump, where its window has room) or, from newer `<sys/sdt.h>`, a
//! 5-byte one: trap-free either way.
//!
//! # Guides
//! How a hit runs and what it costs, return and timing probes, aarch64,
//! and the rules for handlers and programs: the [`docs`] pages.
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "uprobe-core supports Linux only: it patches code through /proc/self/maps and membarrier \
     and handles SIGTRAP as Linux delivers it"
);

#[cfg(uprobe_engine)]
pub mod docs;

// The engine runs on x86-64 and aarch64; elsewhere the crate builds with
// just its error type. Each folder is a layer that uses only the layers
// above it in this list (ARCHITECTURE.md draws them; the workspace's
// `module_layers` test checks it).
#[cfg(uprobe_engine)]
mod api;
#[cfg(uprobe_engine)]
mod arch;
#[cfg(uprobe_engine)]
mod attach;
mod base;
#[cfg(uprobe_engine)]
mod code;
#[cfg(uprobe_engine)]
mod entry;
#[cfg(uprobe_engine)]
mod hit;
#[cfg(uprobe_engine)]
mod patch;
#[cfg(uprobe_engine)]
mod process;
#[cfg(uprobe_engine)]
mod site;
#[cfg(uprobe_engine)]
mod table;

#[cfg(uprobe_engine)]
pub use api::{functions, memory, usdt};
#[cfg(uprobe_engine)]
pub use hit::unwind;

#[cfg(uprobe_engine)]
pub use api::memory::{CodeMemory, code_memory};
#[cfg(uprobe_engine)]
pub use api::probe::Probe;
#[cfg(uprobe_engine)]
pub use api::uprobe::Uprobe;
#[cfg(uprobe_engine)]
pub use arch::Reg;
pub use base::error::{AttachError, BlockedPath, DetachError, Errno};
#[cfg(uprobe_engine)]
pub use base::mode::{Mode, NotOptimized, Tactic};
#[cfg(uprobe_engine)]
pub use site::context::{EntryContext, ReturnContext};
#[cfg(uprobe_engine)]
pub use site::count::{CountCell, count_cells};
#[cfg(uprobe_engine)]
pub use site::timing::{LATENCY_BUCKETS, LatencyCell, latency_cells};

/// Makes probe hits of the calling thread observed or not, and returns
/// whether they were. A hit in a thread that is not observed runs no
/// handler, entry or return, and counts nothing (not even as missed): for
/// a tool's own threads, whose calls to probed functions (`malloc` while
/// it reports) are not the program's. The engine's own service threads
/// are not observed. Threads start observed; a fork child's thread
/// inherits its parent's setting. **Async-signal-safe** (one
/// thread-local store); from a handler, it takes effect at the thread's
/// next hit after the handler.
///
/// ```
/// # #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))] {
/// use uprobe_core::{Uprobe, set_thread_observed};
/// #[inline(never)]
/// extern "C" fn tick(x: u64) -> u64 { std::hint::black_box(x + 1) }
/// // SAFETY: a function's address is an instruction's first byte.
/// let probe = unsafe { Uprobe::address(tick as usize) }.attach()?;
/// tick(1);
/// assert!(set_thread_observed(false));
/// tick(2);
/// assert!(!set_thread_observed(true));
/// tick(3);
/// assert_eq!(probe.hits(), 2);
/// # }
/// # Ok::<(), uprobe_core::AttachError>(())
/// ```
#[cfg(uprobe_engine)]
#[allow(clippy::must_use_candidate)] // called for its effect; the old setting is a convenience
pub fn set_thread_observed(observed: bool) -> bool {
    base::thread::set_observed(observed)
}

/// Frees what the engine keeps only to make later attaches faster: the
/// symbol indexes of the objects it looked at and their rseq critical
/// sections (read again when needed). For a program, or a tool's agent,
/// that detached its probes and will not attach for a while. Generated
/// code (trampolines, slots, return stubs) stays: a thread may still run
/// it. Not async-signal-safe.
#[cfg(uprobe_engine)]
pub fn release_caches() {
    process::symbols::forget_indexes();
    process::threads::forget_rseq_sections();
}

/// Hooks for the workspace's benchmarks and tests (feature `test-hooks`,
/// which `bench-variants` turns on too); no part of the stable API.
#[cfg(all(uprobe_engine, feature = "test-hooks"))]
#[doc(hidden)]
pub mod testing;
