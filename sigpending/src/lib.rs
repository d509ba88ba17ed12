//! Two small primitives from the Linux signal path, each the userspace form
//! of a kernel patch that removed a scalability wall.
//!
//! # Accounts that pin their owner only while charged
//! The kernel counted pending signals per user and took a reference on the
//! user for every queued signal: three atomics on two shared cache lines
//! per signal. The fix (2020, "signal: take the user reference only on
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
//! ## Held charges: which charge to call
//! In the kernel, the task that queues a signal holds the user it charges
//! (through its credentials), so the 0 -> 1 `get_uid` is a plain
//! increment. [`Account::charge_holding`] is that case: the caller passes
//! the owner's `Arc` (checked by address to be the account's owner,
//! [`ChargeError::NotOwner`] otherwise), and the 0 -> 1 pin is one
//! increment of its strong count, which cannot fail, plus (on an idle
//! level) one compare-and-swap on the count. [`Account::charge`] has only
//! the account's `Weak`: its pin is an upgrade (a compare-and-swap loop)
//! that may find the owner gone, and the account then refuses this and
//! every later charge ([`ChargeError::OwnerGone`]).
//!
//! Why the held charge is correct: the caller's strong reference keeps the
//! strong count above 0 for the whole charge, so the increment is valid,
//! no pin of that owner can fail meanwhile, and the account can never have
//! found it gone (a count that reached 0 stays 0, and the account's `Weak`
//! keeps the allocation, so no other `Arc` can share its address). After
//! the charge the account's own pin keeps the owner alive, whatever the
//! caller does with its `Arc`. The two charges mix freely on one account.
//!
//! Use `charge_holding` wherever the charging code has the owner's `Arc`
//! at hand (a sender charging its own user, a thread charging the consumer
//! it runs for); use `charge` where it has only the account (a signal
//! handler reaching the account through a table), or where a charge
//! after the owner is gone must be refused rather than made impossible.
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
//! recomputed it under the process-wide siglock. The fix (2025,
//! "uprobes: remove siglock in `uprobe_deny_signal` / `handle_singlestep`")
//! remembers that the flag was cleared and sets it again without the lock.
//! [`TaskFlags`] is a per-thread flag word with exactly that pair
//! ([`deny`](TaskFlags::deny) / [`restore`](TaskFlags::restore)), posted to
//! by other threads with [`set`](TaskFlags::set), never losing a request.
//!
//! # Async-signal safety
//! | operation | signal-safe |
//! |---|---|
//! | [`Account::charge`], [`Account::charge_holding`], dropping a [`Charge`], [`Account::uncharge_unchecked`] | yes for [`Release::Deferred`] accounts (or owners whose release is signal-safe); lock-free, no allocation |
//! | [`PendingQueue::enqueue`], [`PendingQueue::dequeue`] | as above; never waits for another thread |
//! | every [`TaskFlags`] operation but `install_current` | yes |
//! | constructors, [`release_deferred`], [`TaskFlags::install_current`] | no |
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

mod account;
mod flags;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks;
mod owner;
mod queue;
mod ring;

pub use account::deferred::release_deferred;
pub use account::{Account, Charge, ChargeError, MAX_DEPTH, Release};
pub use flags::TaskFlags;
pub use owner::Owner;
pub use queue::{Accounting, PendingQueue, Refusal, Refused};
