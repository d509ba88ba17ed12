//! The `hand` rows of `uprobe-nop5` and `uprobe-entry`: the floor of a
//! trap-free hit that hands a handler the full register state. Each
//! function starts with a `jmp` (where the engine writes its own) to a
//! trampoline written by hand next to it: step over the red zone, save
//! the flags, every general-purpose register and `xmm0`-`xmm15` (what
//! the engine's full frame saves), call a handler that adds to a
//! thread-local counter, restore, run the instructions the jump
//! replaced, and jump back. No table, no read section, no consumer list:
//! what is left is the price of the frame and the call, which the
//! engine's full-context hit is measured against.

use super::calls::Calls;
use super::tally;
use crate::harness::Workload;

/// The hand trampoline's body: saves, calls the handler, restores.
macro_rules! hand_frame {
    () => {
        concat!(
            "lea rsp, [rsp - 128]\n",
            "pushfq\n",
            "push rax\n push rcx\n push rdx\n push rbx\n push rbp\n push rsi\n push rdi\n",
            "push r8\n push r9\n push r10\n push r11\n push r12\n push r13\n push r14\n push r15\n",
            "mov rbx, rsp\n",
            "and rsp, -16\n",
            "sub rsp, 256\n",
            "movaps [rsp + 0], xmm0\n movaps [rsp + 16], xmm1\n",
            "movaps [rsp + 32], xmm2\n movaps [rsp + 48], xmm3\n",
            "movaps [rsp + 64], xmm4\n movaps [rsp + 80], xmm5\n",
            "movaps [rsp + 96], xmm6\n movaps [rsp + 112], xmm7\n",
            "movaps [rsp + 128], xmm8\n movaps [rsp + 144], xmm9\n",
            "movaps [rsp + 160], xmm10\n movaps [rsp + 176], xmm11\n",
            "movaps [rsp + 192], xmm12\n movaps [rsp + 208], xmm13\n",
            "movaps [rsp + 224], xmm14\n movaps [rsp + 240], xmm15\n",
            "cld\n",
            "call {handler}\n",
            "movaps xmm0, [rsp + 0]\n movaps xmm1, [rsp + 16]\n",
            "movaps xmm2, [rsp + 32]\n movaps xmm3, [rsp + 48]\n",
            "movaps xmm4, [rsp + 64]\n movaps xmm5, [rsp + 80]\n",
            "movaps xmm6, [rsp + 96]\n movaps xmm7, [rsp + 112]\n",
            "movaps xmm8, [rsp + 128]\n movaps xmm9, [rsp + 144]\n",
            "movaps xmm10, [rsp + 160]\n movaps xmm11, [rsp + 176]\n",
            "movaps xmm12, [rsp + 192]\n movaps xmm13, [rsp + 208]\n",
            "movaps xmm14, [rsp + 224]\n movaps xmm15, [rsp + 240]\n",
            "mov rsp, rbx\n",
            "pop r15\n pop r14\n pop r13\n pop r12\n pop r11\n pop r10\n pop r9\n pop r8\n",
            "pop rdi\n pop rsi\n pop rbp\n pop rbx\n pop rdx\n pop rcx\n pop rax\n",
            "popfq\n",
            "lea rsp, [rsp + 128]\n",
        )
    };
}

core::arch::global_asm!(
    ".text",
    // uprobe-nop5's function, its nop5 replaced by the jump.
    ".globl bench_h_nop5",
    ".type bench_h_nop5, @function",
    "bench_h_nop5:",
    "jmp bench_h_nop5_tramp",
    "2:",
    "ret",
    ".size bench_h_nop5, . - bench_h_nop5",
    "bench_h_nop5_tramp:",
    hand_frame!(),
    "jmp 2b",
    // uprobe-entry's function, its first three instructions (push rbp;
    // mov rbp, rsp; push rbx: 5 bytes) replaced by the jump.
    ".globl bench_h_entry",
    ".type bench_h_entry, @function",
    "bench_h_entry:",
    ".byte 0xe9",
    ".long bench_h_entry_tramp - (. + 4)",
    "3:",
    "mov rbx, rdi",
    "lea rax, [rbx + 1]",
    "pop rbx",
    "pop rbp",
    "ret",
    ".size bench_h_entry, . - bench_h_entry",
    "bench_h_entry_tramp:",
    hand_frame!(),
    "push rbp",
    "mov rbp, rsp",
    "push rbx",
    "jmp 3b",
    handler = sym hand_handler,
);

unsafe extern "C" {
    fn bench_h_nop5();
    fn bench_h_entry();
}

/// The handler the hand trampolines call: one thread-local add.
extern "C" fn hand_handler() {
    tally::add();
}

/// The `hand` row of `uprobe-nop5` (`entry`: of `uprobe-entry`).
pub(super) fn build(entry: bool) -> Box<dyn Workload> {
    Box::new(Calls {
        target: if entry { bench_h_entry } else { bench_h_nop5 },
        guard: tally::ended(),
        check: |&before, ops| {
            let hits = tally::ended() - before;
            if hits >= ops {
                Ok(())
            } else {
                Err(format!("{hits} hits for {ops} calls"))
            }
        },
    })
}
