//! aarch64: the engine's mask/value classifier against an independent
//! decoder (yaxpeax-arm) over a large set of encodings: everything it
//! simulates is one of the simulated instructions, everything it runs out
//! of line neither addresses relative to the PC nor belongs to a refused
//! class, and everything it refuses is in a refused class (or is not an
//! instruction at all).
#![cfg(target_arch = "aarch64")]

use uprobe_core::testing::{Class, classify};
use yaxpeax_arch::{Decoder, U8Reader};
use yaxpeax_arm::armv8::a64::{InstDecoder, Instruction, Opcode, Operand};

fn decode(word: u32) -> Option<Instruction> {
    let bytes = word.to_le_bytes();
    InstDecoder::default()
        .decode(&mut U8Reader::new(&bytes))
        .ok()
        .filter(|i| i.opcode != Opcode::Invalid)
}

fn pc_relative(i: &Instruction) -> bool {
    i.operands.iter().any(|o| matches!(o, Operand::PCOffset(_)))
}

/// What the classifier simulates, as the decoder names it.
fn simulated(i: &Instruction, word: u32) -> bool {
    match i.opcode {
        Opcode::B
        | Opcode::BL
        | Opcode::Bcc(_)
        | Opcode::CBZ
        | Opcode::CBNZ
        | Opcode::TBZ
        | Opcode::TBNZ
        | Opcode::ADR
        | Opcode::ADRP
        | Opcode::BR
        | Opcode::BLR
        | Opcode::RET => true,
        Opcode::LDR | Opcode::LDRSW | Opcode::PRFM => pc_relative(i),
        // nop (hint #0) and bti (hint #32/34/36/38).
        Opcode::HINT => word == 0xd503_201f || word & 0xffff_ff3f == 0xd503_241f,
        _ => false,
    }
}

/// The classes the engine refuses.
fn refused_class(i: &Instruction) -> bool {
    matches!(
        i.opcode,
        Opcode::LDXR
            | Opcode::LDXRB
            | Opcode::LDXRH
            | Opcode::LDXP
            | Opcode::LDAXR
            | Opcode::LDAXRB
            | Opcode::LDAXRH
            | Opcode::LDAXP
            | Opcode::STXR
            | Opcode::STXRB
            | Opcode::STXRH
            | Opcode::STXP
            | Opcode::STLXR
            | Opcode::STLXRB
            | Opcode::STLXRH
            | Opcode::STLXP
            // Pair compare-and-swap shares the exclusive encoding class
            // (refused with it, as the kernel's mask does).
            | Opcode::CASP(_)
            | Opcode::SVC
            | Opcode::HVC
            | Opcode::SMC
            | Opcode::BRK
            | Opcode::HLT
            | Opcode::DCPS1
            | Opcode::DCPS2
            | Opcode::DCPS3
            | Opcode::MSR
            | Opcode::SYS(_)
            | Opcode::SYSL(_)
            | Opcode::ERET
            | Opcode::DRPS
    )
}

fn check(word: u32, counts: &mut [u64; 3]) {
    let decoded = decode(word);
    match classify(word) {
        Class::Simulated => {
            counts[0] += 1;
            let i = decoded.unwrap_or_else(|| panic!("{word:#010x}: simulated, but not decodable"));
            assert!(
                simulated(&i, word),
                "{word:#010x}: simulated, but the decoder says `{i}`"
            );
        }
        Class::OutOfLine => {
            counts[1] += 1;
            // Encodings the decoder does not know run out of line and
            // raise SIGILL there, reported at the probed address, as they
            // would unprobed.
            if let Some(i) = decoded {
                assert!(
                    !pc_relative(&i),
                    "{word:#010x}: out of line, but `{i}` is PC-relative"
                );
                assert!(
                    !simulated(&i, word),
                    "{word:#010x}: `{i}` should be simulated"
                );
                assert!(!refused_class(&i), "{word:#010x}: `{i}` should be refused");
            }
        }
        Class::Refused(why) => {
            counts[2] += 1;
            if let Some(i) = decoded {
                assert!(
                    refused_class(&i),
                    "{word:#010x}: refused ({why}), but the decoder says `{i}`"
                );
            }
        }
    }
}

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
        (0xd10043ff, "sub sp, sp, #16"),
    ] {
        assert_ne!(
            std::mem::discriminant(&classify(word)),
            std::mem::discriminant(&Class::Refused("")),
            "{name} must be probeable"
        );
    }
}
