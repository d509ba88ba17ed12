//! Timing probes: a call count and a latency histogram without a handler.
//!
//! What [`Uprobe::time_into`] does, and where it runs without the engine.
//!
//! [`Uprobe::time_into`] makes a probe at a function's entry that counts
//! its calls and adds each call's time to return (nanoseconds) to a log2
//! histogram, in [`LatencyCell`]s the caller provides (one per possible
//! CPU and one more, [`latency_cells`]; a `MAP_SHARED` mapping another
//! process reads works). No handler runs, so nothing needs the register
//! frame, the read section or the lease of a return probe:
//!
//! - **On x86-64, where the site runs through a jump and the timing probe
//!   is its only probe**, the trampoline calls a routine of its own that
//!   counts the call in its CPU's cell (a restartable sequence), pushes
//!   the call on the thread's stack of timed calls with the TSC, and
//!   swaps the return address for the call site's stub; the stub calls a
//!   routine that pops it, reads the TSC again and adds one to the
//!   bucket in its CPU's cell (another restartable sequence). Each saves only the
//!   registers it uses (and the status flags with `lahf`/`seto`, not
//!   `pushfq`). It needs the TSC as the kernel's clocksource (its scale
//!   is measured once against `CLOCK_MONOTONIC_RAW`), BMI2 and `lzcnt`,
//!   and glibc's rseq registration; anything it does not handle (a
//!   thread inside the engine or not observed, a thread's first return
//!   probe hit, a call site without a stub yet, a full stack, a chained
//!   or abandoned call, a return probe's instance on the same frame) goes
//!   to the engine's routines with every register as it was.
//! - **Elsewhere** (a breakpoint site, another probe on the same address,
//!   aarch64, no TSC) the engine does the same work on its ordinary path.
//!
//! A call that cannot be tracked (32 timed calls pending on the thread,
//! more than 16384 call sites, left by `longjmp` or unwinding, nested in
//! the engine) is counted, not timed. Once the probe's detach returns,
//! nothing writes to its cells, not even a call that was pending then
//! (each pending call names the probe's *switch*, which the detach turns
//! off; see the source's `site::timing`). Measured with `bench
//! uretprobe-entry` (its `uprobe-core+time` row).

#[allow(unused_imports)] // the names the links above resolve to
use crate::{
    AttachError, CountCell, EntryContext, LatencyCell, Mode, NotOptimized, Probe, ReturnContext,
    Tactic, Uprobe, code_memory, functions, latency_cells, set_thread_observed, unwind, usdt,
};
