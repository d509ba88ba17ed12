//! Trap-free probes on x86-64: which sites take a jump and why others do
//! not, identical results and registers through a trampoline, handlers
//! that redirect, return probes, and probes hit where signals cannot
//! help (every signal blocked, a replaced SIGTRAP handler, a
//! `posix_spawn` child).
//!
//! `cargo test` runs these tests as threads of one process, and a probe's
//! handlers run for every caller: of the tests that probe one fixture
//! function, one runs in the binary's process and the others each in a
//! process of their own (`test_support::in_own_process`), as do the tests
//! that change process-wide state (SIGTRAP's and SIGSEGV's handlers, a
//! thread blocking every signal, a probe on `execve`).
#![cfg(target_arch = "x86_64")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use common::{byte_at, call, fn_addr};
use uprobe_core::{Mode, NotOptimized, Probe, Reg, Tactic, Uprobe};

core::arch::global_asm!(
    ".text",
    // A 5-byte nop, as USDT and patchable-entry sites have.
    ".globl j_nop5",
    ".type j_nop5, @function",
    "j_nop5:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "lea rax, [rdi + 5]",
    "ret",
    ".size j_nop5, . - j_nop5",
    // Returns its own return address (after a 5-byte nop).
    ".globl j_where",
    ".type j_where, @function",
    "j_where:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "mov rax, [rsp]",
    "ret",
    ".size j_where, . - j_where",
    // A real prologue: push rbp; mov rbp, rsp; push rbx (5 bytes, three
    // instructions).
    ".globl j_prologue",
    ".type j_prologue, @function",
    "j_prologue:",
    "push rbp",
    "mov rbp, rsp",
    "push rbx",
    "mov rbx, rdi",
    "lea rax, [rbx + rbx*2]",
    "pop rbx",
    "pop rbp",
    "ret",
    ".size j_prologue, . - j_prologue",
    // A CET landing pad, then the same prologue.
    ".globl j_endbr",
    ".type j_endbr, @function",
    "j_endbr:",
    "endbr64",
    "push rbp",
    "mov rbp, rsp",
    "push rbx",
    "mov rbx, rdi",
    "lea rax, [rbx + rbx*2]",
    "pop rbx",
    "pop rbp",
    "ret",
    ".size j_endbr, . - j_endbr",
    // A RIP-relative load inside a multi-instruction range.
    ".globl j_riprel",
    ".type j_riprel, @function",
    "j_riprel:",
    "push rbx",
    "mov rax, [rip + j_data]",
    "add rax, rdi",
    "pop rbx",
    "ret",
    ".size j_riprel, . - j_riprel",
    // A call as the last instruction of the range: the callee must return
    // to the original code (and see the original return address).
    ".globl j_call_last",
    ".type j_call_last, @function",
    "j_call_last:",
    "push rbx",
    "call j_helper",
    "add rax, 1",
    "pop rbx",
    "ret",
    ".size j_call_last, . - j_call_last",
    ".globl j_helper",
    ".type j_helper, @function",
    "j_helper:",
    "mov rax, [rsp]",
    "lea rdx, [rip + j_call_last + 6]",
    "sub rax, rdx",
    "add rax, rdi",
    "ret",
    ".size j_helper, . - j_helper",
    // Too short: 4 bytes in all.
    ".globl j_short",
    ".type j_short, @function",
    "j_short:",
    "lea eax, [rdi + 1]",
    "ret",
    ".size j_short, . - j_short",
    // A loop back to the second instruction of the range.
    ".globl j_loop_in",
    ".type j_loop_in, @function",
    "j_loop_in:",
    "xor eax, eax",
    "2:",
    "add rax, 1",
    "sub rdi, 1",
    "jg 2b",
    "ret",
    ".size j_loop_in, . - j_loop_in",
    // An indirect jump made as deep in the stack as instructions of the
    // range are (a jump table could land there).
    ".globl j_indirect",
    ".type j_indirect, @function",
    "j_indirect:",
    "push rbx",
    "mov rax, rdi",
    "lea rcx, [rip + 3f]",
    "jmp rcx",
    "3:",
    "pop rbx",
    "ret",
    ".size j_indirect, . - j_indirect",
    // A sibling call through a register, once the frame is given back:
    // no instruction of the range is at its depth.
    ".globl j_sibling",
    ".type j_sibling, @function",
    "j_sibling:",
    "push rbx",
    "mov rbx, rdi",
    "lea rax, [rip + 3f]",
    "test rbx, rbx",
    "pop rbx",
    "jmp rax",
    ".size j_sibling, . - j_sibling",
    "3:",
    "lea rax, [rdi + 1]",
    "ret",
    // A return inside what the range would be.
    ".globl j_ret_in",
    ".type j_ret_in, @function",
    "j_ret_in:",
    "mov eax, edi",
    "ret",
    "nop",
    "nop",
    "nop",
    ".size j_ret_in, . - j_ret_in",
    // A load at an interior boundary of the range (+1), where a thread
    // can be parked on a missing page.
    ".globl j_park",
    ".type j_park, @function",
    "j_park:",
    "push rbx",
    "mov eax, [rdi]",
    "mov ebx, eax",
    "lea eax, [rbx + 1]",
    "pop rbx",
    "ret",
    ".size j_park, . - j_park",
    // Bytes that do not decode in 64-bit code after the return.
    ".globl j_undecodable",
    ".type j_undecodable, @function",
    "j_undecodable:",
    "push rbx",
    "lea eax, [rdi + 1]",
    "pop rbx",
    "ret",
    ".byte 0x06",
    ".size j_undecodable, . - j_undecodable",
    // Too short, and a jump punned over the 1-byte `xchg` would land 56
    // bytes before it (the displacement is `ret` and three 0xff bytes),
    // in code.
    ".globl j_pun_taken",
    ".type j_pun_taken, @function",
    "j_pun_taken:",
    "xchg eax, edi",
    "ret",
    ".size j_pun_taken, . - j_pun_taken",
    ".byte 0xff, 0xff, 0xff",
    // Indirect calls, through a register and through memory, each
    // followed by a check that the callee returned to the original code:
    // the result is x when it did.
    ".globl j_icall",
    ".type j_icall, @function",
    "j_icall:",
    "lea rax, [rip + j_return_address]",
    "call rax",
    "8:",
    "lea rdx, [rip + 8b]",
    "sub rax, rdx",
    "mov r8, rax",
    "call [rip + j_return_address_ptr]",
    "9:",
    "lea rdx, [rip + 9b]",
    "sub rax, rdx",
    "add rax, r8",
    "add rax, rdi",
    "ret",
    ".size j_icall, . - j_icall",
    ".globl j_return_address",
    ".type j_return_address, @function",
    "j_return_address:",
    "mov rax, [rsp]",
    "ret",
    ".size j_return_address, . - j_return_address",
    // A lone return (a handler's pushed return address can lead here).
    // A 1-byte instruction with no known extent (no symbol size): punned,
    // its jump's tail runs the load and the add after it.
    ".globl j_tail_load",
    "j_tail_load:",
    "nop",
    "mov eax, [rdi]",
    "add eax, 1",
    "ret",
    // A 2-byte instruction with no known extent, then a 3-byte one, then
    // one at +5: past the bytes a jump without prefixes punned over the
    // first spans, inside its tail (which covers what starts before +6).
    ".globl j_tail_wide",
    "j_tail_wide:",
    "mov eax, edi",
    "lea eax, [rax + 1]",
    "add eax, 2",
    "ret",
    ".globl j_ret_only",
    ".type j_ret_only, @function",
    "j_ret_only:",
    "ret",
    ".size j_ret_only, . - j_ret_only",
    // The flags at a 5-byte nop, as a handler may have set them: the
    // carry, the overflow, the direction flag.
    ".globl j_carry",
    ".type j_carry, @function",
    "j_carry:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "setc al",
    "movzx eax, al",
    "ret",
    ".size j_carry, . - j_carry",
    ".globl j_overflow",
    ".type j_overflow, @function",
    "j_overflow:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "seto al",
    "movzx eax, al",
    "ret",
    ".size j_overflow, . - j_overflow",
    ".globl j_direction",
    ".type j_direction, @function",
    "j_direction:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "pushfq",
    "pop rax",
    "shr eax, 10",
    "and eax, 1",
    "cld",
    "ret",
    ".size j_direction, . - j_direction",
    // A one-byte instruction whose pun lands in the code itself: its
    // displacement is `push rbx`'s E9 and the next instruction's first
    // four bytes (`add eax, 0`: 05 00 00 00), 5 bytes on from its end.
    ".globl j_stuck",
    ".type j_stuck, @function",
    "j_stuck:",
    "mov rax, rdi",
    ".globl j_stuck_push",
    "j_stuck_push:",
    "push rbx",
    ".globl j_stuck_add",
    "j_stuck_add:",
    ".byte 0x05, 0x00, 0x00, 0x00, 0x00",
    "pop rbx",
    "lea rax, [rax + 1]",
    "ret",
    ".size j_stuck, . - j_stuck",
    // Where a redirected hit goes.
    ".globl j_elsewhere",
    ".type j_elsewhere, @function",
    "j_elsewhere:",
    "mov eax, 99",
    "ret",
    ".size j_elsewhere, . - j_elsewhere",
    ".data",
    ".balign 8",
    "j_data:",
    ".quad 1000",
    "j_return_address_ptr:",
    ".quad j_return_address",
    ".text",
);

unsafe extern "C" {
    fn j_nop5(x: u64) -> u64;
    fn j_prologue(x: u64) -> u64;
    fn j_riprel(x: u64) -> u64;
    fn j_call_last(x: u64) -> u64;
    fn j_short(x: u64) -> u64;
    fn j_loop_in(x: u64) -> u64;
    fn j_indirect(x: u64) -> u64;
    fn j_sibling(x: u64) -> u64;
    fn j_ret_in(x: u64) -> u64;
    fn j_elsewhere(x: u64) -> u64;
    fn j_park(x: u64) -> u64;
    fn j_endbr(x: u64) -> u64;
    fn j_where(x: u64) -> u64;
    fn j_undecodable(x: u64) -> u64;
    fn j_pun_taken(x: u64) -> u64;
    fn j_ret_only(x: u64) -> u64;
    fn j_tail_load(x: u64) -> u64;
    fn j_tail_wide(x: u64) -> u64;
    fn j_icall(x: u64) -> u64;
    fn j_carry(x: u64) -> u64;
    fn j_overflow(x: u64) -> u64;
    fn j_direction(x: u64) -> u64;
    fn j_stuck(x: u64) -> u64;
    static j_stuck_push: u8;
    static j_stuck_add: u8;
}

/// A probe on `f`'s entry, found through the symbol table (so the
/// function's size is known).
fn at_entry(f: unsafe extern "C" fn(u64) -> u64) -> Uprobe {
    Uprobe::at(fn_addr(f)).unwrap_or_else(|e| panic!("no symbol: {e}"))
}

/// `f` gives the same results with a counting probe on its entry as
/// without, the probe takes the mode `want` says, sees every call with
/// its first argument, and the code is restored after detach.
fn same_through(f: unsafe extern "C" fn(u64) -> u64, jump: bool) {
    same_for(f, jump, &[0, 1, 7, 1 << 40]);
}

/// [`same_through`] for these inputs.
fn same_for(f: unsafe extern "C" fn(u64) -> u64, jump: bool, inputs: &[u64]) {
    let plain: Vec<u64> = inputs.iter().map(|&x| call(f, x)).collect();
    let at = fn_addr(f);
    let original: Vec<u8> = (0..8).map(|i| byte_at(at + i)).collect();
    let sum = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&sum);
    let probe = at_entry(f)
        .on_entry(move |cx| {
            seen.fetch_add(cx.arg(0).unwrap(), SeqCst);
        })
        .attach()
        .unwrap();
    assert_eq!(probe.mode().is_jump(), jump, "mode: {:?}", probe.mode());
    if original[..4] == [0xf3, 0x0f, 0x1e, 0xfa] && jump {
        // The landing pad stays; the jump follows it.
        assert_eq!(byte_at(at), 0xf3);
        assert_eq!(byte_at(at + 4), 0xe9);
    } else if let Mode::Jump(Tactic::Pun { prefixes, .. }) = probe.mode() {
        // Padding prefixes, then the jump.
        assert_eq!(byte_at(at + usize::from(prefixes)), 0xe9);
    } else {
        assert_eq!(byte_at(at), if jump { 0xe9 } else { 0xcc });
    }
    let probed: Vec<u64> = inputs.iter().map(|&x| call(f, x)).collect();
    assert_eq!(probed, plain);
    assert_eq!(probe.hits(), inputs.len() as u64);
    assert_eq!(sum.load(SeqCst), inputs.iter().sum::<u64>());
    probe.detach().unwrap();
    let after: Vec<u8> = (0..8).map(|i| byte_at(at + i)).collect();
    assert_eq!(after, original, "code restored");
    assert_eq!(
        inputs.iter().map(|&x| call(f, x)).collect::<Vec<_>>(),
        plain
    );
}

#[test]
fn a_five_byte_nop_takes_a_jump() {
    same_through(j_nop5, true);
}

#[test]
fn a_prologue_of_three_instructions_takes_a_jump() {
    same_through(j_prologue, true);
}

#[test]
fn a_function_whose_indirect_jump_is_a_sibling_call_takes_a_jump_over_its_prologue() {
    same_through(j_sibling, true);
    let probe = at_entry(j_sibling).attach().unwrap();
    assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
    assert_eq!(call(j_sibling, 41), 42);
}

#[test]
fn an_endbr64_entry_keeps_its_landing_pad() {
    same_through(j_endbr, true);
    // Called indirectly, as IBT checks.
    let f: unsafe extern "C" fn(u64) -> u64 = std::hint::black_box(j_endbr);
    let probe = at_entry(j_endbr).attach().unwrap();
    assert_eq!(call(f, 5), 15);
    assert_eq!(probe.hits(), 1);
}

#[test]
fn a_rip_relative_load_inside_the_range_is_retargeted() {
    same_through(j_riprel, true);
}

#[test]
fn a_call_ending_the_range_returns_to_the_original_code() {
    // j_helper returns (its return address - (j_call_last + 6)) + x: 0
    // plus x when it was called from the original code.
    assert_eq!(call(j_call_last, 5), 6);
    same_through(j_call_last, true);
}

#[test]
fn a_five_byte_nop_without_a_symbol_takes_a_jump() {
    // Its own process: other tests probe and call j_nop5 (hits and modes are
    // exact here).
    test_support::in_own_process("a_five_byte_nop_without_a_symbol_takes_a_jump", || {
        let probe = common::probe_at(fn_addr(j_nop5)).attach().unwrap();
        assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
        assert_eq!(call(j_nop5, 1), 6);
        assert_eq!(probe.hits(), 1);
    });
}

fn refused(f: unsafe extern "C" fn(u64) -> u64) -> NotOptimized {
    let probe = at_entry(f).attach().unwrap();
    let before = call(f, 3);
    let Mode::Trap(why) = probe.mode() else {
        panic!("optimized");
    };
    assert_eq!(byte_at(fn_addr(f)), 0xcc);
    assert_eq!(probe.hits(), 1, "still probed, by its breakpoint");
    drop(probe);
    assert_eq!(call(f, 3), before);
    why
}

#[test]
fn sites_a_jump_over_whole_instructions_refuses_are_punned() {
    // Its own process: other tests probe and call j_prologue and j_short
    // (modes and hits are exact here).
    test_support::in_own_process(
        "sites_a_jump_over_whole_instructions_refuses_are_punned",
        || {
            // Too short, a branch into the range, an indirect jump, a return
            // inside it, bytes that do not decode: the first instruction
            // alone takes a jump punned over the bytes after it, which stay
            // as they are. (j_locked's pun would land in the heap's room to
            // grow.)
            for f in [j_short, j_loop_in, j_indirect, j_ret_in, j_undecodable] {
                // Small inputs: j_loop_in loops that many times.
                same_for(f, true, &[0, 1, 7, 100]);
                let probe = at_entry(f).attach().unwrap();
                assert!(
                    matches!(probe.mode(), Mode::Jump(Tactic::Pun { .. })),
                    "{:?}",
                    probe.mode()
                );
            }
            // Without a symbol the function's extent is unknown: a short
            // first instruction is punned.
            let probe = common::probe_at(fn_addr(j_prologue)).attach().unwrap();
            assert!(common::one_byte_jump(&probe.mode()), "{:?}", probe.mode());
            assert_eq!(call(j_prologue, 2), 6);
            assert_eq!(probe.hits(), 1);
            drop(probe);
            // Where the punned jump could only land on mapped code, the
            // site stays on its breakpoint and says both reasons.
            let why = refused(j_pun_taken);
            assert!(
                matches!(&why, NotOptimized::NoPunTarget { len: 1, instead } if matches!(**instead, NotOptimized::TooShort { .. })),
                "{why:?}"
            );
        },
    );
}

/// Indirect calls run relocated as a push of the original return address
/// and a jump through the same operand: the callee returns to the probed
/// code (`j_icall` returns x only if both callees saw their original
/// return addresses).
#[test]
fn indirect_calls_return_to_the_original_code() {
    // Its own process: exact hits.
    test_support::in_own_process("indirect_calls_return_to_the_original_code", || {
        assert_eq!(call(j_icall, 5), 5);
        let at = fn_addr(j_icall);
        // `call rax` (2 bytes, at +7) and `call [rip + ...]` (6 bytes, at +22).
        for offset in [7, 22] {
            let probe = Uprobe::at(at + offset).unwrap().attach().unwrap();
            assert!(probe.mode().is_jump(), "+{offset}: {:?}", probe.mode());
            assert_eq!(call(j_icall, 5), 5, "+{offset}");
            assert_eq!(call(j_icall, 9), 9, "+{offset}");
            assert_eq!(probe.hits(), 2);
        }
    });
}

/// A handler that moves the stack pointer through a jump (a replaced
/// range and a punned one): up, returning to the caller at once; and
/// down, pushing a return address before redirecting.
#[test]
fn handlers_move_the_stack_pointer_through_a_jump() {
    // Its own process: other tests probe and call j_nop5 and j_short.
    test_support::in_own_process("handlers_move_the_stack_pointer_through_a_jump", || {
        for f in [j_nop5, j_short] {
            let back = at_entry(f)
                .on_entry(|cx| {
                    let rsp = cx.reg(Reg::Rsp);
                    // SAFETY: at entry, [rsp] is the return address.
                    let ret = unsafe { (rsp as *const u64).read() };
                    cx.set_reg(Reg::Rax, 77);
                    cx.set_reg(Reg::Rsp, rsp + 8);
                    cx.set_reg(Reg::Rip, ret);
                })
                .attach()
                .unwrap();
            assert!(back.mode().is_jump(), "{:?}", back.mode());
            assert_eq!(call(f, 1), 77);
            drop(back);
            // j_elsewhere (rax = 99) returns to j_ret_only, which returns
            // to the caller.
            let pushed = at_entry(f)
                .on_entry(|cx| {
                    let rsp = cx.reg(Reg::Rsp) - 8;
                    // SAFETY: the red zone below the probed function's
                    // stack pointer, unused at its entry.
                    unsafe { (rsp as *mut u64).write(fn_addr(j_ret_only) as u64) };
                    cx.set_reg(Reg::Rsp, rsp);
                    cx.set_reg(Reg::Rip, fn_addr(j_elsewhere) as u64);
                })
                .attach()
                .unwrap();
            assert!(pushed.mode().is_jump());
            assert_eq!(call(f, 1), 99);
            assert_eq!(call(f, 5), 99);
            drop(pushed);
            assert_ne!(call(f, 1), 99);
        }
    });
}

#[test]
fn trap_only_keeps_the_breakpoint_and_turns_an_address_back() {
    // Its own process: other tests probe and call j_nop5 (hits and modes are
    // exact here).
    test_support::in_own_process(
        "trap_only_keeps_the_breakpoint_and_turns_an_address_back",
        || {
            let trap = at_entry(j_nop5).trap_only().attach().unwrap();
            assert_eq!(trap.mode(), Mode::Trap(NotOptimized::TrapOnly));
            assert_eq!(byte_at(fn_addr(j_nop5)), 0xcc);
            drop(trap);
            let jump = at_entry(j_nop5).attach().unwrap();
            assert_eq!(jump.mode(), Mode::Jump(Tactic::Replace));
            let trap = at_entry(j_nop5).trap_only().attach().unwrap();
            assert_eq!(jump.mode(), Mode::Trap(NotOptimized::TrapOnly));
            assert_eq!(byte_at(fn_addr(j_nop5)), 0xcc);
            assert_eq!(call(j_nop5, 2), 7);
            assert_eq!((jump.hits(), trap.hits()), (1, 1));
        },
    );
}

#[test]
fn handlers_read_and_write_registers_through_a_trampoline() {
    // Its own process: its handler changes the argument of every call of
    // j_prologue, which other tests make.
    test_support::in_own_process(
        "handlers_read_and_write_registers_through_a_trampoline",
        || {
            let probe = at_entry(j_prologue)
                .on_entry(|cx| {
                    assert_eq!(cx.reg(Reg::Rip), cx.probe_addr() as u64);
                    let x = cx.reg(Reg::Rdi);
                    cx.set_reg(Reg::Rdi, x + 1);
                })
                .attach()
                .unwrap();
            assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
            assert_eq!(call(j_prologue, 10), 33);
        },
    );
}

#[test]
fn flags_a_handler_sets_reach_the_code_through_a_jump() {
    // The way back restores the status flags with `sahf` (OF through an
    // overflowing add), and every flag with `popfq` once a handler changed
    // another one (DF here).
    const CF: u64 = 1;
    const DF: u64 = 1 << 10;
    const OF: u64 = 1 << 11;
    for (f, flag) in [
        (j_carry as unsafe extern "C" fn(u64) -> u64, CF),
        (j_overflow, OF),
        (j_direction, DF),
    ] {
        let set = at_entry(f)
            .on_entry(move |cx| cx.set_reg(Reg::Rflags, cx.reg(Reg::Rflags) | flag))
            .attach()
            .unwrap();
        assert_eq!(set.mode(), Mode::Jump(Tactic::Replace));
        assert_eq!(call(f, 0), 1, "flag {flag:#x} set by the handler");
        set.detach().unwrap();
        let clear = at_entry(f)
            .on_entry(move |cx| cx.set_reg(Reg::Rflags, cx.reg(Reg::Rflags) & !flag))
            .attach()
            .unwrap();
        assert_eq!(call(f, 0), 0, "flag {flag:#x} cleared by the handler");
        clear.detach().unwrap();
    }
}

#[test]
fn a_handler_that_sets_rip_redirects_the_thread() {
    // Its own process: its handler sends every call of j_prologue elsewhere,
    // and other tests call it.
    test_support::in_own_process("a_handler_that_sets_rip_redirects_the_thread", || {
        let probe = at_entry(j_prologue)
            .on_entry(|cx| cx.set_reg(Reg::Rip, j_elsewhere as *const () as u64))
            .attach()
            .unwrap();
        assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
        for _ in 0..3 {
            assert_eq!(call(j_prologue, 10), 99);
        }
    });
}

#[test]
fn the_stack_pointer_is_the_one_at_the_probe() {
    // At the entry, [rsp] is the return address: what the function itself
    // reads there once the probe is done.
    let ret = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&ret);
    let probe = at_entry(j_where)
        .on_entry(move |cx| {
            // SAFETY: at a function's entry rsp points at its return
            // address.
            let r = unsafe { (cx.reg(Reg::Rsp) as *const u64).read() };
            seen.store(r, SeqCst);
        })
        .attach()
        .unwrap();
    assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
    let own = call(j_where, 0);
    assert_eq!(ret.load(SeqCst), own, "the handler saw another stack");
}

#[test]
fn return_probes_through_a_trampoline() {
    // Its own process: other tests call j_prologue (returns are exact here).
    test_support::in_own_process("return_probes_through_a_trampoline", || {
        let returned = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&returned);
        let probe = at_entry(j_prologue)
            .on_entry(|cx| cx.set_cookie(cx.arg(0).unwrap()))
            .on_return(move |cx| {
                seen.fetch_add(cx.return_value() + 1000 * cx.cookie(), SeqCst);
            })
            .attach()
            .unwrap();
        assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
        assert_eq!(call(j_prologue, 2), 6);
        assert_eq!(call(j_prologue, 3), 9);
        assert_eq!(probe.returns(), 2);
        assert_eq!(returned.load(SeqCst), 6 + 2000 + 9 + 3000);
    });
}

#[test]
fn a_thread_with_every_signal_blocked_hits_an_optimized_probe() {
    // Its own process: while its thread blocks every signal, other tests'
    // attaches refuse (AttachError::TrapBlocked) and their jumps' thread
    // checks go unanswered; hits of j_prologue are exact here.
    test_support::in_own_process(
        "a_thread_with_every_signal_blocked_hits_an_optimized_probe",
        || {
            let probe = at_entry(j_prologue).attach().unwrap();
            assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
            let r = std::thread::spawn(|| {
                // SAFETY: blocking every signal of this thread only.
                unsafe {
                    let mut all: libc::sigset_t = core::mem::zeroed();
                    libc::sigfillset(&raw mut all);
                    libc::pthread_sigmask(libc::SIG_BLOCK, &raw const all, core::ptr::null_mut());
                }
                (0..100).map(|x| call(j_prologue, x)).sum::<u64>()
            })
            .join()
            .unwrap();
            assert_eq!(r, 3 * (0..100).sum::<u64>());
            assert_eq!(probe.hits(), 100);
        },
    );
}

#[test]
fn an_optimized_probe_survives_a_replaced_trap_handler() {
    // Its own process: it ignores SIGTRAP for the rest of the process (every
    // later attach fails, breakpoints are disarmed).
    test_support::in_own_process(
        "an_optimized_probe_survives_a_replaced_trap_handler",
        || {
            let probe = at_entry(j_prologue).attach().unwrap();
            // Stays on its breakpoint (no room for a punned jump).
            let trap = at_entry(j_pun_taken).attach().unwrap();
            assert!(!trap.mode().is_jump());
            assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
            // SAFETY: replacing SIGTRAP's disposition (the program's right).
            unsafe { libc::signal(libc::SIGTRAP, libc::SIG_IGN) };
            // The next attach notices, disarms the breakpoint probe only.
            let err = at_entry(j_nop5).attach().unwrap_err();
            assert!(
                matches!(
                    err,
                    uprobe_core::AttachError::TrapHandlerReplaced { disarmed: 1 }
                ),
                "{err}"
            );
            assert!(!trap.is_armed());
            assert!(probe.is_armed());
            assert_eq!(call(j_prologue, 4), 12);
            assert_eq!(probe.hits(), 1);
            assert_eq!(call(j_pun_taken, 4), 4);
            assert_eq!(trap.hits(), 0);
        },
    );
}

#[test]
fn a_spawned_child_runs_through_an_optimized_probe() {
    // Its own process: it probes execve, which a process spawned meanwhile
    // (by test-support's children) runs with every signal blocked.
    test_support::in_own_process("a_spawned_child_runs_through_an_optimized_probe", || {
        // posix_spawn's child shares the parent's memory until it execs:
        // the hit is counted here. `execve` begins with `mov eax, 59`.
        let probe = Uprobe::in_object("libc.so.6", "execve")
            .unwrap()
            .allow_blocked_signal_paths()
            .attach()
            .unwrap();
        if !probe.mode().is_jump() {
            eprintln!("skipped: execve is not optimized here: {:?}", probe.mode());
            return;
        }
        let status = std::process::Command::new("/bin/true").status().unwrap();
        assert!(status.success());
        assert!(probe.hits() >= 1, "the child's execve was not seen");
    });
}

#[test]
fn optimizing_and_unoptimizing_under_callers_thousands_of_times() {
    // Its own process: its probes and callers churn on j_prologue, which
    // other tests probe and call.
    test_support::in_own_process(
        "optimizing_and_unoptimizing_under_callers_thousands_of_times",
        || {
            churn(j_prologue, 2000);
        },
    );
}

#[test]
fn optimizing_after_a_landing_pad_under_callers() {
    // Its own process: its probes and callers churn on j_endbr, which another
    // test probes and calls.
    test_support::in_own_process("optimizing_after_a_landing_pad_under_callers", || {
        churn(j_endbr, 1000);
    });
}

#[test]
fn punned_jumps_under_callers_thousands_of_times() {
    // Its own process: its probes and callers churn on j_short and
    // j_prologue, which other tests probe and call.
    test_support::in_own_process("punned_jumps_under_callers_thousands_of_times", || {
        // A 3-byte instruction punned (its stub reused every round), one
        // round in ten trap-only.
        let jumps = common::churn_with(
            j_short,
            |x| (x + 1) & 0xffff_ffff,
            2,
            2000,
            |round| {
                let probe = at_entry(j_short);
                if round % 10 == 9 {
                    probe.trap_only()
                } else {
                    probe
                }
            },
        );
        assert!(jumps >= 1800, "only {jumps} of 2000 rounds took a jump");
        // A 1-byte `push rbp` punned (without a symbol, so not a range of
        // three instructions).
        let jumps = common::churn_with(
            j_prologue,
            |x| 3 * x,
            2,
            2000,
            |_| common::probe_at(fn_addr(j_prologue)),
        );
        assert_eq!(jumps, 2000);
    });
}

/// Every instruction of `j_prologue` probed (eight sites, most shorter
/// than a jump, each punned over its neighbour's jump or breakpoint),
/// attached and detached one by one in a different order each round,
/// some rounds with a trap-only probe among them, while two threads call
/// the function and check every result: each change of a neighbour's
/// bytes takes the jumps that end in them back and plans them again.
#[test]
fn neighbours_attached_and_detached_under_callers() {
    // Its own process: its probes and callers churn on j_prologue, which
    // other tests probe and call.
    test_support::in_own_process("neighbours_attached_and_detached_under_callers", || {
        let at = fn_addr(j_prologue);
        // push rbp; mov rbp, rsp; push rbx; mov rbx, rdi; lea; pop; pop; ret
        let offsets = [0usize, 1, 4, 5, 8, 12, 13, 14];
        let stop = AtomicBool::new(false);
        let mut most_jumps = 0;
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let stop = &stop;
                s.spawn(move || {
                    let mut x = t;
                    while !stop.load(SeqCst) {
                        assert_eq!(call(j_prologue, x), 3 * x);
                        x = (x + 2) % 1_000_000;
                    }
                });
            }
            let _stop = common::StopOnDrop(&stop);
            let mut order: Vec<usize> = (0..offsets.len()).collect();
            let mut seed = 0x9e37_79b9_u64;
            for round in 0..300 {
                // A new order each round (xorshift), for attach and detach.
                for i in (1..order.len()).rev() {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    order.swap(i, (seed % (i as u64 + 1)) as usize);
                }
                let mut probes: Vec<Option<Probe>> = (0..offsets.len()).map(|_| None).collect();
                for &k in &order {
                    let probe = common::probe_at(at + offsets[k]);
                    let probe = if round % 10 == 9 && k == 3 {
                        probe.trap_only()
                    } else {
                        probe
                    };
                    probes[k] = Some(probe.attach().unwrap());
                }
                let probes: Vec<Probe> = probes.into_iter().map(Option::unwrap).collect();
                let before: Vec<u64> = probes.iter().map(Probe::hits).collect();
                assert_eq!(call(j_prologue, 5), 15);
                for (k, p) in probes.iter().enumerate() {
                    assert!(p.hits() > before[k], "site +{}: a hit was lost", offsets[k]);
                }
                most_jumps = most_jumps.max(probes.iter().filter(|p| p.mode().is_jump()).count());
                let mut probes: Vec<Option<Probe>> = probes.into_iter().map(Some).collect();
                order.reverse();
                for &k in &order {
                    probes[k].take().unwrap().detach().unwrap();
                    assert_eq!(call(j_prologue, 7), 21);
                }
            }
        });
        assert!(most_jumps >= 6, "at most {most_jumps} of 8 sites on jumps");
        // Every byte back.
        assert_eq!(byte_at(at), 0x55);
        assert_eq!(byte_at(at + 1), 0x48);
    });
}

/// Attaches and detaches a probe on `f` (which returns 3x) `rounds` times,
/// one round in ten trap-only, while two threads call it.
fn churn(f: unsafe extern "C" fn(u64) -> u64, rounds: usize) {
    // Multi-instruction range: every optimization checks the callers'
    // threads, which are often stopped inside it.
    let jumps = common::churn_with(
        f,
        |x| 3 * x,
        2,
        rounds,
        |round| {
            let probe = at_entry(f);
            if round % 10 == 9 {
                probe.trap_only()
            } else {
                probe
            }
        },
    );
    println!("{jumps} of {rounds} rounds through a jump");
    assert!(
        jumps > rounds / 2,
        "only {jumps} of {rounds} rounds took a jump"
    );
}

/// userfaultfd, to park a thread on a missing page: the thread stops at
/// the load, an instruction boundary inside the range, and stays there
/// (in the kernel) until the page is filled.
mod uffd {
    const UFFDIO_API: u64 = 0xc018_aa3f;
    const UFFDIO_REGISTER: u64 = 0xc020_aa00;
    const UFFDIO_COPY: u64 = 0xc028_aa03;
    const UFFD_USER_MODE_ONLY: i32 = 1;

    /// A userfaultfd watching one missing anonymous page: (fd, page).
    pub fn missing_page() -> Option<(i32, usize)> {
        // SAFETY: plain system calls on memory and descriptors of ours.
        unsafe {
            let mut fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) as i32;
            if fd < 0 {
                fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | UFFD_USER_MODE_ONLY)
                    as i32;
            }
            if fd < 0 {
                return None;
            }
            let mut api = [0xaa_u64, 0, 0];
            if libc::ioctl(fd, UFFDIO_API as _, api.as_mut_ptr()) != 0 {
                return None;
            }
            let page = libc::mmap(
                core::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if page == libc::MAP_FAILED {
                return None;
            }
            // range (start, len), mode MISSING, ioctls (out)
            let mut reg = [page as u64, 4096, 1, 0];
            if libc::ioctl(fd, UFFDIO_REGISTER as _, reg.as_mut_ptr()) != 0 {
                return None;
            }
            Some((fd, page as usize))
        }
    }

    /// Waits until a thread faults on the page.
    pub fn wait_fault(fd: i32) {
        let mut msg = [0u8; 32];
        // SAFETY: reading one uffd_msg into our buffer.
        let n = unsafe { libc::read(fd, msg.as_mut_ptr().cast(), 32) };
        assert_eq!(n, 32, "uffd read");
        assert_eq!(msg[0], 0x12, "a page fault event");
    }

    /// Fills the page with `value` in its first word, waking the faulting
    /// thread.
    pub fn fill(fd: i32, page: usize, value: u32) {
        let mut src = vec![0u8; 4096];
        src[..4].copy_from_slice(&value.to_le_bytes());
        // dst, src, len, mode, copy (out)
        let mut copy = [page as u64, src.as_ptr() as u64, 4096, 0, 0];
        // SAFETY: UFFDIO_COPY of our buffer into our registered page.
        let rc = unsafe { libc::ioctl(fd, UFFDIO_COPY as _, copy.as_mut_ptr()) };
        assert_eq!(rc, 0, "UFFDIO_COPY");
    }
}

/// A thread parked at an instruction boundary inside the range (its load
/// waits for a missing page) while the site is optimized: the engine
/// must move it to the relocated copy, or it would resume in the middle
/// of the jump. It then finishes its call with the right result.
#[test]
fn a_thread_parked_inside_the_range_is_moved_before_the_jump_is_written() {
    let Some((fd, page)) = uffd::missing_page() else {
        println!("skipped: userfaultfd is not available here");
        return;
    };
    let parked = std::thread::spawn(move || call(j_park, page as u64));
    uffd::wait_fault(fd);
    // The thread is stopped at j_park + 1, inside the 5 bytes the jump
    // replaces (push rbx; mov eax, [rdi]; mov ebx, eax).
    let probe = at_entry(j_park).attach().unwrap();
    assert_eq!(
        probe.mode(),
        Mode::Jump(Tactic::Replace),
        "{:?}",
        probe.mode()
    );
    assert_eq!(byte_at(fn_addr(j_park)), 0xe9);
    uffd::fill(fd, page, 41);
    assert_eq!(parked.join().unwrap(), 42);
    // And the probe works for later calls.
    assert_eq!(call(j_park, page as u64), 42);
    assert_eq!(probe.hits(), 1);
}

/// Attaches `probe`, which must take a jump punned over `written` bytes.
fn attach_punned(probe: Uprobe, written: u8) -> uprobe_core::Probe {
    let probe = probe.attach().unwrap();
    assert!(
        matches!(probe.mode(), Mode::Jump(Tactic::Pun { written: w, .. }) if w == written),
        "{:?}",
        probe.mode()
    );
    probe
}

/// A thread parked on the very instruction a jump is punned over (its
/// load waits for a missing page): it restarts the instruction once the
/// page comes, which now runs through the jump and the relocated load.
#[test]
fn a_thread_parked_on_a_punned_instruction_runs_through_the_jump() {
    // Its own process: other tests probe and call j_park.
    test_support::in_own_process(
        "a_thread_parked_on_a_punned_instruction_runs_through_the_jump",
        || {
            let Some((fd, page)) = uffd::missing_page() else {
                println!("skipped: userfaultfd is not available here");
                return;
            };
            let parked = std::thread::spawn(move || call(j_park, page as u64));
            uffd::wait_fault(fd);
            // `mov eax, [rdi]` (2 bytes) at j_park + 1, where the thread waits.
            let probe = attach_punned(Uprobe::at(fn_addr(j_park) + 1).unwrap(), 2);
            uffd::fill(fd, page, 41);
            assert_eq!(parked.join().unwrap(), 42);
            assert_eq!(probe.hits(), 1, "the restarted load ran through the jump");
            assert_eq!(call(j_park, page as u64), 42);
            assert_eq!(probe.hits(), 2);
        },
    );
}

#[test]
fn a_probe_inside_another_range_leaves_it_a_jump_punned_over_its_own() {
    // Its own process: other tests probe and call j_prologue (modes and hits
    // are exact here).
    test_support::in_own_process(
        "a_probe_inside_another_range_leaves_it_a_jump_punned_over_its_own",
        || {
            let at = fn_addr(j_prologue);
            // The second instruction (mov rbp, rsp) first: the entry cannot
            // take a jump over it, and is punned over its jump instead.
            let inner = Uprobe::at(at + 1).unwrap().attach().unwrap();
            let outer = at_entry(j_prologue).attach().unwrap();
            assert!(
                matches!(inner.mode(), Mode::Jump(Tactic::Pun { .. })),
                "{:?}",
                inner.mode()
            );
            assert_eq!(
                outer.mode(),
                Mode::Jump(Tactic::Pun {
                    written: 1,
                    prefixes: 0
                })
            );
            // The entry's displacement ends in the inner jump's bytes.
            assert_eq!((byte_at(at), byte_at(at + 1)), (0xe9, 0xe9));
            assert_eq!(call(j_prologue, 2), 6);
            assert_eq!((outer.hits(), inner.hits()), (1, 1));
            // Detaching the inner probe changes those bytes: the entry goes
            // back to its breakpoint first, then takes a jump over the
            // original code again.
            drop(inner);
            assert_eq!(outer.mode(), Mode::Jump(Tactic::Replace));
            assert_eq!(call(j_prologue, 2), 6);
            assert_eq!(outer.hits(), 2);
            drop(outer);
            // The entry first, optimized over three instructions; a probe
            // inside its range takes it back, and it is punned over the
            // new probe's jump.
            let outer = at_entry(j_prologue).attach().unwrap();
            assert_eq!(outer.mode(), Mode::Jump(Tactic::Replace));
            let inner = Uprobe::at(at + 1).unwrap().attach().unwrap();
            assert!(outer.mode().is_jump(), "{:?}", outer.mode());
            assert!(inner.mode().is_jump(), "{:?}", inner.mode());
            assert_eq!(call(j_prologue, 2), 6);
            assert_eq!((outer.hits(), inner.hits()), (1, 1));
            // The other order of detaching: the entry's bytes go back, the
            // inner jump stays.
            drop(outer);
            assert!(inner.mode().is_jump(), "{:?}", inner.mode());
            assert_eq!(byte_at(at), 0x55, "push rbp back");
            assert_eq!(call(j_prologue, 2), 6);
            assert_eq!(inner.hits(), 2);
            drop(inner);
            assert_eq!(byte_at(at + 1), 0x48, "mov rbp, rsp back");
        },
    );
}

static FAULT_RIP: AtomicU64 = AtomicU64::new(0);
static VALID: u32 = 9;

extern "C" fn on_segv(_sig: i32, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid ucontext (SA_SIGINFO).
    let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
    FAULT_RIP.store(uc.uc_mcontext.gregs[libc::REG_RIP as usize] as u64, SeqCst);
    // Retry the load with a valid address.
    uc.uc_mcontext.gregs[libc::REG_RDI as usize] = (&raw const VALID) as i64;
}

/// Installs [`on_segv`] as the process's SIGSEGV handler: a test's own,
/// before the engine's fault handlers (installed at the process's first
/// attach), which chain to it.
fn install_on_segv() {
    // SAFETY: a zeroed sigaction is valid; the handler has the SA_SIGINFO
    // signature.
    unsafe {
        let mut sa: libc::sigaction = core::mem::zeroed();
        sa.sa_sigaction = on_segv as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigaction(libc::SIGSEGV, &raw const sa, core::ptr::null_mut());
    }
}

/// A fault raised by a relocated instruction reaches the program's
/// handler at the original instruction, and a handler that returns to
/// retry it finishes the call.
#[test]
fn a_fault_in_a_trampoline_is_reported_at_the_original_instruction() {
    // Its own process: its SIGSEGV handler must come before the engine's
    // fault handlers (installed at the process's first attach), which it
    // would replace for the other tests.
    test_support::in_own_process(
        "a_fault_in_a_trampoline_is_reported_at_the_original_instruction",
        || {
            install_on_segv();
            let probe = at_entry(j_park).attach().unwrap();
            assert_eq!(probe.mode(), Mode::Jump(Tactic::Replace));
            // j_park loads from its argument at j_park + 1.
            assert_eq!(call(j_park, 16), 10);
            assert_eq!(FAULT_RIP.load(SeqCst) as usize, fn_addr(j_park) + 1);
            assert_eq!(probe.hits(), 1);
        },
    );
}

/// The same for an instruction of a punned jump's tail (run in the
/// trampoline after the probed one, so that no hit goes back into the
/// middle of the jump): reported at its own original address.
#[test]
fn a_fault_in_a_punned_jumps_tail_is_reported_at_its_instruction() {
    // Its own process: as above.
    test_support::in_own_process(
        "a_fault_in_a_punned_jumps_tail_is_reported_at_its_instruction",
        || {
            install_on_segv();
            let at = fn_addr(j_tail_load);
            let probe = attach_punned(common::probe_at(at), 1);
            assert_eq!(call(j_tail_load, (&raw const VALID) as u64), 10);
            assert_eq!(FAULT_RIP.load(SeqCst), 0);
            // The load at j_tail_load + 1 faults, in the tail.
            assert_eq!(call(j_tail_load, 16), 10);
            assert_eq!(FAULT_RIP.load(SeqCst) as usize, at + 1);
            assert_eq!(probe.hits(), 2);
        },
    );
}

/// A probe attached at an instruction of a punned jump's tail takes the
/// jump back to its breakpoint first (the trampoline's copy would skip
/// the new probe), and the jump is planned again with a tail that stops
/// before the new probe; both count every call.
#[test]
fn a_probe_in_a_punned_jumps_tail_takes_the_jump_back_and_again() {
    // Its own process: hits are exact.
    test_support::in_own_process(
        "a_probe_in_a_punned_jumps_tail_takes_the_jump_back_and_again",
        || {
            let at = fn_addr(j_tail_wide);
            let outer = attach_punned(common::probe_at(at), 2);
            assert_eq!(call(j_tail_wide, 4), 7);
            let inner = common::probe_at(at + 5).attach().unwrap();
            assert!(
                matches!(outer.mode(), Mode::Jump(Tactic::Pun { written: 2, .. })),
                "{:?}",
                outer.mode()
            );
            assert_eq!(call(j_tail_wide, 4), 7);
            assert_eq!((outer.hits(), inner.hits()), (2, 1));
        },
    );
}

/// A site with no pun target over the original code (its window is the
/// code itself) is planned again when the bytes its pun ends in change:
/// once the next instruction takes a jump, it is punned over that jump
/// (whose stub moves, if need be, to where the pun has room), and when
/// that one is detached it goes back to its breakpoint.
#[test]
fn a_site_without_a_pun_target_is_planned_again_when_the_next_one_changes() {
    test_support::in_own_process(
        "a_site_without_a_pun_target_is_planned_again_when_the_next_one_changes",
        || {
            let (push, add) = (
                &raw const j_stuck_push as usize,
                &raw const j_stuck_add as usize,
            );
            let first = Uprobe::at(push).unwrap().attach().unwrap();
            assert!(
                matches!(first.mode(), Mode::Trap(NotOptimized::NoPunTarget { .. })),
                "{:?}",
                first.mode()
            );
            assert_eq!(call(j_stuck, 41), 42);
            let next = Uprobe::at(add).unwrap().attach().unwrap();
            assert!(next.mode().is_jump(), "{:?}", next.mode());
            assert_eq!(
                first.mode(),
                Mode::Jump(Tactic::Pun {
                    written: 1,
                    prefixes: 0
                })
            );
            assert_eq!((byte_at(push), byte_at(add)), (0xe9, 0xe9));
            for x in 0..100 {
                assert_eq!(call(j_stuck, x), x + 1);
            }
            assert_eq!((first.hits(), next.hits()), (101, 100));
            drop(next);
            assert!(
                matches!(first.mode(), Mode::Trap(NotOptimized::NoPunTarget { .. })),
                "{:?}",
                first.mode()
            );
            assert_eq!(byte_at(add), 0x05, "add eax, 0 back");
            assert_eq!(call(j_stuck, 1), 2);
            assert_eq!(first.hits(), 102);
            drop(first);
            assert_eq!(byte_at(push), 0x53, "push rbx back");
        },
    );
}
