//! Return probes without the engine at their entry: the entry routine a
//! trampoline calls when its site's only consumer is a return probe with
//! no entry handler, no thread filter, and returns that hold nothing
//! (`JumpCell::returns`, see `crate::hit::returns`). Where the engine's
//! entry saves every register, enters Rust and runs the hit, this one
//! saves six registers and the status flags (as the timed entry,
//! `super::timing`, whose start it shares), then:
//! - goes to the engine wherever the timed entry does (inside the
//!   engine, not observed, no stack of pending returns, no stub yet for
//!   the return address), and where the thread's pending returns are
//!   full or their top is not a frame below this one (abandoned or
//!   chained frames: the engine sorts those out);
//! - reads the probe's switch and its generation and counts the hit in
//!   the probe's per-CPU counters (`return_hits`) inside one restartable
//!   sequence that reads the cell again, so that once a detach has
//!   cleared it and fenced, no hit is counted, and the switch and
//!   generation are those of the probe the hit was counted for (a thread
//!   without a sequence goes to the engine);
//! - pushes the pending return as the engine's `prepare` would: its
//!   slot, then the depth, then the slot again (a signal handler's push
//!   in between cannot leave its slot there), then the probed function,
//!   the original return address, a zero cookie, that switch and
//!   generation (the switch cleared if the cell no longer names it: the
//!   probe was detached during the call, and the return names nothing),
//!   nothing charged;
//! - replaces the return address with the stub, restores, and returns
//!   into the trampoline, which runs the relocated code.
//!
//! A detach after the count: the hit is counted, and the return names
//! nothing (as a detach during the call does), or, should the switch have
//! been given back and turned on for another probe since, a generation
//! that is no longer the switch's: no handler of the other probe runs
//! for it. (Reading the switch after the count let a thread preempted
//! between the two count a hit for one probe and track its return for
//! the next.) The return goes through the stub to the engine's return
//! trampoline (`super::timing`'s return routine sends it there: the
//! pending return is the engine's), which runs the handler with the
//! full `ReturnContext`.

use super::timing::{entry_routine, restore_for_entry, sequence_start};
use crate::base::abi::{
    JUMP_CELL_RETURN_HITS_AT as RETURN_HITS_AT, JUMP_CELL_RETURNS_AT as RETURNS_CELL_AT,
    MAX_RETURN_DEPTH, RETURN_CHARGED_AT, RETURN_COOKIE_AT, RETURN_FUNC_AT, RETURN_GENERATION_AT,
    RETURN_RET_AT, RETURN_SIZE, RETURN_SLOT_AT, RETURN_SWITCH_AT, RETURNS_AT, RETURNS_DEPTH_AT,
};

/// The routine's address (what a trampoline's header names while its
/// cell has a return probe's switch).
pub(super) fn routine() -> usize {
    uprobe_core_return_probe_entry as *const () as usize
}

unsafe extern "C" {
    fn uprobe_core_return_probe_entry();
}

// On entry: [rsp] = the trampoline's resume address, the red zone below
// the probed stack pointer stepped over. After the start the timed entry
// shares (`entry_routine`): rsi = the thread's pending returns, r8 = the
// slot of the return address, rdi = its stub.
entry_routine!(
    "uprobe_core_return_probe_entry",
    [
        // Full, or a top that is not a frame below this one: the engine's.
        "mov rdx, [rsi + {r_depth}]",
        "cmp rdx, {max_depth}",
        "jae 9f",
        "test rdx, rdx",
        "jz 2f",
        "imul rax, rdx, {size}",
        "cmp [rsi + {instances} - {size} + {slot} + rax], r8",
        "jbe 9f",
        "2:",
        // In a restartable sequence: the probe's switch and its generation
        // (kept below the stack pointer: this routine calls nothing, and a
        // signal frame goes below the red zone), then the hit counted (rcx:
        // slot 0 of the counters, 128 bytes apart). A detach fences the
        // sequence once the cell names neither, so the return tracked
        // below is the one of the probe this hit was counted for.
        sequence_start!(),
        "mov rax, [rcx + {cell_returns}]",
        "test rax, rax",
        "jz 9f",
        "mov [rsp - 8], rax",
        "mov rax, [rax + 8]",
        "mov [rsp - 16], rax",
        "mov rcx, [rcx + {cell_hits}]",
        "test rcx, rcx",
        "jz 9f",
        "shl rdx, 7",
        "mov rax, [rcx + rdx]",
        "lea rax, [rax + 1]",
        "mov [rcx + rdx], rax",
        "5:",
        "mov rcx, [rsp - 8]",
        "mov rdx, [rsp + {resume_slot}]",
        "mov rdx, [rdx - {resume} + {cell}]",
        // Push: the slot, the depth, the slot again, then the rest.
        "mov rax, [rsi + {r_depth}]",
        "imul rax, rax, {size}",
        "lea rax, [rsi + {instances} + rax]",
        "mov [rax + {slot}], r8",
        "add qword ptr [rsi + {r_depth}], 1",
        "mov [rax + {slot}], r8",
        "mov rdx, [rdx]",
        "mov [rax + {func}], rdx",
        "mov rdx, [r8]",
        "mov [rax + {ret}], rdx",
        "mov qword ptr [rax + {cookie}], 0",
        "mov word ptr [rax + {charged}], 0",
        "mov [rax + {switch}], rcx",
        "mov rdx, [rsp - 16]",
        "mov [rax + {generation}], rdx",
        // Still the cell's switch: else the probe was detached during the
        // call, and the return names nothing.
        "mov rdx, [rsp + {resume_slot}]",
        "mov rdx, [rdx - {resume} + {cell}]",
        "cmp rcx, [rdx + {cell_returns}]",
        "je 1f",
        "mov qword ptr [rax + {switch}], 0",
        "1:",
        // Return through the stub from now on.
        "mov [r8], rdi",
        restore_for_entry!(),
        "ret",
    ],
    cell_returns = const RETURNS_CELL_AT,
    cell_hits = const RETURN_HITS_AT,
    r_depth = const RETURNS_DEPTH_AT,
    instances = const RETURNS_AT,
    size = const RETURN_SIZE,
    max_depth = const MAX_RETURN_DEPTH,
    slot = const RETURN_SLOT_AT,
    func = const RETURN_FUNC_AT,
    ret = const RETURN_RET_AT,
    cookie = const RETURN_COOKIE_AT,
    charged = const RETURN_CHARGED_AT,
    switch = const RETURN_SWITCH_AT,
    generation = const RETURN_GENERATION_AT,
);
