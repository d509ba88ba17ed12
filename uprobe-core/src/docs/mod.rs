//! Guides to the engine, one page each (no code): what it does at a hit,
//! what it promises and what it asks of a probed program. The crate root
//! is the user's guide to the API; these pages are what a serious user
//! reads next. How the engine is built inside is the repository's
//! `ARCHITECTURE.md`.
//!
//! - [`hits`]: a hit on x86-64: the trap, emulation, out-of-line slots,
//!   and the jumps (whole instructions or punned) that replace the trap;
//!   counting probes; how code is patched while threads run it.
//! - [`returns`]: return probes.
//! - [`timing`]: timing probes.
//! - [`aarch64`]: what differs on aarch64.
//! - [`rules`]: what handlers may do, and the rules for the program.

pub mod aarch64;
pub mod hits;
pub mod returns;
pub mod rules;
pub mod timing;
