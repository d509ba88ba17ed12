//! The public API: probes ([`probe`]: `Uprobe`, `Probe`), the memory
//! generated code takes ([`memory`]), a loaded object's functions
//! ([`functions`]) and its USDT probes ([`usdt`]).

pub mod functions;
pub mod memory;
pub(crate) mod probe;
pub mod usdt;
