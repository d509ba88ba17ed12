//! Instructions run out of line: relocated into a slot near the code with
//! a jump back. Results identical with and without the probe, including
//! RIP-relative loads and stores, indirect calls and the `rcx` loops (both
//! emulated), and while other threads run the code during attach/detach.
#![cfg(target_arch = "x86_64")]

mod common;

use common::{HitsPerCall, byte_at, fn_addr, probe_at, same_with_probe};

core::arch::global_asm!(
    ".data",
    ".balign 8",
    "x_data:",
    ".quad 1000",
    "x_store:",
    ".quad 0",
    "x_fnptr:",
    ".quad x_helper",
    "x_table:",
    ".quad 0",
    ".quad x_helper",
    "x_jmpptr:",
    ".quad x_ijmp_target",
    ".text",
    // rip-relative lea and load
    ".globl x_lea",
    "x_lea:",
    "lea rax, [rip + x_data]",
    "mov rax, [rax]",
    "add rax, rdi",
    "ret",
    ".globl x_load",
    "x_load:",
    "mov rax, [rip + x_data]",
    "add rax, rdi",
    "ret",
    // rip-relative store
    ".globl x_store_fn",
    "x_store_fn:",
    "mov [rip + x_store], rdi",
    "mov rax, [rip + x_store]",
    "ret",
    // plain register instructions
    ".globl x_add",
    "x_add:",
    "add rdi, 5",
    "mov rax, rdi",
    "ret",
    ".globl x_mov",
    "x_mov:",
    "mov rax, rdi",
    "ret",
    ".globl x_push_imm",
    "x_push_imm:",
    "push 42",
    "pop rax",
    "add rax, rdi",
    "ret",
    ".globl x_sse",
    "x_sse:",
    "movq xmm0, rdi",
    "movq rax, xmm0",
    "ret",
    // indirect calls: through memory (rip-relative) and through a register
    ".globl x_helper",
    "x_helper:",
    "lea rax, [rdi + 9]",
    "ret",
    ".globl x_icall_mem",
    "x_icall_mem:",
    "call [rip + x_fnptr]",
    "ret",
    ".globl x_icall_reg",
    "x_icall_reg:",
    "lea r11, [rip + x_helper]",
    ".globl x_icall_reg_insn",
    "x_icall_reg_insn:",
    "call r11",
    "ret",
    // indirect call through base + index * scale
    ".globl x_icall_sib",
    "x_icall_sib:",
    "lea r10, [rip + x_table]",
    "mov r11, 1",
    ".globl x_icall_sib_insn",
    "x_icall_sib_insn:",
    "call [r10 + r11 * 8]",
    "ret",
    // indirect jumps: through memory and a register
    ".globl x_ijmp_target",
    "x_ijmp_target:",
    "lea rax, [rdi + 11]",
    "ret",
    ".globl x_ijmp_mem",
    "x_ijmp_mem:",
    "jmp [rip + x_jmpptr]",
    ".globl x_ijmp_reg",
    "x_ijmp_reg:",
    "lea r11, [rip + x_ijmp_target]",
    ".globl x_ijmp_reg_insn",
    "x_ijmp_reg_insn:",
    "jmp r11",
    // loop (1 to 8 rounds) and jrcxz
    ".globl x_loop",
    "x_loop:",
    "mov rcx, rdi",
    "and rcx, 7",
    "inc rcx",
    "xor eax, eax",
    "2:",
    "inc rax",
    ".globl x_loop_insn",
    "x_loop_insn:",
    "loop 2b",
    "ret",
    ".globl x_jrcxz",
    "x_jrcxz:",
    "mov rcx, rdi",
    ".globl x_jrcxz_insn",
    "x_jrcxz_insn:",
    "jrcxz 3f",
    "mov eax, 1",
    "ret",
    "3:",
    "mov eax, 2",
    "ret",
    // refused
    ".globl x_hlt",
    "x_hlt:",
    "hlt",
    "ret",
);

unsafe extern "C" {
    fn x_lea(x: u64) -> u64;
    fn x_load(x: u64) -> u64;
    fn x_store_fn(x: u64) -> u64;
    fn x_add(x: u64) -> u64;
    fn x_mov(x: u64) -> u64;
    fn x_push_imm(x: u64) -> u64;
    fn x_sse(x: u64) -> u64;
    fn x_icall_mem(x: u64) -> u64;
    fn x_icall_reg(x: u64) -> u64;
    static x_icall_reg_insn: u8;
    fn x_icall_sib(x: u64) -> u64;
    static x_icall_sib_insn: u8;
    fn x_ijmp_mem(x: u64) -> u64;
    fn x_ijmp_reg(x: u64) -> u64;
    static x_ijmp_reg_insn: u8;
    fn x_loop(x: u64) -> u64;
    static x_loop_insn: u8;
    fn x_jrcxz(x: u64) -> u64;
    static x_jrcxz_insn: u8;
    fn x_hlt(x: u64) -> u64;
}

#[test]
fn relocated_instructions_behave_as_unprobed() {
    for f in [
        x_lea,
        x_load,
        x_store_fn,
        x_add,
        x_mov,
        x_push_imm,
        x_sse,
        x_icall_mem,
    ] {
        same_with_probe(f, fn_addr(f), HitsPerCall::AtLeastOne);
    }
    same_with_probe(
        x_icall_reg,
        (&raw const x_icall_reg_insn) as usize,
        HitsPerCall::AtLeastOne,
    );
    same_with_probe(
        x_icall_sib,
        (&raw const x_icall_sib_insn) as usize,
        HitsPerCall::AtLeastOne,
    );
    same_with_probe(x_ijmp_mem, fn_addr(x_ijmp_mem), HitsPerCall::AtLeastOne);
    same_with_probe(
        x_ijmp_reg,
        (&raw const x_ijmp_reg_insn) as usize,
        HitsPerCall::AtLeastOne,
    );
    same_with_probe(
        x_loop,
        (&raw const x_loop_insn) as usize,
        HitsPerCall::AtLeastOne,
    );
    same_with_probe(
        x_jrcxz,
        (&raw const x_jrcxz_insn) as usize,
        HitsPerCall::AtLeastOne,
    );
}

#[test]
fn reattaching_reuses_the_same_slot_contents() {
    // Its own process: other tests probe and call x_load (its breakpoint and
    // restored byte are checked here).
    test_support::in_own_process("reattaching_reuses_the_same_slot_contents", || {
        // Attach, detach, attach again: the second attach finds the same key
        // (address and bytes) and its slot; results stay right throughout.
        for _ in 0..3 {
            same_with_probe(x_load, fn_addr(x_load), HitsPerCall::AtLeastOne);
        }
    });
}

#[test]
fn refused_instructions_leave_the_code_alone() {
    let at = fn_addr(x_hlt);
    let err = probe_at(at).attach().unwrap_err();
    assert!(err.to_string().contains("hlt"), "{err}");
    assert_eq!(byte_at(at), 0xf4);
}

#[test]
fn out_of_line_under_concurrent_callers() {
    // Its own process: its probes and callers churn on x_load, which other
    // tests probe and call.
    test_support::in_own_process("out_of_line_under_concurrent_callers", || {
        common::churn_under_callers(x_load, |x| 1000 + x, 3, 200);
    });
}
