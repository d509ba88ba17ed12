//! Deciding, at attach, how hits run the instruction a probe displaces
//! on A64: simulated ([`super::decode`]), run out of line from a slot, or
//! refused with the reason.

use super::decode::{Emulation, refusal, simulate};
use crate::arch::{SlotEnd, SlotFor};
use crate::base::error::AttachError;

/// Decides, at attach, how hits at `addr` will run the instruction
/// `bytes` starts with.
pub(crate) fn analyze(
    addr: usize,
    bytes: &[u8],
    slot_for: SlotFor,
) -> Result<Emulation, AttachError> {
    let Some(&[a, b, c, d]) = bytes.first_chunk::<4>() else {
        return Err(AttachError::NotCode { addr });
    };
    if addr % 4 != 0 {
        return Err(AttachError::NotInstructionBoundary {
            addr,
            function: String::from("(A64 instructions are 4-byte aligned)"),
        });
    }
    let insn = u32::from_le_bytes([a, b, c, d]);
    if let Some(e) = simulate(addr as u64, insn) {
        return Ok(e);
    }
    if let Some(why) = refusal(insn) {
        return Err(AttachError::Unsupported {
            addr,
            insn: format!("{insn:#010x}"),
            why,
        });
    }
    let (slot, end) = super::xol::slot_for(addr, insn, slot_for)?;
    Ok(Emulation::OutOfLine {
        slot: slot as u64,
        trap_back: end == SlotEnd::TrapBack,
    })
}
