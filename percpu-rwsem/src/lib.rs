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
//! # Two sets of guards, and why
//! [`PercpuRwSem`] has its own guards; [`RwLock`] is the same raw lock
//! under [`lock_api`]'s (re-exported here, so `lock_api`'s traits and
//! mapping work without a direct dependency), as `parking_lot` builds its
//! types. Prefer [`PercpuRwSem`] where a read may end on another thread or
//! inside a signal handler: its read guard remembers the thread that took
//! it, so the per-thread read depth that lets a handler read again past a
//! waiting writer stays exact when the guard moves; `lock_api` guards
//! carry no state, so a moved [`RwLockReadGuard`] leaves the taker's
//! depth counted (harmless unless a signal handler on that thread reads
//! while a writer waits). [`PercpuRwSem::read_checked`] also reports a
//! read on the writer's own thread as an error, where `lock_api` can only
//! panic.
//!
//! ```
//! use percpu_rwsem::RwLock;
//!
//! let cfg = RwLock::new(String::from("a"));
//! cfg.write().push('b');
//! let len = percpu_rwsem::RwLockReadGuard::map(cfg.read(), |s| s.as_bytes()).len();
//! assert_eq!(len, 2);
//! ```
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
pub use lock_api;
pub use raw::{LINGER_DELAY, RawPercpuRwSem};

/// The semaphore with [`lock_api`]'s guards (mapping, `RwLockDowngrade`):
/// see [above](crate#two-sets-of-guards-and-why) for when to prefer
/// [`PercpuRwSem`].
#[cfg(not(pcpu_loom))]
pub type RwLock<T> = lock_api::RwLock<RawPercpuRwSem, T>;
/// A read guard of [`RwLock`].
#[cfg(not(pcpu_loom))]
pub type RwLockReadGuard<'a, T> = lock_api::RwLockReadGuard<'a, RawPercpuRwSem, T>;
/// A write guard of [`RwLock`].
#[cfg(not(pcpu_loom))]
pub type RwLockWriteGuard<'a, T> = lock_api::RwLockWriteGuard<'a, RawPercpuRwSem, T>;
