//! The foundations: what every layer above may use and what knows nothing
//! of probes. The error and mode types of the public API, the thread's
//! engine state, the clock timing probes read, and the layout of what
//! generated code and assembly share with Rust.

#[cfg(uprobe_engine)]
pub(crate) mod abi;
#[cfg(uprobe_engine)]
pub(crate) mod clock;
pub(crate) mod error;
#[cfg(uprobe_engine)]
pub(crate) mod mode;
#[cfg(uprobe_engine)]
pub(crate) mod thread;
