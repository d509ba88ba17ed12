//! A fault raised by an instruction running out of line reaches the
//! program's own handler at the probed address, as if the probe were not
//! there. Its own binary: it installs a process-wide SIGSEGV handler.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};

// Loads through its argument: faults on a null pointer.
#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    ".globl z_deref",
    "z_deref:",
    "mov rax, [rdi]",
    "ret"
);
#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(".text", ".globl z_deref", "z_deref:", "ldr x0, [x0]", "ret");

unsafe extern "C" {
    fn z_deref(p: u64) -> u64;
}

/// Where the program's handler saw the fault.
static FAULT_IP: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_segv(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: SA_SIGINFO handlers get the interrupted context.
    let uc = unsafe { &mut *ctx.cast::<libc::ucontext_t>() };
    // Skip the load, returning a marker, as a JIT's handler might.
    #[cfg(target_arch = "x86_64")]
    {
        let rip = uc.uc_mcontext.gregs[libc::REG_RIP as usize];
        FAULT_IP.store(rip as usize, SeqCst);
        uc.uc_mcontext.gregs[libc::REG_RIP as usize] = rip + 3;
        uc.uc_mcontext.gregs[libc::REG_RAX as usize] = 0xdead;
    }
    #[cfg(target_arch = "aarch64")]
    {
        FAULT_IP.store(uc.uc_mcontext.pc as usize, SeqCst);
        uc.uc_mcontext.pc += 4;
        uc.uc_mcontext.regs[0] = 0xdead;
    }
}

#[test]
fn a_fault_out_of_line_is_reported_at_the_probed_address() {
    // SAFETY: installing an SA_SIGINFO handler that only edits the frame.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_segv as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGSEGV, &raw const sa, std::ptr::null_mut()),
            0
        );
    }
    // Without a probe: the handler sees the function's own address.
    assert_eq!(call(z_deref, 0), 0xdead);
    assert_eq!(FAULT_IP.load(SeqCst), fn_addr(z_deref));
    let value = 77u64;
    let probe = probe_at(fn_addr(z_deref)).attach().unwrap();
    assert_eq!(call(z_deref, (&raw const value) as u64), 77);
    FAULT_IP.store(0, SeqCst);
    // With it: the load runs in a slot, faults there, and the handler
    // still sees the probed address (and resumes in the original code).
    assert_eq!(call(z_deref, 0), 0xdead);
    assert_eq!(FAULT_IP.load(SeqCst), fn_addr(z_deref));
    assert_eq!(probe.hits(), 2);
}
