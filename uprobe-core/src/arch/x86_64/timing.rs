//! Timing probes without the engine (see `crate::site::timing`): the
//! entry routine a trampoline calls when its site's only consumer is a
//! timing probe, and the return routine every stub calls first. Both
//! keep to the thread's own state (its timed calls,
//! `crate::hit::timing`) and restartable sequences for the call count
//! and the histogram: no register frame, no read section,
//! no call into Rust. Whatever they cannot handle goes, with every
//! register as it was, to the engine's routines (`super::jump_entry`,
//! `super::return_entry`), which do the same work the slow way.
//!
//! **The entry** (`uprobe_core_timed_entry`). A trampoline's full path
//! calls through its header's entry pointer; `crate::site::jump::route`
//! points it here while the site's cell names a timing probe's switch
//! (`JumpCell::timed`). It saves six registers and the status flags
//! (`lahf`, `seto`: no `pushfq`/`popfq`), then, in order:
//! - goes to the engine if the thread is inside it or not observed (its
//!   flags word), has no stack of pending returns yet, or the call's
//!   return address has no stub yet in the slot its hash picks first
//!   (the engine makes one), or its timed calls are full, or their top
//!   is not a frame below this one (a chained or abandoned call: the
//!   engine sorts those out);
//! - counts the call in its CPU's cell inside a restartable sequence
//!   that reads the cell's `timed` pointer again (so once a detach has
//!   cleared it and fenced, no call is counted), or goes to the engine
//!   where no sequence runs (an unregistered thread);
//! - pushes the call: its slot, then the depth, then the slot again (a
//!   signal handler's push in between cannot leave its slot there),
//!   then its probe's switch and the switch's generation
//!   (`crate::site::timing`: what lets a detach stop every later write
//!   to the cells), and the TSC;
//! - replaces the return address with the stub, restores, and returns
//!   into the trampoline, which runs the relocated code.
//!
//! **The return** (`uprobe_core_timed_return`). The stubs' `call` comes
//! here (the stub region's pointer). With the thread's stack of pending
//! returns, no instance of the engine's own for this frame (their top's
//! slot above this one), and the top timed call's slot this frame's, it
//! reads the TSC and, for each timed call of this frame (several when
//! chained by tail calls), converts the difference to nanoseconds
//! (`mul`, `shrd`: `crate::base::clock`'s scale), finds its log2 bucket
//! (`lzcnt`) and adds one to it in the current CPU's cell, inside a
//! restartable sequence that first reads the call's switch (nothing if it
//! is off, or on in another generation), and pops the call; then it
//! returns to the stub, whose `jmp` goes on to the stub's target. A
//! thread without a restartable sequence goes to the engine. Anything
//! else goes to `uprobe_core_return_trampoline` with every register and
//! flag as it was.
//!
//! Both are off (straight to the engine) until [`enable`] fills in
//! [`PARAMS`]: where trampolines count (BMI2, rseq with fences), the TSC
//! keeps time, and the processor has `lzcnt`.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::base::abi::{
    JUMP_CELL_TIMED_AT as TIMED_AT, LATENCY_BUCKETS, LATENCY_BUCKETS_AT as BUCKETS_AT,
    LATENCY_CELL_SIZE, MAX_TIMED_DEPTH, RETURN_SIZE, RETURN_SLOT_AT, RETURNS_AT, RETURNS_DEPTH_AT,
    RETURNS_TIMED_AT, TIMED_DEPTH_AT as DEPTH_AT, TIMED_ENTRIES_AT as ENTRIES_AT,
    TIMED_ENTRY_SIZE as ENTRY_SIZE,
};

/// What the routines need of the process, filled in once by [`enable`].
/// `stack` is written last: 0 means off. The return entry
/// (`super::lean_return`) reads it too.
#[repr(C)]
pub(super) struct Params {
    /// The thread's pointer to its pending returns, from the thread
    /// pointer (0: the routines are off).
    pub(super) stack: AtomicI64,
    /// The engine's per-thread flags word, from the thread pointer.
    pub(super) flags: AtomicI64,
    /// The rseq area, from the thread pointer.
    pub(super) area: AtomicI64,
    /// Possible CPUs (the last cell's index).
    pub(super) cpus: AtomicU64,
    /// The TSC's scale (`crate::base::clock::Scale::mult`).
    pub(super) mult: AtomicU64,
    /// The first stub's address.
    pub(super) first_stub: AtomicU64,
}

pub(super) static PARAMS: Params = Params {
    stack: AtomicI64::new(0),
    flags: AtomicI64::new(0),
    area: AtomicI64::new(0),
    cpus: AtomicU64::new(0),
    mult: AtomicU64::new(0),
    first_stub: AtomicU64::new(0),
};

/// Turns the routines on if this process and processor allow them (after
/// `crate::base::clock::init` and the stubs' region, whose first stub is
/// at `first_stub`). Returns the timed entry a trampoline's header may
/// name, if they are on. Not async-signal-safe (the first time).
pub(crate) fn enable(first_stub: usize) -> Option<usize> {
    if PARAMS.stack.load(Ordering::Acquire) != 0 {
        return Some(uprobe_core_timed_entry as *const () as usize);
    }
    // `lzcnt`: CPUID 0x8000_0001, ECX bit 5.
    let lzcnt = core::arch::x86_64::__cpuid(0x8000_0000).eax >= 0x8000_0001
        && core::arch::x86_64::__cpuid(0x8000_0001).ecx & (1 << 5) != 0;
    let (Some(scale), Some(adder)) = (crate::base::clock::counter(), pcpu::rseq::GatedAdder::get())
    else {
        return None;
    };
    if !lzcnt || !super::count::enabled() || first_stub == 0 {
        return None;
    }
    PARAMS.flags.store(
        crate::base::thread::flags_offset() as i64,
        Ordering::Relaxed,
    );
    PARAMS
        .area
        .store(adder.area_offset() as i64, Ordering::Relaxed);
    PARAMS
        .cpus
        .store(pcpu::possible_cpus() as u64, Ordering::Relaxed);
    PARAMS.mult.store(scale.mult, Ordering::Relaxed);
    PARAMS
        .first_stub
        .store(first_stub as u64, Ordering::Relaxed);
    PARAMS.stack.store(
        crate::base::thread::return_stack_offset() as i64,
        Ordering::Release,
    );
    Some(uprobe_core_timed_entry as *const () as usize)
}

/// The address every stub calls.
pub(crate) fn return_routine() -> usize {
    uprobe_core_timed_return as *const () as usize
}

unsafe extern "C" {
    fn uprobe_core_timed_entry();
    fn uprobe_core_timed_return();
}

/// The way out of an entry routine (the timed entry, the return entry):
/// the flags image back into the status flags (`OF` through an `add`
/// that overflows exactly when it was set, then `sahf`), then the
/// registers it saved.
macro_rules! restore_for_entry {
    () => {
        concat!(
            "pop rax\n add al, 0x7f\n sahf\n",
            "pop r8\n pop rdi\n pop rsi\n pop rdx\n pop rax\n pop rcx\n",
        )
    };
}
pub(super) use restore_for_entry;

/// The calling thread's stack of pending returns into rsi, or to `9f`
/// (the engine's) while the routines are off or the thread has none yet.
/// Operand: `params`.
macro_rules! thread_returns {
    () => {
        concat!(
            "mov rsi, [rip + {params}]\n",
            "test rsi, rsi\n",
            "jz 9f\n",
            "mov rsi, fs:[rsi]\n",
            "test rsi, rsi\n",
            "jz 9f\n",
        )
    };
}
pub(super) use thread_returns;

/// An entry routine (the timed entry, the return entry): `$body`
/// between the part they share at the start and at the end.
///
/// The start saves rcx rax rdx rsi rdi r8 and the flags image (ah: SF ZF
/// AF PF CF, al: OF), so that the probed stack pointer is [`PROBED_AT`]
/// above rsp; goes to `9f` (the engine's) if the thread is inside the
/// engine or not observed, has no stack of pending returns yet (rsi once
/// it has), or the call's return address (at r8) has no stub yet in the
/// slot its hash picks first (the engine makes one); else leaves that
/// stub's address in rdi. The end is `9:` (everything back as it was,
/// then the engine's routine), the abort handler of the body's
/// restartable sequence (`6:`, a restart at `3:`), and the sequence's
/// descriptor (`8:`, from `4:` to `5:`). The operands both use are
/// given here; `$operands` are the body's own.
macro_rules! entry_routine {
    ($name:literal, [$($body:expr),* $(,)?], $($operands:tt)*) => {
        core::arch::global_asm!(
            concat!(".pushsection .text.", $name, ",\"ax\",@progbits"),
            ".p2align 4",
            concat!(".globl ", $name),
            concat!(".hidden ", $name),
            concat!($name, ":"),
            "push rcx\n push rax\n push rdx\n push rsi\n push rdi\n push r8",
            "lahf\n seto al\n push rax",
            // Inside the engine, or not observed: the engine's.
            "mov rax, [rip + {params} + {p_flags}]",
            "mov eax, fs:[rax]",
            "test eax, eax",
            "jnz 9f",
            // The thread's pending returns (rsi), none yet: the engine's.
            $crate::arch::x86_64::timing::thread_returns!(),
            // The return address (rdi) and the stub its hash picks first:
            // if that one is not its, the engine's (which finds or makes one).
            "lea r8, [rsp + {probed}]",
            "mov rdi, [r8]",
            "movabs rax, {hash}",
            "imul rax, rdi",
            "shr rax, 40",
            "and eax, {stubs_mask}",
            "lea rdx, [rip + {targets}]",
            "cmp [rdx + rax * 8], rdi",
            "jne 9f",
            "shl rax, 4",
            "add rax, [rip + {params} + {p_first_stub}]",
            "mov rdi, rax",
            $($body,)*
            // The engine's: everything back as it was, then its routine.
            "9:",
            $crate::arch::x86_64::timing::restore_for_entry!(),
            "jmp uprobe_core_jump_entry",
            // The sequence's abort handler: the signature glibc registered,
            // as the tail of a `ud1`, then a restart.
            ".byte 0x0f, 0xb9, 0x3d",
            ".long 0x53053053",
            "6:",
            "jmp 3b",
            ".popsection",
            // The sequence's descriptor (struct rseq_cs).
            concat!(".pushsection .data.rel.ro.", $name, ",\"aw\",@progbits"),
            ".p2align 5",
            "8:",
            ".long 0, 0",
            ".quad 4b",
            ".quad 5b - 4b",
            ".quad 6b",
            ".popsection",
            params = sym $crate::arch::x86_64::timing::PARAMS,
            p_flags = const core::mem::offset_of!($crate::arch::x86_64::timing::Params, flags),
            p_area = const core::mem::offset_of!($crate::arch::x86_64::timing::Params, area),
            p_cpus = const core::mem::offset_of!($crate::arch::x86_64::timing::Params, cpus),
            p_first_stub = const core::mem::offset_of!($crate::arch::x86_64::timing::Params, first_stub),
            targets = sym $crate::base::abi::STUB_TARGETS,
            hash = const $crate::base::abi::STUB_HASH,
            stubs_mask = const $crate::base::abi::MAX_STUBS - 1,
            probed = const $crate::arch::x86_64::timing::PROBED_AT,
            resume_slot = const $crate::arch::x86_64::timing::RESUME_SLOT_AT,
            resume = const $crate::arch::x86_64::count::RESUME_AT,
            cell = const $crate::arch::CELL_AT,
            $($operands)*
        );
    };
}
pub(super) use entry_routine;

/// The start of an entry routine's restartable sequence: arms it
/// (`3:`, where its abort handler restarts), reads the CPU id into rdx
/// at the sequence's start (`4:`), goes to the engine (`9f`) for an id
/// past the possible CPUs (a thread without a registered sequence), and
/// loads the trampoline's cell into rcx. The body goes on with the
/// cell's field it needs and ends the sequence with its commit at `5:`.
macro_rules! sequence_start {
    () => {
        concat!(
            "3:\n",
            "lea rax, [rip + 8f]\n",
            "mov rdx, [rip + {params} + {p_area}]\n",
            "mov fs:[rdx + 8], rax\n",
            "4:\n",
            "mov rdx, [rip + {params} + {p_area}]\n",
            "mov edx, fs:[rdx + 4]\n",
            "cmp rdx, [rip + {params} + {p_cpus}]\n",
            "jae 9f\n",
            "mov rcx, [rsp + {resume_slot}]\n",
            "mov rcx, [rcx - {resume} + {cell}]\n",
        )
    };
}
pub(super) use sequence_start;

/// Where the probed stack pointer (the slot of the call's return
/// address) is, from an entry routine's stack pointer once
/// [`entry_routine`] saved its registers.
pub(super) const PROBED_AT: usize = 7 * 8 + 8 + 128;
/// Where the routine's own return address is, from there: the
/// trampoline's resume point, a fixed distance after its cell pointer.
pub(super) const RESUME_SLOT_AT: usize = 7 * 8;

/// The timed return's way out, as [`restore_for_entry`], with its frame
/// description kept up to date.
macro_rules! restore_for_return {
    () => {
        concat!(
            "pop rax\n .cfi_adjust_cfa_offset -8\n add al, 0x7f\n sahf\n",
            "pop r10\n .cfi_adjust_cfa_offset -8\n pop r9\n .cfi_adjust_cfa_offset -8\n pop r8\n .cfi_adjust_cfa_offset -8\n",
            "pop rdi\n .cfi_adjust_cfa_offset -8\n pop rsi\n .cfi_adjust_cfa_offset -8\n",
            "pop rdx\n .cfi_adjust_cfa_offset -8\n pop rcx\n .cfi_adjust_cfa_offset -8\n",
            "pop rax\n .cfi_adjust_cfa_offset -8\n",
        )
    };
}

// The entry. On entry: [rsp] = the trampoline's resume address, the red
// zone below the probed stack pointer (128 bytes) stepped over. Saved:
// rcx rax rdx rsi rdi r8, then the flags image (ah: SF ZF AF PF CF, al:
// OF), so the probed stack pointer is rsp + 7 * 8 + 8 + 128.
entry_routine!(
    "uprobe_core_timed_entry",
    [
        // The timed calls: full, or a top that is not a frame below this
        // one: the engine's.
        "mov rdx, [rsi + {timed} + {depth}]",
        "cmp rdx, {max_depth}",
        "jae 9f",
        "test rdx, rdx",
        "jz 2f",
        "mov rax, rdx",
        "shl rax, {entry_shift}",
        "cmp [rsi + {timed} + {entries} - {entry_size} + rax], r8",
        "jbe 9f",
        "2:",
        // Count the call (rcx: the cells), in a restartable sequence.
        sequence_start!(),
        "mov rcx, [rcx + {cell_timed}]",
        "test rcx, rcx",
        "jz 9f",
        "mov rcx, [rcx]",
        "test rcx, rcx",
        "jz 9f",
        "imul rdx, rdx, {cell_size}",
        "mov rax, [rcx + rdx]",
        "lea rax, [rax + 1]",
        "mov [rcx + rdx], rax",
        "5:",
        // Push the call: slot, depth, slot again, the probe's switch (read
        // again: a detach since the count leaves it null, and the return
        // then records nothing) and its generation, then the clock.
        "mov rcx, [rsp + {resume_slot}]",
        "mov rcx, [rcx - {resume} + {cell}]",
        "mov rcx, [rcx + {cell_timed}]",
        "mov rdx, [rsi + {timed} + {depth}]",
        "mov rax, rdx",
        "shl rax, {entry_shift}",
        "lea rax, [rsi + {timed} + {entries} + rax]",
        "mov [rax], r8",
        "lea rdx, [rdx + 1]",
        "mov [rsi + {timed} + {depth}], rdx",
        "mov [rax], r8",
        "mov [rax + 16], rcx",
        "test rcx, rcx",
        "jz 1f",
        "mov rdx, [rcx + 8]",
        "mov [rax + 24], rdx",
        // Still the cell's switch after its generation was read: else it may
        // have been given back and turned on for another probe meanwhile,
        // and the call records nothing.
        "mov rdx, [rsp + {resume_slot}]",
        "mov rdx, [rdx - {resume} + {cell}]",
        "cmp rcx, [rdx + {cell_timed}]",
        "je 1f",
        "mov qword ptr [rax + 16], 0",
        "1:",
        "mov rsi, rax",
        "rdtsc",
        "shl rdx, 32",
        "or rax, rdx",
        "mov [rsi + 8], rax",
        // Return through the stub from now on.
        "mov [r8], rdi",
        restore_for_entry!(),
        "ret",
    ],
    cell_timed = const TIMED_AT,
    cell_size = const LATENCY_CELL_SIZE,
    timed = const RETURNS_TIMED_AT,
    depth = const DEPTH_AT,
    entries = const ENTRIES_AT,
    entry_size = const ENTRY_SIZE,
    entry_shift = const ENTRY_SIZE.trailing_zeros(),
    max_depth = const MAX_TIMED_DEPTH,
);

// The return. On entry: [rsp] = the stub's return address (rsp is the
// slot the function's return address was in). Saved: rax rcx rdx rsi rdi
// r8 r9 r10, then the flags image: the slot is rsp + 9 * 8 (r8 from then
// on).
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_timed_return,\"ax\",@progbits",
    ".p2align 4",
    ".globl uprobe_core_timed_return",
    ".hidden uprobe_core_timed_return",
    "uprobe_core_timed_return:",
    ".cfi_startproc",
    "push rax",
    ".cfi_adjust_cfa_offset 8",
    "push rcx",
    ".cfi_adjust_cfa_offset 8",
    "push rdx",
    ".cfi_adjust_cfa_offset 8",
    "push rsi",
    ".cfi_adjust_cfa_offset 8",
    "push rdi",
    ".cfi_adjust_cfa_offset 8",
    "push r8",
    ".cfi_adjust_cfa_offset 8",
    "push r9",
    ".cfi_adjust_cfa_offset 8",
    "push r10",
    ".cfi_adjust_cfa_offset 8",
    "lahf",
    "seto al",
    "push rax",
    ".cfi_adjust_cfa_offset 8",
    // The thread's pending returns (rsi), none yet: the engine's.
    thread_returns!(),
    "lea r8, [rsp + 72]",
    // A thread without a restartable sequence: the engine's.
    "mov rax, [rip + {params} + {p_area}]",
    "mov eax, fs:[rax + 4]",
    "cmp rax, [rip + {params} + {p_cpus}]",
    "jae 9f",
    // An instance of the engine's at or below this frame: the engine's.
    "mov rcx, [rsi + {r_depth}]",
    "test rcx, rcx",
    "jz 2f",
    "imul rcx, rcx, {instance_size}",
    "cmp [rsi + {instances} - {instance_size} + {slot} + rcx], r8",
    "jbe 9f",
    "2:",
    // The top timed call, if it is this frame's; the clock (rdi).
    "mov rcx, [rsi + {timed} + {depth}]",
    "test rcx, rcx",
    "jz 9f",
    "mov rax, rcx",
    "shl rax, {entry_shift}",
    "cmp [rsi + {timed} + {entries} - {entry_size} + rax], r8",
    "jne 9f",
    "rdtsc",
    "shl rdx, 32",
    "or rax, rdx",
    "mov rdi, rax",
    // Each timed call of this frame (several when chained: tail calls),
    // from the top (rcx: the depth): read it, time it, pop it.
    "3:",
    "shl rcx, {entry_shift}",
    "lea rax, [rsi + {timed} + {entries} - {entry_size} + rcx]",
    "mov rdx, [rax + 8]",
    "mov rcx, [rax + 16]",
    "mov r10, [rax + 24]",
    // Nanoseconds since its entry, and their bucket (rdx).
    "mov rax, rdi",
    "sub rax, rdx",
    "mul qword ptr [rip + {params} + {p_mult}]",
    "shrd rax, rdx, 32",
    "lzcnt rax, rax",
    "mov edx, 64",
    "sub edx, eax",
    "mov eax, {last_bucket}",
    "cmp edx, eax",
    "cmova edx, eax",
    // One more in that bucket of the current CPU's cell, in a restartable
    // sequence that reads the probe's switch (rcx): nothing once it is
    // detached (its switch off, or on again for another probe: another
    // generation than the call's, r10), even for a sequence it
    // restarted.
    "test rcx, rcx",
    "jz 7f",
    "4:",
    "lea rax, [rip + 8f]",
    "mov r9, [rip + {params} + {p_area}]",
    "mov fs:[r9 + 8], rax",
    "6:",
    "mov rax, [rcx]",
    "test rax, rax",
    "jz 7f",
    // The generation after the cells: a switch turned on again holds
    // its new generation before its new cells.
    "cmp r10, [rcx + 8]",
    "jne 7f",
    "mov r9d, fs:[r9 + 4]",
    "cmp r9, [rip + {params} + {p_cpus}]",
    "jae 7f",
    "imul r9, r9, {cell_size}",
    "add rax, r9",
    "mov r9, [rax + rdx * 8 + {buckets}]",
    "lea r9, [r9 + 1]",
    "mov [rax + rdx * 8 + {buckets}], r9",
    "7:",
    // Popped once timed: a signal handler's pushes meanwhile go above it.
    "mov rax, [rsi + {timed} + {depth}]",
    "lea rax, [rax - 1]",
    "mov [rsi + {timed} + {depth}], rax",
    // Another timed call of this frame under it?
    "mov rcx, [rsi + {timed} + {depth}]",
    "test rcx, rcx",
    "jz 5f",
    "mov rax, rcx",
    "shl rax, {entry_shift}",
    "cmp [rsi + {timed} + {entries} - {entry_size} + rax], r8",
    "je 3b",
    // Back to the stub, whose `jmp` goes on to its target.
    "5:",
    restore_for_return!(),
    "ret",
    // The engine's: everything back as it was, then its trampoline.
    "9:",
    ".cfi_adjust_cfa_offset 72",
    restore_for_return!(),
    "jmp uprobe_core_return_trampoline",
    // The sequence's abort handler: the signature, then a restart.
    ".byte 0x0f, 0xb9, 0x3d",
    ".long 0x53053053",
    "11:",
    "jmp 4b",
    ".cfi_endproc",
    ".popsection",
    // The sequence's descriptor (struct rseq_cs).
    ".pushsection .data.rel.ro.uprobe_core_timed_return,\"aw\",@progbits",
    ".p2align 5",
    "8:",
    ".long 0, 0",
    ".quad 6b",
    ".quad 7b - 6b",
    ".quad 11b",
    ".popsection",
    params = sym PARAMS,
    p_area = const core::mem::offset_of!(Params, area),
    p_cpus = const core::mem::offset_of!(Params, cpus),
    p_mult = const core::mem::offset_of!(Params, mult),
    r_depth = const RETURNS_DEPTH_AT,
    instances = const RETURNS_AT,
    instance_size = const RETURN_SIZE,
    slot = const RETURN_SLOT_AT,
    timed = const RETURNS_TIMED_AT,
    depth = const DEPTH_AT,
    entries = const ENTRIES_AT,
    entry_size = const ENTRY_SIZE,
    entry_shift = const ENTRY_SIZE.trailing_zeros(),
    cell_size = const LATENCY_CELL_SIZE,
    buckets = const BUCKETS_AT,
    last_bucket = const LATENCY_BUCKETS - 1,
);
