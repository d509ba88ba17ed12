//! The return trampoline: plain code, no trap.
//!
//! A hijacked return address points at a **stub**, one per distinct
//! original return address (call site): 16 bytes holding `call
//! [rip + disp]` to the common trampoline. The common trampoline saves the
//! registers a function returns in (and every other caller-saved one, and
//! the flags), calls [`crate::returns::on_return`], restores them, and
//! `ret`s to the original return address, which `on_return` wrote over the
//! address the stub's `call` pushed. So the thread is back in its caller
//! with exactly the registers the function returned with.
//!
//! **Why a stub per call site.** The stub's index names the original
//! return address in [`TARGETS`], so returning never depends on per-thread
//! bookkeeping (an instance dropped by a `longjmp` cleanup, a full return
//! stack: the thread still returns to the right place), and the unwinder
//! can find the original return address too: the stubs have one DWARF
//! frame description, registered with `__register_frame`, whose return
//! address rule reads `TARGETS[(pc - base) / 16 - 1]`. A Rust panic or a
//! C++ exception raised below a hijacked frame therefore unwinds through
//! it to the real caller, and so do backtraces. (The instance left behind
//! is cleaned up by the stack-pointer comparison, as after `longjmp`.)
//!
//! Stubs are never freed: a call site keeps its stub for the life of the
//! process, and a thread that returns through it at any time later finds
//! the same target.

use core::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::AttachError;
use crate::error::os_error;

/// Call sites a process can have stubs for.
pub(crate) const MAX_STUBS: usize = 16 * 1024;
/// Bytes per stub.
const STUB_SIZE: usize = 16;
/// The stub region: the trampoline's address in its first 8 bytes, then
/// the stubs (stub `k` at `base + 16 * (k + 1)`).
const REGION_SIZE: usize = STUB_SIZE * (MAX_STUBS + 1);

/// The original return address of each stub (0: unused). Assigned by
/// hashing the return address; entries are never removed, so a stub's
/// target never changes once set.
static TARGETS: [AtomicUsize; MAX_STUBS] = [const { AtomicUsize::new(0) }; MAX_STUBS];

/// The mapped stub region's base address.
static REGION: OnceLock<Result<usize, AttachError>> = OnceLock::new();

/// The registers the trampoline saved, lowest address first (the order of
/// its pushes, reversed). `ret` is the slot the stub's `call` pushed, which
/// the trampoline finally `ret`s through.
#[repr(C)]
pub(crate) struct SavedRegs {
    pub(crate) r11: u64,
    pub(crate) r10: u64,
    pub(crate) r9: u64,
    pub(crate) r8: u64,
    pub(crate) rdi: u64,
    pub(crate) rsi: u64,
    pub(crate) rdx: u64,
    pub(crate) rcx: u64,
    pub(crate) rax: u64,
    pub(crate) rflags: u64,
    pub(crate) rbp: u64,
    pub(crate) ret: u64,
}

impl SavedRegs {
    /// The thread's stack pointer once it is back in its caller.
    pub(crate) fn caller_sp(&self) -> usize {
        core::ptr::from_ref(&self.ret) as usize + 8
    }
}

/// The saved `xmm0`-`xmm15`.
pub(crate) type SavedXmm = [u128; 16];

// The common trampoline. Entered by a stub's `call`, so its frame
// description is the ordinary one of a called function (CFA = rsp + 8 on
// entry); `rbp` then anchors the frame while the stack is realigned.
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_return_trampoline,\"ax\",@progbits",
    ".p2align 4",
    ".globl uprobe_core_return_trampoline",
    ".hidden uprobe_core_return_trampoline",
    "uprobe_core_return_trampoline:",
    ".cfi_startproc",
    "push rbp",
    ".cfi_adjust_cfa_offset 8",
    ".cfi_rel_offset rbp, 0",
    "mov rbp, rsp",
    ".cfi_def_cfa_register rbp",
    "pushfq",
    "push rax",
    "push rcx",
    "push rdx",
    "push rsi",
    "push rdi",
    "push r8",
    "push r9",
    "push r10",
    "push r11",
    "mov rdi, rsp",
    "and rsp, -16",
    "sub rsp, 256",
    "movaps [rsp + 0], xmm0",
    "movaps [rsp + 16], xmm1",
    "movaps [rsp + 32], xmm2",
    "movaps [rsp + 48], xmm3",
    "movaps [rsp + 64], xmm4",
    "movaps [rsp + 80], xmm5",
    "movaps [rsp + 96], xmm6",
    "movaps [rsp + 112], xmm7",
    "movaps [rsp + 128], xmm8",
    "movaps [rsp + 144], xmm9",
    "movaps [rsp + 160], xmm10",
    "movaps [rsp + 176], xmm11",
    "movaps [rsp + 192], xmm12",
    "movaps [rsp + 208], xmm13",
    "movaps [rsp + 224], xmm14",
    "movaps [rsp + 240], xmm15",
    "mov rsi, rsp",
    "call {on_return}",
    "movaps xmm0, [rsp + 0]",
    "movaps xmm1, [rsp + 16]",
    "movaps xmm2, [rsp + 32]",
    "movaps xmm3, [rsp + 48]",
    "movaps xmm4, [rsp + 64]",
    "movaps xmm5, [rsp + 80]",
    "movaps xmm6, [rsp + 96]",
    "movaps xmm7, [rsp + 112]",
    "movaps xmm8, [rsp + 128]",
    "movaps xmm9, [rsp + 144]",
    "movaps xmm10, [rsp + 160]",
    "movaps xmm11, [rsp + 176]",
    "movaps xmm12, [rsp + 192]",
    "movaps xmm13, [rsp + 208]",
    "movaps xmm14, [rsp + 224]",
    "movaps xmm15, [rsp + 240]",
    "lea rsp, [rbp - 80]",
    "pop r11",
    "pop r10",
    "pop r9",
    "pop r8",
    "pop rdi",
    "pop rsi",
    "pop rdx",
    "pop rcx",
    "pop rax",
    "popfq",
    "pop rbp",
    ".cfi_def_cfa rsp, 8",
    "ret",
    ".cfi_endproc",
    ".popsection",
    on_return = sym trampoline_entry,
);

unsafe extern "C" {
    /// The common trampoline above (not callable from Rust: it expects a
    /// stub's `call`).
    fn uprobe_core_return_trampoline();
    /// libgcc's (and LLVM libunwind's) registration of runtime-generated
    /// unwind information: `begin` points at `.eh_frame`-format data
    /// (a CIE, an FDE, a zero terminator) that must stay alive.
    fn __register_frame(begin: *const u8);
}

/// What the trampoline calls: hands the saved registers to the engine,
/// which writes the original return address into `regs.ret`.
extern "C" fn trampoline_entry(regs: &mut SavedRegs, xmm: &mut SavedXmm) {
    crate::returns::on_return(regs, xmm);
}

/// Maps the stub region and registers its unwind information, once. Not
/// async-signal-safe.
pub(crate) fn init() -> Result<(), AttachError> {
    REGION.get_or_init(map_region).clone().map(|_| ())
}

fn map_region() -> Result<usize, AttachError> {
    // SAFETY: a fresh anonymous private mapping.
    let base = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            REGION_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(os_error("mmap(return trampoline stubs)"));
    }
    let base = base as usize;
    // SAFETY: the region is ours, writable, REGION_SIZE bytes.
    let bytes = unsafe { core::slice::from_raw_parts_mut(base as *mut u8, REGION_SIZE) };
    bytes.fill(0xcc);
    let trampoline = uprobe_core_return_trampoline as *const () as usize;
    bytes[..8].copy_from_slice(&trampoline.to_le_bytes());
    for k in 0..MAX_STUBS {
        let at = STUB_SIZE * (k + 1);
        // call [rip + disp32]: the pointer at `base`, relative to the end
        // of this 6-byte instruction.
        let disp = -((at + 6) as i64) as i32;
        bytes[at..at + 2].copy_from_slice(&[0xff, 0x15]);
        bytes[at + 2..at + 6].copy_from_slice(&disp.to_le_bytes());
    }
    // SAFETY: our mapping; from now on it is only executed and read.
    if unsafe {
        libc::mprotect(
            base as *mut _,
            REGION_SIZE,
            libc::PROT_READ | libc::PROT_EXEC,
        )
    } != 0
    {
        return Err(os_error("mprotect(return trampoline stubs)"));
    }
    let eh_frame = Box::leak(unwind_info(base).into_boxed_slice());
    // SAFETY: well-formed `.eh_frame` data (see `unwind_info`), leaked so
    // it stays alive as long as the unwinder may read it.
    unsafe { __register_frame(eh_frame.as_ptr()) };
    Ok(base)
}

/// `.eh_frame` data for the stub region: one CIE, one FDE covering the
/// region, a terminator. In every stub, CFA = rsp and the return address
/// is `TARGETS[(pc - base) / 16 - 1]`, read by a DWARF expression (the
/// stub's "caller" is the original caller; no register is saved).
fn unwind_info(base: usize) -> Vec<u8> {
    const DW_CFA_DEF_CFA: u8 = 0x0c;
    const DW_CFA_VAL_EXPRESSION: u8 = 0x16;
    const DW_OP_BREG16: u8 = 0x80;
    const DW_OP_CONST8U: u8 = 0x0e;
    const DW_OP_MINUS: u8 = 0x1c;
    const DW_OP_LIT3: u8 = 0x33;
    const DW_OP_LIT4: u8 = 0x34;
    const DW_OP_SHR: u8 = 0x25;
    const DW_OP_SHL: u8 = 0x24;
    const DW_OP_PLUS: u8 = 0x22;
    const DW_OP_DEREF: u8 = 0x06;
    const RA: u8 = 16; // DWARF's x86-64 return address column
    const RSP: u8 = 7;

    let mut out = Vec::new();
    // CIE: version 1, augmentation "zR", code alignment 1, data alignment
    // -8, return address column 16, absolute pointers.
    let mut cie = vec![0, 0, 0, 0, 1, b'z', b'R', 0, 1, 0x78, RA, 1, 0x00];
    cie.extend_from_slice(&[DW_CFA_DEF_CFA, RSP, 8]);
    push_record(&mut out, &cie);

    let targets_minus_one = (TARGETS.as_ptr() as usize).wrapping_sub(8) as u64;
    let mut expr = vec![DW_OP_BREG16, 0, DW_OP_CONST8U];
    expr.extend_from_slice(&(base as u64).to_le_bytes());
    expr.extend_from_slice(&[DW_OP_MINUS, DW_OP_LIT4, DW_OP_SHR, DW_OP_LIT3, DW_OP_SHL]);
    expr.push(DW_OP_CONST8U);
    expr.extend_from_slice(&targets_minus_one.to_le_bytes());
    expr.extend_from_slice(&[DW_OP_PLUS, DW_OP_DEREF]);

    // FDE: CIE pointer (distance back to the CIE, filled by
    // `push_record`), pc begin, pc range, no augmentation data, then the
    // rules.
    let fde_start = out.len();
    let mut fde = vec![0, 0, 0, 0];
    fde.extend_from_slice(&(base as u64).to_le_bytes());
    fde.extend_from_slice(&(REGION_SIZE as u64).to_le_bytes());
    fde.push(0);
    fde.extend_from_slice(&[DW_CFA_DEF_CFA, RSP, 0]);
    fde.extend_from_slice(&[DW_CFA_VAL_EXPRESSION, RA, expr.len() as u8]);
    fde.extend_from_slice(&expr);
    push_record(&mut out, &fde);
    // The CIE pointer: bytes from the FDE's CIE-pointer field back to the
    // CIE's start (offset 0).
    let field = fde_start + 4;
    out[field..field + 4].copy_from_slice(&(field as u32).to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out
}

/// Appends a CIE or FDE: a 4-byte length, `body` padded with `DW_CFA_nop`
/// to a multiple of 8 bytes overall.
fn push_record(out: &mut Vec<u8>, body: &[u8]) {
    let padded = (body.len() + 4).next_multiple_of(8) - 4;
    out.extend_from_slice(&(padded as u32).to_le_bytes());
    out.extend_from_slice(body);
    out.resize(out.len() + padded - body.len(), 0);
}

/// The stub that returns to `ret`: the existing one, or a new one. `None`
/// if every stub is taken by other call sites (or the region could not be
/// mapped). Lock-free, no allocation: async-signal-safe.
pub(crate) fn stub_for(ret: usize) -> Option<usize> {
    let base = *REGION.get()?.as_ref().ok()?;
    let start = (ret.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % MAX_STUBS;
    for i in 0..MAX_STUBS {
        let k = (start + i) % MAX_STUBS;
        let t = TARGETS[k].load(Ordering::Acquire);
        let found = t == ret
            || (t == 0
                && match TARGETS[k].compare_exchange(0, ret, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => true,
                    Err(now) => now == ret,
                });
        if found {
            return Some(base + STUB_SIZE * (k + 1));
        }
    }
    None
}

/// The original return address of the stub at `addr` (or of the stub
/// whose `call` pushed `addr`), if `addr` lies in a stub. Async-signal-safe.
pub(crate) fn target_of(addr: usize) -> Option<usize> {
    let base = *REGION.get()?.as_ref().ok()?;
    let k = addr.checked_sub(base)? / STUB_SIZE;
    if k == 0 || k > MAX_STUBS {
        return None;
    }
    match TARGETS[k - 1].load(Ordering::Acquire) {
        0 => None,
        t => Some(t),
    }
}

/// Whether the calling thread runs with a shadow stack (x86 CET user
/// shadow stacks): a hijacked return would then fault. Not
/// async-signal-safe only in that it is meant for attach time.
pub(crate) fn shadow_stack_enabled() -> bool {
    const ARCH_SHSTK_STATUS: libc::c_int = 0x5005;
    const ARCH_SHSTK_SHSTK: u64 = 1;
    let mut features: u64 = 0;
    // SAFETY: ARCH_SHSTK_STATUS writes one u64 to the address given; older
    // kernels fail with EINVAL (no shadow stacks).
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_SHSTK_STATUS, &raw mut features) };
    rc == 0 && features & ARCH_SHSTK_SHSTK != 0
}
