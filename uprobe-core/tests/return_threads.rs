//! Many threads with returns pending at once: the pool of per-thread
//! stacks has room for the threads there are at attach, and grows ahead
//! of new ones. In a file of its own: it counts the process's threads.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use uprobe_core::Uprobe;
use uprobe_core::testing::return_stacks;

static INSIDE: AtomicUsize = AtomicUsize::new(0);
static RELEASE: AtomicBool = AtomicBool::new(false);

/// Blocks until released: a return pending for as long.
#[inline(never)]
extern "C" fn blocks(x: u64) -> u64 {
    INSIDE.fetch_add(1, SeqCst);
    while !RELEASE.load(SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::hint::black_box(x) + 1
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_mins(2);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn hundreds_of_threads_with_returns_pending() {
    const EARLY: usize = 300;
    const LATE: usize = 300;
    // Threads that exist at attach.
    let start = Arc::new(Barrier::new(EARLY + 1));
    let mut threads: Vec<_> = (0..EARLY)
        .map(|i| {
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                assert_eq!(blocks(i as u64), i as u64 + 1);
            })
        })
        .collect();
    let f: extern "C" fn(u64) -> u64 = blocks;
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { Uprobe::address(f as *const () as usize) }
        .on_return(|_| {})
        .attach()
        .unwrap();
    assert!(
        return_stacks() >= EARLY,
        "no room for the threads there are"
    );
    start.wait();
    wait_until("the early threads are inside", || {
        INSIDE.load(SeqCst) == EARLY
    });
    // Threads that come later, in waves: the pool grows ahead of them.
    for wave in 0..LATE / 50 {
        let before = INSIDE.load(SeqCst);
        threads.extend((0..50).map(|i| {
            std::thread::spawn(move || {
                let x = (wave * 50 + i) as u64;
                assert_eq!(blocks(x), x + 1);
            })
        }));
        wait_until("a wave is inside", || INSIDE.load(SeqCst) == before + 50);
        // The service thread keeps a quarter of the stacks spare.
        wait_until("the pool grew", || {
            4 * INSIDE.load(SeqCst) < 3 * return_stacks() + 4
        });
    }
    RELEASE.store(true, SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    println!(
        "{} threads: {} returns, {} missed, {} stacks",
        EARLY + LATE,
        probe.returns(),
        probe.missed_returns(),
        return_stacks()
    );
    assert_eq!(probe.missed_returns(), 0);
    assert_eq!(probe.returns(), (EARLY + LATE) as u64);
}
