//! A read held by another thread at `fork()` never ends in the child: the
//! child's `try_write` must fail instead of hanging, and its `try_read`
//! must still work.

use std::sync::Barrier;

use percpu_rwsem::PercpuRwSem;

#[test]
#[cfg_attr(miri, ignore = "fork: Miri cannot fork")]
fn child_try_operations_do_not_hang_on_holds_from_before_fork() {
    let sem = PercpuRwSem::new(7u32);
    sem.prepare();
    let held = Barrier::new(2);
    let forked = Barrier::new(2);
    std::thread::scope(|s| {
        s.spawn(|| {
            let _g = sem.read();
            held.wait();
            forked.wait(); // hold across the fork
        });
        held.wait();
        // SAFETY: the child only runs lock operations that neither allocate
        // nor take user-space locks, then `_exit`s.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = match (sem.try_write().is_none(), sem.try_read().map(|g| *g)) {
                (true, Some(7)) => 0,
                (false, _) => 1, // the writer ignored the parent's reader
                (true, _) => 2,  // readers were shut out
            };
            // SAFETY: leave the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &raw mut status, 0) };
        forked.wait();
        assert!(
            libc::WIFEXITED(status),
            "child did not exit normally: {status}"
        );
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "child saw the wrong lock state"
        );
    });
    assert!(sem.try_write().is_some());
}
