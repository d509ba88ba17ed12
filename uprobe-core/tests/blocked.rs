//! A thread that blocks SIGTRAP would be killed (with the whole process)
//! by a probe hit: attaching refuses while one exists, and refuses the
//! functions glibc runs with every signal blocked.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

#[cfg(target_arch = "x86_64")]
mod common;

#[cfg(target_arch = "x86_64")]
use std::sync::mpsc;

#[cfg(target_arch = "x86_64")]
use common::{call, fn_addr, probe_at};
use uprobe_core::{AttachError, BlockedPath, Uprobe};

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    ".globl b_nop",
    "b_nop:",
    "nop",
    "mov rax, rdi",
    "ret"
);

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    fn b_nop(x: u64) -> u64;
}

/// The examples of the issue that found them: a probe on `madvise`
/// killed the process at the next thread exit, one on `execve` or `dup2`
/// every child `Command` started; `free` and `strlen` (an IFUNC: the
/// implementation this CPU runs) are on the same paths.
#[test]
fn functions_glibc_runs_with_signals_blocked_are_refused() {
    for (name, expected) in [
        ("madvise", BlockedPath::ThreadExit),
        ("free", BlockedPath::ThreadExit),
        ("_setjmp", BlockedPath::ThreadStart),
        ("munmap", BlockedPath::SpawnParent),
        ("execve", BlockedPath::SpawnChild),
        ("dup2", BlockedPath::SpawnChild),
        ("strlen", BlockedPath::SpawnChild),
    ] {
        let probe = Uprobe::in_object("libc.so.6", name).unwrap();
        let addr = probe.addr();
        match probe.attach() {
            Err(e @ AttachError::SignalsBlocked { .. }) => {
                let AttachError::SignalsBlocked {
                    addr: at,
                    function,
                    path,
                } = &e
                else {
                    unreachable!()
                };
                assert_eq!((*at, *function, *path), (addr, name, expected));
                assert!(e.to_string().contains("every signal blocked"), "{e}");
            }
            other => panic!("{name}: expected SignalsBlocked, got {other:?}"),
        }
    }
    // A return probe is refused the same way (its entry is a breakpoint).
    assert!(matches!(
        Uprobe::in_object("libc.so.6", "execve")
            .unwrap()
            .on_return(|_| {})
            .attach(),
        Err(AttachError::SignalsBlocked { .. })
    ));
}

/// The opt-out attaches: `tcsetpgrp` (on the spawn child's path when a
/// spawn asks for a foreground process group; this test spawns nothing).
#[test]
fn the_opt_out_attaches_on_a_blocked_path() {
    type Tcsetpgrp = unsafe extern "C" fn(i32, i32) -> i32;
    let probe = Uprobe::in_object("libc.so.6", "tcsetpgrp").unwrap();
    assert!(matches!(
        Uprobe::in_object("libc.so.6", "tcsetpgrp")
            .unwrap()
            .attach(),
        Err(AttachError::SignalsBlocked { .. })
    ));
    let probe = probe.allow_blocked_signal_paths().attach().unwrap();
    let f: Tcsetpgrp = std::hint::black_box(libc::tcsetpgrp);
    // SAFETY: tcsetpgrp on a closed descriptor fails with EBADF.
    assert_eq!(unsafe { f(-1, 0) }, -1);
    assert_eq!(probe.hits(), 1);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn threads_blocking_sigtrap_refuse_the_attach() {
    // Its own process: while its thread blocks SIGTRAP every attach of the
    // process is refused, the other tests' too.
    test_support::in_own_process("threads_blocking_sigtrap_refuse_the_attach", || {
        let (tid_tx, tid_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let blocker = std::thread::spawn(move || {
            // SAFETY: blocking one signal for this thread only.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&raw mut set);
                libc::sigaddset(&raw mut set, libc::SIGTRAP);
                libc::pthread_sigmask(libc::SIG_BLOCK, &raw const set, std::ptr::null_mut());
                tid_tx.send(libc::syscall(libc::SYS_gettid) as i32).unwrap();
            }
            done_rx.recv().unwrap();
        });
        let tid = tid_rx.recv().unwrap();
        match probe_at(fn_addr(b_nop)).attach() {
            Err(AttachError::TrapBlocked { tids }) => assert_eq!(tids, [tid]),
            other => panic!("expected TrapBlocked, got {other:?}"),
        }
        done_tx.send(()).unwrap();
        blocker.join().unwrap();
        let probe = probe_at(fn_addr(b_nop)).attach().unwrap();
        assert_eq!(call(b_nop, 3), 3);
        assert_eq!(probe.hits(), 1);
    });
}
