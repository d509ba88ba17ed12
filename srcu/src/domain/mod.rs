//! The SRCU domain: read counts in two banks (per thread for guard
//! sections, per CPU for sections that may end elsewhere), and grace
//! periods.
//!
//! The domain owns its read counts, its grace periods and the public
//! handles on them ([`Srcu`], [`ReadGuard`], [`ReadIndex`]). It builds on
//! `readers` (the per-thread slots), `reclaim` (its callback queue, which
//! runs grace periods through `reclaim::Domain`) and `fork` (with which it
//! registers itself, answering through `fork::Domain`).
//!
//! # Layout
//!
//! Each submodule uses only those listed before it:
//!
//! - `backoff`: how a waiting loop spins, yields and sleeps;
//! - `gp_lock`: the lock that serialises grace periods, taken over in a
//!   fork child;
//! - `state`: a domain's shared state (`Inner`) and its construction;
//! - `sections`: the read side: beginning and ending guard sections (in
//!   the thread's slot) and sections counted per CPU;
//! - `grace_period`: checking that a bank has drained, and the two-bank
//!   grace period;
//! - `handle`: the public [`Srcu`] handle and the allocation of its state;
//! - `fork_hooks`: the domain at `fork()` (its locks, discounting, and
//!   its helper threads revived in the child);
//! - `read`: the read API ([`Srcu::read_lock`], raw sections) and its
//!   tokens, [`ReadGuard`] and [`ReadIndex`];
//! - `update`: the update API: grace periods, callbacks and barriers.

mod backoff;
mod fork_hooks;
mod gp_lock;
mod grace_period;
mod handle;
mod read;
mod sections;
mod state;
mod update;

pub use handle::Srcu;
pub use read::{ReadGuard, ReadIndex};
pub(crate) use state::Inner;
