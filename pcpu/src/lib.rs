//! Per-CPU data for userspace, the foundation of the `kscale` crates.
//!
//! The Linux kernel scales its hottest paths with per-CPU data: each CPU
//! writes only its own cache line, and the rare reader of "all of it" sums.
//! Userspace cannot disable preemption, but it can come close:
//!
//! - [`current_cpu()`] reads the CPU id that the kernel keeps in glibc's
//!   registered rseq area (one load), falling back to `sched_getcpu()`;
//! - [`possible_cpus()`] sizes per-CPU arrays from the kernel's possible
//!   mask (never from the affinity mask);
//! - [`PerCpu<T>`] holds one cache-padded slot per possible CPU plus an
//!   overflow slot for CPU ids beyond it;
//! - [`rseq`] runs per-CPU updates as restartable sequences: plain stores
//!   that the kernel restarts on preemption, ~7x cheaper than an atomic
//!   `fetch_add`, with atomic fallbacks where rseq is not registered;
//!   [`PerCpuCounter`] and [`PerCpuStack`] are built on them;
//! - [`fence`] pairs a compiler-only fence on the hot side with
//!   `membarrier()` on the cold side (asymmetric fences);
//! - `unstable` (hidden from these docs, **not** a semver promise) holds
//!   what only the sibling crates of this family use: the loom shim the
//!   whole workspace model-checks with (`unstable::sync`, futex
//!   wait/wake included), the lock-free list on which signal handlers
//!   leave work for ordinary context (`unstable::owed`), and the modelled
//!   CPU ids under loom (`unstable::loom_cpu`), the monotonic clock
//!   (`unstable::time`) and the slot of a test hook (`unstable::hook`).
//!
//! # Async-signal safety
//! Each item says whether it may be called from a signal handler. In short:
//! reading the CPU id, the rseq operations, the counters, the `try_`
//! operations of [`PerCpuStack`], both fences and the futex wait/wake are
//! async-signal-safe; constructors (which allocate) are not. The rseq area
//! and membarrier are looked up from a load-time constructor, so nothing
//! initialises lazily inside a handler.
//!
//! # Fork
//! A child inherits rseq registration and membarrier registration; per-CPU
//! data is copied as it was. A [`PerCpuStack`] lock held by another thread
//! at `fork()` stays held in the child (that thread does not exist there):
//! only the `try_` operations are safe on such a stack in the child.
//!
//! # Targets
//! Linux only (glibc's rseq area, futex, membarrier); other systems get a
//! `compile_error!`. On x86-64 and aarch64 the CPU id comes from the rseq
//! area and the per-CPU operations are restartable sequences (x86-64; on
//! aarch64 the atomic fallbacks for now). On any other Linux architecture
//! the crate builds its generic paths: the CPU id from `sched_getcpu`, the
//! atomic fallbacks for every operation. `--cfg pcpu_force_generic`
//! builds those paths on x86-64 and aarch64 too (CI tests the whole
//! family that way). Where `sched_getcpu` is a system call (no rseq
//! area, and no vDSO `getcpu`: aarch64 and most others), [`PerCpu`]
//! picks a thread's slot by the id it read last, read again every 64
//! uses, rather than making a system call per use.
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "pcpu supports Linux only: it reads glibc's rseq area and uses futex and membarrier"
);

mod counter;
mod cpu;
pub mod fence;
mod per_cpu;
pub mod rseq;
#[cfg(not(pcpu_loom))]
mod rseq_area;
mod stack;

/// Plumbing the sibling crates of this family share: **not part of the
/// stable API**. Anything here may change or go away in any release,
/// patch releases included; depend on it only from those crates (which
/// pin this crate's exact version).
#[doc(hidden)]
pub mod unstable {
    // The benchmarks' floor: no model (the real sections only).
    #[cfg(not(pcpu_loom))]
    pub mod bare_stack;
    pub mod hook;
    #[cfg(pcpu_loom)]
    pub mod loom_cpu;
    pub mod owed;
    pub mod sync;
    pub mod syscall;
    pub mod time;
}
#[cfg(pcpu_loom)]
pub(crate) use unstable::loom_cpu;
pub(crate) use unstable::sync;

pub use counter::PerCpuCounter;
#[cfg(not(pcpu_loom))]
pub use cpu::sched_getcpu;
pub use cpu::{current_cpu, possible_cpus};
pub use per_cpu::PerCpu;
pub use stack::{LocalPop, PerCpuStack, WouldBlock};
