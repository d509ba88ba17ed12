//! What handlers may do, and the rules a probed program must keep.
//!
//! Read this before writing a handler.
//!
//! # What handlers may do
//! They run **inside the signal handler (a trap) or called from the
//! trampoline (a jump), on the interrupted thread's stack** (not on an
//! alternate stack: Rust threads' are small, and a signal frame is ~3.4
//! KB), in the middle of whatever the thread was doing, so they must be
//! async-signal-safe either way: no
//! allocation, no lock the interrupted code may hold, no `println!`. A
//! probe hit while the thread is already inside the engine (a handler
//! calling a probed function, or the engine's own code) runs no handler,
//! is counted as missed, and still executes the instruction. A handler
//! that panics aborts the process with a message (unwinding through a
//! signal frame or a trampoline is not possible). Detaching waits until no handler of the
//! probe runs; it must not be called from a handler.
//!
//! # Rules for the program
//! - A thread that blocks SIGTRAP must never run probed code: the kernel
//!   turns such a trap into the default action and the process dies.
//!   `attach` refuses while one exists and refuses glibc's own
//!   signal-blocked paths, but code of the program (or of another C
//!   library) that blocks SIGTRAP around calls to probed functions is the
//!   program's responsibility.
//! - A thread's stack pointer must leave room for a signal frame below it
//!   whenever it runs probed code, as for any signal.
//! - After `fork`, the child keeps the probes (breakpoints, table and
//!   handler are inherited) and runs probed code normally.
//! - A kernel uprobe (`perf`, `bpftrace`) on the same instruction of the
//!   same file is not compatible: attached first, it is someone else's
//!   breakpoint and attach refuses the address; attached while a probe of
//!   ours is there, its detach writes the file's original byte back over
//!   our breakpoint or jump. Probe different code, or one at a time.

#[allow(unused_imports)] // the names the links above resolve to
use crate::{
    AttachError, CountCell, EntryContext, LatencyCell, Mode, NotOptimized, Probe, ReturnContext,
    Tactic, Uprobe, code_memory, functions, latency_cells, set_thread_observed, unwind, usdt,
};
