//! x86-64 trap-free probes: which sites can take a `jmp rel32` into a
//! per-probe trampoline ([`plan`]), and the trampoline's code ([`build`]).
//!
//! **A trampoline** (immutable once written, never freed; see
//! `crate::patch::jump` for the patching protocol):
//!
//! ```text
//!   +0  .quad cell            the probe's JumpCell (which site it serves)
//!   +8  .quad entry           the common routine
//!  +16  pop rdx; pop rcx; pop rax (the counting prelude's way out)
//!  +19  call [rip-17]         -> entry: saves, runs the consumers, restores
//!  +25  lea rsp, [rsp+128]    (entry returns here unless a handler set RIP)
//!  +33  jmp +131
//!  +38  the jump's target: lea rsp, [rsp-128] (step over the red zone),
//!       then the counting prelude (`super::count`), or a jump to +19
//! +131  the replaced instructions, relocated (RIP-relative operands
//!      re-targeted; a final `call rel32` becomes a push of the original
//!      return address and a `jmp`, so the callee returns to the probed
//!      code, not here)
//!      jmp back              to the first byte after the replaced range
//! ```
//!
//!
//! The common routine every trampoline calls is [`super::jump_entry`];
//! the counting prelude (with the abort handler of its restartable
//! sequence after the relocated code, and its descriptor in the last 32
//! bytes) is [`super::count`].

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, Mnemonic, OpKind, Register,
};

use super::JUMP_LEN;
use super::count::COPY_AT;
pub(crate) use super::count::ENTRY_AT;
use super::jump_entry::uprobe_core_jump_entry;
use super::relocate::{self, Piece};
use crate::code::trampolines::{CELL_AT, ENTRY_PTR_AT, Moves, TRAMPOLINE_SIZE};
use crate::mode::NotOptimized;
use crate::site::jump::FAST_AT;
use crate::site::jump::Function;

/// What a site's optimization replaces: whole instructions from `start`,
/// `len` (>= 5) bytes, decoded.
pub(crate) struct Plan {
    pub(crate) start: usize,
    pub(crate) len: usize,
    insns: Vec<Instruction>,
    /// The range's original bytes (`len` of them).
    bytes: Vec<u8>,
}

impl Plan {
    /// Whether the range holds several instructions.
    pub(crate) fn has_interior(&self) -> bool {
        self.insns.len() > 1
    }
}

/// Decides whether the instruction at `addr` (whose bytes start `here`)
/// can be replaced by a jump, and which instructions the jump covers:
///
/// - one instruction of 5 bytes or more, anywhere;
/// - a function's first instruction being `endbr64`, the same after it
///   (the landing pad stays in place);
/// - or, at a function's first instruction (`function` known, with its
///   whole code), the first instructions up to at least 5 bytes, if the
///   whole function decodes, no direct branch in it lands inside the
///   range (past its first byte), it has no indirect jump (a jump table
///   could land there), and no instruction of the range but the last
///   changes control flow.
///
/// Every replaced instruction must be relocatable: not refused by the
/// kernel's tables, not a far branch, an `rcx` loop or transactional
/// memory (a call, direct or indirect, runs as a push of the original
/// return address and a jump). Not async-signal-safe.
pub(crate) fn plan(
    addr: usize,
    here: &[u8],
    function: Option<Function<'_>>,
) -> Result<Plan, NotOptimized> {
    let first = decode_first(addr, here)?;
    if first.mnemonic() == Mnemonic::Endbr64 {
        // The landing pad stays: indirect calls must still find it on
        // machines that enforce IBT. The jump goes right after it.
        let skip = first.len();
        return plan(
            addr + skip,
            &here[skip..],
            function.and_then(|f| {
                (f.code.len() > skip).then(|| Function {
                    start: f.start + skip,
                    code: &f.code[skip..],
                    sole_entry: f.sole_entry,
                })
            }),
        );
    }
    if first.len() >= JUMP_LEN {
        relocatable(&here[..first.len()], &first)?;
        return Ok(Plan {
            start: addr,
            len: first.len(),
            bytes: here[..first.len()].to_vec(),
            insns: vec![first],
        });
    }
    let function = range_function(addr, first.len(), function)?;
    let mut all = Vec::new();
    let mut decoder = Decoder::with_ip(64, function.code, addr as u64, DecoderOptions::NONE);
    while decoder.can_decode() {
        let insn = decoder.decode();
        if insn.is_invalid() {
            return Err(NotOptimized::Undecodable {
                at: insn.ip() as usize,
            });
        }
        all.push(insn);
    }
    // The range: instructions from the entry until a jump fits.
    let mut len = 0;
    let mut range = Vec::new();
    for insn in &all {
        if len >= JUMP_LEN {
            break;
        }
        if !range.is_empty() {
            let prev: &Instruction = range.last().expect("non-empty");
            if prev.flow_control() != FlowControl::Next {
                return Err(NotOptimized::ControlFlowInRange {
                    at: prev.ip() as usize,
                });
            }
        }
        let off = insn.ip() as usize - addr;
        relocatable(&function.code[off..off + insn.len()], insn)?;
        len += insn.len();
        range.push(*insn);
    }
    if len < JUMP_LEN {
        return Err(NotOptimized::TooShort {
            len,
            why: "the whole function is shorter than a jump",
        });
    }
    for insn in &all {
        if matches!(
            insn.flow_control(),
            FlowControl::IndirectBranch | FlowControl::XbeginXabortXend
        ) {
            return Err(NotOptimized::IndirectJump {
                at: insn.ip() as usize,
            });
        }
        if is_near_branch(insn) {
            let target = insn.near_branch_target() as usize;
            if target > addr && target < addr + len {
                return Err(NotOptimized::BranchIntoRange {
                    from: insn.ip() as usize,
                    target,
                });
            }
        }
    }
    Ok(Plan {
        start: addr,
        len,
        insns: range,
        bytes: function.code[..len].to_vec(),
    })
}

/// The probed instruction alone (after an `endbr64`, which stays), when
/// the jump cannot replace whole instructions: what a punned jump
/// (`super::pun`) replaces. It must be relocatable. Not
/// async-signal-safe.
pub(crate) fn single(addr: usize, here: &[u8]) -> Result<Plan, NotOptimized> {
    let first = decode_first(addr, here)?;
    if first.mnemonic() == Mnemonic::Endbr64 {
        let skip = first.len();
        return single(addr + skip, &here[skip..]);
    }
    relocatable(&here[..first.len()], &first)?;
    Ok(Plan {
        start: addr,
        len: first.len(),
        bytes: here[..first.len()].to_vec(),
        insns: vec![first],
    })
}

/// The instruction at `addr` (whose bytes start `here`).
fn decode_first(addr: usize, here: &[u8]) -> Result<Instruction, NotOptimized> {
    let first = Decoder::with_ip(64, here, addr as u64, DecoderOptions::NONE).decode();
    if first.is_invalid() {
        return Err(NotOptimized::NotRelocatable {
            why: "the instruction does not decode",
        });
    }
    Ok(first)
}

/// The function whose first instructions a range of several may take:
/// known, probed at its start, and entered only there.
fn range_function(
    addr: usize,
    len: usize,
    function: Option<Function<'_>>,
) -> Result<Function<'_>, NotOptimized> {
    let too_short = |why| Err(NotOptimized::TooShort { len, why });
    match function {
        None => too_short(
            "shorter than a jump, and not a function's first instruction with a known size",
        ),
        Some(f) if f.start != addr => {
            too_short("shorter than a jump, and not the function's first instruction")
        }
        Some(f) if !f.sole_entry => too_short(
            "shorter than a jump, and the function's extent comes from unwind information only \
             (no symbol): other entry points may branch into the range",
        ),
        Some(f) => Ok(f),
    }
}

fn is_near_branch(insn: &Instruction) -> bool {
    (0..insn.op_count()).any(|i| {
        matches!(
            insn.op_kind(i),
            OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
        )
    })
}

/// Whether `insn` (its bytes `bytes`) can run relocated in a trampoline.
fn relocatable(bytes: &[u8], insn: &Instruction) -> Result<(), NotOptimized> {
    let refuse = |why| Err(NotOptimized::NotRelocatable { why });
    if let Err(why) = super::insn::refuse_by_table(bytes, insn) {
        return refuse(why);
    }
    match insn.flow_control() {
        FlowControl::IndirectCall if insn.code() != Code::Call_rm64 => {
            refuse("an indirect call of another operand size")
        }
        FlowControl::IndirectCall
            if insn.op0_kind() == OpKind::Register && insn.op0_register() == Register::RSP =>
        {
            refuse("an indirect call through the stack pointer")
        }
        FlowControl::IndirectCall
            if insn.op0_kind() == OpKind::Memory
                && insn.memory_base() == Register::RSP
                && (insn.memory_displacement64() as i64) < 0 =>
        {
            // The pushed return address would overwrite the operand.
            refuse("an indirect call through memory below the stack pointer")
        }
        FlowControl::Interrupt | FlowControl::Exception => refuse("raises an exception"),
        FlowControl::XbeginXabortXend => refuse("transactional memory"),
        _ if insn.is_call_far()
            || insn.is_jmp_far()
            || insn.is_call_far_indirect()
            || insn.is_jmp_far_indirect() =>
        {
            refuse("a far branch")
        }
        _ if matches!(
            insn.mnemonic(),
            Mnemonic::Loop | Mnemonic::Loope | Mnemonic::Loopne | Mnemonic::Jrcxz | Mnemonic::Jecxz
        ) =>
        {
            refuse("an rcx loop (no rel32 form to relocate it to)")
        }
        _ if super::insn::has_operand_size_override(bytes) && is_near_branch(insn) => {
            refuse("a 66-prefixed branch")
        }
        _ => Ok(()),
    }
}

/// A trampoline's code for `plan`, to be written at `base`, serving the
/// cell at `cell`; and, for each instruction of the range, where its
/// relocated copy starts in the trampoline (a thread stopped at that
/// instruction moves there). Not async-signal-safe.
pub(crate) fn build(
    plan: &Plan,
    base: usize,
    cell: usize,
) -> Result<(Vec<u8>, Moves), NotOptimized> {
    let mut code = vec![0xcc_u8; COPY_AT];
    code[CELL_AT..CELL_AT + 8].copy_from_slice(&(cell as u64).to_le_bytes());
    let entry = uprobe_core_jump_entry as *const () as u64;
    code[ENTRY_PTR_AT..ENTRY_PTR_AT + 8].copy_from_slice(&entry.to_le_bytes());
    // The counting prelude (or a jump over it), the call into the common
    // routine, and the way back to the relocated code.
    super::count::prelude(&mut code, CELL_AT, ENTRY_PTR_AT, FAST_AT);

    let mut pieces = Vec::with_capacity(plan.insns.len() + 4);
    // Which of `pieces` starts the copy of each range instruction.
    let mut firsts = Vec::with_capacity(plan.insns.len());
    for insn in &plan.insns {
        firsts.push(pieces.len());
        let off = insn.ip() as usize - plan.start;
        let bytes = &plan.bytes[off..off + insn.len()];
        if matches!(
            insn.flow_control(),
            FlowControl::Call | FlowControl::IndirectCall
        ) {
            // The callee must return to the probed code: push the
            // original return address (no flags touched), then jump (an
            // indirect call's operand read 8 bytes further up if it is
            // addressed from the stack pointer, which the push moved).
            pieces.push(Piece::PushAddress(insn.next_ip()));
            pieces.push(if insn.flow_control() == FlowControl::Call {
                Piece::Jump(insn.near_branch_target())
            } else {
                Piece::CallAsJump(insn, bytes)
            });
        } else {
            pieces.push(Piece::Moved(insn, bytes));
        }
    }
    pieces.push(Piece::Jump((plan.start + plan.len) as u64));
    let copy = base + COPY_AT;
    let (encoded, starts) =
        relocate::encode(&pieces, copy as u64).ok_or(NotOptimized::NotRelocatable {
            why: "cannot be relocated to the trampoline",
        })?;
    if encoded.len() > super::count::copy_room(TRAMPOLINE_SIZE) {
        return Err(NotOptimized::NotRelocatable {
            why: "relocated, it does not fit a trampoline",
        });
    }
    code.extend_from_slice(&encoded);
    super::count::finish(&mut code, base, TRAMPOLINE_SIZE);
    let moves = plan
        .insns
        .iter()
        .zip(&firsts)
        .map(|(insn, &k)| (insn.ip() as usize, copy + starts[k] as usize))
        .collect();
    Ok((code, moves))
}

/// The `jmp rel32` from `start` to trampoline `base`.
pub(crate) fn jump_bytes(start: usize, base: usize) -> [u8; JUMP_LEN] {
    let rel = (base + ENTRY_AT) as i64 - (start + JUMP_LEN) as i64;
    let rel = i32::try_from(rel).expect("trampolines are placed within rel32 reach");
    let mut b = [0xe9, 0, 0, 0, 0];
    b[1..].copy_from_slice(&rel.to_le_bytes());
    b
}

/// Where a thread that trapped at the range's start continues after the
/// consumers ran (the relocated copy, past the call into the engine).
pub(crate) fn copy_start(base: usize) -> usize {
    base + COPY_AT
}

/// Why the thread's vector state rules trampolines out: never on x86-64
/// (the save covers what the engine's code may touch; see the module
/// docs for what it leaves out).
pub(crate) fn unsaved_vector_state() -> Option<&'static str> {
    None
}

/// Where a thread that trapped at the start of a range after `endbr64`
/// continues: 0, the consumers run in the trap handler (nothing the
/// landing pad did needs undoing), and the thread goes on at the copy.
pub(crate) fn landing_entry(_base: usize) -> usize {
    0
}
