//! aarch64 out-of-line slots: the instruction itself (everything run out
//! of line is position-independent: the PC-relative classes are
//! simulated), then `B` back to the next instruction when the slot is
//! within +-128 MB, or `BRK #5` (a second trap) anywhere. The regions are
//! the engine's (the [`SlotFor`] analysis is given).

use crate::arch::{SlotEnd, SlotFor};
use crate::base::error::AttachError;

/// The slot running `insn` (at `addr`) out of line, and how it ends, from
/// `slot_for`. Not async-signal-safe.
pub(crate) fn slot_for(
    addr: usize,
    insn: u32,
    slot_for: SlotFor,
) -> Result<(usize, SlotEnd), AttachError> {
    slot_for(addr, &insn.to_le_bytes(), false, &|slot, end| {
        let back = match end {
            // `B` reaches +-128 MiB; a slot source that hands out a slot
            // further away for a jump back is refused, not given a
            // branch that lands elsewhere.
            SlotEnd::JumpBack => {
                super::jump::branch(slot + 4, addr + 4).ok_or_else(|| AttachError::Unsupported {
                    addr,
                    insn: format!("{insn:#010x}"),
                    why: "its out-of-line slot is out of a branch's reach",
                })?
            }
            SlotEnd::TrapBack => u32::from_le_bytes(super::BREAKPOINT),
        };
        let mut code = insn.to_le_bytes().to_vec();
        code.extend_from_slice(&back.to_le_bytes());
        Ok(code)
    })
}
