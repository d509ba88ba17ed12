//! Return probes: the stubs, pending returns, their lifetime, threads, limits.
//!
//! What [`Uprobe::on_return`] does, at the entry and at the return.
//!
//! [`Uprobe::on_return`] runs a handler when the probed function returns
//! ([`ReturnContext`]: integer and floating-point return values, the
//! function, the original return address, the thread, a cookie the entry
//! handler set: a *session*). At the entry trap the engine replaces the
//! return address with that of a **stub** of its return trampoline, one
//! stub per call site; the function returns into plain code (no second
//! trap) that saves the registers, runs the return handlers, restores
//! them and jumps to the original return address, which the stub itself
//! names. Each pending return is an instance on the thread's stack
//! (at most 64; more are counted in [`Probe::missed_returns`], as are
//! returns past [`Uprobe::max_active`]); a tail call or a second consumer
//! finds the stub already in place and chains onto the same return.
//!
//! - **Cost**: a return probe with no entry handler and no thread filter
//!   (the common case: `on_return` alone, whose returns hold nothing) on
//!   a site that runs through a jump costs what a timing probe
//!   ([`Uprobe::time_into`]) costs at its entry, plus its handler: on
//!   x86-64 the trampoline calls a routine of its own that counts the hit
//!   and pushes the pending return with no register frame and no call
//!   into Rust; only the return runs the engine's trampoline (the
//!   handler sees the full [`ReturnContext`] and may change the return
//!   value). Whatever that routine cannot handle (a tail call's chained
//!   return, frames left by `longjmp`, a thread inside the engine or
//!   without a restartable sequence, a call site without a stub yet)
//!   goes to the engine's entry, which does the same work the slow way.
//!   A probe with an entry handler, a thread filter, a lease (see below),
//!   or another probe on its site, runs the engine's entry; so does every
//!   probe on aarch64 and on a breakpoint.
//! - **Lifetime**: by default a pending return holds nothing of its
//!   probe. It names the probe's switch (a word the engine never frees)
//!   and the switch's generation, and the return looks the handler up
//!   through it inside a read section of the probe table's domain, as the
//!   kernel's `handle_uretprobe_chain` walks only the consumers live at
//!   the return. [`Probe::detach`] returns once no handler of the probe
//!   runs or will run, without waiting for pending returns: those return
//!   normally, without the handler, and the handler is freed at once.
//!   A probe with [`Uprobe::max_active`] (its return must give back its
//!   in-flight charge) or [`Uprobe::return_after_detach`] (its return
//!   handler must see every call) has each pending return hold an `srcu`
//!   *lease* on it instead (as the kernel's uretprobes since 2024), not a
//!   reference count: leases older than 100 ms expire into references, so
//!   a function that never returns delays nothing. With
//!   `return_after_detach` the handler of a call pending at detach runs at
//!   that call's return, after the detach, and is freed after the last
//!   such return.
//! - **Frames left without returning**: after `longjmp`, an instance
//!   whose stack slot the stack pointer has risen above is dropped at the
//!   thread's next probe hit or probed return (counted as missed).
//!   **Unwinding** (a Rust panic, a C++ exception, `pthread_exit`) through
//!   a hijacked frame works: the stubs have DWARF unwind information that
//!   gives the original return address, so the unwinder reaches the real
//!   caller; the instance is then dropped the same way. Backtraces through
//!   a pending return show the stub, then the real caller.
//! - **Threads** that exit with returns pending (even by `exit(2)` in the
//!   middle of a probed call) release them: a service thread notices that
//!   the thread is gone within about 20 ms. Each thread's stack of
//!   pending returns comes from a pool that the trap handler only pops
//!   from (no allocation there); the pool grows in ordinary context: an
//!   attach of a return probe makes room for twice the threads the process
//!   has, and the service thread adds a chunk whenever fewer than a
//!   quarter of the stacks are free (up to 65,280 threads). A thread that
//!   finds the pool empty in a burst of new threads has that return
//!   counted as missed. A fork child keeps the forking thread's pending
//!   returns. The service thread, the lease set's expiry thread and the
//!   return domain's reclaimer run only while return probes are attached
//!   (and leases are left to expire): a program that detached every
//!   return probe keeps no thread of the engine's; the next return probe
//!   starts them again (the stacks of threads that died meanwhile are
//!   released then).
//! - **Refused**: a return handler on a probe that is not at a function's
//!   first instruction ([`AttachError::ReturnProbeNotAtEntry`]), and any
//!   return probe while the thread runs with an x86 shadow stack or an
//!   arm64 guarded control stack ([`AttachError::ShadowStack`]: a hijacked
//!   return would fault).
//! - **Limits**: a return probe hit on a signal alternate stack placed
//!   above the thread's stack can make older pending returns look
//!   abandoned (their handlers then do not run; the program still returns
//!   correctly); the trampoline preserves the caller-saved general
//!   registers, the flags and the caller-saved vector registers (x86-64:
//!   `xmm0`-`xmm15`; aarch64: `q0`-`q7`, `q16`-`q31`, but x16, which it
//!   uses as a veneer may), not the upper halves of `ymm`/`zmm`/SVE `z`
//!   registers or the x87 stack (the engine's code does not touch them).

#[allow(unused_imports)] // the names the links above resolve to
use crate::{
    AttachError, CountCell, EntryContext, LatencyCell, Mode, NotOptimized, Probe, ReturnContext,
    Tactic, Uprobe, code_memory, functions, latency_cells, set_thread_observed, unwind, usdt,
};
