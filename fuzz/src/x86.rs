//! Moved x86-64 code decoded and compared with the original, with
//! iced-x86 as the independent decoder: each copy must be the same
//! instruction with the same operands and the same absolute targets
//! (RIP-relative operands and branches re-targeted to where they pointed
//! from the original address; a `rel8` branch may become `rel32`), a
//! moved `call` a push of the original return address and a jump, and
//! the copies must follow each other and end where the original code
//! goes on.

use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Formatter, Instruction, Mnemonic, NasmFormatter,
    OpKind, Register,
};
use uprobe_core::testing::code::{PunWindow, Trampoline};

/// The instruction `code` starts with, decoded at `ip`.
#[must_use]
pub fn decode(code: &[u8], ip: u64) -> Instruction {
    Decoder::with_ip(64, code, ip, DecoderOptions::NONE).decode()
}

/// An instruction as text, with absolute addresses for RIP-relative
/// operands and branch targets, and without branch sizes: equal texts
/// at two addresses mean the same instruction.
#[must_use]
pub fn text(insn: &Instruction) -> String {
    let mut f = NasmFormatter::new();
    f.options_mut().set_show_branch_size(false);
    f.options_mut().set_rip_relative_addresses(false);
    let mut s = String::new();
    f.format(insn, &mut s);
    // A RIP-relative operand out of reach may be encoded EIP-relative
    // (`addr32`, the 32-bit sum zero-extended) where that reaches the
    // same address, which the text already shows.
    // `f2` before a near branch is MPX's `bnd`, which the decoder shows
    // for some forms only (`jmp rel32`, not `jmp rel8`); without MPX,
    // which Linux no longer enables, it does nothing.
    s.replace("[dword rel ", "[rel ").replace("bnd ", "")
}

/// The bytes at `at` of `code`, which is placed at `base`.
fn at(code: &[u8], base: u64, at: u64) -> &[u8] {
    let off = usize::try_from(at - base).expect("inside the code");
    assert!(off <= code.len(), "{at:#x} is past the code at {base:#x}");
    &code[off..]
}

/// Checks the three instructions that push `ret` without touching the
/// flags (`lea rsp, [rsp-8]`, then its halves stored), at `ip` of `code`
/// (placed at `base`); returns the address after them.
fn check_push_address(code: &[u8], base: u64, ip: u64, ret: u64) -> u64 {
    let lea = decode(at(code, base, ip), ip);
    assert!(
        lea.code() == Code::Lea_r64_m
            && lea.op0_register() == Register::RSP
            && lea.memory_base() == Register::RSP
            && lea.memory_index() == Register::None
            && lea.memory_displacement64() as i64 == -8,
        "a moved call starts with {} at {ip:#x}, not lea rsp, [rsp-8]",
        text(&lea)
    );
    let mut value = 0u64;
    let mut next = lea.next_ip();
    for half in 0..2u64 {
        let mov = decode(at(code, base, next), next);
        assert!(
            mov.code() == Code::Mov_rm32_imm32
                && mov.memory_base() == Register::RSP
                && mov.memory_index() == Register::None
                && mov.memory_displacement64() == 4 * half,
            "a moved call's push stores with {} at {next:#x}",
            text(&mov)
        );
        value |= u64::from(mov.immediate32()) << (32 * half);
        next = mov.next_ip();
    }
    assert_eq!(value, ret, "a moved call pushes {value:#x}, not {ret:#x}");
    next
}

/// Checks the copy at `ip` of `code` (placed at `base`) of `orig`, made
/// the way trampolines and slots copy it; returns the address after the
/// copy.
///
/// # Panics
/// On a copy that does not mean what `orig` means.
#[must_use]
pub fn check_copy(orig: &Instruction, code: &[u8], base: u64, ip: u64) -> u64 {
    match orig.flow_control() {
        FlowControl::Call if orig.is_call_near() => {
            let after = check_push_address(code, base, ip, orig.next_ip());
            let jmp = decode(at(code, base, after), after);
            assert!(
                jmp.mnemonic() == Mnemonic::Jmp
                    && jmp.op0_kind() == OpKind::NearBranch64
                    && jmp.near_branch_target() == orig.near_branch_target(),
                "{} moved to {ip:#x} jumps with {}",
                text(orig),
                text(&jmp)
            );
            jmp.next_ip()
        }
        FlowControl::IndirectCall if orig.code() == Code::Call_rm64 => {
            let after = check_push_address(code, base, ip, orig.next_ip());
            let jmp = decode(at(code, base, after), after);
            // The same operand, read 8 bytes further up where it is
            // addressed from the stack pointer (the push moved it).
            let mut expected = *orig;
            expected.set_code(Code::Jmp_rm64);
            if orig.op0_kind() == OpKind::Memory && orig.memory_base() == Register::RSP {
                expected.set_memory_displacement64(orig.memory_displacement64().wrapping_add(8));
            }
            assert_eq!(
                text(&jmp),
                text(&expected),
                "{} moved to {ip:#x}",
                text(orig)
            );
            jmp.next_ip()
        }
        _ => {
            let copy = decode(at(code, base, ip), ip);
            assert!(
                !copy.is_invalid(),
                "{} moved to {ip:#x} does not decode",
                text(orig)
            );
            assert_eq!(
                text(&copy),
                text(orig),
                "moved from {:#x} to {ip:#x}",
                orig.ip()
            );
            // Text aside: the same instruction (a jcc may change form).
            if !is_rel_branch(orig) {
                assert_eq!(copy.code(), orig.code(), "{}", text(orig));
            }
            copy.next_ip()
        }
    }
}

fn is_rel_branch(insn: &Instruction) -> bool {
    matches!(
        insn.op0_kind(),
        OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
    )
}

/// Checks that `code` (placed at `base`) has a `jmp` to `to` at `ip`.
///
/// # Panics
/// If it has not.
pub fn check_jump(code: &[u8], base: u64, ip: u64, to: u64) {
    let jmp = decode(at(code, base, ip), ip);
    let target = match jmp.code() {
        Code::Jmp_rel32_64 | Code::Jmp_rel8_64 => Some(jmp.near_branch_target()),
        // jmp [rip+disp], the address in the code (after the jump, or
        // where the block encoder put its constants).
        Code::Jmp_rm64 if jmp.is_ip_rel_memory_operand() => {
            let q = at(code, base, jmp.ip_rel_memory_address());
            Some(u64::from_le_bytes(q[..8].try_into().expect("8 bytes")))
        }
        _ => None,
    };
    assert_eq!(
        target,
        Some(to),
        "{} at {ip:#x} does not jump to {to:#x}",
        text(&jmp)
    );
}

/// Checks an out-of-line slot's code (placed at `slot`) for the
/// instruction `orig`: its copy, then a jump back to the next.
///
/// # Panics
/// On a slot that does not do what `orig` does.
pub fn check_slot(orig: &Instruction, code: &[u8], slot: u64) {
    let after = check_copy(orig, code, slot, slot);
    check_jump(code, slot, after, orig.next_ip());
}

/// Checks a trampoline (placed at `base`) against the original code
/// `original` (from `t.start` on): it copies the instructions from
/// `t.start` on in order (all of them to `t.end`, or, where a punned
/// jump's tail could not be relocated, the range alone), each meaning
/// what it meant, one after the other, and goes on where the original
/// would after the last. Returns the instructions copied.
///
/// # Panics
/// On a trampoline that does not do what the original does.
#[must_use]
pub fn check_trampoline(
    original: &[u8],
    t: &Trampoline,
    base: u64,
    punned: bool,
) -> Vec<Instruction> {
    assert!(t.end >= t.start + t.len, "{t:x?}");
    assert!(t.len >= 1 && t.start < t.end);
    if !punned {
        assert!(t.len >= 5, "a jump over {} bytes", t.len);
    }
    let mut insns = Vec::new();
    let mut decoder = Decoder::with_ip(
        64,
        &original[..t.end - t.start],
        t.start as u64,
        DecoderOptions::NONE,
    );
    while decoder.can_decode() {
        let i = decoder.decode();
        assert!(
            !i.is_invalid(),
            "an invalid instruction copied at {:#x}",
            i.ip()
        );
        insns.push(i);
    }
    let range_len = insns
        .iter()
        .take_while(|i| (i.ip() as usize) < t.start + t.len)
        .count();
    // The range: whole instructions, none but the last changing control
    // flow.
    let range = &insns[..range_len];
    assert_eq!(
        range.last().map(|i| i.next_ip() as usize),
        Some(t.start + t.len),
        "the jump's range does not end at an instruction boundary"
    );
    for i in &range[..range.len() - 1] {
        assert_eq!(
            i.flow_control(),
            FlowControl::Next,
            "{} inside a range",
            text(i)
        );
    }
    // Copied: the range, and the tail unless it was left out.
    let copied = if t.copies.len() == range_len {
        range
    } else {
        &insns[..]
    };
    assert_eq!(
        copied.iter().map(|i| i.ip() as usize).collect::<Vec<_>>(),
        t.copies.iter().map(|c| c.0).collect::<Vec<_>>(),
        "the copies are not the instructions of {:#x}..{:#x}",
        t.start,
        t.end
    );
    let mut ip = t.copies[0].1 as u64;
    for (orig, &(_, copy)) in copied.iter().zip(&t.copies) {
        assert_eq!(
            copy as u64,
            ip,
            "the copy of {} is not where the last ended: {t:x?}",
            text(orig)
        );
        ip = check_copy(orig, &t.code, base, copy as u64);
    }
    let last = copied.last().expect("a copied instruction");
    if copied.len() == range_len
        || matches!(
            last.flow_control(),
            FlowControl::Next | FlowControl::ConditionalBranch
        )
    {
        check_jump(&t.code, base, ip, last.next_ip());
    }
    copied.to_vec()
}

/// Asserts that the `n` bytes after the instruction of `len` bytes at
/// `start` are padding no thread runs: the instruction never falls
/// through, and what follows it is `nop`s and `int3`s, at least `n`
/// bytes of them, up to a 16-byte boundary.
fn assert_padding(start: usize, len: usize, code: &[u8], n: usize) {
    let insn = decode(code, start as u64);
    assert!(
        matches!(
            insn.flow_control(),
            FlowControl::Return | FlowControl::UnconditionalBranch | FlowControl::IndirectBranch
        ),
        "{n} bytes after {} (which falls through) written",
        text(&insn)
    );
    let mut at = len;
    while !(start + at).is_multiple_of(16) {
        let pad = decode(&code[at..], (start + at) as u64);
        assert!(
            !pad.is_invalid() && matches!(pad.mnemonic(), Mnemonic::Nop | Mnemonic::Int3),
            "{} after {} written as padding",
            text(&pad),
            text(&insn)
        );
        at += pad.len();
    }
    assert!(
        at >= len + n,
        "{n} bytes written after {}, more than its padding",
        text(&insn)
    );
}

/// Checks the puns offered over the instruction of `len` bytes at
/// `start` (code `code` from there): each written jump, followed by the
/// bytes it leaves, decodes as a `jmp rel32` to any target in its
/// window, and writes no byte past the instruction (or past the first,
/// `one_byte`) but padding that nothing runs.
///
/// # Panics
/// On a pun that does not jump where it says.
pub fn check_puns(start: usize, len: usize, code: &[u8], one_byte: bool, windows: &[PunWindow]) {
    // Over an instruction of a jump's length or more, the whole jump;
    // over a shorter one, its bytes and maybe padding after it.
    let written_len = if one_byte { 1 } else { len.min(5) };
    for w in windows {
        assert!(
            w.written == written_len || (!one_byte && len < 5 && w.written <= 5),
            "{w:?}"
        );
        if w.written > len {
            assert_padding(start, len, code, w.written - len);
        }
        assert!(w.prefixes < w.written, "{w:?}");
        // A `jmp rel32` after its prefixes, or (one byte written) a
        // `jmp rel8` over the next byte.
        let jump_end = w.written + w.fixed.len();
        let short = jump_end == 2 && w.written == 1;
        assert!(short || jump_end == w.prefixes + 5, "{w:?}");
        assert_eq!(&code[w.written..jump_end], &w.fixed[..], "{w:?}");
        assert!(w.size >= 1);
        for target in [w.lo, w.lo + w.size / 2, w.lo + w.size - 1] {
            let written = uprobe_core::testing::code::pun_bytes(w, target).expect("x86-64 puns");
            assert_eq!(written.len(), w.written);
            let bytes: Vec<u8> = written.iter().chain(&w.fixed).copied().collect();
            let jmp = decode(&bytes, start as u64);
            let code = if short {
                Code::Jmp_rel8_64
            } else {
                Code::Jmp_rel32_64
            };
            assert!(
                jmp.code() == code
                    && jmp.len() == bytes.len()
                    && jmp.near_branch_target() == target as u64,
                "{w:?} to {target:#x} decodes as {} ({} bytes)",
                text(&jmp),
                jmp.len()
            );
        }
        assert!(
            uprobe_core::testing::code::pun_bytes(w, w.lo.wrapping_sub(1)).is_none() || w.lo == 0
        );
    }
}
