//! One run, in a child process of its own: the registers loaded (vector
//! state cleared), a jump to the code, and at an end (a stub's routine)
//! the registers and pages written to memory shared with the parent
//! ([`run`]).

use core::ptr;
use std::sync::OnceLock;

use super::layout::Layout;
use super::{Hit, MAX_PAGES, PAGE, Regs};

/// What one run came to.
#[repr(C)]
pub(super) struct Outcome {
    /// 0 until the run reached an end; then 1 + the end's index.
    end: u32,
    regs: Regs,
    pages: [[u8; PAGE as usize]; MAX_PAGES],
}

/// What a run came to, as the parent reads it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Run {
    /// It reached an end (which address), with these registers and pages.
    Ended { at: u64, regs: Regs, pages: u64 },
    /// A signal ended it.
    Signal(i32),
}

/// The shared pages the children write their outcomes to (two).
fn shared() -> *mut Outcome {
    static SHARED: OnceLock<usize> = OnceLock::new();
    *SHARED.get_or_init(|| {
        // SAFETY: a fresh anonymous shared mapping.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                2 * size_of::<Outcome>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "shared outcome pages");
        p as usize
    }) as *mut Outcome
}

// ---- The child's side -----------------------------------------------------

#[unsafe(no_mangle)]
static mut KSCALE_EXEC_OUT: Regs = Regs {
    gpr: [0; 16],
    flags: 0,
};
#[unsafe(no_mangle)]
static mut KSCALE_EXEC_HOST_RSP: u64 = 0;
#[unsafe(no_mangle)]
static mut KSCALE_EXEC_TARGET: u64 = 0;
#[unsafe(no_mangle)]
static KSCALE_EXEC_MXCSR: u32 = 0x1f80;
/// The child's outcome, and the pages it copies into it.
static mut CHILD_OUTCOME: *mut Outcome = ptr::null_mut();
static mut CHILD_PAGES: [u64; MAX_PAGES] = [0; MAX_PAGES];
static mut CHILD_PAGE_COUNT: usize = 0;

unsafe extern "C" {
    /// Loads `regs` (vector state cleared; `avx`: with `vzeroall`) and
    /// jumps to `start`; never returns.
    fn kscale_exec_start(regs: *const Regs, start: u64, avx: u64) -> !;
}

core::arch::global_asm!(
    ".text",
    ".globl kscale_exec_start",
    "kscale_exec_start:",
    "mov [rip + KSCALE_EXEC_HOST_RSP], rsp",
    "mov [rip + KSCALE_EXEC_TARGET], rsi",
    "fninit",
    "ldmxcsr [rip + KSCALE_EXEC_MXCSR]",
    "test rdx, rdx",
    "jz 2f",
    "vzeroall",
    "jmp 3f",
    "2:",
    "pxor xmm0, xmm0",
    "pxor xmm1, xmm1",
    "pxor xmm2, xmm2",
    "pxor xmm3, xmm3",
    "pxor xmm4, xmm4",
    "pxor xmm5, xmm5",
    "pxor xmm6, xmm6",
    "pxor xmm7, xmm7",
    "pxor xmm8, xmm8",
    "pxor xmm9, xmm9",
    "pxor xmm10, xmm10",
    "pxor xmm11, xmm11",
    "pxor xmm12, xmm12",
    "pxor xmm13, xmm13",
    "pxor xmm14, xmm14",
    "pxor xmm15, xmm15",
    "3:",
    // The flags without a write to the stack (both runs must leave it
    // as the code under test does): popped from the state itself.
    "lea rsp, [rdi + 128]",
    "popfq",
    "mov rsp, [rdi + 32]",
    "mov rax, [rdi]",
    "mov rcx, [rdi + 8]",
    "mov rdx, [rdi + 16]",
    "mov rbx, [rdi + 24]",
    "mov rbp, [rdi + 40]",
    "mov rsi, [rdi + 48]",
    "mov r8, [rdi + 64]",
    "mov r9, [rdi + 72]",
    "mov r10, [rdi + 80]",
    "mov r11, [rdi + 88]",
    "mov r12, [rdi + 96]",
    "mov r13, [rdi + 104]",
    "mov r14, [rdi + 112]",
    "mov r15, [rdi + 120]",
    "mov rdi, [rdi + 56]",
    "jmp qword ptr [rip + KSCALE_EXEC_TARGET]",
);

macro_rules! end_routine {
    ($name:literal, $n:literal) => {
        core::arch::global_asm!(
            ".text",
            concat!(".globl ", $name),
            concat!($name, ":"),
            "mov [rip + KSCALE_EXEC_OUT], rax",
            "mov [rip + KSCALE_EXEC_OUT + 8], rcx",
            "mov [rip + KSCALE_EXEC_OUT + 16], rdx",
            "mov [rip + KSCALE_EXEC_OUT + 24], rbx",
            "mov [rip + KSCALE_EXEC_OUT + 32], rsp",
            "mov [rip + KSCALE_EXEC_OUT + 40], rbp",
            "mov [rip + KSCALE_EXEC_OUT + 48], rsi",
            "mov [rip + KSCALE_EXEC_OUT + 56], rdi",
            "mov [rip + KSCALE_EXEC_OUT + 64], r8",
            "mov [rip + KSCALE_EXEC_OUT + 72], r9",
            "mov [rip + KSCALE_EXEC_OUT + 80], r10",
            "mov [rip + KSCALE_EXEC_OUT + 88], r11",
            "mov [rip + KSCALE_EXEC_OUT + 96], r12",
            "mov [rip + KSCALE_EXEC_OUT + 104], r13",
            "mov [rip + KSCALE_EXEC_OUT + 112], r14",
            "mov [rip + KSCALE_EXEC_OUT + 120], r15",
            "mov rsp, [rip + KSCALE_EXEC_HOST_RSP]",
            "and rsp, -16",
            "pushfq",
            "pop rax",
            "mov [rip + KSCALE_EXEC_OUT + 128], rax",
            "cld",
            concat!("mov edi, ", $n),
            "call kscale_exec_finish",
            "ud2",
        );
    };
}
end_routine!("kscale_exec_end0", "0");
end_routine!("kscale_exec_end1", "1");
end_routine!("kscale_exec_end2", "2");
end_routine!("kscale_exec_end3", "3");

/// Where every end routine goes: the outcome written, the child gone.
#[unsafe(no_mangle)]
extern "C" fn kscale_exec_finish(end: u32) -> ! {
    // SAFETY: the child is single-threaded; its statics were set before
    // the run, the pages listed are mapped, and the outcome is the shared
    // page's.
    unsafe {
        let out = &mut *CHILD_OUTCOME;
        out.regs = ptr::read(&raw const KSCALE_EXEC_OUT);
        let pages: [u64; MAX_PAGES] = CHILD_PAGES;
        for (i, &page) in pages[..CHILD_PAGE_COUNT].iter().enumerate() {
            ptr::copy_nonoverlapping(page as *const u8, out.pages[i].as_mut_ptr(), PAGE as usize);
        }
        out.end = end + 1;
        libc::_exit(0)
    }
}

/// The child: default signal actions, a time limit, then the run.
///
/// # Safety
/// In a child just forked, with the layout mapped.
unsafe fn child(
    out: *mut Outcome,
    pages: &[u64],
    start: Regs,
    at: u64,
    apply: Option<&Hit<'_>>,
) -> ! {
    // SAFETY: plain system calls; the statics are this (single-threaded)
    // child's.
    unsafe {
        for sig in [
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGILL,
            libc::SIGFPE,
            libc::SIGTRAP,
            libc::SIGABRT,
            libc::SIGALRM,
            libc::SIGVTALRM,
            libc::SIGSYS,
        ] {
            libc::signal(sig, libc::SIG_DFL);
        }
        let mut all: libc::sigset_t = core::mem::zeroed();
        libc::sigemptyset(&raw mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &raw const all, ptr::null_mut());
        let limit = libc::itimerval {
            it_interval: libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            },
            it_value: libc::timeval {
                tv_sec: 0,
                tv_usec: 50_000,
            },
        };
        // CPU time, not wall-clock time: a loaded machine must not end a
        // run that merely waits to be scheduled.
        libc::setitimer(libc::ITIMER_VIRTUAL, &raw const limit, ptr::null_mut());
        CHILD_OUTCOME = out;
        for (i, &p) in pages.iter().enumerate() {
            CHILD_PAGES[i] = p;
        }
        CHILD_PAGE_COUNT = pages.len();
        let (mut regs, mut at) = (start, at);
        if let Some(apply) = apply {
            apply(&mut regs, &mut at);
        }
        let avx = u64::from(std::arch::is_x86_feature_detected!("avx"));
        kscale_exec_start(&raw const regs, at, avx)
    }
}

/// Runs from `start` at `at` in a child, or (`apply`) first lets the
/// child change the registers and memory as a hit would, then runs from
/// where that leaves the thread.
pub(super) fn run(
    layout: &Layout,
    slot: usize,
    start: Regs,
    at: u64,
    apply: Option<&Hit<'_>>,
) -> Run {
    let out = shared().wrapping_add(slot);
    // SAFETY: the shared page, not used by any live child.
    unsafe { (*out).end = 0 };
    let pages = layout.pages();
    // SAFETY: fork; the child only runs `child` (and `apply`), which
    // allocate nothing.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // SAFETY: in the child just forked, the layout mapped.
        unsafe { child(out, &pages, start, at, apply) }
    }
    let mut status = 0;
    // SAFETY: our child. Interrupted by the fuzzer's own timer signal,
    // it waits again.
    while unsafe { libc::waitpid(pid, &raw mut status, 0) } != pid {
        let e = std::io::Error::last_os_error();
        assert_eq!(e.kind(), std::io::ErrorKind::Interrupted, "waitpid: {e}");
    }
    if libc::WIFSIGNALED(status) {
        return Run::Signal(libc::WTERMSIG(status));
    }
    // SAFETY: the child wrote it before exiting.
    let o = unsafe { &*out };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 && o.end != 0,
        "a run ended neither at a stub nor by a signal: {status:#x}"
    );
    // The pages, hashed (they are compared as a whole).
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for page in &o.pages[..pages.len()] {
        for &b in page {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    Run::Ended {
        at: layout.end_at(o.end as usize - 1),
        regs: o.regs,
        pages: h,
    }
}
