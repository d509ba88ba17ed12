//! aarch64 trap-free probes: landing pads kept in place with the jump
//! after them (`paciasp`, `pacibsp`, `bti c`), the sites that stay on
//! their breakpoint and why, a handler moving the PC, no trampoline within
//! reach, a BTI-guarded page, threads with every signal blocked, attach/detach churn under
//! callers, and fork. (Every simulated and out-of-line class through an
//! optimized probe is checked register by register in `a64_simulation`.)
#![cfg(target_arch = "aarch64")]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uprobe_core::{Mode, NotOptimized, Reg, Tactic, Uprobe};

mod common;

// Functions with symbols that have sizes (the landing-pad form needs the
// function's extent), each probed by one test only.
macro_rules! function {
    ($name:literal, $($body:literal),+ $(,)?) => {
        concat!(
            ".globl ", $name, "\n",
            ".type ", $name, ", %function\n",
            ".p2align 3\n",
            $name, ":\n",
            $($body, "\n",)+
            ".size ", $name, ", .-", $name, "\n",
        )
    };
}

core::arch::global_asm!(
    ".text",
    function!(
        "j_pac",
        "hint #25", // paciasp
        "stp x29, x30, [sp, #-16]!",
        "add x0, x0, #3",
        "ldp x29, x30, [sp], #16",
        "hint #29", // autiasp
        "ret",
    ),
    function!(
        "j_pacb",
        "hint #27", // pacibsp
        "stp x29, x30, [sp, #-16]!",
        "add x0, x0, #3",
        "ldp x29, x30, [sp], #16",
        "hint #31", // autibsp
        "ret",
    ),
    function!("j_bti", "hint #34", "add x0, x0, #4", "ret"),
    function!(
        "j_pac_inner",
        "hint #25",
        "stp x29, x30, [sp, #-16]!",
        "add x0, x0, #3",
        "ldp x29, x30, [sp], #16",
        "hint #29",
        "ret",
    ),
    function!("j_bti_addr", "hint #34", "add x0, x0, #4", "ret"),
    // A loop back to the instruction after the landing pad.
    function!(
        "j_loop",
        "hint #34",
        "1:",
        "add x0, x0, #1",
        "subs x1, x1, #1",
        "b.ne 1b",
        "ret",
    ),
    function!("j_setpc", "add x0, x0, #6", "ret"),
    function!("j_far", "add x0, x0, #7", "ret"),
    function!("j_blocked", "add x0, x0, #8", "ret"),
    function!("j_churn", "add x0, x0, #9", "ret"),
    function!("j_fork", "add x0, x0, #10", "ret"),
    function!("j_wide", "add x0, x0, #11", "ret"),
    // Returns the stack pointer it runs with; its caller keeps its own in
    // x29 across the call, so a handler may move it.
    function!("j_sp", "mov x0, sp", "ret"),
    function!(
        "j_sp_call",
        "stp x29, x30, [sp, #-16]!",
        "mov x29, sp",
        "bl j_sp",
        "mov sp, x29",
        "ldp x29, x30, [sp], #16",
        "ret",
    ),
);

unsafe extern "C" {
    fn j_pac(x: u64) -> u64;
    fn j_pacb(x: u64) -> u64;
    fn j_bti(x: u64) -> u64;
    fn j_pac_inner(x: u64) -> u64;
    fn j_bti_addr(x: u64) -> u64;
    fn j_loop(x: u64, n: u64) -> u64;
    fn j_setpc(x: u64) -> u64;
    fn j_far(x: u64) -> u64;
    fn j_blocked(x: u64) -> u64;
    fn j_churn(x: u64) -> u64;
    fn j_fork(x: u64) -> u64;
    fn j_wide(x: u64) -> u64;
    fn j_sp_call(x: u64) -> u64;
}

type Fn1 = unsafe extern "C" fn(u64) -> u64;

const PACIASP: u32 = 0xd503_233f;
const PACIBSP: u32 = 0xd503_237f;
const BTI_C: u32 = 0xd503_245f;

/// The tests change what attaches get (no trampoline room): one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether this thread's vector state lets sites be optimized (no SME,
/// SVE vectors of at most 128 bits); otherwise every site reports
/// `NotOptimized::VectorState`, checked by `wide_sve_vectors_keep_breakpoints`.
fn jumps_possible() -> bool {
    let (sve, sme) = vector_extensions();
    // SAFETY: a query of this thread's vector length.
    !sme && (!sve || unsafe { libc::prctl(PR_SVE_GET_VL, 0, 0, 0, 0) } & 0xffff <= 16)
}

const PR_SVE_SET_VL: libc::c_int = 50;
const PR_SVE_GET_VL: libc::c_int = 51;

/// Whether the CPU has SVE, and SME.
fn vector_extensions() -> (bool, bool) {
    const HWCAP_SVE: libc::c_ulong = 1 << 22;
    const HWCAP2_SME: libc::c_ulong = 1 << 23;
    // SAFETY: plain queries.
    unsafe {
        (
            libc::getauxval(libc::AT_HWCAP) & HWCAP_SVE != 0,
            libc::getauxval(libc::AT_HWCAP2) & HWCAP2_SME != 0,
        )
    }
}

/// Takes the file's lock; `None` (with the reason printed) where this
/// machine's vector state keeps every site on its breakpoint.
fn serial_with_jumps() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !jumps_possible() {
        eprintln!(
            "skipped: SME, or SVE vectors over 128 bits (run qemu with sme=off,sve-default-vector-length=16)"
        );
        return None;
    }
    Some(serial())
}

/// An indirect call, as through a function pointer (`blr`: on a
/// BTI-guarded page it must land on a landing pad).
fn call(f: Fn1, x: u64) -> u64 {
    // SAFETY: the functions above take and return a u64.
    unsafe { std::hint::black_box(f)(x) }
}

/// The instruction `offset` bytes into `f`.
fn word(f: Fn1, offset: usize) -> u32 {
    // SAFETY: inside the function's code.
    unsafe { core::ptr::read_volatile((f as usize + offset) as *const u32) }
}

fn is_branch(w: u32) -> bool {
    w & 0xfc00_0000 == 0x1400_0000
}

#[test]
fn landing_pads_stay_in_place_and_the_jump_follows_them() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let cases: [(&str, Fn1, u32, u64); 3] = [
        ("j_pac", j_pac, PACIASP, 3),
        ("j_pacb", j_pacb, PACIBSP, 3),
        ("j_bti", j_bti, BTI_C, 4),
    ];
    for (name, f, pad, add) in cases {
        let (entries, returns, plain_lr) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(true)),
        );
        let (e, r, p) = (entries.clone(), returns.clone(), plain_lr.clone());
        let probe = Uprobe::function(name)
            .unwrap()
            .on_entry(move |cx| {
                assert_eq!(cx.arg(0), Some(10));
                assert_eq!(cx.reg(Reg::Pc), f as usize as u64);
                // After paciasp the link register is signed: the handler
                // sees it authenticated (a user address, no PAC bits).
                if cx.reg(Reg::LR) >> 48 != 0 {
                    p.store(false, SeqCst);
                }
                e.fetch_add(1, SeqCst);
            })
            .on_return(move |cx| {
                r.fetch_add(cx.return_value(), SeqCst);
            })
            .attach()
            .unwrap();
        assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace), "{name}");
        assert_eq!(word(f, 0), pad, "{name}: the landing pad stays");
        assert!(is_branch(word(f, 4)), "{name}: the jump follows it");
        // The return probe's hijacked address is signed again by the
        // trampoline, so the function's `autiasp` accepts it.
        assert_eq!(call(f, 10), 10 + add, "{name}");
        assert_eq!(entries.load(SeqCst), 1, "{name}");
        assert_eq!(returns.load(SeqCst), 10 + add, "{name}");
        assert!(plain_lr.load(SeqCst), "{name}: the handler saw a signed LR");
        assert_eq!((probe.hits(), probe.returns()), (1, 1), "{name}");
        drop(probe);
        assert_eq!(word(f, 0), pad, "{name}");
        assert!(!is_branch(word(f, 4)), "{name}: restored");
        assert_eq!(call(f, 10), 10 + add, "{name}");
    }
}

#[test]
fn sites_that_stay_on_their_breakpoint_say_why() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    // A loop branches back to the instruction after the landing pad.
    let probe = Uprobe::function("j_loop").unwrap().attach().unwrap();
    assert!(
        matches!(
            probe.mode(),
            Mode::Trap(NotOptimized::BranchIntoRange { target, .. })
                if target == j_loop as *const () as usize + 4
        ),
        "{:?}",
        probe.mode()
    );
    // SAFETY: takes and returns u64s.
    assert_eq!(unsafe { j_loop(1, 5) }, 6);
    assert_eq!(probe.hits(), 1);
    drop(probe);
    // A landing pad probed by address alone: no function extent.
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { Uprobe::address(j_bti_addr as *const () as usize) }
        .attach()
        .unwrap();
    assert!(
        matches!(probe.mode(), Mode::Trap(NotOptimized::LandingPad { .. })),
        "{:?}",
        probe.mode()
    );
    assert_eq!(call(j_bti_addr, 1), 5);
    assert_eq!(probe.hits(), 1);
}

#[test]
fn a_handler_that_moves_the_pc_resumes_exactly_there() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    // Returns 99 to the caller without running the function.
    let probe = Uprobe::function("j_setpc")
        .unwrap()
        .on_entry(|cx| {
            let lr = cx.reg(Reg::LR);
            cx.set_reg(Reg::X(0), 99);
            cx.set_reg(Reg::Pc, lr);
        })
        .attach()
        .unwrap();
    assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
    for _ in 0..3 {
        assert_eq!(call(j_setpc, 1), 99);
    }
    assert_eq!(probe.hits(), 3);
    drop(probe);
    assert_eq!(call(j_setpc, 1), 7);
}

#[test]
fn without_a_trampoline_within_reach_the_probe_stays_on_its_breakpoint() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    uprobe_core::testing::no_trampoline_room(true);
    let probe = Uprobe::function("j_far").unwrap().attach();
    uprobe_core::testing::no_trampoline_room(false);
    let probe = probe.unwrap();
    assert_eq!(probe.mode(), Mode::Trap(NotOptimized::NoTrampolineRoom));
    assert_eq!(call(j_far, 1), 8);
    assert_eq!(probe.hits(), 1);
}

#[test]
fn a_thread_with_every_signal_blocked_hits_an_optimized_probe() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let probe = Uprobe::function("j_blocked").unwrap().attach().unwrap();
    assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
    std::thread::spawn(|| {
        // SAFETY: blocking every signal of this thread only.
        unsafe {
            let mut all: libc::sigset_t = core::mem::zeroed();
            libc::sigfillset(&raw mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &raw const all, core::ptr::null_mut());
        }
        for i in 0..100 {
            assert_eq!(call(j_blocked, i), i + 8);
        }
    })
    .join()
    .unwrap();
    assert_eq!(probe.hits(), 100);
}

#[test]
fn attach_and_detach_under_callers() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..2)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut calls = 0u64;
                while !stop.load(SeqCst) {
                    let x = calls * 2 + t;
                    assert_eq!(call(j_churn, x), x + 9);
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut jumps = 0;
    for round in 0..100 {
        if Instant::now() > deadline {
            break;
        }
        let mut probe = Uprobe::function("j_churn").unwrap();
        if round % 3 == 0 {
            probe = probe.trap_only();
        }
        let probe = probe.on_entry(|cx| assert_eq!(cx.reg(Reg::Pc), j_churn as *const () as u64));
        let probe = probe.attach().unwrap();
        jumps += u32::from(probe.mode().is_jump());
        std::thread::sleep(Duration::from_micros(200));
        drop(probe);
    }
    stop.store(true, SeqCst);
    let calls: u64 = callers.into_iter().map(|c| c.join().unwrap()).sum();
    assert!(calls > 0);
    assert!(jumps > 0, "no round was optimized");
}

#[test]
fn a_forked_child_runs_an_optimized_probe() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let probe = Uprobe::function("j_fork").unwrap().attach().unwrap();
    assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
    assert_eq!(call(j_fork, 1), 11);
    // SAFETY: the child calls the probed function, reads counters and
    // `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = call(j_fork, 2) == 12 && probe.hits() == 2;
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    assert!(pid > 0);
    let deadline = Instant::now() + Duration::from_mins(1);
    let mut status = 0;
    // SAFETY: our own child.
    while unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) } == 0 {
        if Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child hung");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status:#x}"
    );
    assert_eq!(call(j_fork, 3), 13);
    assert_eq!(probe.hits(), 2);
}

#[test]
fn a_bti_guarded_page() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let f: Fn1 = common::bti_guarded_function(&[
        BTI_C,
        0x9100_1000, // add x0, x0, #4
        0xd65f_03c0, // ret
    ]);
    // The landing pad itself, by address: it stays a breakpoint (BRK is
    // a valid landing instruction, B is not).
    // SAFETY: the page's first instruction.
    let pad = unsafe { Uprobe::address(f as usize) }.attach().unwrap();
    assert!(
        matches!(pad.mode(), Mode::Trap(NotOptimized::LandingPad { .. })),
        "{:?}",
        pad.mode()
    );
    // The instruction after it: a jump, reached through the landing pad
    // by an indirect call.
    // SAFETY: the page's second instruction.
    let after = unsafe { Uprobe::address(f as usize + 4) }.attach().unwrap();
    assert_eq!(after.mode(), Mode::Jump(Tactic::Replace));
    assert!(is_branch(word(f, 4)));
    assert_eq!(call(f, 38), 42);
    assert_eq!((pad.hits(), after.hits()), (1, 1));
    drop((pad, after));
    assert_eq!(word(f, 0), BTI_C);
    assert_eq!(call(f, 1), 5);
}

#[test]
fn a_probe_on_the_instruction_after_a_landing_pad_takes_the_jump_back() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let f: Fn1 = j_pac_inner;
    let entry = Uprobe::function("j_pac_inner")
        .unwrap()
        .on_return(|cx| assert_eq!(cx.return_value(), 13))
        .attach()
        .unwrap();
    assert_eq!(entry.mode(), Mode::Jump(Tactic::Replace));
    // SAFETY: the instruction after `paciasp`.
    let inner = unsafe { Uprobe::address(f as usize + 4) }.attach().unwrap();
    assert_eq!(
        entry.mode(),
        Mode::Trap(NotOptimized::OtherProbeInRange { at: f as usize + 4 })
    );
    // The entry is a breakpoint again; the inner probe has a jump of its
    // own.
    assert_eq!(word(f, 0) & 0xffe0_001f, 0xd420_0000, "the entry's BRK");
    assert_eq!(inner.mode(), Mode::Jump(Tactic::Replace));
    assert_eq!(call(f, 10), 13);
    assert_eq!((entry.hits(), entry.returns(), inner.hits()), (1, 1, 1));
    drop((entry, inner));
    assert_eq!(word(f, 0), PACIASP);
    assert_eq!(call(f, 10), 13);
}

#[test]
fn wide_sve_vectors_keep_breakpoints() {
    let _one = serial();
    let (sve, sme) = vector_extensions();
    if !sve && !sme {
        eprintln!("skipped: no SVE or SME on this CPU");
        return;
    }
    std::thread::spawn(move || {
        // 256-bit vectors for this thread, where SME does not already
        // rule trampolines out.
        // SAFETY: changes this thread's vector length only.
        let raised = sme || unsafe { libc::prctl(PR_SVE_SET_VL, 32, 0, 0, 0) } >= 0;
        assert!(raised, "PR_SVE_SET_VL failed");
        let probe = Uprobe::function("j_wide").unwrap().attach().unwrap();
        assert!(
            matches!(probe.mode(), Mode::Trap(NotOptimized::VectorState { .. })),
            "{:?}",
            probe.mode()
        );
        assert_eq!(call(j_wide, 1), 12);
        assert_eq!(probe.hits(), 1);
    })
    .join()
    .unwrap();
}

#[test]
fn a_handler_that_moves_only_the_stack_pointer_runs_the_instruction_once() {
    let Some(_one) = serial_with_jumps() else {
        return;
    };
    let plain = call(j_sp_call, 0);
    for trap_only in [false, true] {
        let mut probe = Uprobe::function("j_sp").unwrap();
        if trap_only {
            probe = probe.trap_only();
        }
        let probe = probe
            .on_entry(|cx| {
                let sp = cx.reg(Reg::Sp);
                cx.set_reg(Reg::Sp, sp - 32);
            })
            .attach()
            .unwrap();
        assert_eq!(probe.mode().is_jump(), !trap_only);
        // The displaced `mov x0, sp` runs once, with the handler's stack
        // pointer (not the probe again: that would move it further).
        assert_eq!(call(j_sp_call, 0), plain - 32, "trap-only {trap_only}");
        assert_eq!(probe.hits(), 1, "trap-only {trap_only}");
    }
}
