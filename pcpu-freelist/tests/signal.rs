//! `try_pop` and `try_push` from a signal handler that interrupts a thread
//! in the middle of its own pops and pushes (possibly holding a list's
//! lock, or inside a critical section): no deadlock, no element lost or
//! handed out twice.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pcpu_freelist::FreeList;

static POOL: OnceLock<FreeList<AtomicBool>> = OnceLock::new();
static HANDLED: AtomicU64 = AtomicU64::new(0);
static TOOK: AtomicU64 = AtomicU64::new(0);

fn take(flag: &AtomicBool) {
    assert!(
        !flag.swap(true, Ordering::Relaxed),
        "element handed out twice"
    );
}

extern "C" fn on_usr1(_: libc::c_int) {
    let pool = POOL.get().expect("pool built before the handler");
    // Take two elements, then give one back with try_push and one by drop.
    let a = pool.try_pop();
    let b = pool.try_pop();
    for e in [&a, &b].into_iter().flatten() {
        take(e);
        TOOK.fetch_add(1, Ordering::Relaxed);
        e.store(false, Ordering::Relaxed);
    }
    if let Some(a) = a {
        pool.try_push(a);
    }
    drop(b);
    HANDLED.fetch_add(1, Ordering::Relaxed);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn handler_pops_and_pushes_while_the_thread_it_interrupted_does() {
    let pool = POOL.get_or_init(|| FreeList::new((0..4).map(|_| AtomicBool::new(false))));
    // SAFETY: installing a handler that only uses async-signal-safe
    // operations (try_pop, try_push, drop of an element, atomics).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as libc::sighandler_t;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &raw const sa, std::ptr::null_mut()),
            0
        );
    }
    let stop = AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            let mut held = Vec::new();
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                if held.len() < 2
                    && let Some(e) = pool.pop()
                {
                    take(&e);
                    held.push(e);
                } else if let Some(e) = held.pop() {
                    e.store(false, Ordering::Relaxed);
                    if round.is_multiple_of(2) {
                        pool.push(e);
                    } else {
                        drop(e);
                    }
                }
            }
            for e in held {
                e.store(false, Ordering::Relaxed);
            }
        });
        // Another thread pops other CPUs' lists (taking their locks).
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Some(e) = pool.pop() {
                    take(&e);
                    e.store(false, Ordering::Relaxed);
                }
            }
        });
        let worker = rx.recv().unwrap();
        for _ in 0..20_000 {
            // SAFETY: the worker runs until `stop`, so its pthread_t is live.
            assert_eq!(unsafe { libc::pthread_kill(worker, libc::SIGUSR1) }, 0);
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(HANDLED.load(Ordering::Relaxed) > 0, "no signal was handled");
    let back: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
    assert_eq!(back.len(), 4, "elements lost or duplicated");
    println!(
        "{} handlers ran, took {} elements",
        HANDLED.load(Ordering::Relaxed),
        TOOK.load(Ordering::Relaxed)
    );
}
