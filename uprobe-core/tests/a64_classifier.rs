//! aarch64: the engine's mask/value classifier against an independent
//! decoder (yaxpeax-arm, `common/a64_oracle.rs`) over a large set of
//! encodings. The classifier is the same code on every host (it depends
//! on nothing of the engine), so this runs everywhere.

#[path = "common/a64_oracle.rs"]
mod oracle;

use oracle::check;
use uprobe_core::testing::{Class, classify};

#[test]
fn the_classifier_agrees_with_an_independent_decoder() {
    let mut counts = [0u64; 3];
    // Every value of the top 12 bits (which select the encoding group)
    // with 192 pseudo-random low 20 bits each, plus the operand fields
    // all-zero and all-one: 0.8 million encodings.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for top in 0u32..4096 {
        for k in 0..194 {
            let low = match k {
                0 => 0,
                1 => 0xf_ffff,
                _ => {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x as u32) & 0xf_ffff
                }
            };
            check(top << 20 | low, &mut counts);
        }
    }
    // Encodings real function entries and bodies use.
    for word in [
        0xd503_233f, // paciasp
        0xd503_23bf, // autiasp
        0xd503_245f, // bti c
        0xa9bf_7bfd, // stp x29, x30, [sp, #-16]!
        0x9100_03fd, // mov x29, sp
        0xd65f_03c0, // ret
        0xd65f_0bff, // retaa
        0x885f_7c01, // ldxr w1, [x0]
        0xc8df_fc00, // ldar x0, [x0]
        0xd400_0001, // svc #0
        0xd51b_4200, // msr nzcv, x0
        0xd53b_d040, // mrs x0, tpidr_el0
    ] {
        check(word, &mut counts);
    }
    // Each class is well represented.
    assert!(counts.iter().all(|&c| c > 1000), "classes seen: {counts:?}");
}

#[test]
fn function_entries_are_probeable() {
    for (word, name) in [
        (0xd503_233f, "paciasp"),
        (0xd503_237f, "pacibsp"),
        (0xd503_245f, "bti c"),
        (0xa9bf_7bfd, "stp x29, x30, [sp, #-16]!"),
        (0xd100_43ff, "sub sp, sp, #16"),
    ] {
        assert_ne!(
            std::mem::discriminant(&classify(word)),
            std::mem::discriminant(&Class::Refused("")),
            "{name} must be probeable"
        );
    }
}
