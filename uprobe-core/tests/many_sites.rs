//! Many probed sites at once: the probe table grows past its first size
//! while every hit is still found, and attaching a large batch shares its
//! scans and its grace period. (Times are printed, never asserted: see
//! `bench uprobe-attach` for the measurement.)
#![cfg(target_arch = "x86_64")]

mod common;

use std::time::Instant;

use common::{byte_at, probe_at};
use uprobe_core::{Mode, Probe, Uprobe};

/// `n` one-byte `nop`s then `ret`, in fresh executable memory: `n`
/// distinct instruction boundaries.
fn nop_sled(n: usize) -> usize {
    let len = (n + 1).next_multiple_of(4096);
    // SAFETY: a fresh anonymous mapping.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: `len` bytes of our own writable mapping.
    unsafe {
        std::ptr::write_bytes(base.cast::<u8>(), 0x90, n);
        *base.cast::<u8>().add(n) = 0xc3;
        assert_eq!(
            libc::mprotect(base, len, libc::PROT_READ | libc::PROT_EXEC),
            0
        );
    }
    base as usize
}

fn run_sled(base: usize) {
    // SAFETY: the sled: nops, then ret.
    let f: extern "C" fn() = unsafe { std::mem::transmute(base) };
    f();
}

#[test]
fn a_hundred_thousand_sites() {
    const N: usize = 100_000;
    let base = nop_sled(N);
    let start = Instant::now();
    let probes: Vec<Probe> =
        Uprobe::attach_all((0..N).map(|i| probe_at(base + i))).expect("attach 100k sites");
    let attached = start.elapsed();
    // Each nop holds its breakpoint, or a jump punned over the next ones'
    // (prefixed or not).
    for (i, p) in probes.iter().enumerate() {
        let first = byte_at(base + i);
        match p.mode() {
            Mode::Jump(_) => assert!(first == 0xe9 || first == 0x26, "{first:#x}"),
            Mode::Trap(_) => assert_eq!(first, 0xcc),
        }
    }
    let jumps = probes.iter().filter(|p| p.mode().is_jump()).count();
    let start = Instant::now();
    run_sled(base);
    let ran = start.elapsed();
    let missing = probes.iter().filter(|p| p.hits() != 1).count();
    assert_eq!(missing, 0, "hits not found in the table");
    // One more on top of them all.
    let start = Instant::now();
    let extra_base = nop_sled(1);
    let extra = probe_at(extra_base).attach().unwrap();
    let one_more = start.elapsed();
    run_sled(extra_base);
    assert_eq!(extra.hits(), 1);
    let start = Instant::now();
    Probe::detach_all(probes).unwrap();
    let detached = start.elapsed();
    assert!((0..N).all(|i| byte_at(base + i) == 0x90), "bytes restored");
    run_sled(base);
    println!(
        "{N} sites ({jumps} through a jump): attach_all {attached:?}, one hit each {ran:?}, \
         one more attach {one_more:?}, detach_all {detached:?}"
    );
}
