//! x86-64: the analysis of an instruction at a probed site (emulated, run
//! out of line, or refused with a reason), and the out-of-line slot it
//! makes, decoded and compared with the original.
//!
//! Input: the site's address (8 bytes), the slot's distance from it
//! (4 bytes, signed), the instruction's bytes (up to 15).
#![no_main]

use iced_x86::Mnemonic;
use kscale_fuzz::{Input, x86};
use libfuzzer_sys::fuzz_target;
use uprobe_core::testing::code::analyze;

/// Canonical user-space addresses only (what a process has).
const USER: u64 = 0x0000_7fff_ffff_ffff;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let addr = input.u64() & USER;
    let slot = addr.wrapping_add(i64::from(input.u32() as i32) as u64) & USER;
    let code = input.bytes(15);
    let insn = x86::decode(code, addr);
    match analyze(addr as usize, code, slot as usize) {
        Ok(analysis) => {
            assert!(!insn.is_invalid(), "{code:02x?} accepted");
            match analysis.slot_code() {
                Some(slot_code) => x86::check_slot(&insn, slot_code, slot),
                None => assert!(
                    matches!(
                        insn.mnemonic(),
                        Mnemonic::Nop
                            | Mnemonic::Endbr64
                            | Mnemonic::Endbr32
                            | Mnemonic::Push
                            | Mnemonic::Jmp
                            | Mnemonic::Call
                            | Mnemonic::Ret
                            | Mnemonic::Loop
                            | Mnemonic::Loope
                            | Mnemonic::Loopne
                            | Mnemonic::Jrcxz
                    ) || insn.is_jcc_short_or_near(),
                    "{} emulated: {analysis:?}",
                    x86::text(&insn)
                ),
            }
        }
        // The refusal prints (the formatter runs on any instruction).
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
