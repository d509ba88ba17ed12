//! The x86-64 restartable sequences.
//!
//! Each critical section follows the kernel's ABI (`include/uapi/linux/rseq.h`):
//! - a `struct rseq_cs` descriptor (version 0, flags 0, `start_ip`,
//!   `post_commit_offset`, `abort_ip`), 32-byte aligned, in the `__rseq_cs`
//!   section (and its address in `__rseq_cs_ptr_array`, where debuggers and
//!   uprobe-core look for critical sections that must not be probed);
//! - on entry the descriptor's address is stored into the thread's
//!   `rseq->rseq_cs`; from `start_ip` on, the section reads `rseq->cpu_id`
//!   itself, so "which CPU" and "the update" are one atomic unit;
//! - the section ends with exactly one store, the commit; preemption,
//!   migration or signal delivery before it makes the kernel move the
//!   instruction pointer to `abort_ip`;
//! - `abort_ip` is preceded by the 4-byte signature glibc registered
//!   (`0x53053053`, encoded as the tail of `ud1 0x53053053(%rip),%edi` so a
//!   stray jump there faults), and simply restarts the section.
//!
//! Labels: `3` descriptor, `2` (re)start, `4` `start_ip`, `5` post-commit
//! (and the end of the block), `6` abort, `7` slow-path exit, `9` empty exit. Numeric labels
//! are local, so inlining the functions many times is fine.

use core::arch::asm;

/// The operation committed (also `GatedAdd::Added`).
pub(crate) const DONE: u32 = 0;
/// `pop` found the current CPU's list empty.
pub(crate) const EMPTY: u32 = 1;
/// The operation did not run: the CPU id is not below `cpus` (hotplug, or
/// this thread's rseq registration failed) or the slot's lock word is set.
pub(crate) const SLOW: u32 = 2;

/// Shared head of every critical section: descriptor, registration,
/// start label.
macro_rules! rseq_cs_prologue {
    () => {
        rseq_cs_prologue!("shl ${shift}, {slot}\n")
    };
    ($scale:expr) => {
        concat!(
            ".pushsection __rseq_cs, \"aw\"\n",
            ".balign 32\n",
            "3:\n",
            ".long 0, 0\n",
            ".quad 4f, 5f - 4f, 6f\n",
            ".popsection\n",
            ".pushsection __rseq_cs_ptr_array, \"aw\"\n",
            ".quad 3b\n",
            ".popsection\n",
            "xor {rc:e}, {rc:e}\n",
            "2:\n",
            "lea 3b(%rip), {tmp}\n",
            "mov {tmp}, %fs:8({area})\n",
            "4:\n",
            // slot = base + (cpu_id << shift), or the slow exit if out of range
            "mov %fs:4({area}), {slot:e}\n",
            "cmp {cpus:e}, {slot:e}\n",
            "jae 7f\n",
            $scale,
            "add {base}, {slot}\n",
        )
    };
}

/// Shared tail: the post-commit label, where the success path simply falls
/// out of the block, and, out of line in the `__rseq_failure` section (as
/// librseq does, to keep the hot path free of taken jumps): the signature,
/// the abort handler (restart) and the slow and empty exits.
macro_rules! rseq_cs_epilogue {
    () => {
        concat!(
            "5:\n",
            ".pushsection __rseq_failure, \"ax\"\n",
            ".byte 0x0f, 0xb9, 0x3d\n",
            ".long 0x53053053\n",
            "6:\n",
            "jmp 2b\n",
            "7:\n",
            "mov $2, {rc:e}\n",
            "jmp 5b\n",
            "9:\n",
            "mov $1, {rc:e}\n",
            "jmp 5b\n",
            ".popsection\n",
        )
    };
}

/// log2 of the distance between the slots of a `PerCpu<AtomicU64>`: the
/// counter sections shift instead of multiplying, which frees a register.
const COUNTER_STRIDE_SHIFT: u32 = {
    let stride = size_of::<crossbeam_utils::CachePadded<core::sync::atomic::AtomicU64>>();
    assert!(stride.is_power_of_two());
    stride.trailing_zeros()
};

/// log2 of the distance between the slots of a list's `PerCpu` of heads
/// (each a few words, cache-padded like a counter): the list sections
/// shift too. The stacks check their heads' layout against it
/// ([`LIST_STRIDE`]).
const LIST_STRIDE_SHIFT: u32 = COUNTER_STRIDE_SHIFT;

/// The distance between the heads of the lists the sections below take.
pub(crate) const LIST_STRIDE: usize = 1 << LIST_STRIDE_SHIFT;

/// `*(u64 *)slot(cpu) += delta` on the current CPU's slot.
///
/// # Safety
/// `area` is glibc's `__rseq_offset` (so `%fs:area` is the calling
/// thread's registered rseq area); `base + (i << COUNTER_STRIDE_SHIFT)`
/// for every `i < cpus` is a valid, 8-byte aligned `u64` written only by
/// rseq operations of CPU `i`.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn add(area: isize, base: *const u8, cpus: u32, delta: u64) -> u32 {
    let rc: u32;
    // SAFETY: the caller's contract; the section touches only the rseq
    // area and the current CPU's slot.
    unsafe {
        asm!(
            rseq_cs_prologue!("shl ${shift}, {slot}\n"),
            "add {delta}, ({slot})",
            rseq_cs_epilogue!(),
            area = in(reg) area, base = in(reg) base, shift = const COUNTER_STRIDE_SHIFT,
            cpus = in(reg) cpus, delta = in(reg) delta,
            tmp = out(reg) _, slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
    }
    rc
}

/// `((u64 *)slot(cpu))[word] += delta`: [`add`] on word `word` of slots
/// that hold several counters (one cache line per CPU for all of them).
///
/// # Safety
/// As for [`add`], for every `u64` at `base + (i << COUNTER_STRIDE_SHIFT) + 8 * word`.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn add_word(
    area: isize,
    base: *const u8,
    cpus: u32,
    word: usize,
    delta: u64,
) -> u32 {
    let rc: u32;
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            rseq_cs_prologue!("shl ${shift}, {slot}\n"),
            "add {delta}, ({slot}, {word}, 8)",
            rseq_cs_epilogue!(),
            area = in(reg) area, base = in(reg) base, shift = const COUNTER_STRIDE_SHIFT,
            cpus = in(reg) cpus, word = in(reg) word, delta = in(reg) delta,
            tmp = out(reg) _, slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
    }
    rc
}

/// `*(u64 *)slot(cpu) += delta`, but only if `*gate == 0` when the commit
/// happens (returns `EMPTY` without writing anything otherwise). Because
/// the gate is read inside the critical section, a writer that sets the
/// gate and then restarts every CPU's critical sections
/// (`MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ`) knows that no add can commit
/// afterwards having seen the gate open.
///
/// # Safety
/// As for [`add`]; `gate` is a valid, aligned `u32`.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn add_if_zero(
    area: isize,
    base: *const u8,
    cpus: u32,
    gate: *const u32,
    delta: u64,
) -> u32 {
    let rc: u32;
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            rseq_cs_prologue!("shl ${shift}, {slot}\n"),
            "cmpl $0, ({gate})",
            "jne 9f",
            "add {delta}, ({slot})",
            rseq_cs_epilogue!(),
            area = in(reg) area, base = in(reg) base, shift = const COUNTER_STRIDE_SHIFT,
            cpus = in(reg) cpus, gate = in(reg) gate, delta = in(reg) delta,
            tmp = out(reg) _, slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
    }
    rc
}

/// The lock-word check of the locked lists' sections: the slow exit if
/// the slot's lock (at `slot + 8`) is set.
macro_rules! lock_check {
    () => {
        "cmpq $0, 8({slot})\njne 7f\n"
    };
}

/// The body of [`push`] and [`bare_push`]: `$check` runs first (the lock
/// check, or nothing for a bare list).
macro_rules! push_section {
    ($check:expr, $area:expr, $base:expr, $cpus:expr, $node:expr, $next:expr) => {{
        let rc: u32;
        asm!(
            rseq_cs_prologue!(),
            $check,
            "mov ({slot}), {tmp}",
            "mov {tmp}, ({next})",
            "mov {node}, ({slot})",
            rseq_cs_epilogue!(),
            area = in(reg) $area, base = in(reg) $base, shift = const LIST_STRIDE_SHIFT,
            cpus = in(reg) $cpus, node = in(reg) $node, next = in(reg) $next,
            tmp = out(reg) _, slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
        rc
    }};
}

/// Pushes `node` on the current CPU's list: `*next_field = head; head = node`,
/// unless the slot's lock word (at `slot + 8`) is set.
///
/// # Safety
/// As for [`add`], with each slot a `(head, lock)` pair of words; `node`
/// is owned by the caller and `next_field` is its link word.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn push(
    area: isize,
    base: *const u8,
    cpus: u32,
    node: usize,
    next_field: *mut usize,
) -> u32 {
    // SAFETY: the caller's contract. The store to `next_field` may be
    // repeated on restart, which is harmless: the node is not yet visible.
    unsafe { push_section!(lock_check!(), area, base, cpus, node, next_field) }
}

/// [`push`] that also clears the slot's `u32` empty flag (at `slot + 16`)
/// and then sets the list's bit (the CPU id) in the bitmap at `summary`,
/// before the commit, when the list was empty (the head it already loaded
/// is 0): a set flag always describes an empty list, so only that
/// transition can find it set, and the common case costs a predicted
/// branch on a register. Neither store is the commit: a section aborted
/// after them leaves the flag clear, and the bit set, on a list that may be
/// empty, which only costs a remote pop a wasted look (never a hidden
/// node); a restarted section sets them again (`lock bts` is idempotent).
/// The flag is visible before the bit (the locked instruction drains the
/// store buffer), so whoever clears the bit and then finds the flag clear
/// knows to set it back.
///
/// # Safety
/// As for [`push`], with each slot a `(head, lock, empty flag)` triple;
/// `summary` is a bitmap with a bit for every CPU below `cpus`, written
/// only with locked instructions.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn push_clearing_flag(
    area: isize,
    base: *const u8,
    cpus: u32,
    node: usize,
    next_field: *mut usize,
    summary: *const u64,
) -> u32 {
    let rc: u32;
    // SAFETY: as for `push`; the bit written is the current CPU's, which
    // is below `cpus` (checked by the prologue).
    unsafe {
        asm!(
            rseq_cs_prologue!(),
            lock_check!(),
            "mov ({slot}), {tmp}",
            "mov {tmp}, ({next})",
            "test {tmp}, {tmp}",
            "jnz 1f",
            "movl $0, 16({slot})",
            "mov %fs:4({area}), {tmp:e}",
            "lock btsq {tmp}, ({summary})",
            "1:",
            "mov {node}, ({slot})",
            rseq_cs_epilogue!(),
            area = in(reg) area, base = in(reg) base, shift = const LIST_STRIDE_SHIFT,
            cpus = in(reg) cpus, node = in(reg) node, next = in(reg) next_field,
            summary = in(reg) summary,
            tmp = out(reg) _, slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
    }
    rc
}

/// Sets the current CPU's empty flag (the `u32` at `slot + 16`), after
/// clearing the list's bit (the CPU id) in the bitmap at `summary`, if at
/// the commit its list is empty and unlocked:
/// `if head == 0 { bit = 0; flag = 1 }`. Returns `DONE` when it set the
/// flag, `EMPTY` when the list was not empty (nothing written), `SLOW`
/// when the list was locked.
///
/// Because the flag is the commit and the head is read in the same
/// section, a set flag always describes an empty list at that instant;
/// every push clears it before linking a node. A section aborted after
/// the bit's clearing leaves the bit clear on a list that was empty; the
/// next push into it sets it again.
///
/// # Safety
/// As for [`push_clearing_flag`].
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn mark_empty(
    area: isize,
    base: *const u8,
    cpus: u32,
    summary: *const u64,
) -> u32 {
    let rc: u32;
    // SAFETY: the caller's contract; the section reads the slot's head and
    // lock and writes only its flag and its CPU's summary bit.
    unsafe {
        asm!(
            rseq_cs_prologue!(),
            lock_check!(),
            "cmpq $0, ({slot})",
            "jne 9f",
            "mov %fs:4({area}), {tmp:e}",
            "lock btrq {tmp}, ({summary})",
            "movl $1, 16({slot})",
            rseq_cs_epilogue!(),
            area = in(reg) area, base = in(reg) base, shift = const LIST_STRIDE_SHIFT,
            cpus = in(reg) cpus, summary = in(reg) summary,
            tmp = out(reg) _, slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
    }
    rc
}

/// [`push`] of a list without a lock word (a `PerCpu<AtomicUsize>` of
/// heads that no other CPU ever writes): the floor the locked lists are
/// measured against.
///
/// # Safety
/// As for [`push`], with each slot a head word only.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn bare_push(
    area: isize,
    base: *const u8,
    cpus: u32,
    node: usize,
    next_field: *mut usize,
) -> u32 {
    // SAFETY: as for `push`.
    unsafe { push_section!("", area, base, cpus, node, next_field) }
}

/// The body of [`pop`] and [`bare_pop`]: `$check` runs first (the lock
/// check, or nothing for a bare list).
macro_rules! pop_section {
    ($check:expr, $area:expr, $base:expr, $cpus:expr, $off:expr) => {{
        let rc: u32;
        let node: usize;
        let next: usize;
        asm!(
            rseq_cs_prologue!(),
            $check,
            "mov ({slot}), {node}",
            "test {node}, {node}",
            "jz 9f",
            "mov ({node}, {off}), {next}",
            "mov {next}, ({slot})",
            rseq_cs_epilogue!(),
            area = in(reg) $area, base = in(reg) $base, shift = const LIST_STRIDE_SHIFT,
            cpus = in(reg) $cpus, off = in(reg) $off,
            node = out(reg) node, next = out(reg) next, tmp = out(reg) _,
            slot = out(reg) _, rc = out(reg) rc,
            options(att_syntax, nostack),
        );
        (rc, node, next)
    }};
}
/// [`pop`] of a list without a lock word (see [`bare_push`]).
///
/// # Safety
/// As for [`bare_push`]; every node in a list has a readable link word
/// at `next_offset`.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn bare_pop(
    area: isize,
    base: *const u8,
    cpus: u32,
    next_offset: usize,
) -> (u32, usize) {
    // SAFETY: as for `pop`.
    let (rc, node, _) = unsafe { pop_section!("", area, base, cpus, next_offset) };
    (rc, node)
}

/// Pops the current CPU's list: `node = head; head = *(node + next_offset)`,
/// with the load of the next pointer inside the critical section (no ABA:
/// nothing else can run on this CPU between the load and the commit).
/// Returns the code, the node (0 unless `DONE`) and the new head (the
/// node's next pointer: 0 when the pop emptied the list).
///
/// # Safety
/// As for [`push`]; every node in a list has a readable link word at
/// `next_offset`.
// Always inlined: a call would cost more than the critical section.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) unsafe fn pop(
    area: isize,
    base: *const u8,
    cpus: u32,
    next_offset: usize,
) -> (u32, usize, usize) {
    // SAFETY: the caller's contract.
    unsafe { pop_section!(lock_check!(), area, base, cpus, next_offset) }
}
