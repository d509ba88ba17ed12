//! loom models of the semaphore (`RUSTFLAGS="--cfg pcpu_loom"`). Each model runs
//! twice: with rseq modelled (see `pcpu::unstable::loom_cpu`: the gated fast path
//! without any fence, the grace period as "wait out every CPU's critical
//! section") and in the fallback world (atomic counts, `SeqCst` fences).
//! Futex waits are yields (a lost wake-up becomes a model that never
//! finishes) and the linger delay is always over, so the return to the
//! fast path races with every writer.
//! The protected data is a loom `UnsafeCell`: any overlap of a writer with
//! a reader or writer is reported as a data race.
#![cfg(pcpu_loom)]

use loom::cell::UnsafeCell;
use loom::thread;
use percpu_rwsem::PercpuRwSem;

/// The protected data: a loom cell, so overlapping accesses are reported.
struct Data(UnsafeCell<u32>);

// SAFETY: only accessed under the semaphore, which is what the models check.
unsafe impl Sync for Data {}
// SAFETY: as above.
unsafe impl Send for Data {}

/// A semaphore for one model iteration (leaked so guards can move to
/// spawned threads, which need `'static`).
fn shared() -> &'static PercpuRwSem<Data> {
    Box::leak(Box::new(PercpuRwSem::new(Data(UnsafeCell::new(0)))))
}

/// Checks `f` twice: with rseq modelled (gated fast paths without fences,
/// membarrier as "wait out every CPU's critical section") and in the
/// fallback world (atomic counts, `SeqCst` fences on both sides).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let f = std::sync::Arc::new(f);
    for rseq in [true, false] {
        pcpu::unstable::loom_cpu::set_rseq_modelled(rseq);
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(2);
        let f = std::sync::Arc::clone(&f);
        b.check(move || f());
    }
}

fn read(s: &PercpuRwSem<Data>) -> u32 {
    let g = s.read();
    // SAFETY: the read side is held.
    g.0.with(|p| unsafe { *p })
}

fn write(s: &PercpuRwSem<Data>) {
    let g = s.write();
    // SAFETY: the write side is held.
    g.0.with_mut(|p| unsafe { *p += 1 });
}

#[test]
fn reader_and_writer_exclude_each_other() {
    model(|| {
        let s = shared();
        let w = thread::spawn(move || write(s));
        let seen = read(s);
        w.join().unwrap();
        assert!(seen <= 1);
        assert_eq!(read(s), 1);
    });
}

#[test]
fn writers_exclude_each_other() {
    model(|| {
        let s = shared();
        let w = thread::spawn(move || write(s));
        write(s);
        w.join().unwrap();
        assert_eq!(read(s), 2);
    });
}

#[test]
fn writer_waits_for_a_reader_that_started_first_and_left_on_another_thread() {
    model(|| {
        let s = shared();
        let g = s.read();
        // SAFETY: the read side is held.
        let seen = g.0.with(|p| unsafe { *p });
        let w = thread::spawn(move || write(s));
        // The read side is released by another thread than the one that
        // took it, on another modelled CPU.
        let r = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            // SAFETY: the read side is still held (by this guard).
            let still = g.0.with(|p| unsafe { *p });
            drop(g);
            still
        });
        let still = r.join().unwrap();
        w.join().unwrap();
        assert_eq!(
            (seen, still),
            (0, 0),
            "the writer got in before the reader left"
        );
        assert_eq!(read(s), 1);
    });
}

#[test]
fn back_to_back_writers_with_a_reader_returning_to_the_fast_path() {
    model(|| {
        let s = shared();
        write(s); // leaves the gate lingering
        let w = thread::spawn(move || write(s)); // may skip the grace period
        let seen = read(s); // may reopen the fast path
        let again = read(s); // may take the reopened fast path
        w.join().unwrap();
        assert!(seen == 1 || seen == 2);
        assert!(again >= seen);
    });
}

/// A thread that reads takes the read side again while a writer waits for
/// its first read (what its signal handler does): the second read must not
/// wait for the writer, which waits for the first.
#[test]
fn a_reading_thread_reads_again_past_a_waiting_writer() {
    model(|| {
        let s = shared();
        let first = s.read();
        let w = thread::spawn(move || write(s));
        let again = read(s);
        drop(first);
        w.join().unwrap();
        assert_eq!(again, 0, "the writer got in before the reads ended");
        assert_eq!(read(s), 1);
    });
}

/// A read guard released on another thread leaves its taker counted as a
/// reader; the taker's next read then passes a waiting writer (as a nested
/// read would), and must still never overlap a writer that is inside (the
/// cell reports a data race if it does).
#[test]
fn a_stale_read_depth_never_lets_a_reader_meet_a_writer() {
    model(|| {
        let s = shared();
        let g = s.read();
        thread::spawn(move || drop(g)).join().unwrap();
        let w = thread::spawn(move || write(s));
        let seen = read(s);
        w.join().unwrap();
        assert!(seen <= 1);
        assert_eq!(read(s), 1);
    });
}

/// A writer that downgrades keeps seeing its own write: no other writer
/// gets in between the write and the end of the downgraded read, while a
/// reader may enter alongside it.
#[test]
fn a_downgraded_writer_sees_its_own_write() {
    model(|| {
        let s = shared();
        let w = thread::spawn(move || write(s));
        let g = s.write();
        // SAFETY: the write side is held.
        let mine = g.0.with_mut(|p| unsafe {
            *p += 10;
            *p
        });
        let r = percpu_rwsem::WriteGuard::downgrade(g);
        // SAFETY: the read side is held.
        let still = r.0.with(|p| unsafe { *p });
        drop(r);
        w.join().unwrap();
        assert_eq!(mine, still, "another writer got in during the downgrade");
        assert_eq!(read(s), 11);
    });
}
