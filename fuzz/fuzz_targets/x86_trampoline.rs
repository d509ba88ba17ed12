//! x86-64: which instructions a jump at a site replaces (whole
//! instructions at a function's entry, one long enough anywhere, or the
//! probed one alone with the tail a punned jump needs), and the
//! trampoline's relocated copy of them, decoded and compared with the
//! original.
//!
//! Input: a mode (1 byte: 0 a function's entry with symbols, 1 with
//! unwind tables only, 2 no function known, 3 punned), the site's
//! address (8), the trampoline's distance (4, signed), the cell (8), the
//! code from the site on (up to 64 bytes).
#![no_main]

use kscale_fuzz::{Input, x86};
use libfuzzer_sys::fuzz_target;
use uprobe_core::testing::code::{FunctionCode, punned_trampoline, trampoline};

const USER: u64 = 0x0000_7fff_ffff_ffff;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mode = input.u8() % 4;
    let addr = (input.u64() & USER) as usize;
    let base = (addr as u64).wrapping_add(i64::from(input.u32() as i32) as u64) & USER & !0xff;
    let cell = input.u64() as usize;
    let code = input.bytes(64);
    let function = |sole_entry| FunctionCode {
        start: addr,
        code,
        sole_entry,
    };
    let built = match mode {
        0 => trampoline(addr, code, Some(function(true)), base as usize, cell),
        1 => trampoline(addr, code, Some(function(false)), base as usize, cell),
        2 => trampoline(addr, code, None, base as usize, cell),
        _ => punned_trampoline(addr, code, addr + code.len(), base as usize, cell),
    };
    match built {
        Ok(t) => {
            let from = t.start - addr;
            let _ = x86::check_trampoline(&code[from..], &t, base, mode == 3);
        }
        Err(why) => assert!(!why.to_string().is_empty()),
    }
});
