//! Readers and writers hammer one semaphore for a fixed number of
//! iterations; readers check that the data is never torn (all words
//! equal), writers that no reader is inside. Bounded in iterations, not
//! time.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use percpu_rwsem::{PercpuRwSem, RawPercpuRwSem};

const WORDS: usize = 8;

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

/// Runs `readers` + `writers` threads; returns (reads, writes) done.
fn hammer(readers: usize, writers: usize, iters: u64) -> (u64, u64) {
    let sem = PercpuRwSem::new([0u64; WORDS]);
    let inside = AtomicUsize::new(0);
    let (reads_done, writes_done) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for _ in 0..readers {
            s.spawn(|| {
                for i in 0..iters {
                    let g = if i % 7 == 0 {
                        match sem.try_read() {
                            Some(g) => g,
                            None => continue,
                        }
                    } else {
                        sem.read()
                    };
                    inside.fetch_add(1, Relaxed);
                    let first = g[0];
                    assert!(g.iter().all(|&w| w == first), "torn read: {:?}", *g);
                    inside.fetch_sub(1, Relaxed);
                    drop(g);
                    reads_done.fetch_add(1, Relaxed);
                }
            });
        }
        for _ in 0..writers {
            s.spawn(|| {
                for i in 0..iters / 50 {
                    let mut g = if i % 5 == 0 {
                        match sem.try_write() {
                            Some(g) => g,
                            None => continue,
                        }
                    } else {
                        sem.write()
                    };
                    assert_eq!(inside.load(Relaxed), 0, "reader inside during a write");
                    let next = g[0] + 1;
                    for w in g.iter_mut() {
                        *w = next;
                        std::hint::spin_loop();
                    }
                    drop(g);
                    writes_done.fetch_add(1, Relaxed);
                }
            });
        }
    });
    let total = sem.into_inner();
    assert_eq!(total[0], writes_done.load(Relaxed), "a write was lost");
    (reads_done.load(Relaxed), writes_done.load(Relaxed))
}

#[test]
fn readers_and_writers_never_overlap() {
    let (reads, writes) = hammer(cpus(), 2, test_support::scaled(20_000));
    assert!(reads > 0 && writes > 0);
}

#[test]
fn oversubscribed_readers_and_writers_never_overlap() {
    let (reads, writes) = hammer(4 * cpus(), 3, test_support::scaled(5_000));
    assert!(reads > 0 && writes > 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts a child process; .ci/miri runs the child's part (RWSEM_CHILD=1 PCPU_NO_MEMBARRIER=1)"
)]
fn fallback_paths_never_overlap_without_rseq_or_membarrier() {
    if std::env::var_os("RWSEM_CHILD").is_some() {
        assert!(!pcpu::rseq::available());
        let (reads, writes) = hammer(cpus(), 2, test_support::scaled(10_000));
        assert!(reads > 0 && writes > 0);
        println!("child: fallback ok");
        return;
    }
    let out = test_support::rerun_in_child(
        "fallback_paths_never_overlap_without_rseq_or_membarrier",
        &[
            ("RWSEM_CHILD", "1"),
            ("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
            ("PCPU_NO_MEMBARRIER", "1"),
        ],
    );
    assert!(test_support::printed(&out, "child: fallback ok"));
}

#[test]
fn read_guards_may_be_released_on_another_thread() {
    let sem = PercpuRwSem::new(5);
    let guards: Vec<_> = (0..8).map(|_| sem.read()).collect();
    assert!(sem.try_write().is_none(), "writer got in past 8 readers");
    std::thread::scope(|s| {
        s.spawn(move || drop(guards));
    });
    *sem.write() += 1;
    assert_eq!(*sem.read(), 6);
}

#[test]
fn a_waiting_writer_stops_new_readers() {
    let sem = PercpuRwSem::new(0u32);
    let first = sem.read();
    std::thread::scope(|s| {
        let writer = s.spawn(|| *sem.write() += 1);
        // Wait until the writer has closed the gate (it then sleeps,
        // waiting for `first` to leave).
        while !sem.raw().is_locked_exclusive() {
            std::thread::yield_now();
        }
        assert!(
            sem.try_read().is_none(),
            "a new reader passed a waiting writer"
        );
        drop(first);
        writer.join().unwrap();
    });
    assert_eq!(*sem.read(), 1);
}

#[test]
fn works_through_lock_api() {
    static LOCK: lock_api::RwLock<RawPercpuRwSem, Vec<u8>> =
        lock_api::RwLock::from_raw(RawPercpuRwSem::new(), Vec::new());
    LOCK.write().push(1);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| assert_eq!(*LOCK.read(), [1]));
        }
    });
    let r = LOCK.try_read().unwrap();
    assert!(LOCK.try_write().is_none());
    drop(r);
    assert!(LOCK.try_write().is_some());
}

#[test]
fn back_to_back_writers_and_return_to_the_fast_path() {
    let sem = PercpuRwSem::new(0u64);
    for _ in 0..100 {
        *sem.write() += 1;
    }
    // After the linger delay the first slow reader reopens the fast path;
    // every read is correct either way.
    std::thread::sleep(percpu_rwsem::LINGER_DELAY * 3);
    for _ in 0..1000 {
        assert_eq!(*sem.read(), 100);
    }
    assert!(!sem.raw().is_locked_exclusive());
}
