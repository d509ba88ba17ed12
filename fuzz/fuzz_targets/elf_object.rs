//! What the engine reads of the objects of the process it is loaded
//! into, from mutated object files: the symbol index (a function by
//! address), the unwind tables' extents (`.eh_frame`, `.eh_frame_hdr`),
//! the USDT notes (`.note.stapsdt`) and the argument specs in them.
//! Anything is read or refused; nothing panics or reads out of bounds
//! (the fuzz build has the address sanitizer).
#![no_main]

use kscale_fuzz::Input;
use libfuzzer_sys::fuzz_target;
use uprobe_core::testing::objects::{Object, usdt_notes};
use uprobe_core::usdt::UsdtArg;

fuzz_target!(|data: &[u8]| {
    // The first 8 bytes choose the addresses asked about; the rest is
    // the file.
    let mut input = Input::new(data);
    let probe = input.u64() as usize;
    let file = input.rest();
    if let Some(object) = Object::parse(file) {
        for addr in [probe, probe & 0xffff, probe >> 48, 0, usize::MAX] {
            if let Some((start, size, name)) = object.covering(addr) {
                assert!(
                    start <= addr && addr - start < size,
                    "{name}: {start:#x}+{size}"
                );
            }
            let _ = object.frame_at(addr);
        }
    }
    if let Ok(notes) = usdt_notes(file) {
        for note in notes {
            for arg in note.spec.split_ascii_whitespace() {
                let _ = UsdtArg::parse(arg);
            }
        }
    }
});
