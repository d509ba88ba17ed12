//! `percpu-rwsem`: a reader-writer semaphore whose read side increments a per-CPU count (an rseq critical section, no shared cache line, no full fence) and whose writer forces readers onto a slow path, waits for the per-CPU sum to drain and returns them to the fast path lazily, as the kernel's `percpu_rw_semaphore` with `rcu_sync` does.
//!
//! **Not implemented yet.** This crate is a reserved, empty library in the
//! `kscale` workspace; it has no API until its issue lands (seed
//! `001_e630711ada7161ed` in the workspace's `shared/seeds`). It builds on
//! [`pcpu`](https://docs.rs/pcpu), the workspace's per-CPU foundation.
#![deny(unsafe_op_in_unsafe_fn)]
