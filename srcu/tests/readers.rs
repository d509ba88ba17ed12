//! Guard sections are counted in per-thread slots: threads come and go
//! without registering, their slots are taken over after they exit, a
//! first section may begin in a signal handler, threads beyond the slots'
//! capacity count per CPU, and without membarrier every guard section is
//! counted per CPU. Grace periods wait for all of them.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use srcu::{Srcu, SrcuCell};

/// Threads that start, read and exit one after another: the domain keeps
/// about one slot (an exited thread's slot is taken over), and grace
/// periods complete.
#[test]
#[cfg_attr(
    miri,
    ignore = "a thread's exit is seen with tgkill, which Miri lacks: no slot is ever taken over"
)]
fn slots_of_exited_threads_are_taken_over() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(5u64));
    // A table can come from a domain dropped earlier, with its slots.
    let before = domain.reader_slots();
    for _ in 0..300 {
        std::thread::scope(|s| {
            s.spawn(|| assert_eq!(cell.read().as_deref(), Some(&5)));
        });
    }
    // A thread whose exit the kernel has not finished when the next one
    // claims costs one more slot, never one per thread.
    let added = domain.reader_slots() - before;
    assert!(added < 32, "{added} slots for one thread at a time");
    assert!(domain.synchronize_timeout(Duration::from_secs(20)));
}

/// More threads hold sections at once than a domain has slots: the rest
/// count per CPU, and a grace period waits for every one of them.
#[test]
#[cfg_attr(miri, ignore = "1100 threads: far too slow under Miri")]
fn threads_beyond_the_slots_capacity_are_waited_for() {
    const THREADS: usize = 1100; // more than the 1024 slots
    let domain = Srcu::new();
    domain.prepare();
    let (holding, release) = (Barrier::new(THREADS + 1), Barrier::new(THREADS + 1));
    let synchronized = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            std::thread::Builder::new()
                .stack_size(64 << 10)
                .spawn_scoped(s, || {
                    let guard = domain.read_lock();
                    holding.wait();
                    release.wait();
                    drop(guard);
                })
                .expect("spawn a reader");
        }
        holding.wait();
        assert!(
            !domain.synchronize_timeout(Duration::from_millis(20)),
            "grace period ended with every reader inside"
        );
        s.spawn(|| {
            domain.synchronize();
            synchronized.store(true, SeqCst);
        });
        release.wait();
    });
    assert!(synchronized.load(SeqCst));
    assert!(domain.reader_slots() <= 1024);
}

static DOMAIN: Srcu = Srcu::new();
static HANDLER_SECTIONS: AtomicU64 = AtomicU64::new(0);

extern "C" fn read_in_handler(_: libc::c_int) {
    let guard = DOMAIN.read_lock();
    HANDLER_SECTIONS.fetch_add(1, SeqCst);
    drop(guard);
}

/// A thread's first section of a domain begins in a signal handler (the
/// slot is claimed there), and handlers nest sections inside a section the
/// interrupted code holds: the outer section keeps grace periods waiting.
#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn first_section_in_a_signal_handler_and_nested_in_one() {
    DOMAIN.prepare();
    // SAFETY: a handler that only runs async-signal-safe read sections.
    unsafe {
        let mut sa: libc::sigaction = core::mem::zeroed();
        sa.sa_sigaction = read_in_handler as *const () as usize;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR2, &raw const sa, core::ptr::null_mut()),
            0
        );
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: raising a signal whose handler is installed above.
            unsafe { libc::raise(libc::SIGUSR2) };
            let outer = DOMAIN.read_lock();
            for _ in 0..100 {
                // SAFETY: as above.
                unsafe { libc::raise(libc::SIGUSR2) };
            }
            assert!(
                !DOMAIN.synchronize_timeout(Duration::from_millis(20)),
                "the handlers' sections ended the outer one"
            );
            drop(outer);
        });
    });
    assert_eq!(HANDLER_SECTIONS.load(SeqCst), 101);
    assert!(DOMAIN.synchronize_timeout(Duration::from_secs(20)));
}

/// Without membarrier (and without rseq) guard sections are counted per
/// CPU with full fences; grace periods still wait for them.
#[test]
#[cfg_attr(
    miri,
    ignore = "starts a child process; .ci/miri runs the child's part (SRCU_CHILD=1 PCPU_NO_MEMBARRIER=1)"
)]
fn guard_sections_without_membarrier() {
    if std::env::var_os("SRCU_CHILD").is_some() {
        let domain = Srcu::new();
        let guard = domain.read_lock();
        assert_eq!(domain.reader_slots(), 0, "a slot without membarrier");
        assert!(!domain.synchronize_timeout(Duration::from_millis(20)));
        std::thread::scope(|s| {
            s.spawn(|| drop(domain.read_lock()));
        });
        drop(guard);
        assert!(domain.synchronize_timeout(Duration::from_secs(20)));
        println!("child: fallback ok");
        return;
    }
    let out = test_support::rerun_in_child(
        "guard_sections_without_membarrier",
        &[
            ("SRCU_CHILD", "1"),
            ("GLIBC_TUNABLES", "glibc.pthread.rseq=0"),
            ("PCPU_NO_MEMBARRIER", "1"),
        ],
    );
    assert!(test_support::printed(&out, "child: fallback ok"));
}

/// Whether a grace period of `domain` is held up (it does not end within
/// a short timeout) by a section this thread holds.
fn held(domain: &Srcu) -> bool {
    let done = std::thread::scope(|s| {
        s.spawn(|| domain.synchronize_timeout(Duration::from_millis(20)))
            .join()
            .expect("synchronize")
    });
    !done
}

/// A thread alternates between more domains than its slot cache holds,
/// with guards of several open at once: each guard holds up its own
/// domain's grace periods and no other's.
#[test]
fn one_thread_alternating_between_many_domains() {
    let domains: Vec<Srcu> = (0..8).map(|_| Srcu::new()).collect();
    for round in 0..3 {
        for (i, d) in domains.iter().enumerate() {
            let guard = d.read_lock();
            // A guard of the next domain too: the slot used last changes
            // while this guard is open.
            let next = &domains[(i + 1 + round) % domains.len()];
            let other = next.read_lock();
            drop(other);
            assert!(held(d), "domain {i}'s guard did not hold it up");
            assert!(!held(next), "a dropped guard still held a domain up");
            drop(guard);
            assert!(!held(d), "domain {i} held up after its guard dropped");
        }
    }
}

/// A dropped domain's table passes to the next domain made, with this
/// thread's slot in it, which the thread finds again (from the slot it
/// used last or its cache); a domain made while that one lives has
/// another table. Guards of each hold up their own domain only, also
/// when the thread's cached slot came from the dropped one.
#[test]
fn a_dropped_domains_table_is_reused_and_cached_slots_stay_right() {
    for _ in 0..20 {
        let first = Srcu::new();
        drop(first.read_lock()); // caches a slot of its table
        drop(first);
        let second = Srcu::new(); // may take the first one's table
        let third = Srcu::new(); // another table
        let g2 = second.read_lock();
        assert!(held(&second));
        assert!(!held(&third), "a guard of another domain held this one");
        let g3 = third.read_lock();
        drop(g2);
        assert!(!held(&second));
        assert!(held(&third));
        drop(g3);
        assert!(!held(&third));
    }
}

/// Guard sections nested in one another and dropped outermost first:
/// after the outermost one's drop frees its place in the slot, a new
/// outermost section takes it while nested ones are still open, and
/// grace periods wait for every one of them until the last drops.
#[test]
fn nested_guards_dropped_outermost_first_are_waited_for() {
    let domain = Srcu::new();
    let mut guards: std::collections::VecDeque<_> = (0..1000).map(|_| domain.read_lock()).collect();
    for _ in 0..3000 {
        drop(guards.pop_front());
        guards.push_back(domain.read_lock());
    }
    while guards.len() > 1 {
        drop(guards.pop_front());
    }
    assert!(held(&domain), "the last nested section was not waited for");
    drop(guards);
    assert!(!held(&domain));
}
