//! Two small primitives from the Linux signal path, each the userspace form
//! of a kernel patch that removed a scalability wall.
//!
//! # Accounts that pin their owner only while charged
//! The kernel counted pending signals per user and took a reference on the
//! user for every queued signal: three atomics on two shared cache lines
//! per signal. The fix (seed 003, "signal: take the user reference only on
//! the 0 -> 1 sigpending transition") takes the reference only when the
//! count goes 0 -> 1, drops it on 1 -> 0, and checks the limit against the
//! value the increment returned: one atomic per signal.
//!
//! [`Account`] is that count, reusable: [`Account::charge`] returns a
//! [`Charge`] (uncharging on drop), refuses over the limit with a typed
//! [`ChargeError`], pins its [`Owner`] (an `Arc`, or a callback pair) only
//! while non-zero, and can be nested ([`Account::child`]: a charge counts
//! at every level, each with its own limit). Releases of the owner can be
//! deferred out of signal handlers ([`Release::Deferred`],
//! [`release_deferred`]). [`PendingQueue`] is a bounded FIFO charging each
//! queued item to an account, counting refusals.
//!
//! ```
//! use std::sync::Arc;
//! use sigpending::{Account, Owner, PendingQueue, Release};
//!
//! struct Consumer { name: &'static str }
//! let consumer = Arc::new(Consumer { name: "tracer" });
//! // At most 64 in flight, across every thread; the consumer stays alive
//! // while any is queued, and signal handlers may enqueue and dequeue.
//! let in_flight = Account::with_release(64, Owner::arc(&consumer), Release::Deferred);
//! let returns = PendingQueue::new(64, in_flight);
//! returns.enqueue(0x7fff_1234_u64).expect("under the limit");
//! assert_eq!(returns.dequeue(), Some(0x7fff_1234));
//! sigpending::release_deferred(); // in ordinary context, now and then
//! ```
//!
//! # Thread flags denied and restored without a lock
//! While a uprobe single-steps, the kernel clears the task's
//! `TIF_SIGPENDING` so that no signal is handled mid-step, and afterwards
//! recomputed it under the process-wide siglock. The fix (seed 000)
//! remembers that the flag was cleared and sets it again without the lock.
//! [`TaskFlags`] is a per-thread flag word with exactly that pair
//! ([`deny`](TaskFlags::deny) / [`restore`](TaskFlags::restore)), posted to
//! by other threads with [`set`](TaskFlags::set), never losing a request.
//!
//! # Async-signal safety
//! | operation | signal-safe |
//! |---|---|
//! | [`Account::charge`], dropping a [`Charge`], [`Account::uncharge_unchecked`] | yes for [`Release::Deferred`] accounts (or owners whose release is signal-safe); lock-free, no allocation |
//! | [`PendingQueue::enqueue`], [`PendingQueue::dequeue`] | as above; never waits for another thread |
//! | every [`TaskFlags`] operation but `install_current` | yes |
//! | constructors, [`release_deferred`], [`TaskFlags::install_current`] | no |
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

mod account;
mod deferred;
mod flags;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks;
mod owner;
mod queue;
mod ring;

pub use account::{Account, Charge, ChargeError, MAX_DEPTH, Release};
pub use deferred::release_deferred;
pub use flags::TaskFlags;
pub use owner::Owner;
pub use queue::{Accounting, PendingQueue, Refusal, Refused};
