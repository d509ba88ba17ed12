//! A thread that blocks SIGTRAP would be killed (with the whole process)
//! by a probe hit: attaching refuses while one exists.
#![cfg(target_arch = "x86_64")]

mod common;

use std::sync::mpsc;

use common::{call, fn_addr, probe_at};
use uprobe_core::AttachError;

core::arch::global_asm!(
    ".text",
    ".globl b_nop",
    "b_nop:",
    "nop",
    "mov rax, rdi",
    "ret"
);

unsafe extern "C" {
    fn b_nop(x: u64) -> u64;
}

#[test]
fn threads_blocking_sigtrap_refuse_the_attach() {
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
}
