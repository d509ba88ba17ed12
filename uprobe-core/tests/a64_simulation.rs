//! aarch64: every simulated class, and the out-of-line path, checked by
//! register-file comparison: a snippet runs from a register state (x0-x28,
//! NZCV) once unprobed and once with a probe on the instruction under
//! test, and every register must come out the same, with the probe on
//! its breakpoint and optimized into a jump.
#![cfg(target_arch = "aarch64")]

use uprobe_core::{Mode, NotOptimized, Uprobe};

// exec(state, code): loads x0-x15, x18-x28 and NZCV from `state`, calls
// `code` (through x17; x16 is free for the snippet), stores x0-x28, x30
// and NZCV back. state: [x0..x30, nzcv] (32 words).
core::arch::global_asm!(
    ".text",
    ".globl a64_exec",
    "a64_exec:",
    "stp x29, x30, [sp, #-112]!",
    "stp x19, x20, [sp, #16]",
    "stp x21, x22, [sp, #32]",
    "stp x23, x24, [sp, #48]",
    "stp x25, x26, [sp, #64]",
    "stp x27, x28, [sp, #80]",
    "str x0, [sp, #96]",
    "mov x17, x1",
    "ldr x16, [x0, #248]",
    "msr nzcv, x16",
    "ldp x2, x3, [x0, #16]",
    "ldp x4, x5, [x0, #32]",
    "ldp x6, x7, [x0, #48]",
    "ldp x8, x9, [x0, #64]",
    "ldp x10, x11, [x0, #80]",
    "ldp x12, x13, [x0, #96]",
    "ldp x14, x15, [x0, #112]",
    "ldp x18, x19, [x0, #144]",
    "ldp x20, x21, [x0, #160]",
    "ldp x22, x23, [x0, #176]",
    "ldp x24, x25, [x0, #192]",
    "ldp x26, x27, [x0, #208]",
    "ldr x28, [x0, #224]",
    "ldp x0, x1, [x0, #0]",
    "blr x17",
    "ldr x17, [sp, #96]",
    "stp x0, x1, [x17, #0]",
    "stp x2, x3, [x17, #16]",
    "stp x4, x5, [x17, #32]",
    "stp x6, x7, [x17, #48]",
    "stp x8, x9, [x17, #64]",
    "stp x10, x11, [x17, #80]",
    "stp x12, x13, [x17, #96]",
    "stp x14, x15, [x17, #112]",
    "stp x18, x19, [x17, #144]",
    "stp x20, x21, [x17, #160]",
    "stp x22, x23, [x17, #176]",
    "stp x24, x25, [x17, #192]",
    "stp x26, x27, [x17, #208]",
    "str x28, [x17, #224]",
    "str x30, [x17, #240]",
    "mrs x16, nzcv",
    "str x16, [x17, #248]",
    "ldp x19, x20, [sp, #16]",
    "ldp x21, x22, [sp, #32]",
    "ldp x23, x24, [sp, #48]",
    "ldp x25, x26, [sp, #64]",
    "ldp x27, x28, [sp, #80]",
    "ldp x29, x30, [sp], #112",
    "ret",
);

/// A snippet whose instruction under test is at its start: `$body`.
macro_rules! snippet {
    ($name:literal, $($body:expr),+ $(,)?) => {
        concat!(".globl ", $name, "\n", ".p2align 3\n", $name, ":\n", $($body, "\n"),+)
    };
}

/// b.<cond> to a label that sets x9 = 2, else x9 = 1.
macro_rules! bcond {
    ($name:literal, $cond:literal) => {
        snippet!(
            $name,
            concat!("b.", $cond, " 1f"),
            "movz x9, #1",
            "ret",
            "1:",
            "movz x9, #2",
            "ret"
        )
    };
}

core::arch::global_asm!(
    ".text",
    bcond!("sn_beq", "eq"),
    bcond!("sn_bne", "ne"),
    bcond!("sn_bcs", "cs"),
    bcond!("sn_bcc", "cc"),
    bcond!("sn_bmi", "mi"),
    bcond!("sn_bpl", "pl"),
    bcond!("sn_bvs", "vs"),
    bcond!("sn_bvc", "vc"),
    bcond!("sn_bhi", "hi"),
    bcond!("sn_bls", "ls"),
    bcond!("sn_bge", "ge"),
    bcond!("sn_blt", "lt"),
    bcond!("sn_bgt", "gt"),
    bcond!("sn_ble", "le"),
    bcond!("sn_bal", "al"),
    snippet!(
        "sn_b",
        "b 1f",
        "movz x9, #1",
        "ret",
        "1:",
        "movz x9, #2",
        "ret"
    ),
    // bl at +4 (x30 kept in x16 around it).
    snippet!(
        "sn_bl",
        "mov x16, x30",
        "bl 1f",
        "mov x30, x16",
        "ret",
        "1:",
        "movz x9, #3",
        "ret"
    ),
    snippet!(
        "sn_cbz_w",
        "cbz w3, 1f",
        "movz x9, #1",
        "ret",
        "1:",
        "movz x9, #2",
        "ret"
    ),
    snippet!(
        "sn_cbnz_x",
        "cbnz x3, 1f",
        "movz x9, #1",
        "ret",
        "1:",
        "movz x9, #2",
        "ret"
    ),
    snippet!(
        "sn_tbz_0",
        "tbz x4, #0, 1f",
        "movz x9, #1",
        "ret",
        "1:",
        "movz x9, #2",
        "ret"
    ),
    snippet!(
        "sn_tbnz_63",
        "tbnz x4, #63, 1f",
        "movz x9, #1",
        "ret",
        "1:",
        "movz x9, #2",
        "ret"
    ),
    snippet!(
        "sn_tbz_31",
        "tbz w4, #31, 1f",
        "movz x9, #1",
        "ret",
        "1:",
        "movz x9, #2",
        "ret"
    ),
    snippet!("sn_adr", "adr x9, sn_b", "ret"),
    snippet!("sn_adrp", "adrp x10, sn_b", "ret"),
    snippet!("sn_adr_xzr", "adr xzr, sn_b", "ret"),
    // br / blr at +4 / +8; ret at +4.
    snippet!(
        "sn_br",
        "adr x16, 1f",
        "br x16",
        "brk #1",
        "1:",
        "movz x9, #4",
        "ret"
    ),
    snippet!(
        "sn_blr",
        "mov x15, x30",
        "adr x16, 1f",
        "blr x16",
        "mov x30, x15",
        "ret",
        "1:",
        "movz x9, #5",
        "ret"
    ),
    snippet!("sn_ret", "movz x9, #6", "ret"),
    snippet!(
        "sn_ldr_w",
        "ldr w9, 1f",
        "ret",
        ".p2align 3",
        "1:",
        ".quad 0xfedcba9876543210"
    ),
    snippet!(
        "sn_ldr_x",
        "ldr x9, 1f",
        "ret",
        ".p2align 3",
        "1:",
        ".quad 0xfedcba9876543210"
    ),
    snippet!(
        "sn_ldrsw",
        "ldrsw x9, 1f",
        "ret",
        ".p2align 3",
        "1:",
        ".quad 0x00000000f6543210"
    ),
    snippet!(
        "sn_prfm",
        "prfm pldl1keep, 1f",
        "movz x9, #7",
        "ret",
        ".p2align 3",
        "1:",
        ".quad 0"
    ),
    snippet!(
        "sn_ldr_s",
        "ldr s1, 1f",
        "fmov w9, s1",
        "ret",
        ".p2align 3",
        "1:",
        ".quad 0x0123456789abcdef"
    ),
    snippet!(
        "sn_ldr_d",
        "ldr d1, 1f",
        "fmov x9, d1",
        "ret",
        ".p2align 3",
        "1:",
        ".quad 0x0123456789abcdef"
    ),
    snippet!(
        "sn_ldr_q",
        "ldr q1, 1f",
        "fmov x9, d1",
        "mov x10, v1.d[1]",
        "ret",
        ".p2align 4",
        "1:",
        ".quad 0x0123456789abcdef",
        ".quad 0x1122334455667788"
    ),
    // Register 31 of a SIMD literal load is v31, not xzr.
    snippet!(
        "sn_ldr_q31",
        "ldr q31, 1f",
        "fmov x9, d31",
        "mov x10, v31.d[1]",
        "ret",
        ".p2align 4",
        "1:",
        ".quad 0x0fedcba987654321",
        ".quad 0x8877665544332211"
    ),
    // Literals that are only 4-aligned (found by fuzzing: the simulator
    // read them with an aligned 8-byte load, undefined behaviour that a
    // debug build stops on).
    snippet!(
        "sn_ldr_x_unaligned",
        "ldr x9, 1f",
        "ret",
        ".p2align 3",
        ".word 0",
        "1:",
        ".quad 0x0123456789abcdef"
    ),
    snippet!(
        "sn_ldr_q_unaligned",
        "ldr q1, 1f",
        "fmov x9, d1",
        "mov x10, v1.d[1]",
        "ret",
        ".p2align 4",
        ".word 0",
        "1:",
        ".quad 0x0fedcba987654321",
        ".quad 0x8877665544332211"
    ),
    snippet!("sn_nop", "nop", "movz x9, #8", "ret"),
    snippet!("sn_bti", "hint #34", "movz x9, #9", "ret"),
    // Out of line: an ordinary instruction, a pre-indexed store pair (the
    // usual function entry), an MRS, a load-acquire.
    snippet!("sn_add", "adds x9, x1, x2", "ret"),
    snippet!(
        "sn_stp",
        "stp x9, x10, [sp, #-16]!",
        "ldp x11, x12, [sp], #16",
        "ret"
    ),
    snippet!("sn_mrs", "mrs x9, tpidr_el0", "ret"),
    snippet!(
        "sn_ldar",
        "sub sp, sp, #16",
        "str x5, [sp]",
        "ldar x9, [sp]",
        "add sp, sp, #16",
        "ret"
    ),
);

unsafe extern "C" {
    fn a64_exec(state: *mut [u64; 32], code: unsafe extern "C" fn());
}

macro_rules! snippets {
    ($($name:ident),+ $(,)?) => {
        unsafe extern "C" { $(fn $name();)+ }
    };
}

snippets!(
    sn_beq,
    sn_bne,
    sn_bcs,
    sn_bcc,
    sn_bmi,
    sn_bpl,
    sn_bvs,
    sn_bvc,
    sn_bhi,
    sn_bls,
    sn_bge,
    sn_blt,
    sn_bgt,
    sn_ble,
    sn_bal,
    sn_b,
    sn_bl,
    sn_cbz_w,
    sn_cbnz_x,
    sn_tbz_0,
    sn_tbnz_63,
    sn_tbz_31,
    sn_adr,
    sn_adrp,
    sn_adr_xzr,
    sn_br,
    sn_blr,
    sn_ret,
    sn_ldr_w,
    sn_ldr_x,
    sn_ldrsw,
    sn_prfm,
    sn_ldr_s,
    sn_ldr_d,
    sn_ldr_q,
    sn_ldr_q31,
    sn_ldr_x_unaligned,
    sn_ldr_q_unaligned,
    sn_nop,
    sn_bti,
    sn_add,
    sn_stp,
    sn_mrs,
    sn_ldar,
);

/// A small deterministic generator (xorshift), for register states.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Register states: random words, with x3/x4 (the compare/test operands)
/// often 0, all-ones or a single bit, and every NZCV combination.
fn states() -> Vec<[u64; 32]> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    (0..64)
        .map(|i| {
            let mut s = [0u64; 32];
            for r in s.iter_mut().take(29) {
                *r = rng.next();
            }
            s[3] = match i % 4 {
                0 => 0,
                1 => 0xffff_ffff_0000_0000,
                2 => 1 << (i % 64),
                _ => s[3],
            };
            s[4] = match i % 3 {
                0 => 1 << 63 | 1,
                1 => 1 << 31,
                _ => s[4],
            };
            s[31] = (i as u64 % 16) << 28;
            s
        })
        .collect()
}

fn run(code: unsafe extern "C" fn(), state: &[u64; 32]) -> [u64; 32] {
    let mut s = *state;
    // SAFETY: the snippets follow the harness's contract (they touch only
    // registers, and the stack below sp symmetrically).
    unsafe { a64_exec(&raw mut s, code) };
    // x30 is the harness's own return address: the same in both runs.
    s
}

/// Runs `code` from every state without and with a probe at `offset`
/// bytes into it, and compares the register files: once with the probe
/// on its breakpoint (the trap path's simulation or out-of-line slot),
/// once optimized (the trampoline's copy or equivalent code).
fn same_with_probe(name: &str, code: unsafe extern "C" fn(), offset: usize) {
    let states = states();
    let plain: Vec<_> = states.iter().map(|s| run(code, s)).collect();
    for trap_only in [true, false] {
        // SAFETY: `offset` starts an instruction of the snippet.
        let mut probe = unsafe { Uprobe::address(code as *const () as usize + offset) };
        if trap_only {
            probe = probe.trap_only();
        }
        let probe = probe
            .attach()
            .unwrap_or_else(|e| panic!("{name}: attach: {e}"));
        let mode = probe.mode();
        match (trap_only, &mode) {
            (true, Mode::Trap(NotOptimized::TrapOnly)) | (false, Mode::Jump(_)) => {}
            // A landing pad stays: the jump after it needs the function.
            (false, Mode::Trap(NotOptimized::LandingPad { .. })) if name.starts_with("bti") => {}
            // SME, or SVE vectors over 128 bits: no trampolines at all.
            (false, Mode::Trap(NotOptimized::VectorState { .. })) => {}
            _ => panic!("{name}: trap-only {trap_only}, mode {mode:?}"),
        }
        for (s, want) in states.iter().zip(&plain) {
            let got = run(code, s);
            for r in 0..32 {
                assert_eq!(
                    got[r], want[r],
                    "{name} ({mode:?}): register {r} differs with the probe (state {s:x?})"
                );
            }
        }
        assert_eq!(probe.hits(), states.len() as u64, "{name} ({mode:?}): hits");
    }
}

#[test]
fn conditional_branches_on_every_condition() {
    let all: [(&str, unsafe extern "C" fn()); 15] = [
        ("b.eq", sn_beq),
        ("b.ne", sn_bne),
        ("b.cs", sn_bcs),
        ("b.cc", sn_bcc),
        ("b.mi", sn_bmi),
        ("b.pl", sn_bpl),
        ("b.vs", sn_bvs),
        ("b.vc", sn_bvc),
        ("b.hi", sn_bhi),
        ("b.ls", sn_bls),
        ("b.ge", sn_bge),
        ("b.lt", sn_blt),
        ("b.gt", sn_bgt),
        ("b.le", sn_ble),
        ("b.al", sn_bal),
    ];
    for (name, f) in all {
        same_with_probe(name, f, 0);
    }
}

#[test]
fn direct_and_register_branches() {
    same_with_probe("b", sn_b, 0);
    same_with_probe("bl", sn_bl, 4);
    same_with_probe("br", sn_br, 4);
    same_with_probe("blr", sn_blr, 8);
    same_with_probe("ret", sn_ret, 4);
}

#[test]
fn compare_and_test_branches() {
    same_with_probe("cbz w", sn_cbz_w, 0);
    same_with_probe("cbnz x", sn_cbnz_x, 0);
    same_with_probe("tbz #0", sn_tbz_0, 0);
    same_with_probe("tbnz #63", sn_tbnz_63, 0);
    same_with_probe("tbz #31", sn_tbz_31, 0);
}

#[test]
fn pc_relative_addresses() {
    same_with_probe("adr", sn_adr, 0);
    same_with_probe("adrp", sn_adrp, 0);
    same_with_probe("adr xzr", sn_adr_xzr, 0);
}

#[test]
fn literal_loads_including_simd() {
    same_with_probe("ldr w", sn_ldr_w, 0);
    same_with_probe("ldr x", sn_ldr_x, 0);
    same_with_probe("ldrsw", sn_ldrsw, 0);
    same_with_probe("prfm", sn_prfm, 0);
    same_with_probe("ldr s", sn_ldr_s, 0);
    same_with_probe("ldr d", sn_ldr_d, 0);
    same_with_probe("ldr q", sn_ldr_q, 0);
    same_with_probe("ldr q31", sn_ldr_q31, 0);
    same_with_probe("ldr x, 4-aligned", sn_ldr_x_unaligned, 0);
    same_with_probe("ldr q, 4-aligned", sn_ldr_q_unaligned, 0);
}

#[test]
fn hints_and_out_of_line_instructions() {
    same_with_probe("nop", sn_nop, 0);
    same_with_probe("bti c", sn_bti, 0);
    same_with_probe("adds", sn_add, 0);
    same_with_probe("stp pre-index", sn_stp, 0);
    same_with_probe("mrs tpidr_el0", sn_mrs, 0);
    same_with_probe("ldar", sn_ldar, 8);
}

/// A slot source that hands out a slot beyond a `B`'s +-128 MiB for a
/// jump back gets an error, not a branch that lands elsewhere (found by
/// fuzzing: the branch's offset was truncated).
#[test]
fn a_jump_back_out_of_reach_is_refused() {
    use uprobe_core::testing::code::analyze;
    let add = 0x8b02_0020_u32.to_le_bytes(); // add x0, x1, x2
    let at = 0x1000_0000_0000_usize;
    for (slot, ok) in [
        (at + (128 << 20) - 8, true),
        (at - (128 << 20) + 8, true),
        (at + (128 << 20) + 8, false),
        (at - (200 << 20), false),
    ] {
        let result = analyze(at, &add, slot);
        assert_eq!(result.is_ok(), ok, "slot {slot:#x}: {result:?}");
        if let Ok(a) = result {
            let code = a.slot_code().expect("run out of line");
            let back = u32::from_le_bytes(code[4..8].try_into().unwrap());
            let offset = i64::from((back << 6) as i32 >> 6) * 4;
            assert_eq!(
                slot as i64 + 4 + offset,
                at as i64 + 4,
                "lands on the next instruction"
            );
        }
    }
}

/// `bc.cond` (FEAT_HBC) is simulated only on a CPU that runs it: elsewhere
/// its encoding is unallocated, and it runs out of line to raise SIGILL
/// as it would in place (found by fuzzing against execution: it was
/// simulated as a branch everywhere).
#[test]
fn bc_cond_is_simulated_only_where_the_cpu_has_it() {
    use uprobe_core::testing::{Class, classify, has_hbc};
    let bc_eq = 0x5400_0050; // bc.eq .+8
    let expected = if has_hbc() {
        Class::Simulated
    } else {
        Class::OutOfLine
    };
    assert_eq!(
        std::mem::discriminant(&classify(bc_eq)),
        std::mem::discriminant(&expected)
    );
    assert!(matches!(classify(0x5400_0040), Class::Simulated), "b.eq");
}

/// `blraa`, `blraaz`, `blrab` and `blrabz` are refused: run out of line,
/// their link register would name the slot, and the callee would return
/// there (found by fuzzing against execution: x30 was the slot's).
#[test]
fn pointer_authenticated_branches_with_link_are_refused() {
    use uprobe_core::testing::{Class, classify};
    for insn in [0xd63f_0bff_u32, 0xd63f_0c1f, 0xd73f_0820, 0xd73f_0c41] {
        assert!(matches!(classify(insn), Class::Refused(_)), "{insn:#010x}");
    }
    // Without a link, they run out of line (they do not depend on where).
    for insn in [0xd61f_081f_u32, 0xd65f_0bff, 0xd71f_0820] {
        assert!(matches!(classify(insn), Class::OutOfLine), "{insn:#010x}");
    }
}
