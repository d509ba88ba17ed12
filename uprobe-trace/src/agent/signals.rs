//! SIGTRAP stays deliverable in every thread of a preloaded program: a
//! probe site left on a breakpoint is a SIGTRAP, and a thread that blocks
//! it when it hits the site is killed by the kernel (xz's worker threads,
//! and many threaded programs, block every signal). So the calls that set
//! a signal mask go through the agent, which takes SIGTRAP out of the
//! mask they set: `pthread_sigmask`, `sigprocmask`, the masks handlers
//! run with (`sigaction`), a spawned child's initial mask
//! (`posix_spawnattr_setsigmask`), and the masks the `p*` waits and
//! `sigsuspend` wait with. The program sees SIGTRAP unblocked (nothing
//! sends it one but the engine's breakpoints). glibc's internal masking
//! (around `fork`, thread creation) is a system call these do not see;
//! the engine probes that code only with jumps written in one byte.
//!
//! Interposed only when preloaded (a library loaded into a running
//! process comes after libc): there, the agent leaves unattached the
//! sites that would stay on a breakpoint.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The next definition of `name` (libc's), looked up once. Not
/// async-signal-safe the first time (`dlsym`); callers that may run in a
/// signal handler find it looked up by [`prepare`].
fn next(cache: &AtomicUsize, name: &core::ffi::CStr) -> usize {
    let mut f = cache.load(Relaxed);
    if f == 0 {
        // SAFETY: looking up the next definition by name.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        cache.store(f, Relaxed);
    }
    f
}

/// `set` without SIGTRAP (a copy), or null for null.
fn without_trap(set: *const libc::sigset_t, copy: &mut libc::sigset_t) -> *const libc::sigset_t {
    if set.is_null() {
        return set;
    }
    // SAFETY: the caller's set, read; our copy, written.
    unsafe {
        *copy = *set;
        libc::sigdelset(copy, libc::SIGTRAP);
    }
    copy
}

macro_rules! interpose {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, mask: $mask:ident, cache: $cache:ident) => {
        static $cache: AtomicUsize = AtomicUsize::new(0);

        $(#[$doc])*
        ///
        /// # Safety
        /// As the libc function.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            type F = unsafe extern "C" fn($($ty),*) -> $ret;
            let name = core::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes());
            let f = next(&$cache, name.unwrap_or(c""));
            if f == 0 {
                // SAFETY: setting errno, as a missing function would.
                unsafe { *libc::__errno_location() = libc::ENOSYS };
                return -1 as $ret;
            }
            // SAFETY: a sigset_t is plain data.
            let mut copy: libc::sigset_t = unsafe { core::mem::zeroed() };
            let $mask = without_trap($mask, &mut copy);
            // SAFETY: libc's function, with the caller's arguments but the
            // mask.
            unsafe { core::mem::transmute::<usize, F>(f)($($arg),*) }
        }
    };
}

interpose!(
    /// `pthread_sigmask(3)`, never blocking SIGTRAP.
    fn pthread_sigmask(how: libc::c_int, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> libc::c_int,
    mask: set, cache: PTHREAD_SIGMASK
);
interpose!(
    /// `sigprocmask(2)`, never blocking SIGTRAP.
    fn sigprocmask(how: libc::c_int, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> libc::c_int,
    mask: set, cache: SIGPROCMASK
);
interpose!(
    /// `posix_spawnattr_setsigmask(3)`, never blocking SIGTRAP in the
    /// child.
    fn posix_spawnattr_setsigmask(attr: *mut libc::posix_spawnattr_t, set: *const libc::sigset_t) -> libc::c_int,
    mask: set, cache: SPAWN_SIGMASK
);
interpose!(
    /// `sigsuspend(2)`, never waiting with SIGTRAP blocked.
    fn sigsuspend(set: *const libc::sigset_t) -> libc::c_int,
    mask: set, cache: SIGSUSPEND
);
interpose!(
    /// `ppoll(2)`, never waiting with SIGTRAP blocked.
    fn ppoll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: *const libc::timespec, set: *const libc::sigset_t) -> libc::c_int,
    mask: set, cache: PPOLL
);
interpose!(
    /// `pselect(2)`, never waiting with SIGTRAP blocked.
    fn pselect(n: libc::c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, timeout: *const libc::timespec, set: *const libc::sigset_t) -> libc::c_int,
    mask: set, cache: PSELECT
);
interpose!(
    /// `epoll_pwait(2)`, never waiting with SIGTRAP blocked.
    fn epoll_pwait(fd: libc::c_int, events: *mut libc::epoll_event, max: libc::c_int, timeout: libc::c_int, set: *const libc::sigset_t) -> libc::c_int,
    mask: set, cache: EPOLL_PWAIT
);

static SIGACTION: AtomicUsize = AtomicUsize::new(0);

/// `sigaction(2)`, never blocking SIGTRAP while a handler runs.
///
/// # Safety
/// As `sigaction(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sigaction(
    sig: libc::c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> libc::c_int {
    type F = unsafe extern "C" fn(
        libc::c_int,
        *const libc::sigaction,
        *mut libc::sigaction,
    ) -> libc::c_int;
    let f = next(&SIGACTION, c"sigaction");
    if f == 0 {
        // SAFETY: setting errno, as a missing function would.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    }
    let mut copy;
    let act = if act.is_null() {
        act
    } else {
        // SAFETY: the caller's action, copied; its mask without SIGTRAP.
        unsafe {
            copy = *act;
            libc::sigdelset(&raw mut copy.sa_mask, libc::SIGTRAP);
        }
        &raw const copy
    };
    // SAFETY: libc's sigaction with the caller's arguments but the mask.
    unsafe { core::mem::transmute::<usize, F>(f)(sig, act, old) }
}

/// Looks every interposed function up now, in ordinary context, so that
/// none is looked up (with `dlsym`) from a signal handler later.
pub(super) fn prepare() {
    for (cache, name) in [
        (&PTHREAD_SIGMASK, c"pthread_sigmask"),
        (&SIGPROCMASK, c"sigprocmask"),
        (&SPAWN_SIGMASK, c"posix_spawnattr_setsigmask"),
        (&SIGSUSPEND, c"sigsuspend"),
        (&PPOLL, c"ppoll"),
        (&PSELECT, c"pselect"),
        (&EPOLL_PWAIT, c"epoll_pwait"),
        (&SIGACTION, c"sigaction"),
    ] {
        next(cache, name);
    }
}
