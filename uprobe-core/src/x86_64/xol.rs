//! x86-64 out-of-line slots: the instruction re-encoded at the slot by
//! iced-x86's block encoder (RIP-relative operands re-targeted), then a
//! `jmp` back or an `int3`. The regions and their bookkeeping are the
//! architecture-independent `crate::xol`.

use iced_x86::{BlockEncoder, BlockEncoderOptions, Code, Instruction, InstructionBlock};

use crate::AttachError;
use crate::xol::SlotEnd;

/// Bytes per slot: the longest instruction relocated (15 bytes, longer when
/// a branch is widened) plus a 5-byte jump back fits easily.
pub(crate) const SLOT_SIZE: usize = 64;
/// How far a slot may be from the code it serves: a rel32 displacement.
pub(crate) const REACH_LIMIT: usize = 1 << 31;

/// The slot running `insn` (decoded at `addr` from `bytes`) out of line,
/// and how it ends (see `crate::xol::slot_for`). Not async-signal-safe.
pub(crate) fn slot_for(
    addr: usize,
    bytes: &[u8],
    insn: &Instruction,
) -> Result<(usize, SlotEnd), AttachError> {
    crate::xol::slot_for(addr, bytes, insn.is_ip_rel_memory_operand(), |slot, end| {
        relocate(addr, insn, slot, end)
    })
}

/// `insn` re-encoded to run at `slot`, then a jump back to the
/// instruction after it, or an `int3`.
fn relocate(
    addr: usize,
    insn: &Instruction,
    slot: usize,
    end: SlotEnd,
) -> Result<Vec<u8>, AttachError> {
    let back = match end {
        SlotEnd::JumpBack => Instruction::with_branch(Code::Jmp_rel32_64, insn.next_ip()),
        SlotEnd::TrapBack => Ok(Instruction::with(Code::Int3)),
    }
    .map_err(|_| AttachError::Unsupported {
        addr,
        insn: super::insn::disassemble(insn),
        why: "cannot encode the slot's way back",
    })?;
    let insns = [*insn, back];
    let block = InstructionBlock::new(&insns, slot as u64);
    let code = BlockEncoder::encode(64, block, BlockEncoderOptions::NONE)
        .map_err(|_| AttachError::Unsupported {
            addr,
            insn: super::insn::disassemble(insn),
            why: "cannot be relocated to an out-of-line slot",
        })?
        .code_buffer;
    Ok(code)
}
