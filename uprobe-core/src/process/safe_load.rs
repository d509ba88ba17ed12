//! A load that cannot crash the program: `load` reads a word, and a fault
//! it raises is recovered from by the engine's fault handler
//! (`entry::faults` asks [`recover`] first), which resumes at a second
//! exit that says "unreadable", as the kernel's own user-memory accessors
//! do. For reading a thread's stack during an unwind, where a corrupt
//! frame may name any address.
//!
//! A fault reaches that handler only where it is the process's SIGSEGV and
//! SIGBUS handler (`entry::faults` records whether it was, when it last
//! looked: [`set_handlers_ours`]) and the thread blocks neither:
//! [`recoverable_here`] says whether both hold.

use core::sync::atomic::{AtomicBool, Ordering};

// The recoverable load: `uprobe_core_safe_load(addr, out)` returns 1 with
// the word at `addr` in `*out`, or 0 when the load at
// `uprobe_core_safe_load_at` faulted and the fault handler resumed at
// `uprobe_core_safe_load_fault`.
#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_safe_load,\"ax\",@progbits",
    ".globl uprobe_core_safe_load",
    ".hidden uprobe_core_safe_load",
    ".type uprobe_core_safe_load, @function",
    "uprobe_core_safe_load:",
    ".globl uprobe_core_safe_load_at",
    ".hidden uprobe_core_safe_load_at",
    "uprobe_core_safe_load_at:",
    "mov rax, qword ptr [rdi]",
    "mov qword ptr [rsi], rax",
    "mov eax, 1",
    "ret",
    ".globl uprobe_core_safe_load_fault",
    ".hidden uprobe_core_safe_load_fault",
    "uprobe_core_safe_load_fault:",
    "xor eax, eax",
    "ret",
    ".size uprobe_core_safe_load, . - uprobe_core_safe_load",
    ".popsection",
);
#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_safe_load,\"ax\",@progbits",
    ".globl uprobe_core_safe_load",
    ".hidden uprobe_core_safe_load",
    ".type uprobe_core_safe_load, %function",
    "uprobe_core_safe_load:",
    ".globl uprobe_core_safe_load_at",
    ".hidden uprobe_core_safe_load_at",
    "uprobe_core_safe_load_at:",
    "ldr x2, [x0]",
    "str x2, [x1]",
    "mov w0, #1",
    "ret",
    ".globl uprobe_core_safe_load_fault",
    ".hidden uprobe_core_safe_load_fault",
    "uprobe_core_safe_load_fault:",
    "mov w0, #0",
    "ret",
    ".size uprobe_core_safe_load, . - uprobe_core_safe_load",
    ".popsection",
);

unsafe extern "C" {
    fn uprobe_core_safe_load(addr: usize, out: *mut usize) -> u32;
    fn uprobe_core_safe_load_at();
    fn uprobe_core_safe_load_fault();
}

/// For the fault handler: a fault at the recoverable load resumes at its
/// second exit; `true` if it was one. Async-signal-safe.
pub(crate) fn recover(uc: &mut libc::ucontext_t) -> bool {
    if crate::arch::pc(uc) != uprobe_core_safe_load_at as *const () as usize {
        return false;
    }
    crate::arch::set_pc(uc, uprobe_core_safe_load_fault as *const () as usize);
    true
}

/// Whether the engine's fault handler was the process's SIGSEGV and SIGBUS
/// handler when `entry::faults` last looked (at every attach of a process
/// that unwinds): a program that installs its own afterwards, and then has
/// the unwinder read an unmapped address, gets that fault in its handler.
static HANDLERS_OURS: AtomicBool = AtomicBool::new(false);

/// Records whether the engine's fault handler is the process's SIGSEGV
/// and SIGBUS handler.
pub(crate) fn set_handlers_ours(ours: bool) {
    HANDLERS_OURS.store(ours, Ordering::Relaxed);
}

/// Whether a fault of [`load`] in this thread reaches the engine's
/// handler: it is the process's handler (see [`HANDLERS_OURS`]), and the
/// thread blocks neither SIGSEGV nor SIGBUS (a system call that only
/// asks). Async-signal-safe.
pub(crate) fn recoverable_here() -> bool {
    if !HANDLERS_OURS.load(Ordering::Relaxed) {
        return false;
    }
    // SAFETY: a query of the calling thread's mask.
    let mut mask: libc::sigset_t = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, core::ptr::null(), &raw mut mask) } != 0 {
        return false;
    }
    // SAFETY: reading our own set.
    unsafe {
        libc::sigismember(&raw const mask, libc::SIGSEGV) == 0
            && libc::sigismember(&raw const mask, libc::SIGBUS) == 0
    }
}

/// The word at `addr` (aligned), or `None` where a load faults. Only where
/// [`recoverable_here`] said so. Async-signal-safe.
pub(crate) fn load(addr: usize) -> Option<usize> {
    if !addr.is_multiple_of(size_of::<usize>()) {
        return None;
    }
    let mut out = 0usize;
    // SAFETY: a load whose fault the engine's handler recovers from (the
    // caller checked that it reaches that handler).
    (unsafe { uprobe_core_safe_load(addr, &raw mut out) } == 1).then_some(out)
}
