//! x86-64 instruction punning (`E9Patch`'s tactic, after Duck, Gao and
//! Roychoudhury, PLDI 2020): a `jmp rel32` written over an instruction
//! shorter than the jump, whose displacement's last bytes are the bytes
//! that follow, left as they are.
//!
//! For an instruction of `n` < 5 bytes at `a`, written with `p` < `n`
//! prefixes: bytes `a .. a+p` are prefixes, `a+p` is `E9`, the `n-p-1`
//! bytes after it are the displacement's free low bytes, and its `p+5-n`
//! high bytes are the code at `a+n ..`: the jump lands in a window of
//! `256^(n-p-1)` addresses that those bytes choose. Each prefix moves the
//! window (other bytes become the fixed ones) at the cost of a free byte.
//! An instruction of 5 bytes or more can also be punned over its own
//! bytes: only `E9` is written over its first byte, and its bytes 1-4
//! choose the one address the jump lands on. That patch is a single
//! byte, written the way a breakpoint is, with no window in which a
//! thread could trap.
//!
//! An instruction that never falls through (a return, an unconditional
//! jump) followed by alignment padding (`nop`s or `int3`s up to a
//! 16-byte boundary: what a compiler or assembler puts after a function,
//! or before a loop's aligned start) can be punned over the padding too
//! ([`padding_after`]): no thread runs those bytes and no branch lands
//! in them, so they are written like the instruction's own, and a
//! one-byte `ret` followed by four bytes of padding takes a whole jump.
//!
//! The prefix is `26` (an `es` segment override), which 64-bit mode
//! ignores for a near `jmp` (`66` would truncate the target on AMD
//! processors, `f2` and `f3` mean `bnd` and `rep`; `2e` and `3e` are
//! branch hints, `3e` also `notrack`).

use iced_x86::{Code, Decoder, DecoderOptions, FlowControl, Mnemonic};

use super::JUMP_LEN;
use crate::arch::Pun;

/// The padding prefix.
const PREFIX: u8 = 0x26;
/// `jmp rel32`.
const JMP: u8 = 0xe9;
/// `jmp rel8`.
const JMP_SHORT: u8 = 0xeb;

/// The ways to pun a jump over the instruction of `len` bytes at
/// `start`, whose code (as it will stay around the written bytes) is
/// `code`, from `start` on, most free bytes first. `one_byte`: only the
/// opcode is written (instructions of 5 bytes or more); otherwise every
/// byte of the instruction is, and (`padding`) the padding after it
/// ([`padding_after`]), and over 5 bytes or more that is the whole jump:
/// no byte is fixed, and its window is all a `rel32` reaches. Not
/// async-signal-safe.
pub(crate) fn puns(
    start: usize,
    len: usize,
    code: &[u8],
    one_byte: bool,
    padding: bool,
) -> Vec<Pun> {
    let written = if one_byte {
        1
    } else if padding {
        (len + padding_after(start, len, code)).min(JUMP_LEN.max(len))
    } else {
        len
    };
    if written == 0 {
        return Vec::new();
    }
    if written >= JUMP_LEN && !one_byte {
        let reach = 1usize << 31;
        return vec![Pun {
            start,
            prefixes: 0,
            written: JUMP_LEN,
            fixed: Vec::new(),
            lo: (start + JUMP_LEN).saturating_sub(reach),
            size: 2 * reach - (reach - (start + JUMP_LEN).min(reach)),
        }];
    }
    let mut all = Vec::new();
    for prefixes in 0..written {
        let end = prefixes + JUMP_LEN;
        if code.len() < end {
            break;
        }
        let free = written - 1 - prefixes;
        let mut disp = [0u8; 4];
        disp[free..].copy_from_slice(&code[written..end]);
        let low = i64::from(i32::from_le_bytes(disp));
        let Some(lo) = usize::try_from((start + end) as i64 + low).ok() else {
            continue;
        };
        all.push(Pun {
            start,
            prefixes,
            written,
            fixed: code[written..end].to_vec(),
            lo,
            size: 1 << (8 * free),
        });
    }
    // One byte written: `jmp rel8` too, to the one address within 128
    // bytes that the next byte chooses (code: only a landing pad in its
    // padding can take it).
    if written == 1
        && let Some(&rel) = code.get(1)
        && let Some(lo) = (start + 2).checked_add_signed(isize::from(rel.cast_signed()))
    {
        all.push(Pun {
            start,
            prefixes: 0,
            written,
            fixed: vec![rel],
            lo,
            size: 1,
        });
    }
    all
}

/// How many bytes after the instruction of `len` bytes at `start` (code
/// `code` from there) are padding that nothing runs: where it never
/// falls through (a return, an unconditional direct or indirect jump),
/// the `nop`s and `int3`s after it when they end at a 16-byte boundary
/// before the end of `code` (alignment padding: a branch lands at the
/// aligned instruction after it, never inside). 0 otherwise. A site
/// among them (a probe on a `nop`) is the caller's to check. Not
/// async-signal-safe.
pub(crate) fn padding_after(start: usize, len: usize, code: &[u8]) -> usize {
    /// The longest padding looked for: a 64-byte boundary's.
    const MOST: usize = 63;
    let mut decoder = Decoder::with_ip(64, code, start as u64, DecoderOptions::NONE);
    let first = decoder.decode();
    let ends_flow = matches!(
        first.flow_control(),
        FlowControl::Return | FlowControl::UnconditionalBranch | FlowControl::IndirectBranch
    );
    if first.is_invalid() || first.len() != len || !ends_flow {
        return 0;
    }
    let mut end = start + len;
    while end - (start + len) <= MOST && decoder.can_decode() {
        if end.is_multiple_of(16) {
            return end - (start + len);
        }
        let insn = decoder.decode();
        if insn.is_invalid() || !matches!(insn.mnemonic(), Mnemonic::Nop | Mnemonic::Int3) {
            return 0;
        }
        end = insn.next_ip() as usize;
    }
    0
}

/// How many bytes of padding follow the code from `start` to `end`
/// (`code`: its bytes, and at least those after it up to a 16-byte
/// boundary), decoded from `start` on: its last instruction's
/// [`padding_after`]; 0 where the instructions decoded do not end at
/// `end`. Not async-signal-safe.
pub(crate) fn padding_after_code(start: usize, end: usize, code: &[u8]) -> usize {
    let mut decoder = Decoder::with_ip(64, code, start as u64, DecoderOptions::NONE);
    let mut at = start;
    while at < end && decoder.can_decode() {
        let insn = decoder.decode();
        let next = insn.next_ip() as usize;
        if insn.is_invalid() || next > end {
            return 0;
        }
        if next == end {
            return padding_after(at, next - at, &code[at - start..]);
        }
        at = next;
    }
    0
}

/// The bytes `pun` writes for a jump to `target` (inside its window):
/// the first `pun.written` of the result.
pub(crate) fn pun_bytes(pun: &Pun, target: usize) -> [u8; JUMP_LEN] {
    debug_assert!(target >= pun.lo && target - pun.lo < pun.size);
    let mut b = [0u8; JUMP_LEN];
    if pun.written + pun.fixed.len() == 2 {
        b[0] = JMP_SHORT;
        debug_assert!(decodes_to(&b[..1], &pun.fixed, pun.start, target));
        return b;
    }
    let p = pun.prefixes;
    let end = pun.start + p + JUMP_LEN;
    let rel = (target as i64 - end as i64) as i32;
    b[..p].fill(PREFIX);
    b[p] = JMP;
    let free = pun.written - 1 - p;
    b[p + 1..p + 1 + free].copy_from_slice(&rel.to_le_bytes()[..free]);
    debug_assert!(decodes_to(&b[..pun.written], &pun.fixed, pun.start, target));
    b
}

/// Whether `written` followed by `fixed`, at `start`, decodes as a near
/// `jmp` to `target`.
fn decodes_to(written: &[u8], fixed: &[u8], start: usize, target: usize) -> bool {
    let bytes: Vec<u8> = written.iter().chain(fixed).copied().collect();
    let insn = Decoder::with_ip(64, &bytes, start as u64, DecoderOptions::NONE).decode();
    matches!(insn.code(), Code::Jmp_rel32_64 | Code::Jmp_rel8_64)
        && insn.len() == bytes.len()
        && insn.near_branch_target() == target as u64
}

/// The stub at `at` that jumps on to `target`: a `jmp rel32` where it
/// reaches, else `jmp [rip+0]` and the address. Touches no register or
/// flag.
pub(crate) fn stub(at: usize, target: usize) -> Vec<u8> {
    let rel = target as i64 - (at + JUMP_LEN) as i64;
    if let Ok(rel) = i32::try_from(rel) {
        let mut b = vec![JMP];
        b.extend_from_slice(&rel.to_le_bytes());
        return b;
    }
    let mut b = vec![0xff, 0x25, 0, 0, 0, 0];
    b.extend_from_slice(&(target as u64).to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pun_decodes_to_its_target() {
        // push rbp; mov rbp, rsp; ...
        let code = [0x55, 0x48, 0x89, 0xe5, 0x41, 0x57, 0x90, 0x90, 0x90];
        let start = 0x7f00_0000_1000;
        for len in 1..=4 {
            for pun in puns(start, len, &code, false, true) {
                for target in [pun.lo, pun.lo + pun.size - 1] {
                    let b = pun_bytes(&pun, target);
                    assert!(decodes_to(&b[..pun.written], &pun.fixed, start, target));
                }
            }
        }
        // One byte: `jmp rel32` over the next four, `jmp rel8` over the
        // next one (0x48: 72 bytes on).
        let one = puns(start, 7, &code, true, true);
        assert_eq!(one.len(), 2);
        assert_eq!((one[0].size, one[1].size), (1, 1));
        assert_eq!(pun_bytes(&one[0], one[0].lo)[0], JMP);
        assert_eq!(
            (one[1].lo, one[1].fixed.as_slice()),
            (start + 2 + 0x48, &code[1..2])
        );
        assert_eq!(pun_bytes(&one[1], one[1].lo)[0], JMP_SHORT);
        assert!(decodes_to(&[JMP_SHORT], &one[1].fixed, start, one[1].lo));
        // The whole jump written over a long instruction: anywhere a
        // `rel32` reaches.
        let whole = puns(start, 7, &code, false, true);
        assert_eq!(
            (whole.len(), whole[0].written, whole[0].fixed.len()),
            (1, 5, 0)
        );
        let end = start + 5;
        assert_eq!((whole[0].lo, whole[0].size), (end - (1 << 31), 1 << 32));
        for target in [whole[0].lo, end, whole[0].lo + whole[0].size - 1] {
            let b = pun_bytes(&whole[0], target);
            assert!(decodes_to(&b, &[], start, target));
        }
    }

    #[test]
    fn padding_after_a_return_or_jump_is_written_too() {
        // ret; nop dword [rax+rax*1+0] up to a 16-byte boundary; push rbp
        let code = [0xc3, 0x0f, 0x1f, 0x44, 0x00, 0x00, 0x55];
        assert_eq!(padding_after(0x100a, 1, &code), 5);
        let whole = puns(0x100a, 1, &code, false, true);
        assert_eq!(
            (whole.len(), whole[0].written, whole[0].fixed.len()),
            (1, 5, 0)
        );
        // Two bytes of padding (`xchg ax, ax`): three written, two free.
        let code = [0xc3, 0x66, 0x90, 0x55, 0x48, 0x89, 0xe5];
        assert_eq!(padding_after(0x100d, 1, &code), 2);
        let sizes: Vec<_> = puns(0x7f00_0000_100d, 1, &code, false, true)
            .iter()
            .map(|p| (p.written, p.size))
            .collect();
        assert_eq!(sizes, [(3, 1 << 16), (3, 1 << 8), (3, 1)]);
        // jmp rel8 then int3s.
        assert_eq!(padding_after(0x100c, 2, &[0xeb, 0xf0, 0xcc, 0xcc, 0x90]), 2);
        // Not padding: an instruction that falls through (pop rbx), nops
        // that do not end at a boundary (a loop's start inside), other
        // code, the boundary not seen, only a one-byte patch.
        assert_eq!(padding_after(0x100a, 1, &[0x5b, 0x0f, 0x1f, 0x44, 0, 0]), 0);
        assert_eq!(
            padding_after(0x1009, 1, &[0xc3, 0x0f, 0x1f, 0x44, 0, 0, 0x55]),
            0
        );
        assert_eq!(padding_after(0x100d, 1, &[0xc3, 0x31, 0xc0, 0x90]), 0);
        assert_eq!(padding_after(0x100d, 1, &[0xc3, 0x90]), 0);
        assert_eq!(
            puns(0x100a, 1, &[0xc3, 0x0f, 0x1f, 0x44, 0, 0], true, true)[0].written,
            1
        );
        // Right at a boundary: none.
        assert_eq!(padding_after(0x100f, 1, &[0xc3, 0x90]), 0);
    }

    #[test]
    fn windows_shrink_with_prefixes() {
        let code = [0x31, 0xc0, 0xc3, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc];
        let sizes: Vec<usize> = puns(0x7f00_0000_0000, 2, &code, false, true)
            .iter()
            .map(|p| p.size)
            .collect();
        assert_eq!(sizes, [256, 1]);
    }
}
