//! aarch64 trap-free probes: which sites can take a `B` into a per-probe
//! trampoline ([`plan`]), and the trampoline's code ([`build`], with the
//! common entry routine every trampoline calls, `super::jump_entry`).
//!
//! A probe replaces exactly one 4-byte instruction, so no thread can ever
//! be stopped inside the replaced range, and `BRK` -> `B` is one of the
//! concurrent modifications the architecture defines: the patching is
//! one aligned 32-bit store over the engine's breakpoint (see
//! `crate::patch::jump`), with the cache maintenance `CTR_EL0` asks for and
//! `membarrier(SYNC_CORE)`.
//!
//! **Which sites qualify**: every instruction the trap path accepts, when
//! a trampoline can be placed within `B`'s +-128 MB of it (and, for a
//! branch, its target within reach of the trampoline). A **landing pad**
//! (`bti`, `paciasp`, `pacibsp`) stays in place, since a `B` is no valid
//! target of an indirect branch on a BTI-guarded page, and the jump goes
//! over the instruction after it, as on x86-64 after `endbr64`. That
//! needs the function (a symbol with a size, the probe at its start): a
//! thread must reach the jump only through the landing pad, so no direct
//! branch in the function may target the instruction after it, and the
//! function may have no indirect `br` (a jump table could). After
//! `paciasp` the link register is signed: the trampoline authenticates it
//! before the handlers run (they see the plain return address, as on the
//! trap path, and a return probe may replace it) and signs it again after.
//!
//! **A trampoline** (immutable once written, never freed):
//!
//! ```text
//!  +0  .quad cell             the probe's JumpCell (which site it serves)
//!  +8  .quad entry            uprobe_core_jump_entry (the common routine)
//! +16  autiasp / autibsp / nop  (after paciasp / pacibsp: x30 unsigned)
//! +20  stp x16, x30, [sp, #-16]!
//! +24  ldr x16, +8
//! +28  blr x16               -> entry: saves, runs the consumers, restores
//! +32  ldp x16, x30, [sp], #16
//! +36  paciasp / pacibsp     (after a landing pad that signs)
//!      the displaced instruction: copied when it runs anywhere (what the
//!      trap path runs out of line), or its equivalent (branches with
//!      their targets, `adr`/`adrp` and literal loads with their values,
//!      `bl`/`blr` with the original return address in x30)
//!      b next
//!      b target              (a conditional branch taken)
//! ```
//!
//! **BTI.** The trampoline is entered by a direct `B` (PSTATE.BTYPE 0) on
//! a page the engine maps without `PROT_BTI`, so it needs no landing pad;
//! the common routine, entered by `blr x16`, starts with `bti c`; the
//! way back is a direct `B` (or `ret`). A copied `br`/`blr` leaves the
//! unguarded trampoline page with BTYPE 0b01, which every landing pad
//! accepts (the trap path's simulation makes the same choice).
//!
//! No register but those the displaced instruction writes changes: the
//! trampoline's own use of x16 and x30 is undone before the copy runs.
//! A trap hit of the site (while the jump is being written or taken
//! back) continues at +36 ([`copy_start`]).
//!
//! The common routine every trampoline calls is [`super::jump_entry`].

use super::JUMP_LEN;
use super::decode::{Emulation, LiteralKind, RegisterBranch};
use super::jump_entry::COPY_AT;
pub(crate) use super::jump_entry::copy_start;
use super::{HWCAP_SVE, HWCAP2_SME, hwcaps};
use crate::arch::{CODE_AT, ENTRY_PTR_AT, Function, Moves, TRAMPOLINE_SIZE};

/// Where a site's branch lands in its trampoline: right after the header.
pub(crate) const ENTRY_AT: usize = CODE_AT;
use crate::base::mode::NotOptimized;

/// `B`'s reach, either way.
const B_REACH: i64 = 1 << 27;

const NOP: u32 = 0xd503_201f;
const PACIASP: u32 = 0xd503_233f;
const PACIBSP: u32 = 0xd503_237f;
const AUTIASP: u32 = 0xd503_23bf;
const AUTIBSP: u32 = 0xd503_23ff;
/// `stp x16, x30, [sp, #-16]!` and `ldp x16, x30, [sp], #16`.
const PUSH_X16_X30: u32 = 0xa9bf_7bf0;
const POP_X16_X30: u32 = 0xa8c1_7bf0;
/// `ldr x16, <entry pointer>` (a literal load at +24) and `blr x16`.
const LDR_X16_ENTRY: u32 = 0x5800_0000
    | ((((ENTRY_PTR_AT as i32 - (CODE_AT as i32 + 8)) >> 2) as u32 & 0x7_ffff) << 5)
    | 16;
const _: () = assert!(LDR_X16_ENTRY == 0x58ff_ff90);
const BLR_X16: u32 = 0xd63f_0200;
/// `str x16, [sp, #-16]!` and `ldr x16, [sp], #16`.
const PUSH_X16: u32 = 0xf81f_0ff0;
const POP_X16: u32 = 0xf841_07f0;

/// Why the calling thread's vector state rules trampolines out, if it
/// does: with SME a thread in streaming mode cannot run the trampoline's
/// Advanced SIMD saves, and SVE vectors longer than 128 bits have upper
/// bits in `z0`-`z31` that the trampoline does not save (any SIMD write
/// zeroes them). SVE at 128 bits (Neoverse N2/V2, for instance) has
/// nothing beyond the `q` registers: its `p` registers and FFR are not
/// touched by the engine's code. Not async-signal-safe.
pub(crate) fn unsaved_vector_state() -> Option<&'static str> {
    const PR_SVE_GET_VL: libc::c_int = 51;
    let (hwcap, hwcap2) = hwcaps();
    if hwcap2 & HWCAP2_SME != 0 {
        return Some("the CPU has SME: a thread in streaming mode cannot run the trampoline");
    }
    if hwcap & HWCAP_SVE != 0 {
        // SAFETY: a query; the low 16 bits are the vector length in bytes.
        let vl = unsafe { libc::prctl(PR_SVE_GET_VL, 0, 0, 0, 0) };
        if vl < 0 || vl & 0xffff > 16 {
            return Some("SVE vectors longer than 128 bits: their upper bits are not saved");
        }
    }
    None
}

/// The landing pad a jump goes after, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Landing {
    /// `bti` (any target kind): no state.
    Bti,
    /// `paciasp` / `pacibsp`: x30 signed with key A / B.
    Pac { key_b: bool },
}

/// What a site's optimization replaces: the instruction at `start` (the
/// probed one, or the one after its landing pad).
pub(crate) struct Plan {
    pub(crate) start: usize,
    pub(crate) len: usize,
    insn: u32,
    landing: Option<Landing>,
}

impl Plan {
    /// Whether the range holds several instructions: never on aarch64.
    pub(crate) fn has_interior(&self) -> bool {
        false
    }

    /// The end of the original code the trampoline runs a copy of.
    pub(crate) fn end(&self) -> usize {
        self.start + self.len
    }
}

fn word(code: &[u8], at: usize) -> Option<u32> {
    code.get(at..at + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn landing_of(insn: u32) -> Option<Landing> {
    match insn {
        PACIASP => Some(Landing::Pac { key_b: false }),
        PACIBSP => Some(Landing::Pac { key_b: true }),
        // bti, bti c, bti j, bti jc: hint #32, #34, #36, #38.
        _ if insn & 0xffff_ff3f == 0xd503_241f => Some(Landing::Bti),
        _ => None,
    }
}

/// Decides whether the instruction at `addr` (whose bytes start `here`)
/// can be replaced by a `B`, and which one: the instruction itself, or,
/// for a landing pad at a function's start, the one after it (see the
/// module docs). Not async-signal-safe.
pub(crate) fn plan(
    addr: usize,
    here: &[u8],
    function: Option<Function<'_>>,
) -> Result<Plan, NotOptimized> {
    let Some(insn) = word(here, 0) else {
        return Err(NotOptimized::NotRelocatable {
            why: "the instruction is not readable",
        });
    };
    let Some(landing) = landing_of(insn) else {
        relocatable(addr, insn)?;
        return Ok(Plan {
            start: addr,
            len: JUMP_LEN,
            insn,
            landing: None,
        });
    };
    let Some(function) = function.filter(|f| f.start == addr) else {
        return Err(NotOptimized::LandingPad {
            why: "the jump after it needs the function's extent (a symbol with a size, probed at its start)",
        });
    };
    if !function.sole_entry {
        return Err(NotOptimized::LandingPad {
            why: "the function's extent comes from unwind information only (no symbol): \
                  other entry points may branch to the instruction after it",
        });
    }
    let after = addr + 4;
    let Some(next) = word(function.code, 4) else {
        return Err(NotOptimized::TooShort {
            len: 4,
            why: "the function is only its landing pad",
        });
    };
    if landing_of(next).is_some() {
        return Err(NotOptimized::LandingPad {
            why: "a second landing pad follows it",
        });
    }
    for k in (0..function.code.len() / 4).map(|k| k * 4) {
        let at = addr + k;
        let w = word(function.code, k).expect("in bounds");
        // br / braa / brab / braaz / brabz: a computed target.
        if w & 0xfeff_0000 == 0xd61f_0000 {
            return Err(NotOptimized::IndirectJump { at });
        }
        let target = match super::decode::simulate(at as u64, w) {
            Some(
                Emulation::Branch { target, .. }
                | Emulation::CondBranch { target, .. }
                | Emulation::CompareBranch { target, .. }
                | Emulation::TestBranch { target, .. },
            ) => target as usize,
            _ => continue,
        };
        if target == after {
            return Err(NotOptimized::BranchIntoRange { from: at, target });
        }
    }
    relocatable(after, next)?;
    Ok(Plan {
        start: after,
        len: JUMP_LEN,
        insn: next,
        landing: Some(landing),
    })
}

/// The probed instruction alone: never asked for on aarch64, where a
/// jump always replaces exactly one instruction (`super::pun`).
pub(crate) fn single(_addr: usize, _here: &[u8], _limit: usize) -> Result<Plan, NotOptimized> {
    Err(NotOptimized::Architecture)
}

/// Whether `insn` (at `addr`) can run in a trampoline: what the trap path
/// refuses cannot.
fn relocatable(addr: usize, insn: u32) -> Result<(), NotOptimized> {
    if super::decode::simulate(addr as u64, insn).is_some() {
        return Ok(());
    }
    match super::decode::refusal(insn) {
        Some(why) => Err(NotOptimized::NotRelocatable { why }),
        None => Ok(()),
    }
}

/// `B` from `from` to `to`, if within reach.
pub(super) fn branch(from: usize, to: usize) -> Option<u32> {
    let off = to as i64 - from as i64;
    (off % 4 == 0 && (-B_REACH..B_REACH).contains(&off))
        .then(|| 0x1400_0000 | ((off >> 2) as u32 & 0x03ff_ffff))
}

/// `movz`/`movk` putting `value` in `xd`.
fn materialize(out: &mut Vec<u32>, rd: u8, value: u64) {
    let rd = u32::from(rd);
    out.push(0xd280_0000 | ((value & 0xffff) as u32) << 5 | rd);
    for hw in 1..4 {
        let chunk = (value >> (16 * hw) & 0xffff) as u32;
        if chunk != 0 {
            out.push(0xf280_0000 | hw << 21 | chunk << 5 | rd);
        }
    }
}

/// A trampoline's code for `plan`, to be written at `base`, serving the
/// cell at `cell`; and where the copy of the replaced instruction starts.
/// Not async-signal-safe.
pub(crate) fn build(
    plan: &Plan,
    base: usize,
    cell: usize,
) -> Result<(Vec<u8>, Moves), NotOptimized> {
    let out_of_reach = NotOptimized::NotRelocatable {
        why: "its branch target is beyond a trampoline's reach",
    };
    let (auth, sign) = match plan.landing {
        Some(Landing::Pac { key_b: false }) => (AUTIASP, Some(PACIASP)),
        Some(Landing::Pac { key_b: true }) => (AUTIBSP, Some(PACIBSP)),
        _ => (NOP, None),
    };
    let mut words = vec![auth, PUSH_X16_X30, LDR_X16_ENTRY, BLR_X16, POP_X16_X30];
    words.extend(sign);
    let copy = base + CODE_AT + 4 * words.len();
    debug_assert_eq!(copy - base, COPY_AT + 4 * usize::from(sign.is_some()));
    let next = plan.start + 4;
    // The displaced instruction, then `b next`; `taken` collects a
    // conditional branch's second exit.
    let mut taken = None;
    let insn = plan.insn;
    match super::decode::simulate(plan.start as u64, insn) {
        None => words.push(insn),
        Some(Emulation::Nop { .. }) => {}
        Some(Emulation::Branch { target, link }) => {
            if link.is_some() {
                materialize(&mut words, 30, next as u64);
            }
            let at = base + CODE_AT + 4 * words.len();
            words.push(branch(at, target as usize).ok_or(out_of_reach.clone())?);
        }
        Some(
            Emulation::CondBranch { target, .. }
            | Emulation::CompareBranch { target, .. }
            | Emulation::TestBranch { target, .. },
        ) => {
            // The same test, branching two words on to `b target`.
            let retargeted = if insn & 0x7e00_0000 == 0x3600_0000 {
                insn & !(0x3fff << 5) | 2 << 5
            } else {
                insn & !(0x7_ffff << 5) | 2 << 5
            };
            words.push(retargeted);
            taken = Some(target as usize);
        }
        Some(Emulation::Address { rd, value, .. }) => {
            if rd < 31 {
                materialize(&mut words, rd, value);
            }
        }
        Some(Emulation::Register { rn, kind, .. }) => match kind {
            // Copied: `br` from the trampoline's unguarded page sets
            // BTYPE 0b01, which every landing pad accepts.
            RegisterBranch::Br | RegisterBranch::Ret => words.push(insn),
            RegisterBranch::Blr => {
                // x30 must be the original return address; x16 (IP0) may
                // be clobbered at any call.
                let mut via = u32::from(rn);
                if rn == 30 {
                    words.push(0xaa00_03f0 | 30 << 16);
                    via = 16;
                }
                materialize(&mut words, 30, next as u64);
                words.push(0xd61f_0000 | via << 5);
            }
        },
        Some(Emulation::Literal { rt, kind, addr, .. }) => {
            let rt32 = u32::from(rt);
            match kind {
                LiteralKind::Prefetch => {}
                // Register 31 is xzr for the integer forms (v31 for SIMD).
                LiteralKind::W | LiteralKind::X | LiteralKind::Sw if rt == 31 => {}
                LiteralKind::W | LiteralKind::X | LiteralKind::Sw => {
                    materialize(&mut words, rt, addr);
                    let op = match kind {
                        LiteralKind::W => 0xb940_0000,
                        LiteralKind::X => 0xf940_0000,
                        _ => 0xb980_0000,
                    };
                    words.push(op | rt32 << 5 | rt32);
                }
                LiteralKind::Simd { bytes } => {
                    words.push(PUSH_X16);
                    materialize(&mut words, 16, addr);
                    let op = match bytes {
                        4 => 0xbd40_0000,
                        8 => 0xfd40_0000,
                        _ => 0x3dc0_0000,
                    };
                    words.push(op | 16 << 5 | rt32);
                    words.push(POP_X16);
                }
            }
        }
        Some(Emulation::OutOfLine { .. }) => words.push(insn),
    }
    let at = base + CODE_AT + 4 * words.len();
    words.push(branch(at, next).ok_or(NotOptimized::NoTrampolineRoom)?);
    if let Some(target) = taken {
        let at = base + CODE_AT + 4 * words.len();
        words.push(branch(at, target).ok_or(out_of_reach)?);
    }
    if CODE_AT + 4 * words.len() > TRAMPOLINE_SIZE {
        return Err(NotOptimized::NotRelocatable {
            why: "relocated, it does not fit a trampoline",
        });
    }
    let mut code = Vec::with_capacity(TRAMPOLINE_SIZE);
    code.extend_from_slice(&(cell as u64).to_le_bytes());
    let entry = super::jump_entry::routine() as u64;
    code.extend_from_slice(&entry.to_le_bytes());
    for w in words {
        code.extend_from_slice(&w.to_le_bytes());
    }
    Ok((code, vec![(plan.start, copy)]))
}

/// The `B` from `start` to trampoline `base`.
pub(crate) fn jump_bytes(start: usize, base: usize) -> [u8; JUMP_LEN] {
    branch(start, base + CODE_AT)
        .expect("trampolines are placed within B's reach")
        .to_le_bytes()
}

/// Where a thread that trapped at the start of a range after a landing
/// pad continues: the trampoline's entry, which runs the consumers (the
/// landing pad has run: after `paciasp`, x30 is signed, which the entry
/// undoes before the handlers see it).
pub(crate) fn landing_entry(base: usize) -> usize {
    base + CODE_AT
}
