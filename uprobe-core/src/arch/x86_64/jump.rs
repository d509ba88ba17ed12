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
//!      code, not here); after a punned jump's instruction, its tail
//!      (`tail`: the instructions that start inside the jump's bytes)
//!      jmp back              to the first byte after them (none after a
//!                            return, a jump or a call)
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
use super::branches::is_near_branch;
use super::count::COPY_AT;
pub(crate) use super::count::ENTRY_AT;
use super::relocate::{self, Piece};
use crate::arch::{CELL_AT, ENTRY_PTR_AT, Function, Moves, TRAMPOLINE_SIZE};
use crate::base::abi::JUMP_CELL_COUNTER_AT as COUNTER_AT;
use crate::base::mode::NotOptimized;

/// What a site's optimization replaces: whole instructions from `start`,
/// `len` (>= 5) bytes, decoded; punned, the probed instruction alone and
/// the tail its trampoline runs after it.
pub(crate) struct Plan {
    pub(crate) start: usize,
    pub(crate) len: usize,
    insns: Vec<Instruction>,
    /// A punned jump's [`tail`] (empty otherwise).
    tail: Vec<Instruction>,
    /// The original bytes of the range and the tail.
    bytes: Vec<u8>,
}

impl Plan {
    /// Whether the range holds several instructions.
    pub(crate) fn has_interior(&self) -> bool {
        self.insns.len() > 1
    }

    /// The end of the original code the trampoline runs a copy of: the
    /// range's, or its tail's.
    pub(crate) fn end(&self) -> usize {
        self.start + self.bytes.len()
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
///   range (past its first byte), no indirect jump in it can land there
///   (a jump table could: each must leave from a stack depth that no
///   instruction of the range has, `super::stack_depth`), and no
///   instruction of the range but the last changes control flow.
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
            tail: Vec::new(),
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
    super::branches::none_lands_inside(&all, &range)?;
    Ok(Plan {
        start: addr,
        len,
        insns: range,
        tail: Vec::new(),
        bytes: function.code[..len].to_vec(),
    })
}

/// The probed instruction alone (after an `endbr64`, which stays), when
/// the jump cannot replace whole instructions: what a punned jump
/// (`super::pun`) replaces, with the [`tail`] its trampoline runs after
/// it, which ends at `limit` at the latest. It must be relocatable. Not
/// async-signal-safe.
pub(crate) fn single(addr: usize, here: &[u8], limit: usize) -> Result<Plan, NotOptimized> {
    let first = decode_first(addr, here)?;
    if first.mnemonic() == Mnemonic::Endbr64 {
        let skip = first.len();
        return single(addr + skip, &here[skip..], limit);
    }
    relocatable(&here[..first.len()], &first)?;
    let len = first.len();
    // Over an instruction of a jump's length or more, the jump ends
    // inside it (one byte written); after one that never falls through,
    // nothing runs.
    let falls_through = !matches!(
        first.flow_control(),
        FlowControl::Return | FlowControl::UnconditionalBranch | FlowControl::IndirectBranch
    );
    let tail = if len < JUMP_LEN && falls_through {
        tail(addr + len, &here[len..], limit)
    } else {
        Vec::new()
    };
    let end = tail.last().map_or(addr + len, |t| t.next_ip() as usize);
    Ok(Plan {
        start: addr,
        len,
        bytes: here[..end - addr].to_vec(),
        insns: vec![first],
        tail,
    })
}

/// The instructions after a punned jump's instruction (which ends at
/// `from`; `code` is the code from there) that its trampoline runs too,
/// relocated, ending at `limit` at the latest: every one that starts
/// inside the bytes the `jmp` may span (up to `JUMP_LEN - 1` bytes past
/// `from`, with prefixes), so that a hit never goes back into the middle
/// of the jump. Going back there costs a hit as much again: the CPU's
/// branch predictor and decoded-instruction cache keep the jump at those
/// bytes, and meet an instruction that starts inside it. The tail ends
/// early at an instruction that cannot run relocated (a hit goes back
/// to it), and at a return, a jump or a call (whose callee returns to
/// the original code): nothing comes back from those.
fn tail(from: usize, code: &[u8], limit: usize) -> Vec<Instruction> {
    let mut tail = Vec::new();
    let mut decoder = Decoder::with_ip(64, code, from as u64, DecoderOptions::NONE);
    let mut at = from;
    while at < from + JUMP_LEN - 1 && decoder.can_decode() {
        let insn = decoder.decode();
        let end = insn.next_ip() as usize;
        if insn.is_invalid()
            || end > limit
            || relocatable(&code[at - from..end - from], &insn).is_err()
        {
            break;
        }
        let last = match insn.flow_control() {
            FlowControl::Next | FlowControl::ConditionalBranch => false,
            FlowControl::Return
            | FlowControl::UnconditionalBranch
            | FlowControl::IndirectBranch => true,
            FlowControl::Call | FlowControl::IndirectCall
                if insn.is_call_near() || insn.is_call_near_indirect() =>
            {
                true
            }
            _ => break,
        };
        tail.push(insn);
        if last {
            break;
        }
        at = end;
    }
    tail
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

/// Whether `insn` (its bytes `bytes`) can run relocated in a trampoline.
fn relocatable(bytes: &[u8], insn: &Instruction) -> Result<(), NotOptimized> {
    let refuse = |why| Err(NotOptimized::NotRelocatable { why });
    if let Err(why) = super::insn::refuse_by_table(bytes, insn) {
        return refuse(why);
    }
    match insn.flow_control() {
        // What else the decoder counts as a call (`syscall`, far calls)
        // is no `call` a push and a jump can stand for.
        FlowControl::Call if !insn.is_call_near() => refuse("not a near call"),
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
        _ if super::insn::has_operand_size_override(bytes)
            && (is_near_branch(insn)
                || matches!(
                    insn.flow_control(),
                    FlowControl::IndirectBranch | FlowControl::IndirectCall
                )) =>
        {
            // Found by fuzzing (`x86_exec`, on AMD): `66 ff 17` is a
            // 16-bit `call` there, moved as a 64-bit one.
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
    // A tail that cannot be encoded here (an operand out of reach) or
    // does not fit is left out: hits then go back into the jump's bytes.
    build_copying(plan, &plan.tail, base, cell).or_else(|why| {
        if plan.tail.is_empty() {
            Err(why)
        } else {
            build_copying(plan, &[], base, cell)
        }
    })
}

/// [`build`], copying `tail` after the range.
fn build_copying(
    plan: &Plan,
    tail: &[Instruction],
    base: usize,
    cell: usize,
) -> Result<(Vec<u8>, Moves), NotOptimized> {
    let mut code = vec![0xcc_u8; COPY_AT];
    code[CELL_AT..CELL_AT + 8].copy_from_slice(&(cell as u64).to_le_bytes());
    let entry = super::jump_entry::routine() as u64;
    code[ENTRY_PTR_AT..ENTRY_PTR_AT + 8].copy_from_slice(&entry.to_le_bytes());
    // The counting prelude (or a jump over it), the call into the common
    // routine, and the way back to the relocated code.
    super::count::prelude(&mut code, CELL_AT, ENTRY_PTR_AT, COUNTER_AT);

    let copied: Vec<&Instruction> = plan.insns.iter().chain(tail).collect();
    let mut pieces = Vec::with_capacity(copied.len() + 4);
    // Which of `pieces` starts the copy of each instruction.
    let mut firsts = Vec::with_capacity(copied.len());
    for insn in &copied {
        firsts.push(pieces.len());
        let off = insn.ip() as usize - plan.start;
        relocated(insn, &plan.bytes[off..off + insn.len()], &mut pieces);
    }
    // Back to the code after what was copied, unless the copy ends in a
    // branch of its own.
    let last = copied.last().expect("a range has an instruction");
    if tail.is_empty()
        || matches!(
            last.flow_control(),
            FlowControl::Next | FlowControl::ConditionalBranch
        )
    {
        pieces.push(Piece::Jump(last.next_ip()));
    }
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
    let moves = copied
        .iter()
        .zip(&firsts)
        .map(|(insn, &k)| (insn.ip() as usize, copy + starts[k] as usize))
        .collect();
    Ok((code, moves))
}

/// Appends the pieces that run `insn` (its original bytes `bytes`)
/// relocated: the instruction re-targeted, or for a call, a push of the
/// original return address and a jump (the callee must return to the
/// probed code; an indirect call's operand read 8 bytes further up if it
/// is addressed from the stack pointer, which the push moved).
fn relocated<'a>(insn: &'a Instruction, bytes: &'a [u8], pieces: &mut Vec<Piece<'a>>) {
    match insn.flow_control() {
        FlowControl::Call => {
            pieces.push(Piece::PushAddress(insn.next_ip()));
            pieces.push(Piece::Jump(insn.near_branch_target()));
        }
        FlowControl::IndirectCall => {
            pieces.push(Piece::PushAddress(insn.next_ip()));
            pieces.push(Piece::CallAsJump(insn, bytes));
        }
        _ => pieces.push(Piece::Moved(insn, bytes)),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const AT: usize = 0x7f00_0000_1000;

    /// The tail of a punned `nop` at `AT` followed by `after`: where each
    /// instruction starts, and the plan's end (as offsets from `AT`).
    fn tail_of(after: &[u8], limit: usize) -> (Vec<usize>, usize) {
        let mut code = vec![0x90];
        code.extend_from_slice(after);
        code.resize(64, 0xcc);
        let plan = single(AT, &code, AT + limit).unwrap();
        let starts = plan.tail.iter().map(|i| i.ip() as usize - AT).collect();
        (starts, plan.end() - AT)
    }

    #[test]
    fn a_tail_covers_what_starts_inside_the_jump() {
        // mov eax, [rdi]; add eax, 1; ret: the add starts at +3, the ret at
        // +6, past the bytes a jump over the nop can span (+1 to +4).
        let (starts, end) = tail_of(&[0x8b, 0x07, 0x83, 0xc0, 0x01, 0xc3], 10);
        assert_eq!((starts, end), (vec![1, 3], 6));
        // A return ends it: nothing comes back.
        assert_eq!(tail_of(&[0xc3, 0x55], 10), (vec![1], 2));
        // pop rbp; ret.
        assert_eq!(tail_of(&[0x5d, 0xc3], 10), (vec![1, 2], 3));
        // A conditional branch does not: je +0; nop; nop.
        assert_eq!(tail_of(&[0x74, 0x00, 0x90, 0x90], 10), (vec![1, 3, 4], 5));
    }

    #[test]
    fn a_tail_stops_before_what_cannot_run_relocated_or_reaches_the_limit() {
        // loop +0: no rel32 form.
        assert_eq!(tail_of(&[0xe2, 0x00], 10), (vec![], 1));
        // mov eax, [rdi] would end at +3, past a limit at +2.
        assert_eq!(tail_of(&[0x8b, 0x07], 2), (vec![], 1));
        // Bytes that do not decode.
        assert_eq!(tail_of(&[0x06], 10), (vec![], 1));
    }

    #[test]
    fn a_tail_out_of_the_trampolines_reach_is_left_out() {
        // mov rax, [rip - 0x7fff0000] at +1: its operand is out of rel32
        // reach from a trampoline 256 MiB above.
        let mut code = vec![0x90, 0x48, 0x8b, 0x05, 0x00, 0x00, 0x01, 0x80];
        code.resize(64, 0xcc);
        let plan = single(AT, &code, AT + 10).unwrap();
        assert_eq!(plan.tail.len(), 1);
        let base = AT + 0x1000_0000;
        let (bytes, moves) = build(&plan, base, 0).unwrap();
        assert_eq!(moves.iter().map(|&(at, _)| at).collect::<Vec<_>>(), [AT]);
        let copy = base + COPY_AT;
        let mut decoder =
            Decoder::with_ip(64, &bytes[COPY_AT..], copy as u64, DecoderOptions::NONE);
        assert_eq!(decoder.decode().mnemonic(), Mnemonic::Nop);
        assert_eq!(decoder.decode().near_branch_target() as usize, AT + 1);
    }

    #[test]
    fn an_instruction_of_a_jumps_length_has_no_tail() {
        let mut code = vec![0x0f, 0x1f, 0x44, 0x00, 0x00, 0x90, 0xc3];
        code.resize(64, 0xcc);
        let plan = single(AT, &code, AT + 10).unwrap();
        assert!(plan.tail.is_empty());
        assert_eq!(plan.end(), AT + 5);
    }

    #[test]
    fn the_trampoline_runs_the_tail_and_knows_where_each_copy_is() {
        let mut code = vec![0x90, 0x8b, 0x07, 0x83, 0xc0, 0x01, 0xc3];
        code.resize(64, 0xcc);
        let plan = single(AT, &code, AT + 10).unwrap();
        let base = AT + 0x10_0000;
        let (bytes, moves) = build(&plan, base, 0).unwrap();
        let origins: Vec<usize> = moves.iter().map(|&(at, _)| at - AT).collect();
        assert_eq!(origins, [0, 1, 3]);
        // The copies, in order: nop, the load, the add, then a jump back
        // to the ret at +6.
        let copy = base + COPY_AT;
        let mut decoder =
            Decoder::with_ip(64, &bytes[COPY_AT..], copy as u64, DecoderOptions::NONE);
        let insns: Vec<Instruction> = (0..4).map(|_| decoder.decode()).collect();
        let mnemonics: Vec<Mnemonic> = insns.iter().map(Instruction::mnemonic).collect();
        assert_eq!(
            mnemonics,
            [Mnemonic::Nop, Mnemonic::Mov, Mnemonic::Add, Mnemonic::Jmp]
        );
        assert_eq!(insns[3].near_branch_target() as usize, AT + 6);
        let starts: Vec<usize> = moves.iter().map(|&(_, c)| c).collect();
        assert_eq!(
            starts,
            [insns[0].ip(), insns[1].ip(), insns[2].ip()].map(|a| a as usize)
        );
    }
}
