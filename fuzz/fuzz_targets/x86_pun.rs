//! x86-64: the ways to pun a jump over an instruction (E9Patch's tactic:
//! over a short one, or its whole jump over a long one), each checked by
//! decoding what it writes, with the bytes it leaves, as a `jmp rel32` to
//! the targets of its window; and the stub a punned jump lands on.
//!
//! Input: the instruction's address (8 bytes), a flag (1: the one-byte
//! form), the stub's address (8), the code from the instruction on (up
//! to 24 bytes).
#![no_main]

use kscale_fuzz::{Input, x86};
use libfuzzer_sys::fuzz_target;
use uprobe_core::testing::code::{pun_stub, puns};

const USER: u64 = 0x0000_7fff_ffff_ffff;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let start = (input.u64() & USER) as usize;
    let one_byte = input.u8() & 1 == 1;
    let stub_at = input.u64() & USER;
    let code = input.bytes(24);
    let insn = x86::decode(code, start as u64);
    if insn.is_invalid() {
        return;
    }
    let windows = puns(start, insn.len(), code, one_byte).expect("x86-64 puns");
    if one_byte && insn.len() < 5 {
        // Only instructions of a jump's length take the one-byte form;
        // what the engine asks, it asks of those.
        return;
    }
    x86::check_puns(start, insn.len(), code, one_byte, &windows);
    let target = start as u64 ^ 0x5a5a_5a5a;
    let stub = pun_stub(stub_at as usize, target as usize).expect("x86-64 puns");
    x86::check_jump(&stub, stub_at, stub_at, target);
});
