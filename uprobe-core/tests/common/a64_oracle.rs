//! The oracle the aarch64 classifier is checked against: an independent
//! decoder (yaxpeax-arm) names the instruction, and everything the
//! engine simulates must be one of the simulated instructions, everything
//! it runs out of line must neither address relative to the PC nor
//! belong to a refused class, and everything it refuses must be in a
//! refused class (or be no instruction at all). Shared by
//! `tests/a64_classifier.rs` and the `a64_classify` fuzz target.

use uprobe_core::testing::{Class, classify, has_hbc};
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
            // Branches with link that are not simulated: out of line they
            // would link to the slot.
            | Opcode::BLRAA
            | Opcode::BLRAAZ
            | Opcode::BLRAB
            | Opcode::BLRABZ
    )
}

/// Checks the class of `word`, counting it in `counts` (simulated, out
/// of line, refused).
///
/// # Panics
/// Where the classifier and the decoder disagree.
pub fn check(word: u32, counts: &mut [u64; 3]) {
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
            // would unprobed; so does `bc.cond` on a CPU without it.
            let unallocated_here = word & 0xff00_0010 == 0x5400_0010 && !has_hbc();
            if let Some(i) = decoded.filter(|_| !unallocated_here) {
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
