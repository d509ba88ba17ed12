//! Decoding and classifying the instruction a probe displaces.
//!
//! The probe overwrites the first byte of an instruction with `int3`, so
//! every hit must do what the instruction would have done. This module
//! decides how, at attach time, from the original bytes: each supported
//! instruction becomes an [`Emulation`] that the trap handler applies to
//! the interrupted thread's registers without leaving the handler (the
//! kernel's `branch_emulate_op` / `push_emulate_op`, plus `ret`).
//! Everything else runs out of line (see `xol`), unless the kernel's
//! refusal tables (or this module) say it cannot be probed safely.

use iced_x86::{
    Code, ConditionCode, Decoder, DecoderOptions, Formatter as _, Instruction, Mnemonic,
    NasmFormatter, OpKind, Register,
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
    /// `call r/m64` (push `call_next`, run out of line it would push the
    /// slot's address instead) or `jmp r/m64` (`call_next` is `None`):
    /// continue at the operand's value.
    Indirect {
        target: Operand,
        call_next: Option<u64>,
    },
    /// `loop`, `loope`, `loopne` (`rcx -= 1`, branch if non-zero and the
    /// condition) and `jrcxz` (branch if `rcx` is zero): a taken branch run
    /// out of line would land relative to the slot.
    Loop {
        kind: LoopKind,
        target: u64,
        next: u64,
    },
    /// Anything else: run the relocated copy at `slot`, which jumps back
    /// or (`trap_back`) ends in a second trap.
    OutOfLine { slot: u64, trap_back: bool },
}

/// Where an indirect branch finds its target, decoded at attach so that
/// the trap handler only adds and loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operand {
    /// A register (its `gregs` index).
    Register(usize),
    /// The 8 bytes at `base + index * scale + disp` (registers as `gregs`
    /// indexes; a RIP-relative operand has neither and an absolute `disp`).
    Memory {
        base: Option<usize>,
        index: Option<usize>,
        scale: u64,
        disp: u64,
    },
}

/// The `rcx`-counting branches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoopKind {
    Loop,
    LoopE,
    LoopNe,
    Jrcxz,
}

/// A general-purpose register, by its `REG_*` index in `ucontext_t`'s
/// `gregs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gpr(pub(crate) usize);

/// Whether decoding from `start` (a function's first instruction) lands on
/// `addr`, given the code bytes `code` that begin at `start`.
pub(crate) fn is_boundary(start: usize, addr: usize, code: &[u8]) -> bool {
    let mut decoder = Decoder::with_ip(64, code, start as u64, DecoderOptions::NONE);
    while decoder.can_decode() {
        let insn = decoder.decode();
        if insn.is_invalid() || insn.ip() > addr as u64 {
            return false;
        }
        if insn.ip() == addr as u64 {
            return true;
        }
    }
    false
}

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
        Mnemonic::Loop | Mnemonic::Loope | Mnemonic::Loopne | Mnemonic::Jrcxz => {
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
            let (slot, end) = super::xol::slot_for(addr, &bytes[..insn.len()], &insn)?;
            Emulation::OutOfLine {
                slot: slot as u64,
                trap_back: end == crate::xol::SlotEnd::TrapBack,
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
    )
}

/// The kernel's refusal tables for 64-bit code (`uprobe_init_insn`): the
/// first opcode byte, the second byte of `0f xx`, and the prefixes that
/// make an instruction unsafe to move (segment overrides ES/CS/SS/DS,
/// LOCK). Applies to emulated instructions too.
pub(super) fn refuse_by_table(bytes: &[u8], insn: &Instruction) -> Result<(), &'static str> {
    let prefix_len = bytes
        .iter()
        .take_while(|b| {
            matches!(
                b,
                0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3 | 0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65
            )
        })
        .count();
    let prefixes = &bytes[..prefix_len];
    if prefixes.contains(&0xf0) {
        return Err("lock-prefixed instructions are refused (as by kernel uprobes)");
    }
    // A segment prefix on a nop (`cs nop word [rax + rax]`, the common
    // padding) changes nothing: it is emulated like any nop.
    if insn.mnemonic() != Mnemonic::Nop
        && prefixes
            .iter()
            .any(|b| matches!(b, 0x26 | 0x2e | 0x36 | 0x3e))
    {
        return Err("ES/CS/SS/DS segment prefixes are refused (as by kernel uprobes)");
    }
    // VEX/EVEX/XOP-encoded instructions carry their own opcode maps.
    if insn.encoding() != iced_x86::EncodingKind::Legacy {
        return Ok(());
    }
    let mut rest = &bytes[prefix_len..];
    if let Some(&rex) = rest.first()
        && (0x40..=0x4f).contains(&rex)
    {
        rest = &rest[1..];
    }
    match rest {
        [
            0x0f,
            0x00 | 0x01 | 0x05..=0x09 | 0x0b | 0x30 | 0x34 | 0x35 | 0x37 | 0x78 | 0x79 | 0xae,
            ..,
        ] => Err("a system or serializing two-byte opcode refused by kernel uprobes"),
        [
            0x06
            | 0x07
            | 0x0e
            | 0x16
            | 0x17
            | 0x1e
            | 0x1f
            | 0x27
            | 0x2f
            | 0x37
            | 0x3f
            | 0x60..=0x62
            | 0x6c..=0x6f
            | 0x82
            | 0x9a
            | 0xcc..=0xcf
            | 0xd4..=0xd6
            | 0xe4..=0xe7
            | 0xea
            | 0xec..=0xef
            | 0xf1
            | 0xf4
            | 0xfa
            | 0xfb,
            ..,
        ] => Err("an opcode refused by kernel uprobes (I/O, interrupts, invalid in 64-bit mode)"),
        _ if insn.mnemonic() == Mnemonic::Mov && insn.op0_register() == Register::SS => {
            Err("mov to ss inhibits interrupts for one instruction")
        }
        _ => Ok(()),
    }
}

pub(super) fn has_operand_size_override(bytes: &[u8]) -> bool {
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

pub(crate) fn disassemble(insn: &Instruction) -> String {
    let mut out = String::new();
    NasmFormatter::new().format(insn, &mut out);
    out
}

/// The `gregs` index of a 64-bit general-purpose register.
fn gpr(reg: Register) -> Gpr {
    Gpr(greg_of(reg).expect("a 64-bit general-purpose register"))
}

/// The `gregs` index of a 64-bit general-purpose register (or RIP), if it
/// is one.
pub(crate) fn greg_of(reg: Register) -> Option<usize> {
    Some(match reg {
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
        Register::R15 => libc::REG_R15,
        Register::RIP => libc::REG_RIP,
        _ => return None,
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
            &[0xf0, 0xff, 0x00][..],   // lock inc dword [rax]
            &[0x2e, 0x8b, 0x00],       // mov eax, cs:[rax]
            &[0xf4],                   // hlt
            &[0xfa],                   // cli
            &[0x0f],                   // cut off
            &[0x66, 0xe9, 0, 0],       // 66-prefixed jmp
            &[0xc7, 0xf8, 0, 0, 0, 0], // xbegin
            &[0x67, 0xe2, 0xfe],       // loop with ecx
        ] {
            assert!(
                matches!(emu(refused), Err(AttachError::Unsupported { .. })),
                "{refused:x?} accepted"
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
