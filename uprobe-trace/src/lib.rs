//! `uprobe-trace`: trace a program you did not write, in its own process,
//! whether it starts it or the program already runs.
//!
//! ```sh
//! uprobe-trace -f malloc,free -- python3 script.py
//! uprobe-trace -l -f libz.so.1:deflate -- gzip -9 big.txt
//! uprobe-trace -p 1234 -f 'libsqlite3.so.0:sqlite3_*' -x '*_v2' -d 10
//! uprobe-trace -p 1234 --print -f 'open(str,int)' --hist read:ret
//! uprobe-trace --print -u 'python:function__entry(str,str,int)' -- python3 script.py
//! ```
//!
//! **Starting the program** (`-- PROGRAM`), the tool runs it with this
//! crate's shared library preloaded (`LD_PRELOAD`: no ptrace, no root).
//! **A running process** (`-p PID`), the tool stops one of its threads
//! with ptrace just long enough to make it `dlopen` the library and start
//! a session (see the binary's `inject` module for where a thread may be
//! borrowed), and lets it go; the other threads run on. Either way the
//! library (the *agent*) attaches [`uprobe_core`] probes on a thread of
//! its own, trap-free where the site allows, and each hit counts into a
//! report in shared memory that the tool prints: per probe the calls;
//! for `--latency` a log2 histogram of the time to return; for
//! `--hist FUNCTION:argN` or `:ret` a log2 histogram of the value, as
//! `bpftrace`'s `hist()` draws them; `--print` adds a line per hit with
//! its arguments (typed: `malloc(size_t)`, `open(str,int)`) and one per
//! return with the value; `--json FILE` writes the report as JSON;
//! `--stacks FILE` counts the user stack of each hit (unwound with the
//! objects' call-frame information, no frame pointers needed) and writes
//! them symbolized and folded, for flame graphs; `--metrics ADDR` serves
//! the live counts and histograms in the `OpenMetrics` text format, for
//! Prometheus to scrape.
//! Function names may be patterns (`str*`, `libc.so.6:*alloc*`), with
//! `-x` to leave names out: each matched function is counted on its own,
//! or says why it is not attached.
//!
//! Tracing ends when the program exits, on Ctrl-C or SIGTERM, or after
//! `--duration`; the agent then detaches every probe (every patched byte
//! back, no handler armed, its thread gone) and the report is printed. In
//! a process started with `--`, the program then runs on untraced.
//!
//! The report survives what the program does: it is shared memory the
//! agent maps once (closing every file descriptor does not unmap it), its
//! fork children add into it, the programs it execs get the agent again
//! through the environment (unless `--no-follow`), and every count is
//! stored when it happens (`_exit` loses nothing). Probes on objects
//! loaded later (`dlopen`) are attached when they appear.
//!
//! Refused with a message: a program that cannot be preloaded (statically
//! linked, setuid or setgid); a process ptrace may not trace (another
//! user's, `kernel.yama.ptrace_scope`, one already traced), saying which
//! setting to change.
//!
//! The library half of this crate is that agent plus what the tool shares
//! with it: the probe specs ([`spec`]) and their filters ([`filter`]),
//! function names as people write them ([`names`]) and the report's
//! layout ([`shared`]).
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_os = "linux"))]
compile_error!("uprobe-trace supports Linux only (LD_PRELOAD, uprobe-core)");

#[cfg(all(
    any(target_arch = "x86_64", target_arch = "aarch64"),
    not(pcpu_force_generic)
))]
mod agent;
pub mod by;
pub mod filter;
pub mod names;
pub mod shared;
pub mod spec;

/// Separates the fields of the settings the tool hands an agent it loads
/// into a running process (`uprobe_trace_attach`).
pub const ATTACH_FIELD: char = '\u{1d}';

/// The environment variables the tool hands the agent.
pub mod env {
    /// The report file's path.
    pub const REPORT: &str = "UPROBE_TRACE_REPORT";
    /// The probes, encoded by [`spec::encode`](crate::spec::encode).
    pub const PROBES: &str = "UPROBE_TRACE_PROBES";
    /// The file descriptor `--print` lines go to.
    pub const PRINT_FD: &str = "UPROBE_TRACE_PRINT_FD";
    /// The `--flow` file's path.
    pub const FLOW: &str = "UPROBE_TRACE_FLOW";
    /// `0`: programs the traced one runs are not traced.
    pub const FOLLOW: &str = "UPROBE_TRACE_FOLLOW";
    /// The dynamic linker's preload list, which carries the agent.
    pub const PRELOAD: &str = "LD_PRELOAD";
}
