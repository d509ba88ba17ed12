//! A read section held by another thread at fork never ends in the child:
//! `synchronize_timeout` reports it instead of hanging, and leases are
//! expired in the child (as the kernel does at fork) so grace periods
//! complete there.

use std::sync::Barrier;
use std::time::Duration;

use srcu::{LeaseSet, Srcu, SrcuCell};

#[test]
fn child_handles_sections_and_leases_held_at_fork() {
    let domain = Srcu::new();
    domain.prepare();
    let cell = SrcuCell::new(&domain, Some(7u32));
    let set = LeaseSet::new(&domain);
    let (held, forked) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let block = set.block(1);
            let _lease = block.lease(&cell).unwrap();
            held.wait();
            forked.wait(); // holds the lease across the fork
        });
        held.wait();
        // SAFETY: the child uses the domain and the set, then `_exit`s
        // without unwinding into the parent's state.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let timed_out = !domain.synchronize_timeout(Duration::from_millis(50));
            let expired = set.expire_all();
            let completes = domain.synchronize_timeout(Duration::from_secs(30));
            let code =
                i32::from(!timed_out) | i32::from(expired != 1) << 1 | i32::from(!completes) << 2;
            // SAFETY: leave the child immediately.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: our own child.
        unsafe { libc::waitpid(pid, &raw mut status, 0) };
        forked.wait();
        assert!(libc::WIFEXITED(status), "child died: {status}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "child: bit0 no timeout, bit1 not expired, bit2 no grace period"
        );
    });
}
