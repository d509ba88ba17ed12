//! The public API: probes (`uprobe`: `Uprobe`, the builder; `probe`: `Probe`, the handle), the memory
//! generated code takes ([`memory`]), a loaded object's functions
//! ([`functions`]) and its USDT probes ([`usdt`]).

pub mod functions;
pub mod memory;
pub(crate) mod probe;
pub(crate) mod uprobe;
pub mod usdt;
