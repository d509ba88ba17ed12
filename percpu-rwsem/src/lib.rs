//! A per-CPU reader-writer semaphore for userspace: readers never share a
//! cache line.
//!
//! In 2024 the Linux uprobes subsystem replaced the reader-writer spinlock
//! on its hot lookup path (`uprobes_treelock`) with a
//! `percpu_rw_semaphore`, because every reader of a one-word lock writes
//! the same cache line, which stops scaling at a handful of CPUs. This
//! crate is that semaphore for Rust programs:
//!
//! - [`PercpuRwSem<T>`] with RAII guards, `read`/`try_read`/`write`/
//!   `try_write`, `const` construction for statics;
//! - [`RawPercpuRwSem`], also a [`lock_api::RawRwLock`];
//! - a read side made of one restartable sequence per lock and per unlock
//!   (no locked instruction, no fence: see [`raw`'s ordering
//!   argument](RawPercpuRwSem)), built on [`pcpu`];
//! - writers that pay a `membarrier()` grace period (once per burst) and
//!   wait for the per-CPU sum of readers to drain;
//! - async-signal-safe read operations: a handler that interrupts a
//!   reader reads again past a waiting writer (reads nest, through a
//!   per-thread depth), one that interrupts the writer gets
//!   `WouldDeadlock`, at every instruction of the lock operations;
//! - a read guard covariant in `T` (like `std`'s), and
//!   [`WriteGuard::downgrade`] (also `lock_api::RwLockDowngrade`).
//!
//! Measured with `cargo run --release -p benches --bin bench -- rwsem-read`
//! in the workspace: see its README for the table against `std`,
//! `parking_lot` and crossbeam's `ShardedLock`.
//!
//! ```
//! let table = percpu_rwsem::PercpuRwSem::new(vec![1, 2, 3]);
//! assert_eq!(table.read().len(), 3);
//! table.write().push(4);
//! assert_eq!(*table.read(), [1, 2, 3, 4]);
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

mod futex_mutex;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks;
mod lock;
#[cfg(not(pcpu_loom))]
mod lock_api_impl;
mod raw;

pub use lock::{PercpuRwSem, ReadGuard, WouldDeadlock, WriteGuard};
pub use raw::{LINGER_DELAY, RawPercpuRwSem};
