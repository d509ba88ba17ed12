//! `sigpending`: a charged account that pins its owner only while something is charged (one atomic per charge, the limit checked against the value the increment returned), hierarchical accounts, a bounded pending queue, and per-thread flag words whose owner can deny a flag and restore it without a lock.
//!
//! **Not implemented yet.** This crate is a reserved, empty library in the
//! `kscale` workspace; it has no API until its issue lands (seed
//! `003_7095badbe3522f44 and 000_0b22ef191fffa5fe` in the workspace's `shared/seeds`). It builds on
//! [`pcpu`](https://docs.rs/pcpu), the workspace's per-CPU foundation.
#![deny(unsafe_op_in_unsafe_fn)]
