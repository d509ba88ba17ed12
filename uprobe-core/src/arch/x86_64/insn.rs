//! Decoding and classifying the instruction a probe displaces.
//!
//! What a hit does in place of the displaced instruction ([`Emulation`]),
//! and what analysis, relocation and emulation share: instruction
//! boundaries, the kernel's refusal tables, register numbers, condition
//! codes. The decision itself is `super::analyze`'s.

use iced_x86::{
    ConditionCode, Decoder, DecoderOptions, Formatter as _, Instruction, Mnemonic, NasmFormatter,
    Register,
};

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

/// The kernel's refusal tables for 64-bit code (`uprobe_init_insn`): the
/// first opcode byte and the second byte of `0f xx`. Applies to emulated
/// instructions too.
///
/// Some of the kernel's refusals are not kept, because a displaced
/// instruction here runs natively at another address (an out-of-line
/// slot or a trampoline: never single-stepped, its faults reported at
/// its own address), where they change nothing: the LOCK prefix (an
/// atomic read-modify-write stays atomic wherever it runs; no locked
/// instruction is emulated); the ES/CS/SS/DS segment overrides, which
/// 64-bit mode ignores (`3e` is also the `notrack` of CET-built indirect
/// branches, which the emulation needs no tracking for); `0f ae` (the
/// fences, `stmxcsr`/`ldmxcsr`, `fxsave`/`xsave` and their restores,
/// `clflush`, the FS/GS base reads and writes); and of `0f 01` the forms
/// user code runs (`xgetbv`, `xtest`, `rdpkru`, `wrpkru`, `rdtscp`). Kept:
/// the system calls (a thread may wait inside one for as long as it
/// likes), `ud2` and the privileged or virtualisation opcodes.
pub(super) fn refuse_by_table(bytes: &[u8], insn: &Instruction) -> Result<(), &'static str> {
    // Every byte before the opcode: legacy prefixes and REX bytes, in any
    // order and number (a REX followed by another prefix is ignored by
    // the CPU, but the prefixes after it still count: `42 4f 0f 05` is a
    // `syscall`).
    let prefix_len = bytes
        .iter()
        .take_while(|b| {
            matches!(
                b,
                0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3 | 0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x40
                    ..=0x4f
            )
        })
        .count();
    // VEX/EVEX/XOP-encoded instructions carry their own opcode maps.
    if insn.encoding() != iced_x86::EncodingKind::Legacy {
        return Ok(());
    }
    match &bytes[prefix_len..] {
        // Of `0f 01`, the forms user code runs, each the same at any
        // address: xgetbv, xtest, rdpkru, wrpkru, rdtscp.
        [0x0f, 0x01, 0xd0 | 0xd6 | 0xee | 0xef | 0xf9, ..] => Ok(()),
        [
            0x0f,
            0x00 | 0x01 | 0x05..=0x09 | 0x0b | 0x30 | 0x34 | 0x35 | 0x37 | 0x78 | 0x79,
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
    // Every prefix byte before the opcode, in any order: `67 66 e9` is
    // a 16-bit `jmp` on AMD processors too (found by fuzzing, `x86_exec`,
    // on an AMD host: the scan stopped at the `67`).
    bytes
        .iter()
        .take_while(|b| {
            matches!(
                b,
                0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3 | 0x2e | 0x3e | 0x26 | 0x64 | 0x65 | 0x36 | 0x40
                    ..=0x4f
            )
        })
        .any(|&b| b == 0x66)
}

pub(crate) fn disassemble(insn: &Instruction) -> String {
    let mut out = String::new();
    NasmFormatter::new().format(insn, &mut out);
    out
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
