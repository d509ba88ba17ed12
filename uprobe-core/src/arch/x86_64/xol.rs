//! x86-64 out-of-line slots: the instruction moved to the slot
//! (`super::relocate`: RIP-relative operands re-targeted), then a `jmp`
//! back or an `int3`. The regions and their bookkeeping are the engine's
//! (the [`SlotFor`] analysis is given).

use iced_x86::Instruction;

use super::relocate::{self, Piece};

use crate::arch::{SlotEnd, SlotFor};
use crate::base::error::AttachError;

/// The slot running `insn` (decoded at `addr` from `bytes`) out of line,
/// and how it ends, from `slot_for`. Not async-signal-safe.
pub(crate) fn slot_for(
    addr: usize,
    bytes: &[u8],
    insn: &Instruction,
    slot_for: SlotFor,
) -> Result<(usize, SlotEnd), AttachError> {
    slot_for(
        addr,
        bytes,
        insn.is_ip_rel_memory_operand(),
        &|slot, end| relocate(addr, bytes, insn, slot, end),
    )
}

/// `insn` re-encoded to run at `slot`, then a jump back to the
/// instruction after it, or an `int3`.
fn relocate(
    addr: usize,
    bytes: &[u8],
    insn: &Instruction,
    slot: usize,
    end: SlotEnd,
) -> Result<Vec<u8>, AttachError> {
    let back = match end {
        SlotEnd::JumpBack => Piece::Jump(insn.next_ip()),
        SlotEnd::TrapBack => Piece::Int3,
    };
    let pieces = [Piece::Moved(insn, &bytes[..insn.len()]), back];
    let (code, _) =
        relocate::encode(&pieces, slot as u64).ok_or_else(|| AttachError::Unsupported {
            addr,
            insn: super::insn::disassemble(insn),
            why: "cannot be relocated to an out-of-line slot",
        })?;
    Ok(code)
}
