//! Decoding and classifying the instruction a probe displaces.
//!
//! The probe overwrites the first byte of an instruction with `int3`, so
//! every hit must do what the instruction would have done. This module
//! decides how, at attach time, from the original bytes: each supported
//! instruction becomes an [`Emulation`] that the trap handler applies to
//! the interrupted thread's registers without leaving the handler (the
//! kernel's `branch_emulate_op` / `push_emulate_op`, plus `ret`).
//! Everything else is refused with the instruction and the reason (out of
//! line execution comes next).

use iced_x86::{
    ConditionCode, Decoder, DecoderOptions, Formatter as _, Instruction, Mnemonic, NasmFormatter,
    OpKind, Register,
};

use crate::AttachError;

/// What a hit does in place of the displaced instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Emulation {
    /// `nop` (any form) or `endbr64`: continue at `next`.
    Nop { next: u64 },
    /// `push reg` (64-bit): `rsp -= 8; [rsp] = reg`.
    Push { reg: Gpr, next: u64 },
    /// `jmp rel`: continue at `target`.
    Jmp { target: u64 },
    /// `call rel32`: push `next`, continue at `target`.
    Call { target: u64, next: u64 },
    /// `jcc rel`: `target` if `cond` holds, else `next`.
    Jcc {
        cond: ConditionCode,
        target: u64,
        next: u64,
    },
    /// `ret` / `ret imm16`: pop the return address, then `pop` more bytes.
    Ret { pop: u16 },
}

/// A general-purpose register, by its `REG_*` index in `ucontext_t`'s
/// `gregs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gpr(pub(crate) usize);

/// Decodes the instruction at `addr` from `bytes` (its bytes, up to 15)
/// and decides how hits will emulate it.
pub(crate) fn analyze(addr: usize, bytes: &[u8]) -> Result<Emulation, AttachError> {
    let mut decoder = Decoder::with_ip(64, bytes, addr as u64, DecoderOptions::NONE);
    let insn = decoder.decode();
    let text = disassemble(&insn);
    let refuse = |why| AttachError::Unsupported {
        addr,
        insn: text.clone(),
        why,
    };
    if insn.is_invalid() {
        return Err(refuse(
            "not a valid instruction (or cut off by the end of the mapping)",
        ));
    }
    if insn.has_lock_prefix() {
        return Err(refuse("lock-prefixed instructions are not emulated"));
    }
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
        _ if insn.is_jcc_short_or_near() => Emulation::Jcc {
            cond: insn.condition_code(),
            target: insn.near_branch_target(),
            next,
        },
        Mnemonic::Ret if insn.op_count() == 0 => Emulation::Ret { pop: 0 },
        Mnemonic::Ret if insn.op0_kind() == OpKind::Immediate16 => Emulation::Ret {
            pop: insn.immediate16(),
        },
        _ => {
            return Err(refuse(
                "only nops, endbr64, push reg, jmp/call/jcc rel and ret are handled so far (out-of-line execution is not implemented yet)",
            ));
        }
    };
    if is_branch(&emulation) && has_operand_size_override(bytes) {
        return Err(refuse("66-prefixed branches change the operand size"));
    }
    Ok(emulation)
}

fn is_branch(e: &Emulation) -> bool {
    matches!(
        e,
        Emulation::Jmp { .. }
            | Emulation::Call { .. }
            | Emulation::Jcc { .. }
            | Emulation::Ret { .. }
    )
}

fn has_operand_size_override(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .take_while(|b| {
            matches!(
                b,
                0x66 | 0xf2 | 0xf3 | 0x2e | 0x3e | 0x26 | 0x64 | 0x65 | 0x36
            )
        })
        .any(|&b| b == 0x66)
}

fn is_near_branch(insn: &Instruction) -> bool {
    matches!(
        insn.op0_kind(),
        OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
    )
}

fn disassemble(insn: &Instruction) -> String {
    let mut out = String::new();
    NasmFormatter::new().format(insn, &mut out);
    out
}

/// The `gregs` index of a 64-bit general-purpose register.
fn gpr(reg: Register) -> Gpr {
    Gpr(match reg {
        Register::RAX => libc::REG_RAX,
        Register::RCX => libc::REG_RCX,
        Register::RDX => libc::REG_RDX,
        Register::RBX => libc::REG_RBX,
        Register::RSP => libc::REG_RSP,
        Register::RBP => libc::REG_RBP,
        Register::RSI => libc::REG_RSI,
        Register::RDI => libc::REG_RDI,
        Register::R8 => libc::REG_R8,
        Register::R9 => libc::REG_R9,
        Register::R10 => libc::REG_R10,
        Register::R11 => libc::REG_R11,
        Register::R12 => libc::REG_R12,
        Register::R13 => libc::REG_R13,
        Register::R14 => libc::REG_R14,
        _ => libc::REG_R15,
    } as usize)
}

/// Whether condition `cond` holds for `rflags`.
pub(crate) fn condition_holds(cond: ConditionCode, rflags: u64) -> bool {
    let flag = |bit: u32| rflags >> bit & 1 == 1;
    let (cf, pf, zf, sf, of) = (flag(0), flag(2), flag(6), flag(7), flag(11));
    match cond {
        ConditionCode::o => of,
        ConditionCode::no => !of,
        ConditionCode::b => cf,
        ConditionCode::ae => !cf,
        ConditionCode::e => zf,
        ConditionCode::ne => !zf,
        ConditionCode::be => cf || zf,
        ConditionCode::a => !cf && !zf,
        ConditionCode::s => sf,
        ConditionCode::ns => !sf,
        ConditionCode::p => pf,
        ConditionCode::np => !pf,
        ConditionCode::l => sf != of,
        ConditionCode::ge => sf == of,
        ConditionCode::le => zf || sf != of,
        ConditionCode::g => !zf && sf == of,
        ConditionCode::None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emu(bytes: &[u8]) -> Result<Emulation, AttachError> {
        analyze(0x1000, bytes)
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
    fn refuses_with_the_instruction_and_a_reason() {
        let Err(AttachError::Unsupported { insn, why, .. }) = emu(&[0x48, 0x89, 0xe5]) else {
            panic!("mov rbp,rsp is not emulated");
        };
        assert_eq!(insn, "mov rbp,rsp");
        assert!(why.contains("out-of-line"));
        assert!(matches!(
            emu(&[0xf0, 0xff, 0x00]),
            Err(AttachError::Unsupported { .. })
        ));
        assert!(
            matches!(emu(&[0x0f]), Err(AttachError::Unsupported { .. })),
            "cut off"
        );
        assert!(matches!(
            emu(&[0x66, 0xe9, 0, 0]),
            Err(AttachError::Unsupported { .. })
        ));
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
