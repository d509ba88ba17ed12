//! `pcpu-freelist`: a fixed pool of preallocated elements on per-CPU lists (built on `pcpu::PerCpuStack`), with an extralist and an `is_empty` hint per list that lets a pop skip empty lists without taking their locks.
//!
//! **Not implemented yet.** This crate is a reserved, empty library in the
//! `kscale` workspace; it has no API until its issue lands (seed
//! `004_a07104079e49ae35` in the workspace's `shared/seeds`). It builds on
//! [`pcpu`](https://docs.rs/pcpu), the workspace's per-CPU foundation.
#![deny(unsafe_op_in_unsafe_fn)]
