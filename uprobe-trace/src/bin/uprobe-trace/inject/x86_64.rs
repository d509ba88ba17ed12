//! The x86-64 side of borrowing a thread: registers, vector state, and a
//! call set up as the System V ABI wants it.

use std::os::unix::fs::FileExt as _;

use super::Error;

/// A thread's general-purpose registers.
pub type Regs = libc::user_regs_struct;

/// `NT_PRSTATUS`: the general-purpose registers' regset.
const NT_PRSTATUS: libc::c_int = 1;
/// `NT_X86_XSTATE`: the whole `xsave` area (x87, SSE, AVX, AVX-512).
const NT_X86_XSTATE: libc::c_int = 0x202;

/// Where a call returns to: address 0, which faults (SIGSEGV, seen by us
/// before the program's handler) with the result in `rax`.
pub const RETURN_TO: u64 = 0;

/// `futex`: waits that may be for a lock held by a thread that holds
/// another (tried only when nothing better comes).
pub const FUTEX: u64 = 202;

pub fn pc(r: &Regs) -> u64 {
    r.rip
}

pub fn result(r: &Regs) -> u64 {
    r.rax
}

/// The system call the thread was waiting in when we stopped it, if any
/// (the kernel left a restart code in `rax`).
pub fn interrupted_syscall(r: &Regs) -> Option<u64> {
    const RESTARTS: [i64; 5] = [-512, -513, -514, -516, -(libc::EINTR as i64)];
    (r.orig_rax as i64 >= 0 && RESTARTS.contains(&(r.rax as i64))).then_some(r.orig_rax)
}

/// System calls that block and are not made with one of libc's locks
/// held.
pub fn blocks_without_locks(nr: u64) -> bool {
    // read, poll, select, pause, nanosleep, accept, recvfrom, recvmsg,
    // wait4, rt_sigtimedwait, rt_sigsuspend, clock_nanosleep, epoll_wait,
    // waitid, pselect6, ppoll, epoll_pwait, accept4, epoll_pwait2.
    [
        0, 7, 23, 34, 35, 43, 45, 47, 61, 128, 130, 230, 232, 247, 270, 271, 281, 288, 441,
    ]
    .contains(&nr)
}

/// Below the thread's stack and its red zone: where a call's data and
/// frame may go.
pub fn stack_below(r: &Regs) -> u64 {
    (r.rsp - 128 - 256) & !15
}

/// The registers for `func(args...)` with its frame below `below`: the
/// return address [`RETURN_TO`] pushed where a `call` would have, the
/// stack aligned as the ABI wants at entry, no system call to restart.
pub fn call_regs(
    saved: &Regs,
    func: u64,
    args: &[u64],
    below: u64,
    mem: &std::fs::File,
) -> Result<Regs, Error> {
    let mut r = *saved;
    // At entry rsp + 8 is 16-byte aligned.
    let rsp = (below & !15) - 8;
    mem.write_all_at(&RETURN_TO.to_le_bytes(), rsp)
        .map_err(|e| Error::Other(format!("writing the process's stack: {e}")))?;
    r.rsp = rsp;
    r.rip = func;
    r.rax = 0;
    // Not a system call to restart when it resumes.
    r.orig_rax = u64::MAX;
    let slots = [
        &mut r.rdi, &mut r.rsi, &mut r.rdx, &mut r.rcx, &mut r.r8, &mut r.r9,
    ];
    for (slot, &value) in slots.into_iter().zip(args) {
        *slot = value;
    }
    Ok(r)
}

fn regset(
    tid: i32,
    request: libc::c_uint,
    kind: libc::c_int,
    buf: *mut u8,
    len: usize,
) -> std::io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.cast(),
        iov_len: len,
    };
    // SAFETY: the kernel reads or writes at most `len` bytes at `buf` and
    // updates `iov_len`.
    let r = unsafe { libc::ptrace(request, tid, kind as usize, &raw mut iov) };
    if r == 0 {
        Ok(iov.iov_len)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

pub fn regs(tid: i32) -> Result<Regs, Error> {
    // SAFETY: plain integers; all zeros is a valid value.
    let mut r: Regs = unsafe { core::mem::zeroed() };
    regset(
        tid,
        libc::PTRACE_GETREGSET,
        NT_PRSTATUS,
        (&raw mut r).cast(),
        size_of::<Regs>(),
    )
    .map_err(|e| Error::Other(format!("reading thread {tid}'s registers: {e}")))?;
    Ok(r)
}

pub fn set_regs(tid: i32, r: &Regs) -> Result<(), Error> {
    let mut copy = *r;
    regset(
        tid,
        libc::PTRACE_SETREGSET,
        NT_PRSTATUS,
        (&raw mut copy).cast(),
        size_of::<Regs>(),
    )
    .map(drop)
    .map_err(|e| Error::Other(format!("setting thread {tid}'s registers: {e}")))
}

pub fn vector_state(tid: i32) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; 16 * 1024];
    let n = regset(
        tid,
        libc::PTRACE_GETREGSET,
        NT_X86_XSTATE,
        buf.as_mut_ptr(),
        buf.len(),
    )
    .map_err(|e| Error::Other(format!("reading thread {tid}'s vector registers: {e}")))?;
    buf.truncate(n);
    Ok(buf)
}

pub fn set_vector_state(tid: i32, state: &[u8]) -> Result<(), Error> {
    let mut copy = state.to_vec();
    regset(
        tid,
        libc::PTRACE_SETREGSET,
        NT_X86_XSTATE,
        copy.as_mut_ptr(),
        copy.len(),
    )
    .map(drop)
    .map_err(|e| Error::Other(format!("restoring thread {tid}'s vector registers: {e}")))
}
