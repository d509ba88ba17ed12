//! aarch64: a probed instruction run as a hit runs it (simulated on the
//! signal frame's registers, or out of line in its slot) against the
//! original run in place, each in a child process, from the same random
//! registers and memory (`kscale_fuzz::a64`). It runs aarch64 code: build
//! it for aarch64 and run it on an aarch64 host or under qemu-user
//! (`fuzz/README.md`).
//!
//! Input: the instruction (4 bytes), its place (4), the slot's distance
//! (4), the memory's seed (8), the flags (1), how each register is drawn
//! (32), their values (248).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[cfg(target_arch = "aarch64")]
fn one(data: &[u8]) {
    use kscale_fuzz::Input;
    use kscale_fuzz::a64::{self, CODE_AREA};

    let mut input = Input::new(data);
    let insn = input.u32();
    // Within 16 MiB, and the slot within +-256 MiB of it in 1 MiB steps:
    // half the slots are out of a branch's reach, which the engine must
    // refuse. (Fewer distinct pages keep qemu-user's translations of the
    // harness warm: with any page, a run costs several times as much.)
    let at = CODE_AREA + (u64::from(input.u32() & 0x3f_ffff) << 2);
    let distance = input.u32();
    let slot = at
        .wrapping_add((i64::from(distance as i32 >> 24) << 20) as u64)
        .wrapping_add(u64::from(distance & 0xfff8))
        & !7;
    let seed = input.u64();
    let flags = input.u8();
    let pick = input.bytes(32);
    let values = input.bytes(248);
    let start = a64::registers(pick, values, flags, seed);
    let _ = a64::check(insn, at, slot, &start, seed);
}

#[cfg(not(target_arch = "aarch64"))]
fn one(_: &[u8]) {
    panic!(
        "a64_simulate runs aarch64 code: build it with --target aarch64-unknown-linux-gnu \
         and run it on aarch64 or under qemu-user (fuzz/README.md)"
    );
}

fuzz_target!(|data: &[u8]| one(data));
