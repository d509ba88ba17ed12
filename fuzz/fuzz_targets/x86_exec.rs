//! x86-64: moved code run against the original. A probed instruction as
//! a hit runs it (emulated on the registers, or out of line in its slot),
//! and the instructions a trampoline copies (a function entry's range, a
//! punned jump's instruction and tail) run from the trampoline, each
//! compared with the original run from the same registers and memory
//! (`kscale_fuzz::exec`).
//!
//! Input: a mode (1 byte: 0 a hit, 1 a trampoline at a function's
//! entry, 2 one without a function, 3 a punned one), the code's place
//! (4), the slot's or trampoline's distance (4), the memory's seed (8),
//! the flags (1), how each register is drawn (17), their values (128),
//! the code (up to 48 bytes).
#![no_main]

use kscale_fuzz::exec::{self, CODE_AREA, Layout, Regs, Skip};
use kscale_fuzz::{Input, x86};
use libfuzzer_sys::fuzz_target;
use uprobe_core::testing::code::{FunctionCode, analyze, punned_trampoline, trampoline};

fn one(data: &[u8]) -> Result<(), Skip> {
    let mut input = Input::new(data);
    let mode = input.u8() % 4;
    let place = input.u32();
    let from = CODE_AREA + (u64::from(place >> 12) << 13) + u64::from(place & 0x7ff);
    let moved = from.wrapping_add(i64::from(input.u32() as i32 >> 2) as u64);
    let seed = input.u64();
    let flags = input.u8();
    let pick = input.bytes(17);
    let values = input.bytes(128);
    let code = input.rest();
    let code = &code[..code.len().min(48)];
    let start = exec::registers(pick, values, flags);
    let mut layout = Layout::new(seed);
    if mode == 0 {
        let slot = moved & !63;
        let insn = x86::decode(code, from);
        let Ok(analysis) = analyze(from as usize, code, slot as usize) else {
            return Ok(());
        };
        exec::lay_out_original(&mut layout, &[insn], code)?;
        if let Some(slot_code) = analysis.slot_code() {
            layout.code(slot, slot_code)?;
        }
        let apply = |regs: &mut Regs, at: &mut u64| {
            // SAFETY: `compare` calls it in the child only.
            unsafe { exec::apply_analysis(&analysis, regs, at) }
        };
        return exec::compare(&layout, &[insn], start, from, Some(&apply));
    }
    let base = moved & !0xff;
    let function = |sole_entry| FunctionCode {
        start: from as usize,
        code,
        sole_entry,
    };
    let (addr, base_) = (from as usize, base as usize);
    let built = match mode {
        1 => trampoline(addr, code, Some(function(true)), base_, 0),
        2 => trampoline(addr, code, None, base_, 0),
        _ => punned_trampoline(addr, code, addr + code.len(), base_, 0),
    };
    let Ok(t) = built else { return Ok(()) };
    let original = &code[t.start - addr..t.end - addr];
    // What the trampoline copies (checked as the decoding target does).
    let insns = x86::check_trampoline(original, &t, base, mode == 3);
    exec::lay_out_original(&mut layout, &insns, original)?;
    layout.code(base, &t.code)?;
    exec::compare(&layout, &insns, start, t.copies[0].1 as u64, None)
}

fuzz_target!(|data: &[u8]| {
    let _ = one(data);
});
