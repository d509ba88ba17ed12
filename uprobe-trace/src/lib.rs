//! `uprobe-trace`: trace a program you did not write, in its own process.
//!
//! ```sh
//! uprobe-trace -f malloc,free -- python3 script.py
//! uprobe-trace -l -f libz.so.1:deflate -- gzip -9 big.txt
//! uprobe-trace -p -u 'python:function__entry(str,str,int)' -- python3 script.py
//! ```
//!
//! The tool runs the program with this crate's shared library preloaded
//! (`LD_PRELOAD`: no ptrace, no root). Before `main`, the library (the
//! *agent*) attaches [`uprobe_core`] probes to the functions and USDT
//! probes asked for, trap-free where the site allows. Each hit counts into
//! a report in shared memory that the tool prints when the program exits
//! (and every `--interval` seconds): per probe the calls and, for
//! `--latency`, a log2 histogram of the time to return, as `bpftrace`'s
//! `hist()` draws it; `--print` adds a line per hit with its arguments.
//!
//! The report survives what the program does: it is shared memory the
//! agent maps once (closing every file descriptor does not unmap it), its
//! fork children add into it, the programs it execs get the agent again
//! through the environment (unless `--no-follow`), and every count is
//! stored when it happens (`_exit` loses nothing). Probes on objects
//! loaded later (`dlopen`) are attached when they appear.
//!
//! Refused with a message: a program that cannot be preloaded (statically
//! linked, setuid or setgid).
//!
//! The library half of this crate is that agent plus what the tool shares
//! with it: the probe specs ([`spec`]) and the report's layout
//! ([`shared`]).
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_os = "linux"))]
compile_error!("uprobe-trace supports Linux only (LD_PRELOAD, uprobe-core)");

#[cfg(all(
    any(target_arch = "x86_64", target_arch = "aarch64"),
    not(pcpu_force_generic)
))]
mod agent;
pub mod shared;
pub mod spec;

/// The environment variables the tool hands the agent.
pub mod env {
    /// The report file's path.
    pub const REPORT: &str = "UPROBE_TRACE_REPORT";
    /// The probes, encoded by [`spec::encode`](crate::spec::encode).
    pub const PROBES: &str = "UPROBE_TRACE_PROBES";
    /// The file descriptor `--print` lines go to.
    pub const PRINT_FD: &str = "UPROBE_TRACE_PRINT_FD";
    /// `0`: programs the traced one runs are not traced.
    pub const FOLLOW: &str = "UPROBE_TRACE_FOLLOW";
    /// The dynamic linker's preload list, which carries the agent.
    pub const PRELOAD: &str = "LD_PRELOAD";
}
