//! Deciding, at attach time and from the original bytes, how every hit
//! will do what the displaced instruction would have done (the probe
//! overwrites its first byte with `int3`): each supported instruction
//! becomes an [`Emulation`] that the trap handler applies to the
//! interrupted thread's registers without leaving the handler (the
//! kernel's `branch_emulate_op` / `push_emulate_op`, plus `ret`).
//! Everything else runs out of line (`super::xol`), unless the kernel's
//! refusal tables (or this module) say it cannot be probed safely.

use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};

use super::branches::is_near_branch;
use super::insn::{
    Emulation, Gpr, LoopKind, Operand, disassemble, greg_of, has_operand_size_override,
    refuse_by_table,
};
use crate::arch::{SlotEnd, SlotFor};
use crate::base::error::AttachError;

/// Decodes the instruction at `addr` from `bytes` (its bytes, up to 15)
/// and decides how hits will emulate it.
pub(crate) fn analyze(
    addr: usize,
    bytes: &[u8],
    slot_for: SlotFor,
) -> Result<Emulation, AttachError> {
    let mut decoder = Decoder::with_ip(64, bytes, addr as u64, DecoderOptions::NONE);
    let insn = decoder.decode();
    // The text only where a probe is refused: the formatter's tables,
    // built on first use and never freed, would stay in the process
    // (uprobe-trace -p leaves it as it found it).
    let refuse = |why| AttachError::Unsupported {
        addr,
        insn: disassemble(&insn),
        why,
    };
    if insn.is_invalid() {
        return Err(refuse(
            "not a valid instruction (or cut off by the end of the mapping)",
        ));
    }
    refuse_by_table(bytes, &insn).map_err(refuse)?;
    let next = insn.next_ip();
    let emulation = match insn.mnemonic() {
        Mnemonic::Nop | Mnemonic::Endbr64 | Mnemonic::Endbr32 => Emulation::Nop { next },
        Mnemonic::Push if insn.op_count() == 1 && insn.op0_kind() == OpKind::Register => {
            let reg = insn.op0_register();
            if !reg.is_gpr64() {
                return Err(refuse("only 64-bit `push reg` is emulated"));
            }
            Emulation::Push {
                reg: gpr(reg),
                next,
            }
        }
        Mnemonic::Jmp if is_near_branch(&insn) => Emulation::Jmp {
            target: insn.near_branch_target(),
        },
        Mnemonic::Call if is_near_branch(&insn) => Emulation::Call {
            target: insn.near_branch_target(),
            next,
        },
        Mnemonic::Call | Mnemonic::Jmp
            if matches!(insn.op0_kind(), OpKind::Register | OpKind::Memory) =>
        {
            indirect(&insn).map_err(refuse)?
        }
        _ if insn.is_jcc_short_or_near() => Emulation::Jcc {
            cond: insn.condition_code(),
            target: insn.near_branch_target(),
            next,
        },
        Mnemonic::Loop | Mnemonic::Loope | Mnemonic::Loopne | Mnemonic::Jrcxz | Mnemonic::Jecxz => {
            rcx_loop(&insn).map_err(refuse)?
        }
        Mnemonic::Ret if insn.op_count() == 0 => Emulation::Ret { pop: 0 },
        Mnemonic::Ret if insn.op0_kind() == OpKind::Immediate16 => Emulation::Ret {
            pop: insn.immediate16(),
        },
        Mnemonic::Xbegin | Mnemonic::Xabort | Mnemonic::Xend => {
            return Err(refuse(
                "transactional memory: a trap always aborts the transaction",
            ));
        }
        Mnemonic::Retf | Mnemonic::Iret | Mnemonic::Iretd | Mnemonic::Iretq => {
            return Err(refuse("far returns are not probed"));
        }
        _ if insn.is_call_far()
            || insn.is_jmp_far()
            || insn.is_jmp_far_indirect()
            || insn.is_call_far_indirect() =>
        {
            return Err(refuse("far branches are not probed"));
        }
        _ => {
            let (slot, end) = super::xol::slot_for(addr, &bytes[..insn.len()], &insn, slot_for)?;
            Emulation::OutOfLine {
                slot: slot as u64,
                trap_back: end == SlotEnd::TrapBack,
            }
        }
    };
    if is_branch(&emulation) && has_operand_size_override(bytes) {
        return Err(refuse("66-prefixed branches change the operand size"));
    }
    Ok(emulation)
}

/// `call r/m64` / `jmp r/m64`, emulated: the operand must resolve from
/// the frame alone.
fn indirect(insn: &Instruction) -> Result<Emulation, &'static str> {
    let call_next = match insn.code() {
        Code::Call_rm64 => Some(insn.next_ip()),
        Code::Jmp_rm64 => None,
        _ => return Err("only 64-bit indirect branches are emulated"),
    };
    if matches!(insn.segment_prefix(), Register::FS | Register::GS) {
        return Err("fs/gs-relative indirect branches are not emulated");
    }
    let target = if insn.op0_kind() == OpKind::Register {
        Operand::Register(greg_of(insn.op0_register()).ok_or("not a 64-bit register")?)
    } else if insn.is_ip_rel_memory_operand() {
        Operand::Memory {
            base: None,
            index: None,
            scale: 0,
            disp: insn.ip_rel_memory_address(),
        }
    } else {
        let reg = |r: Register| -> Result<Option<usize>, &'static str> {
            if r == Register::None {
                Ok(None)
            } else {
                greg_of(r)
                    .map(Some)
                    .ok_or("an address register that is not 64-bit")
            }
        };
        Operand::Memory {
            base: reg(insn.memory_base())?,
            index: reg(insn.memory_index())?,
            scale: u64::from(insn.memory_index_scale()),
            disp: insn.memory_displacement64(),
        }
    };
    Ok(Emulation::Indirect { target, call_next })
}

/// `loop`/`loope`/`loopne`/`jrcxz` with 64-bit `rcx`, emulated.
fn rcx_loop(insn: &Instruction) -> Result<Emulation, &'static str> {
    let kind = match insn.code() {
        Code::Loop_rel8_64_RCX => LoopKind::Loop,
        Code::Loope_rel8_64_RCX => LoopKind::LoopE,
        Code::Loopne_rel8_64_RCX => LoopKind::LoopNe,
        Code::Jrcxz_rel8_64 => LoopKind::Jrcxz,
        _ => return Err("32-bit-address (ecx) loops are not emulated"),
    };
    Ok(Emulation::Loop {
        kind,
        target: insn.near_branch_target(),
        next: insn.next_ip(),
    })
}

fn is_branch(e: &Emulation) -> bool {
    matches!(
        e,
        Emulation::Jmp { .. }
            | Emulation::Call { .. }
            | Emulation::Jcc { .. }
            | Emulation::Ret { .. }
            | Emulation::Loop { .. }
            | Emulation::Indirect { .. }
    )
}

/// The `gregs` index of a 64-bit general-purpose register.
fn gpr(reg: Register) -> Gpr {
    Gpr(greg_of(reg).expect("a 64-bit general-purpose register"))
}

#[cfg(test)]
mod tests {
    use super::super::insn::condition_holds;
    use super::*;
    use crate::arch::SlotCode;
    use iced_x86::ConditionCode;

    /// A slot source for the tests: every slot at 0x2000, ending as asked
    /// (its code made, to check that it can be).
    fn test_slot(
        _addr: usize,
        _bytes: &[u8],
        _near: bool,
        code: SlotCode<'_>,
    ) -> Result<(usize, SlotEnd), AttachError> {
        code(0x2000, SlotEnd::JumpBack)?;
        Ok((0x2000, SlotEnd::JumpBack))
    }

    fn emu(bytes: &[u8]) -> Result<Emulation, AttachError> {
        analyze(0x1000, bytes, test_slot)
    }

    #[test]
    fn classifies_the_emulated_forms() {
        assert_eq!(emu(&[0x90]), Ok(Emulation::Nop { next: 0x1001 }));
        assert_eq!(
            emu(&[0x0f, 0x1f, 0x44, 0, 0]),
            Ok(Emulation::Nop { next: 0x1005 })
        );
        assert_eq!(
            emu(&[0xf3, 0x0f, 0x1e, 0xfa]),
            Ok(Emulation::Nop { next: 0x1004 })
        );
        assert_eq!(
            emu(&[0x55]),
            Ok(Emulation::Push {
                reg: Gpr(libc::REG_RBP as usize),
                next: 0x1001
            })
        );
        assert_eq!(
            emu(&[0x41, 0x57]),
            Ok(Emulation::Push {
                reg: Gpr(libc::REG_R15 as usize),
                next: 0x1002
            })
        );
        assert_eq!(emu(&[0xeb, 0x10]), Ok(Emulation::Jmp { target: 0x1012 }));
        assert_eq!(
            emu(&[0xe9, 0, 1, 0, 0]),
            Ok(Emulation::Jmp { target: 0x1105 })
        );
        assert_eq!(
            emu(&[0xe8, 0xfb, 0xff, 0xff, 0xff]),
            Ok(Emulation::Call {
                target: 0x1000,
                next: 0x1005
            })
        );
        assert_eq!(
            emu(&[0x74, 0x02]),
            Ok(Emulation::Jcc {
                cond: ConditionCode::e,
                target: 0x1004,
                next: 0x1002
            })
        );
        assert_eq!(emu(&[0xc3]), Ok(Emulation::Ret { pop: 0 }));
        assert_eq!(emu(&[0xc2, 0x10, 0]), Ok(Emulation::Ret { pop: 16 }));
    }

    #[test]
    fn segment_prefixed_nops_are_nops() {
        for nop in [
            &[0x2e, 0x90][..],
            &[0x66, 0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0],
            &[0x3e, 0x0f, 0x1f, 0x00],
        ] {
            assert!(
                matches!(emu(nop), Ok(Emulation::Nop { .. })),
                "{nop:x?}: {:?}",
                emu(nop)
            );
        }
    }

    #[test]
    fn refuses_with_the_instruction_and_a_reason() {
        let Err(AttachError::Unsupported { insn, why, .. }) = emu(&[0x0f, 0x05]) else {
            panic!("syscall is refused");
        };
        assert_eq!(insn, "syscall");
        assert!(why.contains("kernel uprobes"), "{why}");
        for refused in [
            &[0xf4][..],               // hlt
            &[0xfa],                   // cli
            &[0x0f, 0x01, 0xf8],       // swapgs
            &[0x0f, 0x0b],             // ud2
            &[0x0f],                   // cut off
            &[0x66, 0xe9, 0, 0],       // 66-prefixed jmp
            &[0xc7, 0xf8, 0, 0, 0, 0], // xbegin
            &[0x67, 0xe2, 0xfe],       // loop with ecx
            &[0x67, 0xe3, 0xfc],       // jecxz (found by fuzzing: it ran out of line)
            // Found by fuzzing: the tables looked past one REX byte only.
            &[0x42, 0x4f, 0x0f, 0x05],       // syscall after two REX bytes
            &[0x67, 0x66, 0xe9, 0, 0, 0, 0], // 66-prefixed jmp after 67 (fuzzing)
            &[0x66, 0xff, 0x17],             // 66-prefixed call [rdi] (fuzzing)
            &[0x66, 0xff, 0xe0],             // 66-prefixed jmp rax
        ] {
            assert!(
                matches!(emu(refused), Err(AttachError::Unsupported { .. })),
                "{refused:x?} accepted"
            );
        }
    }

    /// What the kernel refuses but runs unchanged at another address:
    /// locked read-modify-writes, the segment overrides 64-bit mode
    /// ignores, fences, the MXCSR's store, `xgetbv` and `rdtscp`, run out
    /// of line.
    #[test]
    fn what_runs_the_same_elsewhere_runs_out_of_line() {
        for accepted in [
            &[0xf0, 0xff, 0x00][..],               // lock inc dword [rax]
            &[0x40, 0xf0, 0xff, 0x00],             // the same after a REX byte
            &[0xf0, 0x48, 0x0f, 0xb1, 0x0e],       // lock cmpxchg [rsi], rcx
            &[0x2e, 0x8b, 0x00],                   // mov eax, cs:[rax]
            &[0x26, 0x36, 0x48, 0x8b, 0x04, 0x24], // mov rax, ss:[rsp] (es, ss)
            &[0x0f, 0xae, 0xe8],                   // lfence
            &[0x0f, 0xae, 0xf0],                   // mfence
            &[0x0f, 0xae, 0x5c, 0x24, 0xf8],       // stmxcsr [rsp - 8]
            &[0x0f, 0x01, 0xd0],                   // xgetbv
            &[0x0f, 0x01, 0xf9],                   // rdtscp
        ] {
            assert!(
                matches!(emu(accepted), Ok(Emulation::OutOfLine { .. })),
                "{accepted:x?}: {:?}",
                emu(accepted)
            );
        }
    }

    #[test]
    fn conditions_follow_the_flags() {
        const CF: u64 = 1;
        const ZF: u64 = 1 << 6;
        const SF: u64 = 1 << 7;
        const OF: u64 = 1 << 11;
        assert!(condition_holds(ConditionCode::e, ZF));
        assert!(!condition_holds(ConditionCode::ne, ZF));
        assert!(condition_holds(ConditionCode::be, CF));
        assert!(condition_holds(ConditionCode::l, SF));
        assert!(!condition_holds(ConditionCode::l, SF | OF));
        assert!(condition_holds(ConditionCode::g, 0));
        assert!(!condition_holds(ConditionCode::g, ZF));
    }
}
