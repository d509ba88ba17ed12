//! How deep the stack is at each instruction of a compiled function,
//! from its entry: what tells an indirect jump that leaves the function
//! (a sibling call through a function pointer, made once the epilogue
//! has given the frame back) from a jump table that lands inside it.
//!
//! A compiled function keeps one stack depth per instruction, whichever
//! way it is reached (its unwind information says so, one rule per
//! address): a branch, direct or through a jump table, lands only where
//! the depth is the one it leaves from. So an indirect jump made at a
//! depth that no instruction of a range has cannot land inside it. The
//! depths are found by following the direct control flow from the entry
//! (depth 0) through the instructions that move the stack pointer by a
//! known amount (`push`, `pop`, `sub`/`add`/`lea` of `rsp` with a
//! constant, `call`, which comes back at the same depth); anything else
//! that writes `rsp` (`leave`, `mov rsp, ...`, `and rsp, ...`), a branch
//! into the middle of an instruction, or two depths at one instruction,
//! and nothing is known.

use std::collections::HashMap;

use iced_x86::{
    FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind, Register,
};

/// The stack depth (bytes below the stack pointer at entry) at each
/// instruction of `all` (a function's instructions in address order,
/// its entry first) that the direct control flow from the entry
/// reaches; `None` where some reached instruction moves the stack
/// pointer by an amount not known here, or is reached at two depths.
/// Not async-signal-safe.
pub(super) fn depths(all: &[Instruction]) -> Option<HashMap<usize, i64>> {
    let index: HashMap<usize, usize> = all
        .iter()
        .enumerate()
        .map(|(i, insn)| (insn.ip() as usize, i))
        .collect();
    let (start, end) = match (all.first(), all.last()) {
        (Some(f), Some(l)) => (f.ip() as usize, l.next_ip() as usize),
        _ => return None,
    };
    let mut depth: HashMap<usize, i64> = HashMap::new();
    let mut work = vec![(0usize, 0i64)];
    while let Some((i, d)) = work.pop() {
        let insn = &all[i];
        match depth.insert(insn.ip() as usize, d) {
            Some(seen) if seen == d => continue,
            Some(_) => return None,
            None => {}
        }
        let after = d + moved(insn)?;
        let mut go = |target: usize| -> Option<()> {
            if (start..end).contains(&target) {
                work.push((*index.get(&target)?, after));
            }
            Some(())
        };
        match insn.flow_control() {
            FlowControl::Next | FlowControl::Call | FlowControl::IndirectCall => {
                go(insn.next_ip() as usize)?;
            }
            FlowControl::ConditionalBranch => {
                go(insn.near_branch_target() as usize)?;
                go(insn.next_ip() as usize)?;
            }
            FlowControl::UnconditionalBranch => go(insn.near_branch_target() as usize)?,
            FlowControl::Return | FlowControl::IndirectBranch => {}
            // Interrupts, `xbegin` and the like: not followed.
            _ => return None,
        }
    }
    Some(depth)
}

/// How far `insn` moves the stack pointer down (bytes, negative: up),
/// if known here.
fn moved(insn: &Instruction) -> Option<i64> {
    let imm = || match insn.op1_kind() {
        OpKind::Immediate8to64 | OpKind::Immediate32to64 => Some(insn.immediate64() as i64),
        OpKind::Immediate8 | OpKind::Immediate32 => Some(i64::from(insn.immediate32() as i32)),
        _ => None,
    };
    let on_rsp = insn.op_count() > 0
        && insn.op0_kind() == OpKind::Register
        && insn.op0_register() == Register::RSP;
    match insn.mnemonic() {
        Mnemonic::Push | Mnemonic::Pushfq | Mnemonic::Pop | Mnemonic::Popfq if !on_rsp => {
            Some(-i64::from(insn.stack_pointer_increment()))
        }
        Mnemonic::Sub if on_rsp => imm(),
        Mnemonic::Add if on_rsp => imm().map(|n| -n),
        Mnemonic::Lea
            if on_rsp
                && insn.memory_base() == Register::RSP
                && insn.memory_index() == Register::None =>
        {
            Some(-(insn.memory_displacement64() as i64))
        }
        // A call's callee returns to the same depth; a return ends the
        // path (its depth is its own).
        Mnemonic::Call | Mnemonic::Ret => Some(0),
        _ if writes_rsp(insn) => None,
        _ => Some(0),
    }
}

/// Whether `insn` writes `rsp` (explicitly or not).
fn writes_rsp(insn: &Instruction) -> bool {
    InstructionInfoFactory::new()
        .info(insn)
        .used_registers()
        .iter()
        .any(|r| {
            r.register() == Register::RSP
                && !matches!(
                    r.access(),
                    OpAccess::Read | OpAccess::CondRead | OpAccess::None
                )
        })
}

#[cfg(test)]
mod tests {
    use iced_x86::{Decoder, DecoderOptions};

    use super::*;

    fn decode(code: &[u8]) -> Vec<Instruction> {
        Decoder::with_ip(64, code, 0x1000, DecoderOptions::NONE)
            .into_iter()
            .collect()
    }

    #[test]
    fn depths_follow_the_frame_and_its_epilogues() {
        // push rbp; push rbx; sub rsp, 8; test edi, edi; je +6;
        // add rsp, 8; pop rbx; pop rbp; jmp rax  (a sibling call)
        // call [rip]; add rsp, 8; pop rbx; pop rbp; ret
        let code = [
            0x55, 0x53, 0x48, 0x83, 0xec, 0x08, 0x85, 0xff, 0x74, 0x08, 0x48, 0x83, 0xc4, 0x08,
            0x5b, 0x5d, 0xff, 0xe0, 0xff, 0x15, 0, 0, 0, 0, 0x48, 0x83, 0xc4, 0x08, 0x5b, 0x5d,
            0xc3,
        ];
        let all = decode(&code);
        let d = depths(&all).expect("known");
        assert_eq!(
            (d[&0x1000], d[&0x1001], d[&0x1002], d[&0x1006]),
            (0, 8, 16, 24)
        );
        assert_eq!(d[&0x1010], 0, "the indirect jump, after the epilogue");
        assert_eq!(d[&0x1012], 24, "the branch target");
        assert_eq!(d[&0x101e], 0, "the return");
    }

    #[test]
    fn unknown_moves_and_disagreeing_paths_know_nothing() {
        // push rbp; mov rbp, rsp; leave; ret
        assert!(depths(&decode(&[0x55, 0x48, 0x89, 0xe5, 0xc9, 0xc3])).is_none());
        // and rsp, -16; ret
        assert!(depths(&decode(&[0x48, 0x83, 0xe4, 0xf0, 0xc3])).is_none());
        // test edi, edi; je +1; push rax; ret  (0x1005 reached at 0 and 8)
        assert!(depths(&decode(&[0x85, 0xff, 0x74, 0x01, 0x50, 0xc3])).is_none());
        // jmp +1 into the middle of the next instruction
        assert!(depths(&decode(&[0xeb, 0x01, 0x48, 0x89, 0xe5, 0xc3])).is_none());
    }
}
