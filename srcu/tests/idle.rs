//! A domain's reclaimer thread ends when it has had nothing to do for a
//! while, and the next callback starts another: a program that stopped
//! deferring frees keeps no thread of the domain. Its own test binary:
//! other tests' domains have reclaimers of their own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use srcu::Srcu;

fn reclaimers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .filter(|c| c.trim() == "srcu-reclaim")
        .count()
}

fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[test]
#[cfg_attr(
    miri,
    ignore = "counts the threads in /proc/self/task: Miri's threads are not the host's"
)]
fn an_idle_reclaimer_ends_and_the_next_callback_starts_another() {
    let domain = Srcu::new();
    let ran = Arc::new(AtomicU64::new(0));
    for round in 1..=2 {
        let r = Arc::clone(&ran);
        domain.call(move || {
            r.fetch_add(1, SeqCst);
        });
        domain.barrier();
        assert_eq!(ran.load(SeqCst), round);
        assert!(
            eventually(|| reclaimers() == 0),
            "round {round}: {} left",
            reclaimers()
        );
    }
}
