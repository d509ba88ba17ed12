//! Instructions moved to another address (a trampoline's copy, an
//! out-of-line slot), written by hand where that is a copy of their bytes
//! with what depends on the address re-targeted, and by iced-x86's block
//! encoder for the rest.
//!
//! What the engine moves is almost always one of: an instruction that
//! does not depend on its address (its bytes, copied); one with a
//! RIP-relative memory operand (copied, its 32-bit displacement
//! re-targeted); a direct `jmp`, `jcc` or `call` (written in its `rel32`
//! form, re-targeted); and the few instructions the engine adds around
//! them (a `jmp rel32`, a return address pushed without touching flags,
//! an `int3`, an indirect call made the jump through its operand). Those
//! are written here. Anything else (an indirect call through the stack
//! pointer, whose displacement changes; a branch without a `rel32` form
//! or with an operand-size prefix; a target out of `rel32` reach) goes
//! through the block encoder, as everything did before.
//!
//! Why not always the block encoder: iced-x86 builds its encoder's tables
//! on first use (about 560 KiB of heap, a `lazy_static` never freed). In
//! a program the engine is loaded into for a while (a tracer's agent in a
//! running process) that memory stays after the last probe is detached.
//! Written by hand, the tables are never built unless a rare instruction
//! needs them.

use iced_x86::{
    BlockEncoder, BlockEncoderOptions, Code, Decoder, DecoderOptions, FlowControl, Instruction,
    InstructionBlock, MemoryOperand, Register,
};

/// One thing to write at the new address.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Piece<'a> {
    /// An instruction of the original code and its bytes, re-targeted.
    Moved(&'a Instruction, &'a [u8]),
    /// An indirect `call` of the original code, and its bytes, made the
    /// `jmp` through the same operand (the caller pushed the return
    /// address: an operand addressed from the stack pointer is read 8
    /// bytes further up).
    CallAsJump(&'a Instruction, &'a [u8]),
    /// `jmp rel32` to an address.
    Jump(u64),
    /// A return address pushed without touching the flags:
    /// `lea rsp, [rsp-8]`, then its two halves stored with `mov dword`.
    PushAddress(u64),
    /// `int3`.
    Int3,
}

/// The code of `pieces` written at `at`, and where each piece starts in
/// it (offsets from `at`); `None` if it cannot be encoded there (a
/// target out of reach, an instruction no encoder takes). Not
/// async-signal-safe.
pub(crate) fn encode(pieces: &[Piece<'_>], at: u64) -> Option<(Vec<u8>, Vec<u32>)> {
    // An EIP-relative operand (`addr32` before a RIP-relative one, which
    // no compiler writes) addresses modulo 4 GiB; the encoder's own
    // checks reject it (found by fuzzing, `x86_analyze`): not moved.
    let eip_relative = pieces.iter().any(|p| match *p {
        Piece::Moved(i, _) | Piece::CallAsJump(i, _) => i.memory_base() == Register::EIP,
        _ => false,
    });
    if eip_relative {
        return None;
    }
    by_hand(pieces, at).or_else(|| with_block_encoder(pieces, at))
}

/// [`encode`] for pieces that need no encoder; `None` for any other.
fn by_hand(pieces: &[Piece<'_>], at: u64) -> Option<(Vec<u8>, Vec<u32>)> {
    let mut code = Vec::with_capacity(16 * pieces.len());
    let mut starts = Vec::with_capacity(pieces.len());
    for piece in pieces {
        starts.push(u32::try_from(code.len()).ok()?);
        let here = at + code.len() as u64;
        match *piece {
            Piece::Moved(insn, bytes) => moved(insn, bytes, here, &mut code)?,
            Piece::CallAsJump(insn, bytes) => call_as_jump(insn, bytes, here, &mut code)?,
            Piece::Jump(to) => rel32(&[0xe9], here, to, &mut code)?,
            Piece::PushAddress(ret) => {
                // lea rsp, [rsp-8]
                code.extend_from_slice(&[0x48, 0x8d, 0x64, 0x24, 0xf8]);
                // mov dword [rsp], low; mov dword [rsp+4], high
                code.extend_from_slice(&[0xc7, 0x04, 0x24]);
                code.extend_from_slice(&(ret as u32).to_le_bytes());
                code.extend_from_slice(&[0xc7, 0x44, 0x24, 0x04]);
                code.extend_from_slice(&((ret >> 32) as u32).to_le_bytes());
            }
            Piece::Int3 => code.push(0xcc),
        }
    }
    Some((code, starts))
}

/// Appends `insn` (whose original bytes are `bytes`) as it runs at
/// `here`; `None` if that takes an encoder.
fn moved(insn: &Instruction, bytes: &[u8], here: u64, code: &mut Vec<u8>) -> Option<()> {
    match insn.flow_control() {
        FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch | FlowControl::Call
            if is_rel_branch(insn) =>
        {
            let op = opcode(bytes)?;
            // Its prefixes (branch hints, `bnd`) as they were, then the
            // `rel32` form of its opcode; not with `66`, which makes the
            // offset 16 bits on some CPUs.
            let mut out = bytes[..bytes.len() - op.len()].to_vec();
            if out.contains(&0x66) {
                return None;
            }
            match op {
                [0xeb | 0xe9, ..] => out.push(0xe9),
                [0xe8, ..] => out.push(0xe8),
                [cc @ 0x70..=0x7f, ..] => out.extend([0x0f, 0x80 | (cc & 0xf)]),
                [0x0f, cc @ 0x80..=0x8f, ..] => out.extend([0x0f, *cc]),
                _ => return None,
            }
            // Widened with all its prefixes, it must still be an
            // instruction (at most 15 bytes): else the encoder writes it.
            if out.len() + 4 > super::MAX_INSN_LEN {
                return None;
            }
            rel32(&out, here, insn.near_branch_target(), code)
        }
        FlowControl::Next
        | FlowControl::Return
        | FlowControl::IndirectBranch
        | FlowControl::IndirectCall
        | FlowControl::Interrupt
        | FlowControl::Exception
            if !is_branch_with_target(insn) =>
        {
            moved_bytes(insn, bytes, here, code)
        }
        _ => None,
    }
}

/// Appends `bytes`, the instruction `insn`, as it runs at `here`: a copy,
/// its RIP-relative displacement (if any) re-targeted; `None` if that
/// does not reach.
fn moved_bytes(insn: &Instruction, bytes: &[u8], here: u64, code: &mut Vec<u8>) -> Option<()> {
    if bytes.len() != insn.len() {
        return None;
    }
    let start = code.len();
    code.extend_from_slice(bytes);
    if insn.is_ip_rel_memory_operand() {
        // The displacement counts from the end of the instruction, which
        // has the same length here. The offsets are those of the
        // decoder's last instruction.
        let mut decoder = Decoder::with_ip(64, bytes, insn.ip(), DecoderOptions::NONE);
        let again = decoder.decode();
        let offsets = decoder.get_constant_offsets(&again);
        let disp = displacement(insn.ip_rel_memory_address(), here + bytes.len() as u64)
            .filter(|_| offsets.has_displacement() && offsets.displacement_size() == 4);
        let Some(disp) = disp else {
            code.truncate(start);
            return None;
        };
        let at = start + offsets.displacement_offset();
        code[at..at + 4].copy_from_slice(&disp.to_le_bytes());
    }
    Some(())
}

/// Appends the indirect `call` `insn` (bytes `bytes`) as the `jmp`
/// through the same operand (`FF /2` made `FF /4`), as it runs at
/// `here`; `None` for an operand addressed from the stack pointer (whose
/// displacement changes), or anything that is not `FF /2`.
fn call_as_jump(insn: &Instruction, bytes: &[u8], here: u64, code: &mut Vec<u8>) -> Option<()> {
    let op = opcode(bytes)?;
    let modrm = bytes.len() - op.len() + 1;
    let uses_rsp = insn.op0_kind() == iced_x86::OpKind::Memory
        && (insn.memory_base() == Register::RSP || insn.memory_index() == Register::RSP);
    if op.first() != Some(&0xff) || op.get(1)? >> 3 & 7 != 2 || uses_rsp {
        return None;
    }
    let start = code.len();
    moved_bytes(insn, bytes, here, code)?;
    code[start + modrm] = (code[start + modrm] & 0xc7) | (4 << 3);
    Some(())
}

/// Whether `insn` is a near `jmp`, `jcc` or `call` with a relative
/// target (`rel8` or `rel32`).
fn is_rel_branch(insn: &Instruction) -> bool {
    matches!(
        insn.code(),
        Code::Jmp_rel8_64
            | Code::Jmp_rel32_64
            | Code::Call_rel32_64
            | Code::Jo_rel8_64
            | Code::Jno_rel8_64
            | Code::Jb_rel8_64
            | Code::Jae_rel8_64
            | Code::Je_rel8_64
            | Code::Jne_rel8_64
            | Code::Jbe_rel8_64
            | Code::Ja_rel8_64
            | Code::Js_rel8_64
            | Code::Jns_rel8_64
            | Code::Jp_rel8_64
            | Code::Jnp_rel8_64
            | Code::Jl_rel8_64
            | Code::Jge_rel8_64
            | Code::Jle_rel8_64
            | Code::Jg_rel8_64
            | Code::Jo_rel32_64
            | Code::Jno_rel32_64
            | Code::Jb_rel32_64
            | Code::Jae_rel32_64
            | Code::Je_rel32_64
            | Code::Jne_rel32_64
            | Code::Jbe_rel32_64
            | Code::Ja_rel32_64
            | Code::Js_rel32_64
            | Code::Jns_rel32_64
            | Code::Jp_rel32_64
            | Code::Jnp_rel32_64
            | Code::Jl_rel32_64
            | Code::Jge_rel32_64
            | Code::Jle_rel32_64
            | Code::Jg_rel32_64
    )
}

/// Whether `insn` has a branch target of any kind (`loop`, `jrcxz`,
/// `xbegin`, far branches...): not for a byte copy.
fn is_branch_with_target(insn: &Instruction) -> bool {
    (0..insn.op_count()).any(|i| {
        matches!(
            insn.op_kind(i),
            iced_x86::OpKind::NearBranch16
                | iced_x86::OpKind::NearBranch32
                | iced_x86::OpKind::NearBranch64
                | iced_x86::OpKind::FarBranch16
                | iced_x86::OpKind::FarBranch32
        )
    })
}

/// The opcode bytes of an instruction (after its legacy and REX
/// prefixes).
fn opcode(bytes: &[u8]) -> Option<&[u8]> {
    let skip = bytes.iter().position(|b| {
        !matches!(
            b,
            0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3 | 0x40
                ..=0x4f
        )
    })?;
    Some(&bytes[skip..])
}

/// Appends `op` and the `rel32` from `here` (where `op` starts) to `to`.
fn rel32(op: &[u8], here: u64, to: u64, code: &mut Vec<u8>) -> Option<()> {
    let disp = displacement(to, here + op.len() as u64 + 4)?;
    code.extend_from_slice(op);
    code.extend_from_slice(&disp.to_le_bytes());
    Some(())
}

/// `to - end` as a `rel32`, if it fits.
fn displacement(to: u64, end: u64) -> Option<i32> {
    i32::try_from(to.wrapping_sub(end) as i64).ok()
}

/// [`encode`] through iced-x86's block encoder (builds its tables on
/// first use).
fn with_block_encoder(pieces: &[Piece<'_>], at: u64) -> Option<(Vec<u8>, Vec<u32>)> {
    let mut insns = Vec::with_capacity(pieces.len() + 2);
    // Which of `insns` each piece starts at.
    let mut firsts = Vec::with_capacity(pieces.len());
    for piece in pieces {
        firsts.push(insns.len());
        match *piece {
            Piece::Moved(insn, _) => insns.push(*insn),
            Piece::CallAsJump(insn, _) => {
                let mut jmp = *insn;
                jmp.set_code(Code::Jmp_rm64);
                if jmp.op0_kind() == iced_x86::OpKind::Memory && jmp.memory_base() == Register::RSP
                {
                    jmp.set_memory_displacement64(jmp.memory_displacement64().wrapping_add(8));
                }
                insns.push(jmp);
            }
            Piece::Jump(to) => insns.push(Instruction::with_branch(Code::Jmp_rel32_64, to).ok()?),
            Piece::PushAddress(ret) => {
                insns.push(
                    Instruction::with2(
                        Code::Lea_r64_m,
                        Register::RSP,
                        MemoryOperand::with_base_displ(Register::RSP, -8),
                    )
                    .ok()?,
                );
                for (off, half) in [(0, ret as u32), (4, (ret >> 32) as u32)] {
                    insns.push(
                        Instruction::with2(
                            Code::Mov_rm32_imm32,
                            MemoryOperand::with_base_displ(Register::RSP, off),
                            half,
                        )
                        .ok()?,
                    );
                }
            }
            Piece::Int3 => insns.push(Instruction::with(Code::Int3)),
        }
    }
    // The encoder takes a branch to the address of an instruction of the
    // block for a branch into the block, and sends it to the copy: a
    // moved branch back to the probed instruction would loop in the
    // trampoline instead of hitting the probe (and one to address 0
    // would go to an instruction made here, which has no address). So
    // every instruction gets an address no branch and no RIP-relative
    // operand targets (operands and targets are absolute in iced-x86's
    // `Instruction`, whatever its address): in the kernel's half, where
    // no user code is, skipping any that is targeted all the same.
    let targets: Vec<u64> = insns
        .iter()
        .flat_map(|i| [i.near_branch_target(), i.ip_rel_memory_address()])
        .collect();
    let mut fresh = 0xffff_f000_0000_0000_u64;
    for insn in &mut insns {
        fresh += 16;
        while targets.contains(&fresh) {
            fresh += 16;
        }
        insn.set_ip(fresh);
    }
    let encoded = BlockEncoder::encode(
        64,
        InstructionBlock::new(&insns, at),
        BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )
    .ok()?;
    // An instruction the encoder rewrote into several (a `jcc` whose
    // target is out of reach: the opposite `jcc` over a `jmp [rip]`) has
    // no offset (`u32::MAX`): a thread stopped at it could not be moved
    // to its copy, so such code is not relocated.
    let starts = firsts
        .iter()
        .map(|&k| encoded.new_instruction_offsets[k])
        .collect::<Vec<u32>>();
    if starts.contains(&u32::MAX) {
        return None;
    }
    Some((encoded.code_buffer, starts))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `bytes` at `ip`.
    fn insn(bytes: &[u8], ip: u64) -> Instruction {
        Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE).decode()
    }

    /// What iced-x86's block encoder writes for `pieces` at `at`.
    fn reference(pieces: &[Piece<'_>], at: u64) -> (Vec<u8>, Vec<u32>) {
        with_block_encoder(pieces, at).expect("the block encoder takes it")
    }

    /// Decoded, the hand-written code and the block encoder's mean the
    /// same: each instruction with the same mnemonic, operands and
    /// targets (the byte forms may differ: `rel8` against `rel32`).
    fn same_meaning(a: &[u8], b: &[u8], at: u64) {
        let decode = |code: &[u8]| {
            let mut f = iced_x86::NasmFormatter::new();
            iced_x86::Formatter::options_mut(&mut f).set_show_branch_size(false);
            Decoder::with_ip(64, code, at, DecoderOptions::NONE)
                .into_iter()
                .map(|i| {
                    let mut s = String::new();
                    iced_x86::Formatter::format(&mut f, &i, &mut s);
                    s
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(decode(a), decode(b));
    }

    #[test]
    fn moved_instructions_mean_what_the_block_encoder_writes() {
        let from = 0x5555_0000_1000_u64;
        let at = 0x5555_1234_5678_u64;
        let cases: &[&[u8]] = &[
            &[0x55],                                           // push rbp
            &[0x48, 0x89, 0xe5],                               // mov rbp, rsp
            &[0x48, 0x8b, 0x05, 0x10, 0x20, 0x30, 0x00],       // mov rax, [rip+0x302010]
            &[0x80, 0x3d, 0xf0, 0xff, 0xff, 0xff, 0x05],       // cmp byte [rip-16], 5
            &[0xc5, 0xfd, 0x6f, 0x0d, 0x00, 0x01, 0x00, 0x00], // vmovdqa ymm1, [rip+0x100]
            &[0x74, 0x10],                                     // je +16
            &[0x0f, 0x85, 0x00, 0x01, 0x00, 0x00],             // jne +0x100
            &[0xeb, 0x80],                                     // jmp -128
            &[0xe9, 0x00, 0x00, 0x00, 0xf0],                   // jmp -256 MiB
            &[0xf2, 0xe9, 0x10, 0x00, 0x00, 0x00],             // bnd jmp
            &[0xe8, 0x44, 0x33, 0x22, 0x11],                   // call +0x11223344
            &[0x3e, 0x74, 0x05],                               // je (hinted)
            &[0xff, 0xe0],                                     // jmp rax
            &[0xc3],                                           // ret
            &[0x0f, 0x0b],                                     // ud2
        ];
        for &bytes in cases {
            let i = insn(bytes, from);
            let pieces = [Piece::Moved(&i, bytes), Piece::Jump(i.next_ip())];
            let (mine, starts) = by_hand(&pieces, at).unwrap_or_else(|| panic!("{bytes:02x?}"));
            let (theirs, their_starts) = reference(&pieces, at);
            same_meaning(&mine, &theirs, at);
            assert_eq!(starts[0], 0);
            assert_eq!(their_starts[0], 0);
        }
    }

    #[test]
    fn indirect_calls_made_jumps_mean_what_the_block_encoder_writes() {
        let from = 0x5555_0000_1000_u64;
        let at = 0x5555_1234_5678_u64;
        let cases: &[&[u8]] = &[
            &[0xff, 0xd0],                         // call rax
            &[0x41, 0xff, 0xd3],                   // call r11
            &[0xff, 0x53, 0x30],                   // call [rbx+0x30]
            &[0xff, 0x15, 0x10, 0x20, 0x30, 0x00], // call [rip+0x302010]
            &[0x41, 0xff, 0x54, 0xc5, 0x08],       // call [r13+rax*8+8]
        ];
        for &bytes in cases {
            let i = insn(bytes, from);
            let pieces = [
                Piece::PushAddress(i.next_ip()),
                Piece::CallAsJump(&i, bytes),
            ];
            let (mine, _) = by_hand(&pieces, at).unwrap_or_else(|| panic!("{bytes:02x?}"));
            let (theirs, _) = reference(&pieces, at);
            same_meaning(&mine, &theirs, at);
        }
    }

    #[test]
    fn made_pieces_mean_what_the_block_encoder_writes() {
        let at = 0x7f00_0000_0000_u64;
        let pieces = [
            Piece::PushAddress(0x7f12_3456_789a),
            Piece::Jump(0x7f00_0010_0000),
            Piece::Int3,
        ];
        let (mine, starts) = by_hand(&pieces, at).expect("by hand");
        let (theirs, _) = reference(&pieces, at);
        same_meaning(&mine, &theirs, at);
        // lea (5 bytes), mov dword [rsp] (7), mov dword [rsp+4] (8).
        assert_eq!(starts, [0, 20, 25]);
    }

    #[test]
    fn a_branch_to_the_moved_instruction_goes_back_to_the_original() {
        // `jmp $` moved: it still jumps to its original address (where
        // the probe is), not to its copy, as the block encoder would make
        // it (a branch into the block it encodes).
        let from = 0x5555_0000_1000_u64;
        let at = 0x5555_0010_0000_u64;
        let i = insn(&[0xeb, 0xfe], from);
        let (code, _) = by_hand(&[Piece::Moved(&i, &[0xeb, 0xfe])], at).expect("by hand");
        assert_eq!(insn(&code, at).near_branch_target(), from);
    }

    #[test]
    fn a_branch_back_goes_to_the_original_through_the_encoder_too() {
        // Found by fuzzing (`x86_trampoline`): written by the block encoder
        // (here: `jae rel8` after eleven `rep` prefixes, too long to widen
        // by hand), a branch back to the probed instruction itself went
        // to its copy instead; at address 0, to the jump made after it.
        for from in [0x5555_0000_1000_u64, 0] {
            let at = from + 0x10_0000;
            let mut bytes = vec![0xf3; 11];
            bytes.extend([0x73, 0xf3]);
            let i = insn(&bytes, from);
            assert_eq!(i.near_branch_target(), from);
            let pieces = [Piece::Moved(&i, &bytes), Piece::Jump(i.next_ip())];
            assert!(by_hand(&pieces, at).is_none());
            let (code, _) = encode(&pieces, at).expect("encoded");
            assert_eq!(insn(&code, at).near_branch_target(), from, "{code:02x?}");
        }
    }

    #[test]
    fn a_rip_relative_operand_keeps_its_address_through_the_encoder() {
        // Found by fuzzing (`x86_analyze`): given addresses of their own
        // (above), the encoder's instructions must not take one that a
        // RIP-relative operand names: `imul eax, [rip+X], -1` naming
        // address 0x10, out of reach, came out naming itself.
        let from = 0x10_0000_0009_u64;
        let bytes = [0x6b, 0x05, 0x00, 0x00, 0x00, 0x00, 0xff];
        let mut i = insn(&bytes, from);
        i.set_memory_displacement64(0x10);
        let (code, _) = with_block_encoder(&[Piece::Moved(&i, &bytes)], from).expect("encoded");
        assert_eq!(
            insn(&code, from).ip_rel_memory_address(),
            0x10,
            "{code:02x?}"
        );
    }

    #[test]
    fn an_eip_relative_operand_is_not_moved() {
        // Found by fuzzing (`x86_analyze`): `imul eax, [eip-1], -1` made
        // iced-x86's block encoder fail its own assertion.
        let from = 0x10_0000_0000_u64;
        let bytes = [0x67, 0x6b, 0x05, 0xff, 0xff, 0xff, 0xff, 0xff];
        let i = insn(&bytes, from);
        assert_eq!(i.memory_base(), Register::EIP);
        for at in [from + 0x1000, from + (1 << 40)] {
            assert!(encode(&[Piece::Moved(&i, &bytes), Piece::Jump(i.next_ip())], at).is_none());
        }
    }

    #[test]
    fn a_widened_branch_stays_an_instruction() {
        // Found by fuzzing (`x86_exec`): `jp rel8` after ten REX prefixes
        // (12 bytes) widened by hand with its prefixes to `jp rel32` is
        // 16 bytes, past the 15 an instruction may have: the CPU raises
        // #UD. The encoder writes it instead, as one instruction.
        let from = 0x5555_0000_1000_u64;
        let mut bytes = vec![0x41; 10];
        bytes.extend([0x7a, 0xff]);
        let i = insn(&bytes, from);
        assert_eq!(i.len(), 12);
        let (code, _) = encode(&[Piece::Moved(&i, &bytes)], from + 0x1000).expect("encoded");
        let copy = insn(&code, from + 0x1000);
        assert!(!copy.is_invalid() && copy.len() <= 15, "{code:02x?}");
        assert_eq!(copy.near_branch_target(), i.near_branch_target());
        assert_eq!(copy.condition_code(), i.condition_code());
    }

    #[test]
    fn a_branch_the_encoder_rewrites_is_not_relocated() {
        // Found by fuzzing (`x86_trampoline`): `jb` whose target is out of
        // rel32 reach of the copy. The block encoder rewrites it as `jae`
        // over `jmp [rip]` and reports no offset for it (u32::MAX): the
        // copy's start, which moves threads, was 4 GiB off.
        let from = 0x33_u64;
        let at = 0x7fff_a9aa_0098_u64;
        let add = insn(&[0x01, 0x00], from - 2);
        let jb = insn(&[0x72, 0x3d], from);
        let pieces = [
            Piece::Moved(&add, &[0x01, 0x00]),
            Piece::Moved(&jb, &[0x72, 0x3d]),
            Piece::Jump(jb.next_ip()),
        ];
        assert!(encode(&pieces, at).is_none());
        // Within reach, it is relocated, each piece where it starts.
        let (code, starts) = encode(&pieces, 0x1000_0000).expect("in reach");
        assert_eq!(starts.len(), 3);
        assert!(starts.iter().all(|&s| (s as usize) < code.len()));
    }

    #[test]
    fn what_needs_an_encoder_is_not_done_by_hand() {
        let from = 0x5555_0000_1000_u64;
        // A target out of rel32 reach of the new address.
        let far = insn(&[0x74, 0x10], from);
        assert!(by_hand(&[Piece::Moved(&far, &[0x74, 0x10])], from + (1 << 40)).is_none());
        let riprel = [0x48, 0x8b, 0x05, 0, 0, 0, 0];
        let i = insn(&riprel, from);
        assert!(by_hand(&[Piece::Moved(&i, &riprel)], from + (1 << 40)).is_none());
        // Branches without a rel32 form, or with an operand-size prefix.
        for bytes in [
            &[0xe3, 0x10][..],
            &[0xe2, 0x10],
            &[0xc7, 0xf8, 0, 0, 0, 0],
            &[0x66, 0x74, 0x10],
        ] {
            let i = insn(bytes, from);
            assert!(
                by_hand(&[Piece::Moved(&i, bytes)], from).is_none(),
                "{bytes:02x?}"
            );
        }
        // An indirect call through the stack pointer (its displacement
        // changes with the pushed return address).
        let bytes = [0xff, 0x54, 0x24, 0x08]; // call [rsp+8]
        let i = insn(&bytes, from);
        assert!(by_hand(&[Piece::CallAsJump(&i, &bytes)], from).is_none());
    }
}
