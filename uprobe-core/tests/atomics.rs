//! Atomic read-modify-write instructions (`lock`-prefixed), the segment
//! prefixes 64-bit mode ignores, fences, `stmxcsr` and `xgetbv`, probed:
//! kernel uprobes refuse them all, but here a displaced instruction runs
//! natively at another address (an out-of-line slot or a trampoline,
//! never single-stepped), and nothing in these depends on the address it
//! runs at. What is
//! checked: the atomics stay atomic under threads racing through the
//! probed instruction, on the trap path and through jumps (a whole
//! instruction replaced, and a short one punned).
#![cfg(target_arch = "x86_64")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use common::{HitsPerCall, call, fn_addr, probe_at, same_with_probe};
use uprobe_core::{Mode, Tactic};

core::arch::global_asm!(
    ".data",
    ".balign 64",
    "l_count:",
    ".quad 0",
    ".balign 64",
    "l_cas_word:",
    ".quad 0",
    ".text",
    // lock add qword [rip + l_count], 1 (8 bytes, RIP-relative); rax = rdi
    ".globl l_add",
    "l_add:",
    "lock add qword ptr [rip + l_count], 1",
    "mov rax, rdi",
    "ret",
    // a compare-and-swap loop, the cmpxchg probed inside it (9 bytes,
    // RIP-relative); rax = rdi
    ".globl l_cas",
    "l_cas:",
    "mov rax, [rip + l_cas_word]",
    "2:",
    "lea rcx, [rax + 1]",
    ".globl l_cas_insn",
    "l_cas_insn:",
    "lock cmpxchg [rip + l_cas_word], rcx",
    "jne 2b",
    "mov rax, rdi",
    "ret",
    // lock inc qword [rsi] (4 bytes: too short for a jump, punned)
    ".globl l_inc",
    "l_inc:",
    "lock inc qword ptr [rsi]",
    "mov rax, rdi",
    "ret",
    // lock xadd [rsi], rax (5 bytes); rax = the old value
    ".globl l_xadd",
    "l_xadd:",
    "mov eax, 1",
    ".globl l_xadd_insn",
    "l_xadd_insn:",
    "lock xadd [rsi], rax",
    "ret",
    // notrack (3e) jmp rax: the indirect-branch-tracking prefix of
    // CET-built switch tables, emulated; rax = rdi + 3
    ".globl l_notrack",
    "l_notrack:",
    "lea rax, [rip + 3f]",
    ".globl l_notrack_insn",
    "l_notrack_insn:",
    ".byte 0x3e, 0xff, 0xe0",
    "ud2",
    "3:",
    "lea rax, [rdi + 3]",
    "ret",
    // fences, the MXCSR stored and read back, XCR0 read: rax = rdi +
    // (mxcsr & 0x1f80) + (xcr0 & 3)
    ".globl l_system",
    "l_system:",
    "lfence",
    "mfence",
    "sfence",
    ".globl l_stmxcsr",
    "l_stmxcsr:",
    "stmxcsr [rsp - 8]",
    "mov eax, [rsp - 8]",
    "and eax, 0x1f80",
    "add rdi, rax",
    "xor ecx, ecx",
    ".globl l_xgetbv",
    "l_xgetbv:",
    "xgetbv",
    "and eax, 3",
    "add rax, rdi",
    "ret",
    // es and ss segment overrides on a load and an add (ignored in 64-bit
    // mode), run out of line; rax = rdi + 5
    ".globl l_segments",
    "l_segments:",
    "push 5",
    ".byte 0x26, 0x48, 0x8b, 0x04, 0x24", // mov rax, es:[rsp]
    ".byte 0x36, 0x48, 0x03, 0x3c, 0x24", // add rdi, ss:[rsp]
    "pop rcx",
    "mov rax, rdi",
    "ret",
);

unsafe extern "C" {
    fn l_add(x: u64) -> u64;
    fn l_cas(x: u64) -> u64;
    static l_cas_insn: u8;
    static l_count: AtomicU64;
    static l_cas_word: AtomicU64;
    fn l_notrack(x: u64) -> u64;
    static l_notrack_insn: u8;
    fn l_segments(x: u64) -> u64;
    static l_inc: u8;
    static l_xadd_insn: u8;
    fn l_system(x: u64) -> u64;
    static l_stmxcsr: u8;
    static l_xgetbv: u8;
}

/// `l_inc`'s and `l_xadd`'s counter: `rsi` points at it.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Calls `l_inc` or `l_xadd` (which take the counter in `rsi`).
fn call_on_counter(name: &str) {
    let counter = COUNTER.as_ptr();
    // SAFETY: both functions add 1 to the u64 `rsi` points at (an
    // atomic's storage, only ever accessed atomically) and clobber only
    // rax, as their asm above says; every other register is preserved.
    unsafe {
        match name {
            "l_inc" => core::arch::asm!(
                "call l_inc", in("rsi") counter, inout("rdi") 0u64 => _, out("rax") _,
            ),
            _ => core::arch::asm!("call l_xadd", in("rsi") counter, out("rax") _),
        }
    }
}

/// The probed address of `l_inc` or `l_xadd`.
fn site_of(name: &str) -> usize {
    match name {
        "l_inc" => (&raw const l_inc) as usize,
        _ => (&raw const l_xadd_insn) as usize,
    }
}

/// `threads` threads make `calls` calls each of `call_once` while a
/// probe counts the hits at `at`, first on its breakpoint (trap-only),
/// then as the engine chooses (a jump if it can): the counter the probed
/// instruction adds to gains exactly one a call, and the probe sees every
/// call (`hits_per_call`: once, or more where the instruction is retried
/// in a loop). Returns the second probe's mode.
fn exact_under_threads(
    at: usize,
    counter: &AtomicU64,
    hits_per_call: HitsPerCall,
    call_once: impl Fn() + Sync,
) -> Mode {
    const THREADS: u64 = 2;
    const CALLS: u64 = 20_000;
    let mut mode = None;
    for trap_only in [true, false] {
        let hits = Arc::new(AtomicU64::new(0));
        let probe = probe_at(at);
        let probe = if trap_only { probe.trap_only() } else { probe };
        let seen = Arc::clone(&hits);
        let probe = probe
            .on_entry(move |_| {
                seen.fetch_add(1, SeqCst);
            })
            .attach()
            .unwrap_or_else(|e| panic!("attach at {at:#x}: {e}"));
        let before = counter.load(SeqCst);
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                s.spawn(|| {
                    for _ in 0..CALLS {
                        call_once();
                    }
                });
            }
        });
        assert_eq!(
            counter.load(SeqCst) - before,
            THREADS * CALLS,
            "an atomic add was lost under the probe ({:?})",
            probe.mode()
        );
        let hits = hits.load(SeqCst);
        match hits_per_call {
            HitsPerCall::One => assert_eq!(hits, THREADS * CALLS, "{:?}", probe.mode()),
            HitsPerCall::AtLeastOne => assert!(hits >= THREADS * CALLS, "{:?}", probe.mode()),
        }
        if trap_only {
            assert!(matches!(probe.mode(), Mode::Trap(_)), "{:?}", probe.mode());
        }
        mode = Some(probe.mode());
        probe.detach().unwrap();
    }
    mode.expect("two rounds ran")
}

#[test]
fn a_locked_add_stays_atomic_and_takes_a_jump() {
    // SAFETY: l_count is an 8-byte aligned quad only ever accessed
    // atomically (by l_add's locked add and the loads here).
    let count = unsafe { &l_count };
    let mode = exact_under_threads(fn_addr(l_add), count, HitsPerCall::One, || {
        assert_eq!(call(l_add, 4), 4);
    });
    assert!(
        matches!(mode, Mode::Jump(Tactic::Replace)),
        "an 8-byte locked add takes a jump over itself: {mode:?}"
    );
}

#[test]
fn a_locked_compare_and_swap_inside_its_loop_stays_atomic() {
    // SAFETY: as above, for l_cas_word.
    let word = unsafe { &l_cas_word };
    let at = (&raw const l_cas_insn) as usize;
    // A failed compare-and-swap runs the probed instruction again.
    let mode = exact_under_threads(at, word, HitsPerCall::AtLeastOne, || {
        assert_eq!(call(l_cas, 9), 9);
    });
    assert!(mode.is_jump(), "{mode:?}");
}

#[test]
fn locked_instructions_on_a_register_address_stay_atomic() {
    // A 4-byte `lock inc`, too short for a jump of its own: punned over
    // the bytes after it where a target can be mapped, else on its
    // breakpoint.
    let mode = exact_under_threads(site_of("l_inc"), &COUNTER, HitsPerCall::One, || {
        call_on_counter("l_inc");
    });
    assert!(
        matches!(mode, Mode::Jump(Tactic::Pun { .. }) | Mode::Trap(_)),
        "{mode:?}"
    );
    // A 5-byte `lock xadd`: a jump over itself.
    let mode = exact_under_threads(site_of("l_xadd"), &COUNTER, HitsPerCall::One, || {
        call_on_counter("l_xadd");
    });
    assert!(matches!(mode, Mode::Jump(Tactic::Replace)), "{mode:?}");
}

#[test]
fn ignored_segment_prefixes_are_probed() {
    // The emulated notrack jump, and loads with es/ss overrides run out
    // of line (and the push before them emulated).
    same_with_probe(
        l_notrack,
        (&raw const l_notrack_insn) as usize,
        HitsPerCall::One,
    );
    let segments = fn_addr(l_segments);
    for at in [segments + 2, segments + 7] {
        same_with_probe(l_segments, at, HitsPerCall::One);
    }
    assert_eq!(call(l_segments, 1), 6);
}

/// Fences, `stmxcsr` and `xgetbv` (refused by kernel uprobes, whose
/// tables take all of `0f ae` and `0f 01`), probed on their breakpoints
/// and run out of line: results as unprobed.
#[test]
fn fences_mxcsr_and_xgetbv_are_probed() {
    let system = fn_addr(l_system);
    for at in [
        system,
        system + 3,
        system + 6,
        (&raw const l_stmxcsr) as usize,
        (&raw const l_xgetbv) as usize,
    ] {
        same_with_probe(l_system, at, HitsPerCall::One);
    }
}
