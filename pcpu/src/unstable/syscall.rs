//! System calls made without libc, for code that may run while libc's
//! own functions are probed or interrupted (a probe handler's read
//! section, a signal handler): a raw `syscall` (x86-64) or `svc #0`
//! (aarch64) instruction. They also leave `errno` alone, which a signal
//! handler must. Elsewhere they go through `libc::syscall`, saving and
//! restoring `errno`. All are async-signal-safe.

/// The calling thread's kernel thread id.
#[must_use]
pub fn gettid() -> libc::pid_t {
    // SAFETY: gettid takes no arguments and cannot fail.
    let r = unsafe { raw(libc::SYS_gettid, 0, 0, 0) };
    libc::pid_t::try_from(r).unwrap_or(0)
}

/// The process id.
#[must_use]
pub fn getpid() -> libc::pid_t {
    // SAFETY: getpid takes no arguments and cannot fail.
    let r = unsafe { raw(libc::SYS_getpid, 0, 0, 0) };
    libc::pid_t::try_from(r).unwrap_or(0)
}

/// Whether thread `tid` of this process has exited: `tgkill(pid, tid, 0)`
/// (which sends nothing) fails with `ESRCH`. A kernel thread id is unique
/// among live threads, so an exited thread's id may belong to a new
/// thread later: callers that must tell threads apart keep an id of their
/// own next to it.
#[must_use]
pub fn thread_exited(tid: libc::pid_t) -> bool {
    if tid <= 0 {
        return false;
    }
    let (pid, tid) = (getpid() as usize, tid as usize);
    // SAFETY: signal 0 only checks that the thread exists.
    let r = unsafe { raw(libc::SYS_tgkill, pid, tid, 0) };
    r == -libc::c_long::from(libc::ESRCH)
}

/// A system call with up to three arguments; returns the kernel's result
/// (`-errno` on failure).
///
/// # Safety
/// `n` and its arguments must be a call that touches no memory the
/// caller does not own.
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn raw(n: libc::c_long, a: usize, b: usize, c: usize) -> libc::c_long {
    let ret: libc::c_long;
    // SAFETY: the caller's promise; `syscall` clobbers rcx and r11 only.
    unsafe {
        core::arch::asm!(
            "syscall",
            inlateout("rax") n => ret,
            in("rdi") a,
            in("rsi") b,
            in("rdx") c,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack, preserves_flags),
        );
    }
    ret
}

/// As on x86-64, with `svc #0` (number in x8, result in x0).
///
/// # Safety
/// As on x86-64.
#[cfg(all(target_arch = "aarch64", not(miri)))]
unsafe fn raw(n: libc::c_long, a: usize, b: usize, c: usize) -> libc::c_long {
    let ret: libc::c_long;
    // SAFETY: the caller's promise; `svc` preserves every other register.
    unsafe {
        core::arch::asm!(
            "svc #0",
            in("x8") n,
            inlateout("x0") a => ret,
            in("x1") b,
            in("x2") c,
            options(nostack, preserves_flags),
        );
    }
    ret
}

/// Other architectures: `libc::syscall`, with `errno` restored.
///
/// # Safety
/// As on x86-64.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", miri)))]
unsafe fn raw(n: libc::c_long, a: usize, b: usize, c: usize) -> libc::c_long {
    // SAFETY: errno is this thread's; the call is the caller's promise.
    unsafe {
        let errno = libc::__errno_location();
        let saved = *errno;
        let r = libc::syscall(n, a, b, c);
        let r = if r == -1 {
            -libc::c_long::from(*errno)
        } else {
            r
        };
        *errno = saved;
        r
    }
}

/// Under Miri, which runs no inline assembly and no raw system call:
/// the thread and process ids through libc's functions, and `ENOSYS` for
/// anything else (so [`thread_exited`] says no thread has exited).
///
/// # Safety
/// None needed; the signature matches the others.
#[cfg(miri)]
#[allow(clippy::unnecessary_wraps)]
unsafe fn raw(n: libc::c_long, _a: usize, _b: usize, _c: usize) -> libc::c_long {
    match n {
        // SAFETY: takes no arguments and cannot fail.
        libc::SYS_gettid => libc::c_long::from(unsafe { libc::gettid() }),
        // SAFETY: as above.
        libc::SYS_getpid => libc::c_long::from(unsafe { libc::getpid() }),
        _ => -libc::c_long::from(libc::ENOSYS),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_match_libc_and_a_live_thread_has_not_exited() {
        // SAFETY: plain queries.
        let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
        assert_eq!(super::getpid(), pid);
        assert_eq!(super::gettid(), tid);
        assert!(!super::thread_exited(super::gettid()));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no tgkill")]
    fn a_joined_thread_has_exited_eventually() {
        let tid = std::thread::spawn(super::gettid).join().unwrap();
        // The kernel releases the id shortly after the join returns.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !super::thread_exited(tid) {
            assert!(
                std::time::Instant::now() < deadline,
                "thread {tid} still exists"
            );
            std::thread::yield_now();
        }
    }
}
