//! The counting prelude of an x86-64 trampoline (see `crate::site::count`
//! for the protocol): before anything else, the trampoline adds one to
//! its counting probe's counter for the current CPU, inside a
//! restartable sequence of its own, and goes straight on to the
//! relocated code; with no counter in its cell it calls the common
//! routine (`jump_entry`) instead.
//!
//! The prelude touches no flag: `jrcxz` branches, `lea` adds, BMI2's
//! `shrx` and `rorx` shift; the add to the counter is a load, a `lea` and
//! the committing store. So it saves nothing but the three registers it
//! uses (`rax`, `rcx`, `rdx`), below the red zone, and needs no `pushfq`
//! / `popfq` (microcoded, and the dearest part of a frame).
//!
//! ```text
//!   +0  .quad cell; .quad entry        (the common header)
//!  +16  full: pop rdx; pop rax          (the section's exits)
//!  +18  pop rcx                         (the early look's exit)
//!  +19  call [rip + entry pointer]      the common routine
//!  +25  resume: lea rsp, [rsp+128]
//!  +33  jmp copy
//!  +38  the jump's target: lea rsp, [rsp-128]
//!  +43  push rcx
//!  +44  mov rcx, [rip + cell pointer]   the early look: no counter,
//!  +51  mov rcx, [rcx + counter]             no section (a site with a
//!  +55  jrcxz +18                         handler saves 3 stores)
//!  +57  push rax; push rdx
//!  +59  lea rax, [rip + descriptor]     (re)start: arm the section
//!  +66  mov fs:[area+8], rax            rseq->rseq_cs
//!  +75  mov edx, fs:[area+4]            section start: rseq->cpu_id
//!  +83  mov ecx, fs:[flags]             the engine's per-thread flags
//!  +91  mov eax, 63
//!  +96  lea rcx, [rdx + rcx - cpus]     negative iff cpu_id < cpus and
//! +104  shrx rcx, rcx, rax                no flag is set: 1 iff so (an
//! +109  jrcxz full                        unregistered thread's id is
//!                                         2^32 - 1 or - 2; a flag is
//!                                         2^30 or more)
//! +111  mov rax, [rip + cell pointer]
//! +118  mov rcx, [rax + counter]           slot 0 of the counter, or null
//! +122  jrcxz full
//! +124  rorx rdx, rdx, 57               cpu_id * 128 (the slot stride)
//! +130  mov rax, [rcx + rdx]
//! +134  lea rax, [rax + 1]
//! +138  mov [rcx + rdx], rax            the commit
//! +142  pop rdx; pop rax; pop rcx
//! +145  lea rsp, [rsp+128]
//! +153  copy: the relocated code, then the jump back
//!       the abort handler: the signature, then jmp +59
//! +224  the section's descriptor (32 bytes, 32-aligned)
//! ```
//!
//! The early look reads `counter` outside the section only to skip it: the
//! section reads it again, and only that read decides where a hit is
//! counted.
//!
//! The thread's flags (`crate::base::thread`) send a thread that is inside the
//! engine (a handler calling a probed function) or not observed to the
//! full path, which counts the first and not the second: one load and
//! an index in the `lea`, no branch of their own.
//!
//! The counting path runs straight through into the relocated code; the
//! full path lies before it, so that the call's return address (and so
//! where the common routine finds the cell) is the same in every
//! trampoline. Where trampolines do not count (no BMI2, no rseq fences),
//! the jump's target goes straight to the call.

use std::sync::OnceLock;

/// The full path, right after the common header: the registers back,
/// then the call into the engine.
const FULL_AT: usize = crate::arch::CODE_AT;
/// The full path for a thread that saved only `rcx` (the early look).
const FULL_RCX_AT: usize = 18;
const CALL_AT: usize = 19;
/// Where the common routine returns to (past the call).
pub(crate) const RESUME_AT: usize = 25;
/// The full path's jump to the relocated code.
const JUMP_TO_COPY_AT: usize = 33;
/// Where the site's jump lands.
pub(crate) const ENTRY_AT: usize = 38;
/// The early look at the cell's counter pointer (outside the section).
const EARLY_CHECK_AT: usize = 55;
/// Where the prelude starts the section over (re-arming it).
const RESTART_AT: usize = 59;
/// The section: from the CPU id's load to the commit (inclusive).
const START_AT: usize = 75;
const POST_COMMIT_AT: usize = 142;
/// The two `jrcxz full` instructions.
const CPU_CHECK_AT: usize = 109;
const FAST_CHECK_AT: usize = 122;
/// Where the relocated code starts.
pub(crate) const COPY_AT: usize = 153;
/// The section's descriptor, from the end of the trampoline.
const DESCRIPTOR_FROM_END: usize = 32;
/// The abort handler's bytes: the signature glibc registered, as the tail
/// of a `ud1` (a stray jump there faults), then `jmp rel32`.
const ABORT_LEN: usize = 7 + 5;

/// What counting trampolines need of the process, decided once: the rseq
/// area's and the engine's per-thread flags' offsets from the thread
/// pointer, and the possible CPUs (the counters' CPU slots).
#[derive(Clone, Copy)]
struct Counting {
    area: i32,
    flags: i32,
    cpus: u32,
}

fn counting() -> Option<Counting> {
    static COUNTING: OnceLock<Option<Counting>> = OnceLock::new();
    *COUNTING.get_or_init(|| {
        // BMI2 (`shrx`, `rorx`): CPUID leaf 7, EBX bit 8 (where the
        // processor has leaf 7 at all).
        let bmi2 = core::arch::x86_64::__cpuid(0).eax >= 7
            && core::arch::x86_64::__cpuid_count(7, 0).ebx & (1 << 8) != 0;
        let adder = pcpu::rseq::GatedAdder::get()?;
        Some(Counting {
            area: i32::try_from(adder.area_offset()).ok()?,
            flags: i32::try_from(crate::base::thread::flags_offset()).ok()?,
            cpus: u32::try_from(pcpu::possible_cpus()).ok()?,
        })
        .filter(|_| bmi2)
    })
}

/// Whether trampolines count hits themselves in this process: BMI2, and
/// rseq sections with fences that restart them. Decided once; not
/// async-signal-safe on the first call.
pub(crate) fn enabled() -> bool {
    counting().is_some()
}

/// Whether a counter whose CPU slots are `stride` bytes apart, `cpus` of
/// them, is what the prelude indexes (`rorx ..., 57`: 128 bytes; CPU ids
/// below the possible count).
pub(crate) fn fits(stride: usize, cpus: usize) -> bool {
    counting().is_some_and(|c| stride == 128 && cpus == c.cpus as usize)
}

/// Writes the full path and the prelude into `code` (a trampoline's
/// `code[..COPY_AT]`), given the offsets of the cell pointer, the entry
/// pointer and the cell's counter pointer. The abort handler and the
/// descriptor are [`finish`]'s, once the relocated code's length is
/// known. Not async-signal-safe.
pub(crate) fn prelude(code: &mut [u8], cell_at: usize, entry_at: usize, counter_at: usize) {
    let rel32 = |from_end: usize, to: usize| (to as i32 - from_end as i32).to_le_bytes();
    let rel8 = |from_end: usize, to: usize| (to as isize - from_end as isize) as i8 as u8;
    // The full path: pop rdx; pop rax (for the section's exits); pop rcx
    // (for the early look's), call [rip + entry pointer], lea rsp,
    // [rsp+128], jmp copy.
    code[FULL_AT..CALL_AT].copy_from_slice(&[0x5a, 0x58, 0x59]);
    code[CALL_AT..CALL_AT + 2].copy_from_slice(&[0xff, 0x15]);
    code[CALL_AT + 2..RESUME_AT].copy_from_slice(&rel32(RESUME_AT, entry_at));
    code[RESUME_AT..JUMP_TO_COPY_AT].copy_from_slice(&[0x48, 0x8d, 0xa4, 0x24, 0x80, 0, 0, 0]);
    code[JUMP_TO_COPY_AT] = 0xe9;
    code[JUMP_TO_COPY_AT + 1..ENTRY_AT].copy_from_slice(&rel32(ENTRY_AT, COPY_AT));
    // lea rsp, [rsp-128]
    code[ENTRY_AT..ENTRY_AT + 5].copy_from_slice(&[0x48, 0x8d, 0x64, 0x24, 0x80]);
    let Some(c) = counting() else {
        // jmp rel32 to the call: no counting here.
        code[ENTRY_AT + 5] = 0xe9;
        code[ENTRY_AT + 6..ENTRY_AT + 10].copy_from_slice(&rel32(ENTRY_AT + 10, CALL_AT));
        return;
    };
    // The bytes from +43; `at(p)` is the offset in the trampoline where
    // `p` ends.
    let mut p: Vec<u8> = Vec::with_capacity(COPY_AT - ENTRY_AT);
    let at = |p: &Vec<u8>| ENTRY_AT + 5 + p.len();
    // push rcx; mov rcx, [rip + cell pointer]; mov rcx, [rcx + counter];
    // jrcxz: a site with no counter goes to the call at once, without
    // the section.
    p.push(0x51);
    p.extend_from_slice(&[0x48, 0x8b, 0x0d]);
    let end = at(&p) + 4;
    p.extend_from_slice(&rel32(end, cell_at));
    p.extend_from_slice(&[0x48, 0x8b, 0x49, counter_at as u8]);
    debug_assert_eq!(at(&p), EARLY_CHECK_AT);
    p.extend_from_slice(&[0xe3, rel8(EARLY_CHECK_AT + 2, FULL_RCX_AT)]);
    // push rax; push rdx
    p.extend_from_slice(&[0x50, 0x52]);
    debug_assert_eq!(at(&p), RESTART_AT);
    // lea rax, [rip + descriptor]: patched by `finish`.
    p.extend_from_slice(&[0x48, 0x8d, 0x05, 0, 0, 0, 0]);
    // mov fs:[area + 8], rax
    p.extend_from_slice(&[0x64, 0x48, 0x89, 0x04, 0x25]);
    p.extend_from_slice(&(c.area + 8).to_le_bytes());
    debug_assert_eq!(at(&p), START_AT);
    // mov edx, fs:[area + 4]
    p.extend_from_slice(&[0x64, 0x8b, 0x14, 0x25]);
    p.extend_from_slice(&(c.area + 4).to_le_bytes());
    // mov ecx, fs:[flags]
    p.extend_from_slice(&[0x64, 0x8b, 0x0c, 0x25]);
    p.extend_from_slice(&c.flags.to_le_bytes());
    // mov eax, 63
    p.extend_from_slice(&[0xb8, 63, 0, 0, 0]);
    // lea rcx, [rdx + rcx - cpus]
    p.extend_from_slice(&[0x48, 0x8d, 0x8c, 0x0a]);
    p.extend_from_slice(&(-(c.cpus as i32)).to_le_bytes());
    // shrx rcx, rcx, rax
    p.extend_from_slice(&[0xc4, 0xe2, 0xfb, 0xf7, 0xc9]);
    debug_assert_eq!(at(&p), CPU_CHECK_AT);
    // jrcxz full
    p.extend_from_slice(&[0xe3, rel8(CPU_CHECK_AT + 2, FULL_AT)]);
    // mov rax, [rip + cell pointer]
    p.extend_from_slice(&[0x48, 0x8b, 0x05]);
    let end = at(&p) + 4;
    p.extend_from_slice(&rel32(end, cell_at));
    // mov rcx, [rax + counter]
    p.extend_from_slice(&[0x48, 0x8b, 0x48, counter_at as u8]);
    debug_assert_eq!(at(&p), FAST_CHECK_AT);
    // jrcxz full
    p.extend_from_slice(&[0xe3, rel8(FAST_CHECK_AT + 2, FULL_AT)]);
    // rorx rdx, rdx, 57 (rotate left by 7: * 128)
    p.extend_from_slice(&[0xc4, 0xe3, 0xfb, 0xf0, 0xd2, 57]);
    // mov rax, [rcx + rdx]; lea rax, [rax + 1]; mov [rcx + rdx], rax
    p.extend_from_slice(&[0x48, 0x8b, 0x04, 0x11, 0x48, 0x8d, 0x40, 0x01]);
    p.extend_from_slice(&[0x48, 0x89, 0x04, 0x11]);
    debug_assert_eq!(at(&p), POST_COMMIT_AT);
    p.extend_from_slice(&[0x5a, 0x58, 0x59]);
    // lea rsp, [rsp+128], into the relocated code
    p.extend_from_slice(&[0x48, 0x8d, 0xa4, 0x24, 0x80, 0, 0, 0]);
    debug_assert_eq!(at(&p), COPY_AT);
    code[ENTRY_AT + 5..COPY_AT].copy_from_slice(&p);
}

/// The room the relocated code may take in a trampoline of `size` bytes
/// (the abort handler and the descriptor come after it).
pub(crate) fn copy_room(size: usize) -> usize {
    size - COPY_AT - ABORT_LEN - DESCRIPTOR_FROM_END
}

/// Appends the abort handler after the relocated code (`code` ends with
/// it) and writes the section's descriptor at the end of the trampoline
/// (`code` grows to `size` bytes), for a trampoline at `base`. Nothing
/// where trampolines do not count. Not async-signal-safe.
pub(crate) fn finish(code: &mut Vec<u8>, base: usize, size: usize) {
    if counting().is_none() {
        return;
    }
    code.extend_from_slice(&[0x0f, 0xb9, 0x3d, 0x53, 0x30, 0x05, 0x53]);
    let abort = code.len();
    code.push(0xe9);
    code.extend_from_slice(&(RESTART_AT as i32 - (abort + 5) as i32).to_le_bytes());
    let descriptor = size - DESCRIPTOR_FROM_END;
    assert!(code.len() <= descriptor, "checked by `copy_room`");
    code.resize(descriptor, 0xcc);
    // struct rseq_cs: version 0, flags 0, start_ip, post_commit_offset,
    // abort_ip.
    code.extend_from_slice(&[0; 8]);
    code.extend_from_slice(&((base + START_AT) as u64).to_le_bytes());
    code.extend_from_slice(&((POST_COMMIT_AT - START_AT) as u64).to_le_bytes());
    code.extend_from_slice(&((base + abort) as u64).to_le_bytes());
    // lea rax, [rip + descriptor] at the restart.
    let lea_end = RESTART_AT + 7;
    code[RESTART_AT + 3..lea_end]
        .copy_from_slice(&(descriptor as i32 - lea_end as i32).to_le_bytes());
}
