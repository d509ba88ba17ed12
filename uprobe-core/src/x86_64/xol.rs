//! x86-64 out-of-line slots: the instruction re-encoded at the slot by
//! iced-x86's block encoder (RIP-relative operands re-targeted), then a
//! `jmp` back or an `int3`. The regions and their bookkeeping are the
//! architecture-independent `crate::code::slots`.

use iced_x86::{BlockEncoder, BlockEncoderOptions, Code, Instruction, InstructionBlock};

use crate::AttachError;
use crate::code::slots::{self, SlotEnd};

/// The slot running `insn` (decoded at `addr` from `bytes`) out of line,
/// and how it ends (see `crate::code::slots::slot_for`). Not async-signal-safe.
pub(crate) fn slot_for(
    addr: usize,
    bytes: &[u8],
    insn: &Instruction,
) -> Result<(usize, SlotEnd), AttachError> {
    slots::slot_for(addr, bytes, insn.is_ip_rel_memory_operand(), |slot, end| {
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
