//! A thread that blocks SIGTRAP would be killed (with the whole process)
//! by a breakpoint hit: attaching refuses while one exists, and the
//! functions glibc runs with every signal blocked get a one-byte jump
//! (never a breakpoint) or are refused.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

#[cfg(target_arch = "x86_64")]
mod common;

#[cfg(target_arch = "x86_64")]
use std::sync::mpsc;

#[cfg(target_arch = "x86_64")]
use common::{call, fn_addr, probe_at};
use uprobe_core::{AttachError, BlockedPath, Mode, Tactic, Uprobe};

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
/// implementation this CPU runs) are on the same paths. Each gets a
/// one-byte jump and never a breakpoint (x86-64), or is refused with the
/// path named.
#[test]
fn functions_glibc_runs_with_signals_blocked_get_one_byte_jumps_or_are_refused() {
    let mut jumps = 0;
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
            Ok(p) => {
                assert!(
                    matches!(
                        p.mode(),
                        Mode::Jump(Tactic::Pun {
                            written: 1,
                            prefixes: 0
                        })
                    ),
                    "{name}: {:?}",
                    p.mode()
                );
                jumps += 1;
            }
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
            other => panic!("{name}: expected a one-byte jump or SignalsBlocked, got {other:?}"),
        }
    }
    println!("{jumps} of 7 took a one-byte jump");
    if cfg!(target_arch = "x86_64") {
        assert!(jumps > 0, "no function of signal-blocked code took a jump");
    }
    // A return probe the same way (its entry never holds a breakpoint).
    match Uprobe::in_object("libc.so.6", "execve")
        .unwrap()
        .on_return(|_| {})
        .attach()
    {
        Ok(p) => assert!(p.mode().is_jump()),
        Err(e) => assert!(matches!(e, AttachError::SignalsBlocked { .. }), "{e}"),
    }
}

/// A one-byte jump in signal-blocked code is never taken back to a
/// breakpoint: a trap-only probe there, or a probe inside its bytes, is
/// refused while it is attached.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_one_byte_jump_never_goes_back_to_a_breakpoint() {
    // Its own process: it probes madvise and calls it.
    test_support::in_own_process("a_one_byte_jump_never_goes_back_to_a_breakpoint", || {
        type Free = unsafe extern "C" fn(*mut libc::c_void);
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let Ok(probe) = Uprobe::in_object("libc.so.6", "free")
            .unwrap()
            .only_thread(me)
            .attach()
        else {
            println!("skipped: free takes no one-byte jump here");
            return;
        };
        let err = Uprobe::in_object("libc.so.6", "free")
            .unwrap()
            .allow_blocked_signal_paths()
            .trap_only()
            .attach()
            .unwrap_err();
        assert!(matches!(err, AttachError::OneBytePatch { .. }), "{err}");
        assert!(probe.mode().is_jump());
        let f: Free = std::hint::black_box(libc::free);
        // SAFETY: free(NULL) does nothing.
        unsafe { f(core::ptr::null_mut()) };
        assert!(probe.hits() >= 1);
    });
}

/// The opt-out attaches as anywhere else (a breakpoint first): `tcsetpgrp`
/// (on the spawn child's path when a spawn asks for a foreground process
/// group; this test spawns nothing).
#[test]
fn the_opt_out_attaches_on_a_blocked_path() {
    type Tcsetpgrp = unsafe extern "C" fn(i32, i32) -> i32;
    let probe = Uprobe::in_object("libc.so.6", "tcsetpgrp").unwrap();
    let probe = probe.allow_blocked_signal_paths().attach().unwrap();
    let f: Tcsetpgrp = std::hint::black_box(libc::tcsetpgrp);
    // SAFETY: tcsetpgrp on a closed descriptor fails with EBADF.
    assert_eq!(unsafe { f(-1, 0) }, -1);
    assert_eq!(probe.hits(), 1);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn threads_blocking_sigtrap_refuse_breakpoints_not_one_byte_jumps() {
    // Its own process: while its thread blocks SIGTRAP every attach of the
    // process is refused, the other tests' too.
    test_support::in_own_process(
        "threads_blocking_sigtrap_refuse_breakpoints_not_one_byte_jumps",
        || {
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
            // A batch that needs a breakpoint is refused whole, the one-byte
            // jump in it too; alone, the one-byte jump (no breakpoint ever)
            // attaches, and a second probe joins it.
            let free = Uprobe::in_object("libc.so.6", "free").unwrap();
            let both = Uprobe::attach_all(vec![free, probe_at(fn_addr(b_nop))]);
            assert!(
                matches!(both, Err(AttachError::TrapBlocked { .. })),
                "{both:?}"
            );
            match Uprobe::in_object("libc.so.6", "free").unwrap().attach() {
                Ok(p) => {
                    assert!(matches!(
                        p.mode(),
                        Mode::Jump(Tactic::Pun { written: 1, .. })
                    ));
                    let second = Uprobe::in_object("libc.so.6", "free")
                        .unwrap()
                        .attach()
                        .unwrap();
                    let f: unsafe extern "C" fn(*mut libc::c_void) =
                        std::hint::black_box(libc::free);
                    // SAFETY: free(NULL) does nothing.
                    unsafe { f(std::ptr::null_mut()) };
                    assert!(p.hits() >= 1 && second.hits() >= 1);
                }
                Err(AttachError::SignalsBlocked { .. }) => {
                    println!("free takes no one-byte jump here: that part skipped");
                }
                Err(e) => panic!("{e}"),
            }
            done_tx.send(()).unwrap();
            blocker.join().unwrap();
            let probe = probe_at(fn_addr(b_nop)).attach().unwrap();
            assert_eq!(call(b_nop, 3), 3);
            assert_eq!(probe.hits(), 1);
        },
    );
}
