//! `uprobe-core`: the in-process probing engine assembled from the other crates: `int3` (x86-64) and `BRK` (aarch64) breakpoints patched over instructions of the running process, a SIGTRAP handler, emulation or out-of-line execution of the displaced instruction, and return probes.
//!
//! **Not implemented yet.** This crate is a reserved, empty library in the
//! `kscale` workspace; it has no API until its issue lands (seed
//! `000 to 004` in the workspace's `shared/seeds`). It builds on
//! [`pcpu`](https://docs.rs/pcpu), the workspace's per-CPU foundation.
#![deny(unsafe_op_in_unsafe_fn)]
