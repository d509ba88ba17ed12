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
//!  +16  lea rsp, [rsp-128]
//!  +21  push rax; push rcx; push rdx
//!  +24  lea rax, [rip + descriptor]     (re)start: arm the section
//!  +31  mov fs:[area+8], rax            rseq->rseq_cs
//!  +40  mov edx, fs:[area+4]            section start: rseq->cpu_id
//!  +48  mov eax, 63
//!  +53  lea rcx, [rdx - cpus]           negative iff cpu_id < cpus
//!  +60  shrx rcx, rcx, rax              1 iff so (an unregistered
//!  +65  jrcxz full                        thread's id is 2^32 - 1 or - 2)
//!  +67  mov rax, [rip + cell pointer]
//!  +74  mov rcx, [rax + fast]           slot 0 of the counter, or null
//!  +78  jrcxz full
//!  +80  rorx rdx, rdx, 57               cpu_id * 128 (the slot stride)
//!  +86  mov rax, [rcx + rdx]
//!  +90  lea rax, [rax + 1]
//!  +94  mov [rcx + rdx], rax            the commit
//!  +98  pop rdx; pop rcx; pop rax
//! +101  jmp resume
//! +103  full: pop rdx; pop rcx; pop rax
//! +106  call [rip + entry pointer]      the common routine
//! +112  resume: lea rsp, [rsp+128]
//! +120  the relocated code, then the jump back
//!       the abort handler: the signature, then jmp +24
//! +224  the section's descriptor (32 bytes, 32-aligned)
//! ```
//!
//! Where trampolines do not count (no BMI2, no rseq fences), the prelude
//! is a jump from +21 to the call.

use std::sync::OnceLock;

/// Where the prelude starts the section over (re-arming it).
const RESTART_AT: usize = 24;
/// The section: from the CPU id's load to the commit (inclusive).
const START_AT: usize = 40;
const POST_COMMIT_AT: usize = 98;
/// The two `jrcxz full` instructions (their rel8 ends the instruction).
const CPU_CHECK_AT: usize = 65;
const FAST_CHECK_AT: usize = 78;
/// The counting path's jump over the full path to `resume`.
const SKIP_FULL_AT: usize = 101;
/// The full path: the registers back, then the call into the engine.
const FULL_AT: usize = 103;
pub(crate) const CALL_AT: usize = 106;
/// Where the common routine returns to (past the call).
pub(crate) const RESUME_AT: usize = 112;
/// Where the relocated code starts.
pub(crate) const COPY_AT: usize = 120;
/// The section's descriptor, from the end of the trampoline.
const DESCRIPTOR_FROM_END: usize = 32;
/// The abort handler's bytes: the signature glibc registered, as the tail
/// of a `ud1` (a stray jump there faults), then `jmp rel32`.
const ABORT_LEN: usize = 7 + 5;

/// What counting trampolines need of the process, decided once: the rseq
/// area's offset from the thread pointer, and the possible CPUs (the
/// counters' CPU slots).
#[derive(Clone, Copy)]
struct Counting {
    area: i32,
    cpus: u32,
}

fn counting() -> Option<Counting> {
    static COUNTING: OnceLock<Option<Counting>> = OnceLock::new();
    *COUNTING.get_or_init(|| {
        // BMI2 (`shrx`, `rorx`): CPUID leaf 7, EBX bit 8.
        let bmi2 = core::arch::x86_64::__cpuid_count(7, 0).ebx & (1 << 8) != 0;
        let adder = pcpu::rseq::GatedAdder::get()?;
        Some(Counting {
            area: i32::try_from(adder.area_offset()).ok()?,
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

/// Writes the prelude and the full path into `code` (a trampoline at
/// `base`, `code[..COPY_AT]`), given the offsets of the cell pointer, the
/// entry pointer and the cell's fast pointer. The abort handler and the
/// descriptor are [`finish`]'s, once the relocated code's length is
/// known. Not async-signal-safe.
pub(crate) fn prelude(code: &mut [u8], cell_at: usize, entry_at: usize, fast_at: usize) {
    let start = crate::code::trampolines::CODE_AT;
    code[start..start + 5].copy_from_slice(&[0x48, 0x8d, 0x64, 0x24, 0x80]);
    let rel32 = |from_end: usize, to: usize| (to as i32 - from_end as i32).to_le_bytes();
    match counting() {
        None => {
            // jmp rel32 to the call: no counting here.
            code[start + 5] = 0xe9;
            code[start + 6..start + 10].copy_from_slice(&rel32(start + 10, CALL_AT));
        }
        Some(c) => {
            // The bytes from +21; `at(p)` is the offset in the trampoline
            // where `p` ends.
            let mut p: Vec<u8> = Vec::with_capacity(CALL_AT - start);
            let at = |p: &Vec<u8>| start + 5 + p.len();
            p.extend_from_slice(&[0x50, 0x51, 0x52]);
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
            // mov eax, 63
            p.extend_from_slice(&[0xb8, 63, 0, 0, 0]);
            // lea rcx, [rdx - cpus]
            p.extend_from_slice(&[0x48, 0x8d, 0x8a]);
            p.extend_from_slice(&(-(c.cpus as i32)).to_le_bytes());
            // shrx rcx, rcx, rax
            p.extend_from_slice(&[0xc4, 0xe2, 0xfb, 0xf7, 0xc9]);
            debug_assert_eq!(at(&p), CPU_CHECK_AT);
            // jrcxz full
            p.extend_from_slice(&[0xe3, (FULL_AT - (CPU_CHECK_AT + 2)) as u8]);
            // mov rax, [rip + cell pointer]
            p.extend_from_slice(&[0x48, 0x8b, 0x05]);
            let end = at(&p) + 4;
            p.extend_from_slice(&rel32(end, cell_at));
            // mov rcx, [rax + fast]
            p.extend_from_slice(&[0x48, 0x8b, 0x48, fast_at as u8]);
            debug_assert_eq!(at(&p), FAST_CHECK_AT);
            // jrcxz full
            p.extend_from_slice(&[0xe3, (FULL_AT - (FAST_CHECK_AT + 2)) as u8]);
            // rorx rdx, rdx, 57 (rotate left by 7: * 128)
            p.extend_from_slice(&[0xc4, 0xe3, 0xfb, 0xf0, 0xd2, 57]);
            // mov rax, [rcx + rdx]; lea rax, [rax + 1]; mov [rcx + rdx], rax
            p.extend_from_slice(&[0x48, 0x8b, 0x04, 0x11, 0x48, 0x8d, 0x40, 0x01]);
            p.extend_from_slice(&[0x48, 0x89, 0x04, 0x11]);
            debug_assert_eq!(at(&p), POST_COMMIT_AT);
            p.extend_from_slice(&[0x5a, 0x59, 0x58]);
            debug_assert_eq!(at(&p), SKIP_FULL_AT);
            // jmp resume
            p.extend_from_slice(&[0xeb, (RESUME_AT - (SKIP_FULL_AT + 2)) as u8]);
            debug_assert_eq!(at(&p), FULL_AT);
            p.extend_from_slice(&[0x5a, 0x59, 0x58]);
            debug_assert_eq!(at(&p), CALL_AT);
            code[start + 5..CALL_AT].copy_from_slice(&p);
        }
    }
    // call [rip + entry pointer]
    code[CALL_AT..CALL_AT + 2].copy_from_slice(&[0xff, 0x15]);
    code[CALL_AT + 2..RESUME_AT].copy_from_slice(&rel32(RESUME_AT, entry_at));
    // lea rsp, [rsp+128]
    code[RESUME_AT..COPY_AT].copy_from_slice(&[0x48, 0x8d, 0xa4, 0x24, 0x80, 0, 0, 0]);
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
