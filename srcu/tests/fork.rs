//! `fork()` while other threads hold read sections and leases: only the
//! forking thread exists in the child, so their sections are discounted
//! there (after the leases are expired), the helper threads are restarted,
//! and callbacks queued before the fork run in the child. A section the
//! forking thread itself holds stays counted. Each child arms an alarm and
//! the parent gives it a deadline, so a hang shows up as a killed child
//! instead of a hung test.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::Duration;

use srcu::{LeaseSet, Srcu, SrcuCell};

/// Forks; the child runs `child` (its exit status: bit `i` set for failed
/// check `i`) under a watchdog and `_exit`s; returns the child's exit
/// status, or -1 if it was killed (a hang ends in SIGALRM). Never panics,
/// so a test's threads are released before it asserts.
fn fork_and_check(child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only uses this process's srcu state and `_exit`s
    // without unwinding into the parent's.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: plain syscalls in the child.
        unsafe { libc::alarm(30) };
        let code = child();
        // SAFETY: leave the child immediately.
        unsafe { libc::_exit(code) };
    }
    if pid < 0 {
        return -2;
    }
    // A child can also hang inside `fork` (in a fork handler, before the
    // alarm is armed): the parent kills it after a deadline.
    let deadline = std::time::Instant::now() + Duration::from_mins(1);
    let mut status = 0;
    // SAFETY: our own child.
    while unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) } == 0 {
        if std::time::Instant::now() > deadline {
            // SAFETY: our own child, reaped right after.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &raw mut status, 0);
            }
            return -1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    }
}

/// Runs `run` on this thread while another thread holds a guard
/// section of `domain` from before it until after it returns (across the
/// fork `run` makes); returns what `run` returns.
fn while_another_thread_reads(domain: &Srcu, run: impl FnOnce() -> i32) -> i32 {
    let (held, forked) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|s| {
        s.spawn(|| {
            let _guard = domain.read_lock();
            held.wait();
            forked.wait(); // holds the section across the fork
        });
        held.wait();
        let code = run();
        forked.wait();
        code
    })
}

#[test]
#[cfg_attr(miri, ignore = "fork: Miri cannot fork")]
fn child_handles_sections_and_leases_held_at_fork() {
    let domain = Srcu::new();
    domain.prepare();
    let cell = SrcuCell::new(&domain, Some(7u32));
    let set = LeaseSet::new(&domain);
    let (held, forked) = (Barrier::new(2), Barrier::new(2));
    let code = std::thread::scope(|s| {
        s.spawn(|| {
            let block = set.block(1);
            let _lease = block.lease(&cell).unwrap();
            held.wait();
            forked.wait(); // holds the lease across the fork
        });
        held.wait();
        let code = fork_and_check(|| {
            // The lease was expired at the fork (as the kernel does).
            let completes = domain.synchronize_timeout(Duration::from_secs(20));
            let expired = set.expired();
            i32::from(!completes) | i32::from(expired != 1) << 1
        });
        forked.wait();
        code
    });
    assert_eq!(
        code, 0,
        "child: -1 killed (hung), bit0 no grace period, bit1 not expired"
    );
}

static RAN: AtomicBool = AtomicBool::new(false);

/// The reported bug: a callback queued before the fork, while another
/// thread held a plain read section, never ran in the child and `barrier`
/// hung there. Also: leases taken in the child (of a set made before the
/// fork, fresh and in a reused slot) are expired by a restarted expiry
/// thread.
#[test]
#[cfg_attr(miri, ignore = "fork: Miri cannot fork")]
fn child_runs_callbacks_queued_before_the_fork_while_another_thread_read() {
    static DOMAIN: Srcu = Srcu::new();
    DOMAIN.prepare();
    let cell = SrcuCell::new(&DOMAIN, Some(1u64));
    let set = LeaseSet::with_timeout(&DOMAIN, Duration::from_millis(20));
    let code = while_another_thread_reads(&DOMAIN, || {
        // Waits for the reader above: pending (or in flight) at the fork.
        DOMAIN.call(|| RAN.store(true, SeqCst));
        fork_and_check(|| {
            DOMAIN.barrier();
            let ran = RAN.load(SeqCst);
            let completes = DOMAIN.synchronize_timeout(Duration::from_secs(20));
            // Leases of the child, held far beyond the timeout.
            let block = set.block(2);
            drop(block.lease(&cell).unwrap());
            let reused = block.lease(&cell).unwrap();
            let fresh = block.lease(&cell).unwrap();
            let leases_expire = DOMAIN.synchronize_timeout(Duration::from_secs(20))
                && reused.is_expired()
                && fresh.is_expired();
            drop((reused, fresh));
            i32::from(!ran) | i32::from(!completes) << 1 | i32::from(!leases_expire) << 2
        })
    });
    assert_eq!(
        code, 0,
        "child: -1 killed (hung), bit0 callback not run, bit1 no grace period, bit2 leases not expired"
    );
    DOMAIN.barrier();
    assert!(RAN.load(SeqCst));
}

/// Forks holding a guard section of `domain`; the child checks that a
/// grace period waits for that section (bit 0 if not), ends it, and
/// checks that a grace period then completes (bit 1 if not).
fn fork_holding_a_guard(domain: &Srcu) -> i32 {
    let guard = domain.read_lock();
    fork_and_check(|| {
        let waited = !domain.synchronize_timeout(Duration::from_millis(50));
        drop(guard);
        let completes = domain.synchronize_timeout(Duration::from_secs(20));
        i32::from(!waited) | i32::from(!completes) << 1
    })
}

/// A section the forking thread holds across the fork is its own in the
/// child too: it stays counted (discounting it would let the child free
/// what the section still reads), and ending it in the child ends it.
#[test]
#[cfg_attr(miri, ignore = "fork: Miri cannot fork")]
fn a_section_of_the_forking_thread_stays_counted_in_the_child() {
    let domain = Srcu::new();
    let code = fork_holding_a_guard(&domain);
    assert_eq!(
        code, 0,
        "child: -1 killed (hung), bit0 own section discounted, bit1 no grace period"
    );
}

/// The forking thread holds a guard section and another thread holds one
/// too: in the child the other thread's section (counted in that thread's
/// slot) is discounted, the forking thread's own stays counted until it
/// ends there.
#[test]
#[cfg_attr(miri, ignore = "fork: Miri cannot fork")]
fn another_threads_guard_is_discounted_while_the_forking_thread_holds_one() {
    if pcpu::fence::mode() != pcpu::fence::Mode::Membarrier {
        // Without membarrier (`PCPU_NO_MEMBARRIER=1`, as the sanitizer
        // runs test) every guard section is counted per CPU, not in its
        // thread's slot: with the forking thread holding one, the
        // documented outcome is that the other thread's stays counted in
        // the child (see `Srcu`'s "Fork"), which this test does not check.
        eprintln!("skipped: guard sections are counted per CPU without membarrier");
        return;
    }
    let domain = Srcu::new();
    domain.prepare();
    let code = while_another_thread_reads(&domain, || fork_holding_a_guard(&domain));
    assert_eq!(
        code, 0,
        "child: -1 killed (hung), bit0 own section discounted, bit1 other thread's section still counted"
    );
}

/// Forks again and again while a lease set's expiry thread runs rounds
/// every millisecond: a child that inherited a lock the expiry thread held
/// mid-round (its buffer of blocks) hung in the fork's child handler.
#[test]
#[cfg_attr(miri, ignore = "fork: Miri cannot fork")]
fn forks_while_the_expiry_thread_runs_its_rounds() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(3u32));
    let set = LeaseSet::with_timeout(&domain, Duration::from_millis(4));
    // Many slots to scan: each round lasts long enough to be caught by
    // some of the forks.
    let blocks: Vec<_> = (0..256).map(|_| set.block(64)).collect();
    let _lease = blocks[0].lease(&cell).unwrap();
    for round in 0..300 {
        let code = fork_and_check(|| i32::from(set.expired() == 0));
        assert_eq!(
            code, 0,
            "fork {round}: child -1 killed (hung), 1 lease not expired"
        );
    }
}
