//! Guard types: the read guard is covariant in `T` (as `std`'s is), and a
//! write guard can be downgraded to a read guard, directly or through
//! `lock_api`; semaphores built for another CPU count.

use percpu_rwsem::{PercpuRwSem, RawPercpuRwSem, WriteGuard};

/// `std`'s `test_read_guard_covariance`, against this crate's guard: a
/// guard of `PercpuRwSem<&'long i32>` passes where one of `&'short i32`
/// is expected. (Does not compile if the guard is invariant in `T`.)
#[test]
fn read_guard_is_covariant() {
    #[allow(clippy::trivially_copy_pass_by_ref)] // the lifetime is the point
    fn do_stuff<'a>(_: percpu_rwsem::ReadGuard<'_, &'a i32>, _: &'a i32) {}
    let j: i32 = 5;
    let lock = PercpuRwSem::new(&j);
    {
        let i = 6;
        do_stuff(lock.read(), &i);
    }
    drop(lock);
}

#[test]
fn downgrade_keeps_the_write_and_admits_readers_not_writers() {
    let sem = PercpuRwSem::new(1u32);
    let mut w = sem.write();
    *w = 2;
    let r = WriteGuard::downgrade(w);
    assert_eq!(*r, 2);
    assert!(!sem.raw().is_locked_exclusive());
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(*sem.read(), 2, "a reader beside the downgraded one");
            assert!(sem.try_write().is_none(), "a writer got past the read");
        });
    });
    // Nested read on the downgrading thread, then the read is released.
    assert_eq!(*sem.read(), 2);
    drop(r);
    *sem.write() += 1;
    assert_eq!(*sem.read(), 3);
}

#[test]
fn a_writer_waiting_behind_a_downgraded_read_gets_in_after_it() {
    let sem = PercpuRwSem::new(0u32);
    let mut w = sem.write();
    *w = 1;
    std::thread::scope(|s| {
        let r = WriteGuard::downgrade(w);
        let writer = s.spawn(|| *sem.write() += 1);
        while !sem.raw().is_locked_exclusive() {
            std::thread::yield_now();
        }
        // The downgraded thread reads again past the waiting writer.
        assert_eq!(*sem.read(), 1);
        assert_eq!(*r, 1);
        drop(r);
        writer.join().unwrap();
    });
    assert_eq!(*sem.read(), 2);
}

#[test]
fn downgrade_through_lock_api() {
    let lock: lock_api::RwLock<RawPercpuRwSem, Vec<u8>> = lock_api::RwLock::new(Vec::new());
    let mut w = lock.write();
    w.push(1);
    let r = lock_api::RwLockWriteGuard::downgrade(w);
    assert_eq!(*r, [1]);
    assert!(lock.try_write().is_none());
    assert_eq!(*lock.try_read().unwrap(), [1]);
    drop(r);
    assert!(lock.try_write().is_some());
}

/// A semaphore built for more CPUs than the machine has (and for fewer:
/// its overflow slot takes the rest): a writer still waits out a reader on
/// another thread, and readers come back once it is done.
#[test]
fn a_semaphore_for_another_cpu_count_excludes_as_ever() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    for cpus in [1, 64, 300] {
        let sem = PercpuRwSem::with_cpus(0u32, cpus);
        let wrote = AtomicBool::new(false);
        let guard = sem.read();
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                *sem.write() += 1;
                wrote.store(true, SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(!wrote.load(SeqCst), "{cpus} CPUs: wrote under a reader");
            drop(guard);
            writer.join().unwrap();
        });
        assert_eq!(*sem.read(), 1, "{cpus} CPUs");
    }
}
