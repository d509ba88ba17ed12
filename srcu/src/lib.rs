//! `srcu`: sleepable RCU domains (per-CPU lock/unlock counts in two banks, `synchronize()`, deferred callbacks) and *leases*: read-side holds on an object that an expiry service converts into a real reference after a timeout, the kernel's hprobe states LEASED / STABLE / GONE / CONSUMED.
//!
//! **Not implemented yet.** This crate is a reserved, empty library in the
//! `kscale` workspace; it has no API until its issue lands (seed
//! `002_377edf538ade4730` in the workspace's `shared/seeds`). It builds on
//! [`pcpu`](https://docs.rs/pcpu), the workspace's per-CPU foundation.
#![deny(unsafe_op_in_unsafe_fn)]
