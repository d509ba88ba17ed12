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
//! The prefix is `26` (an `es` segment override), which 64-bit mode
//! ignores for a near `jmp` (`66` would truncate the target on AMD
//! processors, `f2` and `f3` mean `bnd` and `rep`; `2e` and `3e` are
//! branch hints, `3e` also `notrack`).

use iced_x86::{Code, Decoder, DecoderOptions};

use super::JUMP_LEN;
use crate::arch::Pun;

/// The padding prefix.
const PREFIX: u8 = 0x26;
/// `jmp rel32`.
const JMP: u8 = 0xe9;

/// The ways to pun a jump over the instruction of `len` bytes at
/// `start`, whose code (as it will stay around the written bytes) is
/// `code`, from `start` on, most free bytes first. `one_byte`: only the
/// opcode is written (instructions of 5 bytes or more); otherwise every
/// byte of the instruction is, and over an instruction of 5 bytes or
/// more that is the whole jump: no byte is fixed, and its window is all
/// a `rel32` reaches (a jump through a stub placed where its bytes suit
/// the instruction before it). Not async-signal-safe.
pub(crate) fn puns(start: usize, len: usize, code: &[u8], one_byte: bool) -> Vec<Pun> {
    let written = if one_byte { 1 } else { len };
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
    all
}

/// The bytes `pun` writes for a jump to `target` (inside its window):
/// the first `pun.written` of the result.
pub(crate) fn pun_bytes(pun: &Pun, target: usize) -> [u8; JUMP_LEN] {
    debug_assert!(target >= pun.lo && target - pun.lo < pun.size);
    let p = pun.prefixes;
    let end = pun.start + p + JUMP_LEN;
    let rel = (target as i64 - end as i64) as i32;
    let mut b = [0u8; JUMP_LEN];
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
    insn.code() == Code::Jmp_rel32_64
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
            for pun in puns(start, len, &code, false) {
                for target in [pun.lo, pun.lo + pun.size - 1] {
                    let b = pun_bytes(&pun, target);
                    assert!(decodes_to(&b[..pun.written], &pun.fixed, start, target));
                }
            }
        }
        let one = puns(start, 7, &code, true);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].size, 1);
        assert_eq!(pun_bytes(&one[0], one[0].lo)[0], JMP);
        // The whole jump written over a long instruction: anywhere a
        // `rel32` reaches.
        let whole = puns(start, 7, &code, false);
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
    fn windows_shrink_with_prefixes() {
        let code = [0x31, 0xc0, 0xc3, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc];
        let sizes: Vec<usize> = puns(0x7f00_0000_0000, 2, &code, false)
            .iter()
            .map(|p| p.size)
            .collect();
        assert_eq!(sizes, [256, 1]);
    }
}
