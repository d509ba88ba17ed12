//! x86-64: instruction analysis, emulation, and the handler's view of the
//! registers.

mod context;
mod emulate;
mod insn;
pub(crate) mod trampoline;
mod xol;

pub(crate) use context::return_address_at;
pub use context::{EntryContext, Reg, ReturnContext};
pub(crate) use emulate::apply;
pub(crate) use insn::{Emulation, analyze, is_boundary};
pub(crate) use xol::{SlotEnd, force_trap_back, origin_of, slot_info};
