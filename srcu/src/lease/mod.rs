//! Leases: read-side holds on one object that expire into a reference.
//!
//! The kernel's "hprobe" (uprobes, 6.12): a pending uretprobe holds an SRCU
//! read section on its uprobe instead of a reference count, because
//! incrementing one shared count per hit was the scalability wall. User
//! code decides how long a function runs, so such a section could stall
//! grace periods forever; a timer therefore *expires* old leases, turning
//! the section into a real reference.
//!
//! # States and races
//!
//! | state | holds | entered by |
//! |---|---|---|
//! | `LEASED` | an SRCU read section of the domain | [`LeaseBlock::lease`] |
//! | `STABLE` | one strong reference (the section was ended) | expiry, if the value was not retired |
//! | `GONE` | nothing (the value was retired before expiry) | expiry |
//! | `CONSUMED` | nothing: the holder took over what there was | [`Lease::consume`] |
//!
//! Expiry and consumption race on one word: expiry moves `LEASED` to
//! `STABLE`/`GONE` with a compare-and-swap, consumption swaps in
//! `CONSUMED`. Exactly one of them sees `LEASED`, and that one ends the
//! SRCU section, so it is ended exactly once whatever the interleaving.
//! The swap is only needed while an expiry round runs: a consumer first
//! sets its slot's claim flag and, after a light fence, checks whether a
//! round is in progress; a round announces itself and issues a heavy fence
//! before looking at slots, and skips claimed ones. So either the consumer
//! sees the round (and swaps), or the round sees the claim (and keeps
//! off), and the common case costs plain stores and a compiler fence. An
//! expiry that loses gives back the reference it took. The expiry's "take
//! a reference unless retired" runs inside its own read section, and
//! values leave an [`SrcuCell`](crate::SrcuCell) only after two grace
//! periods, so the value it looks at cannot be freed under it.
//!
//! Each state word carries a generation, so an expiry that read a slot just
//! before its owner reused it fails its compare-and-swap instead of acting
//! on the new lease.
//!
//! # Slots
//!
//! Leases live in preallocated per-thread [`LeaseBlock`]s (taking and
//! consuming a lease never allocates, never takes a lock and, outside
//! expiry rounds, issues no atomic read-modify-write), which are
//! registered with the [`LeaseSet`] so that its expiry thread can find
//! them.
//!
//! # Layout
//!
//! Each submodule uses only those listed before it:
//!
//! - `slot`: a lease slot and its state word (state and generation);
//! - `held`: what a consumed lease hands over ([`Held`], [`LeasedValue`]);
//! - `expiry`: the state a set shares with its blocks and its expiry
//!   thread, expiry rounds and the thread's loop;
//! - `fork_hooks`: what a set does at `fork()` (expire in the child,
//!   restart its thread there);
//! - `set`: the public [`LeaseSet`];
//! - `block`: a thread's [`LeaseBlock`], taking ([`Lease`]) and consuming
//!   leases.

mod expiry;
mod fork_hooks;
mod held;
mod set;
mod slot;

// After `set`: `block` adds `LeaseSet::block`, which the docs then list
// after the set's own methods.
mod block;

pub use block::{Lease, LeaseBlock, LeaseError, RawLease};
pub use held::{Held, LeasedValue};
pub use set::{DEFAULT_TIMEOUT, LeaseSet};
