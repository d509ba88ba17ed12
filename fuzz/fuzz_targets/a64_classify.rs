//! aarch64: the classifier of a probed instruction (simulated, run out of
//! line, or refused) against an independent decoder, yaxpeax-arm, with
//! the oracle `uprobe-core`'s own test uses. The classifier depends on
//! nothing of the engine, so it runs on any host.
//!
//! Input: the 32-bit encoding (4 bytes, little-endian).
#![no_main]

use kscale_fuzz::Input;
use libfuzzer_sys::fuzz_target;

#[path = "../../uprobe-core/tests/common/a64_oracle.rs"]
mod oracle;

fuzz_target!(|data: &[u8]| {
    let word = Input::new(data).u32();
    let mut counts = [0u64; 3];
    oracle::check(word, &mut counts);
});
