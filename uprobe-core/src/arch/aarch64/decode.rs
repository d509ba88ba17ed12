//! Classifying the instruction a probe displaces, by mask/value tests on
//! its 32-bit encoding (the kernel's `arm64_probe_decode_insn`).
//!
//! Every A64 instruction is 4 bytes, so the breakpoint (`BRK #5`) replaces
//! exactly one. Position-dependent instructions are **simulated** in the
//! trap handler on the signal frame's registers: `b`, `bl`, `b.cond`,
//! `cbz`/`cbnz`, `tbz`/`tbnz`, `adr`/`adrp`, `br`/`blr`/`ret`, literal
//! loads (`ldr`/`ldrsw`/`prfm` literal, and the SIMD forms), and `nop` /
//! `bti`. Other instructions run **out of line** from a slot (they do not
//! depend on the PC). Refused: exclusive loads and stores (a trap between
//! `ldxr` and `stxr` clears the monitor, so the store would fail forever),
//! exception-generating instructions (`svc`, `brk`, `hlt`, ...), writes to
//! system registers and system instructions (`msr`, `sys`), and
//! unallocated encodings of the system class.
//!
//! This file has no dependency on the engine: the fuzz target that checks
//! the classifier against an independent decoder builds it on any host
//! (`crate::arch::a64_decode`, with the `test-hooks` feature).

/// What a hit does in place of the displaced instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Emulation {
    /// `nop` or `bti`: continue at `next`.
    Nop { next: u64 },
    /// `b` (`link: None`) or `bl` (`link: Some(next)`, into x30).
    Branch { target: u64, link: Option<u64> },
    /// `b.cond` (and `bc.cond`): `target` if `cond` holds, else `next`.
    CondBranch { cond: u8, target: u64, next: u64 },
    /// `cbz`/`cbnz` (`nonzero`) on `reg` (`wide`: 64-bit).
    CompareBranch {
        reg: u8,
        wide: bool,
        nonzero: bool,
        target: u64,
        next: u64,
    },
    /// `tbz`/`tbnz` (`nonzero`) on bit `bit` of `reg`.
    TestBranch {
        reg: u8,
        bit: u8,
        nonzero: bool,
        target: u64,
        next: u64,
    },
    /// `adr`/`adrp`: `rd = value`.
    Address { rd: u8, value: u64, next: u64 },
    /// `br`/`blr`/`ret` through `rn` (`link: Some(next)` for `blr`).
    Register {
        rn: u8,
        kind: RegisterBranch,
        next: u64,
    },
    /// A literal load from `addr` into `rt`.
    Literal {
        rt: u8,
        kind: LiteralKind,
        addr: u64,
        next: u64,
    },
    /// Anything else: run the copy at `slot`, which branches back or
    /// (`trap_back`) ends in a second breakpoint.
    OutOfLine { slot: u64, trap_back: bool },
}

/// Which register branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RegisterBranch {
    /// `br`: PSTATE.BTYPE becomes 0b01.
    Br,
    /// `blr`: x30 = next, PSTATE.BTYPE becomes 0b10.
    Blr,
    /// `ret`: PSTATE.BTYPE becomes 0b00.
    Ret,
}

/// What a literal load reads and where it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LiteralKind {
    /// `ldr wt`: 4 bytes, zero-extended into xt.
    W,
    /// `ldr xt`: 8 bytes.
    X,
    /// `ldrsw xt`: 4 bytes, sign-extended.
    Sw,
    /// `prfm`: a prefetch hint, nothing to do.
    Prefetch,
    /// `ldr st`/`dt`/`qt`: 4, 8 or 16 bytes into SIMD register vt, the
    /// rest of the register zeroed.
    Simd { bytes: u8 },
}

/// The class of an encoding, as the classifier sees it (also what the
/// tests compare with an independent decoder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Simulated in the trap handler.
    Simulated,
    /// Run out of line from a slot.
    OutOfLine,
    /// Refused at attach, with the reason.
    Refused(&'static str),
}

/// Sign-extends the low `bits` bits of `v`.
fn sext(v: u32, bits: u32) -> i64 {
    let shift = 64 - bits;
    ((u64::from(v) << shift) as i64) >> shift
}

fn field(insn: u32, lo: u32, width: u32) -> u32 {
    (insn >> lo) & ((1 << width) - 1)
}

/// `HWCAP2_HBC`: the CPU runs `BC.cond` (`FEAT_HBC`).
#[cfg(target_arch = "aarch64")]
const HWCAP2_HBC: u64 = 1 << 44;

/// Whether this CPU runs `BC.cond` (`FEAT_HBC`); built for another host (the
/// classifier's tests), as if it did. Async-signal-safe.
#[must_use]
pub fn has_hbc() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: getauxval reads the auxiliary vector; it has no
        // preconditions.
        (unsafe { libc::getauxval(libc::AT_HWCAP2) } & HWCAP2_HBC) != 0
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        true
    }
}

/// The simulation of `insn` at `addr`, or `None` if it is not simulated.
pub(crate) fn simulate(addr: u64, insn: u32) -> Option<Emulation> {
    let next = addr.wrapping_add(4);
    let rel = |imm: i64| addr.wrapping_add_signed(imm);
    // nop, and bti (any target kind): hint #0 and hint #32..#38 (even).
    if insn == 0xd503_201f || insn & 0xffff_ff3f == 0xd503_241f {
        return Some(Emulation::Nop { next });
    }
    // b / bl: imm26 words.
    if insn & 0x7c00_0000 == 0x1400_0000 {
        let target = rel(sext(field(insn, 0, 26), 26) * 4);
        let link = (insn >> 31 == 1).then_some(next);
        return Some(Emulation::Branch { target, link });
    }
    // b.cond / bc.cond: imm19 words (bc.cond only where the CPU has it:
    // elsewhere its encoding is unallocated, and it runs out of line to
    // fault there as it would in place).
    if insn & 0xff00_0000 == 0x5400_0000 && (insn & 0x10 == 0 || has_hbc()) {
        return Some(Emulation::CondBranch {
            cond: field(insn, 0, 4) as u8,
            target: rel(sext(field(insn, 5, 19), 19) * 4),
            next,
        });
    }
    // cbz / cbnz.
    if insn & 0x7e00_0000 == 0x3400_0000 {
        return Some(Emulation::CompareBranch {
            reg: field(insn, 0, 5) as u8,
            wide: insn >> 31 == 1,
            nonzero: field(insn, 24, 1) == 1,
            target: rel(sext(field(insn, 5, 19), 19) * 4),
            next,
        });
    }
    // tbz / tbnz: the bit number is b5:b40.
    if insn & 0x7e00_0000 == 0x3600_0000 {
        return Some(Emulation::TestBranch {
            reg: field(insn, 0, 5) as u8,
            bit: ((insn >> 31) << 5 | field(insn, 19, 5)) as u8,
            nonzero: field(insn, 24, 1) == 1,
            target: rel(sext(field(insn, 5, 14), 14) * 4),
            next,
        });
    }
    // adr / adrp: immhi:immlo.
    if insn & 0x1f00_0000 == 0x1000_0000 {
        let imm = sext(field(insn, 5, 19) << 2 | field(insn, 29, 2), 21);
        let value = if insn >> 31 == 1 {
            (addr & !0xfff).wrapping_add_signed(imm << 12)
        } else {
            rel(imm)
        };
        return Some(Emulation::Address {
            rd: field(insn, 0, 5) as u8,
            value,
            next,
        });
    }
    // br / blr / ret (without pointer authentication).
    let kind = match insn & 0xffff_fc1f {
        0xd61f_0000 => Some(RegisterBranch::Br),
        0xd63f_0000 => Some(RegisterBranch::Blr),
        0xd65f_0000 => Some(RegisterBranch::Ret),
        _ => None,
    };
    if let Some(kind) = kind {
        return Some(Emulation::Register {
            rn: field(insn, 5, 5) as u8,
            kind,
            next,
        });
    }
    // Literal loads: opc(2) 011 V 00 imm19 Rt.
    if insn & 0x3b00_0000 == 0x1800_0000 {
        let simd = field(insn, 26, 1) == 1;
        let kind = match (field(insn, 30, 2), simd) {
            (0, false) => LiteralKind::W,
            (1, false) => LiteralKind::X,
            (2, false) => LiteralKind::Sw,
            (3, false) => LiteralKind::Prefetch,
            (0, true) => LiteralKind::Simd { bytes: 4 },
            (1, true) => LiteralKind::Simd { bytes: 8 },
            (2, true) => LiteralKind::Simd { bytes: 16 },
            _ => return None, // unallocated: refused below
        };
        return Some(Emulation::Literal {
            rt: field(insn, 0, 5) as u8,
            kind,
            addr: rel(sext(field(insn, 5, 19), 19) * 4),
            next,
        });
    }
    None
}

/// Why `insn` cannot be probed, if it cannot.
pub(crate) fn refusal(insn: u32) -> Option<&'static str> {
    // Load/store exclusive (o2 = 0; the load-acquire/store-release forms
    // with o2 = 1 hold no monitor and run out of line), as the kernel's
    // `aarch64_insn_is_exclusive`.
    if insn & 0x3f80_0000 == 0x0800_0000 {
        return Some("an exclusive load/store: a trap between the pair breaks it");
    }
    // Exception generation: svc, hvc, smc, brk, hlt, dcps.
    if insn & 0xff00_0000 == 0xd400_0000 {
        return Some("it generates an exception");
    }
    // Unallocated literal load (opc 11 with V = 1).
    if insn & 0xff00_0000 == 0xdc00_0000 {
        return Some("an unallocated literal load");
    }
    // The system class: hints, barriers, msr (immediate and register),
    // sys/sysl, mrs.
    if insn & 0xffc0_0000 == 0xd500_0000 {
        let l = field(insn, 21, 1) == 1;
        let op0 = field(insn, 19, 2);
        // Hints (nop, bti, pac*, aut*, yield, ...): run out of line
        // (those that are not simulated).
        if insn & 0xffff_f01f == 0xd503_201f {
            return None;
        }
        // Barriers: clrex, dsb, dmb, isb, sb.
        if insn & 0xffff_f01f == 0xd503_301f {
            return None;
        }
        // mrs: reading a system register (tpidr_el0, cntvct_el0, ...).
        if l && op0 >= 2 {
            return None;
        }
        return Some("it writes a system register or is a system instruction");
    }
    // blraa / blraaz / blrab / blrabz: run out of line, the link register
    // would name the slot (a return lands there, after the probe may be
    // gone); `blr` itself is simulated.
    if insn & 0xfeff_f800 == 0xd63f_0800 {
        return Some(
            "a pointer-authenticated branch with link: out of line, it would link to the slot",
        );
    }
    // eret / drps (and their pointer-authenticated forms).
    if insn & 0xfe00_0000 == 0xd600_0000 && matches!(field(insn, 21, 4), 4 | 5) {
        return Some("an exception return or debug state instruction");
    }
    None
}

/// The class of the 32-bit encoding `insn` on this CPU (for tests and
/// diagnostics; see [`has_hbc`] for the one form that depends on it).
#[must_use]
pub fn classify(insn: u32) -> Class {
    if simulate(0x1000, insn).is_some() {
        Class::Simulated
    } else if let Some(why) = refusal(insn) {
        Class::Refused(why)
    } else {
        Class::OutOfLine
    }
}

/// Whether `addr` starts an instruction of code starting at `start`: on
/// A64, whether it is 4-byte aligned.
pub(crate) fn is_boundary(start: usize, addr: usize, _code: &[u8]) -> bool {
    (addr - start).is_multiple_of(4) && addr.is_multiple_of(4)
}

/// Whether condition `cond` holds for the flags NZCV in `pstate`.
pub(crate) fn condition_holds(cond: u8, pstate: u64) -> bool {
    let n = pstate >> 31 & 1 == 1;
    let z = pstate >> 30 & 1 == 1;
    let c = pstate >> 29 & 1 == 1;
    let v = pstate >> 28 & 1 == 1;
    let base = match cond >> 1 {
        0 => z,
        1 => c,
        2 => n,
        3 => v,
        4 => c && !z,
        5 => n == v,
        6 => n == v && !z,
        _ => true,
    };
    // Odd conditions negate, except 0b1111 ("never" encodes always).
    if cond & 1 == 1 && cond != 0xf {
        !base
    } else {
        base
    }
}
