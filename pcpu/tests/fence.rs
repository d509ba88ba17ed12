//! The asymmetric fence forbids the store-buffering outcome (both sides
//! reading the other's flag as unset), with membarrier and, in a child
//! process started with `PCPU_NO_MEMBARRIER=1`, with the `SeqCst` fallback.

use std::sync::Barrier;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Dekker's handshake, many rounds: the reader does store/light/load, the
/// writer store/heavy/load. Returns the rounds where both read 0.
fn store_buffering_violations(rounds: u32) -> u32 {
    let (a, b) = (AtomicU32::new(0), AtomicU32::new(0));
    let ra = AtomicU32::new(0);
    let barrier = Barrier::new(2);
    let mut violations = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            for r in 1..=rounds {
                barrier.wait();
                a.store(r, Relaxed);
                pcpu::fence::light();
                ra.store(b.load(Relaxed), Relaxed);
                barrier.wait();
            }
        });
        for r in 1..=rounds {
            barrier.wait();
            b.store(r, Relaxed);
            pcpu::fence::heavy();
            let seen = a.load(Relaxed);
            barrier.wait();
            if seen != r && ra.load(Relaxed) != r {
                violations += 1;
            }
        }
    });
    violations
}

#[test]
fn membarrier_mode_forbids_store_buffering() {
    if std::env::var_os("PCPU_NO_MEMBARRIER").is_some() {
        return; // the fallback child runs only its own test
    }
    assert_eq!(
        pcpu::fence::mode(),
        pcpu::fence::Mode::Membarrier,
        "membarrier unavailable here"
    );
    assert_eq!(store_buffering_violations(test_support::scaled(20_000)), 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts a child process; .ci/miri runs the child's part (PCPU_NO_MEMBARRIER=1)"
)]
fn seqcst_fallback_forbids_store_buffering() {
    if std::env::var_os("PCPU_NO_MEMBARRIER").is_some() {
        assert_eq!(pcpu::fence::mode(), pcpu::fence::Mode::SeqCstFallback);
        assert_eq!(store_buffering_violations(test_support::scaled(20_000)), 0);
        println!("child: fallback fences hold");
        return;
    }
    let out = test_support::rerun_in_child(
        "seqcst_fallback_forbids_store_buffering",
        &[("PCPU_NO_MEMBARRIER", "1")],
    );
    assert!(test_support::printed(&out, "child: fallback fences hold"));
}
