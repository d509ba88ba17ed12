//! A program that replaces the SIGTRAP handler after probes are attached:
//! every probe is disarmed (its original bytes back), attaching says why,
//! and the program's code runs whole instructions. In a file of its own:
//! it changes the process's SIGTRAP disposition.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use uprobe_core::{AttachError, Uprobe};

#[inline(never)]
extern "C" fn add_one(x: u64) -> u64 {
    std::hint::black_box(x) + 1
}

#[inline(never)]
extern "C" fn add_two(x: u64) -> u64 {
    std::hint::black_box(x) + 2
}

static PROGRAM_TRAPS: AtomicU64 = AtomicU64::new(0);

extern "C" fn program_handler(_: libc::c_int) {
    PROGRAM_TRAPS.fetch_add(1, SeqCst);
}

/// A probe on `f`'s breakpoint (a probe that takes a jump needs no
/// signal: `tests/jump.rs` checks it survives a replaced handler).
fn probe(f: extern "C" fn(u64) -> u64) -> Uprobe {
    // SAFETY: a function's address starts an instruction.
    unsafe { Uprobe::address(f as *const () as usize) }.trap_only()
}

#[test]
fn a_replaced_trap_handler_disarms_every_probe() {
    let one = probe(add_one).attach().unwrap();
    assert_eq!(add_one(1), 2);
    assert_eq!(one.hits(), 1);
    assert!(one.is_armed());

    // The program installs its own handler (keeping the engine's).
    // SAFETY: a plain handler that only counts.
    let engines = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = program_handler as *const () as libc::sighandler_t;
        libc::sigemptyset(&raw mut sa.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(
            libc::sigaction(libc::SIGTRAP, &raw const sa, &raw mut old),
            0
        );
        old
    };
    assert_eq!(
        probe(add_two).attach().unwrap_err(),
        AttachError::TrapHandlerReplaced { disarmed: 1 }
    );
    assert!(!one.is_armed(), "left armed under a foreign handler");
    // The original instruction runs, whole: the program's handler never
    // sees a trap of ours.
    assert_eq!(add_one(1), 2);
    assert_eq!(add_two(1), 3);
    assert_eq!(PROGRAM_TRAPS.load(SeqCst), 0);
    assert_eq!(one.hits(), 1);

    // The engine's handler back: probes attach again (the disarmed one
    // stays disarmed until it is attached anew).
    // SAFETY: restoring the disposition the program replaced.
    let restored =
        unsafe { libc::sigaction(libc::SIGTRAP, &raw const engines, std::ptr::null_mut()) };
    assert_eq!(restored, 0);
    let two = probe(add_two).attach().unwrap();
    assert_eq!(add_two(1), 3);
    assert_eq!(two.hits(), 1);
    let one_again = probe(add_one).attach().unwrap();
    assert_eq!(add_one(1), 2);
    assert_eq!(one_again.hits(), 1);
    one.detach().unwrap();
    assert!(
        one_again.is_armed(),
        "the old probe's detach disarmed the new one"
    );
    assert_eq!(add_one(5), 6);
    assert_eq!(one_again.hits(), 2);
}
