//! Grace periods wait for earlier readers; callbacks run after them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use srcu::Srcu;

#[test]
fn synchronize_waits_for_a_reader_that_began_before_it() {
    let domain = Srcu::new();
    let returned = AtomicBool::new(false);
    let guard = domain.read_lock();
    std::thread::scope(|s| {
        let sync = s.spawn(|| {
            domain.synchronize();
            returned.store(true, SeqCst);
        });
        // The grace period cannot end while our section is open: this is a
        // property of every interleaving, the pause only gives a broken
        // implementation the chance to show it.
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !returned.load(SeqCst),
            "synchronize returned while a prior reader was inside"
        );
        drop(guard);
        sync.join().unwrap();
    });
    assert!(returned.load(SeqCst));
}

/// A raw section of `domain` holds up its grace periods until it ends, on
/// another thread.
fn a_raw_section_holds_up_grace_periods(domain: &Srcu, what: &str) {
    let index = domain.read_lock_raw();
    assert!(
        !domain.synchronize_timeout(Duration::from_millis(20)),
        "{what}: grace period ignored the raw reader"
    );
    std::thread::scope(|s| {
        // SAFETY: `index` came from this domain.
        s.spawn(|| unsafe { domain.read_unlock_raw(index) });
    });
    assert!(
        domain.synchronize_timeout(Duration::from_secs(10)),
        "{what}"
    );
}

/// A domain built for more CPUs than the machine has (and for fewer: its
/// overflow slot takes the rest) still waits for a reader, whatever CPU
/// it runs on, and only for it.
#[test]
fn a_domain_for_another_cpu_count_waits_for_its_readers() {
    for cpus in [1, 64, 300] {
        a_raw_section_holds_up_grace_periods(&Srcu::with_cpus(cpus), &format!("{cpus} CPUs"));
    }
}

#[test]
fn a_raw_section_may_end_on_another_thread() {
    let domain = Srcu::new();
    a_raw_section_holds_up_grace_periods(&domain, "a domain");
    domain.synchronize_expedited();
}

#[test]
fn readers_of_one_domain_do_not_delay_another() {
    let (a, b) = (Srcu::new(), Srcu::new());
    let _held = a.read_lock();
    assert!(b.synchronize_timeout(Duration::from_secs(10)));
}

#[test]
fn callbacks_run_after_a_grace_period_and_barrier_waits_for_them() {
    let domain = Srcu::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let guard = domain.read_lock();
    for _ in 0..10 {
        let r = Arc::clone(&ran);
        domain.call(move || {
            r.fetch_add(1, SeqCst);
        });
    }
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        ran.load(SeqCst),
        0,
        "a callback ran while a prior reader was inside"
    );
    drop(guard);
    domain.barrier();
    assert_eq!(ran.load(SeqCst), 10);
}

#[test]
fn dropping_a_domain_runs_its_queued_callbacks() {
    let ran = Arc::new(AtomicUsize::new(0));
    {
        let domain = Srcu::new();
        for _ in 0..5 {
            let r = Arc::clone(&ran);
            domain.retire(Dropped(r));
        }
    }
    assert_eq!(ran.load(SeqCst), 5);
}

#[test]
fn a_panicking_callback_does_not_stop_the_others() {
    let domain = Srcu::new();
    let ran = Arc::new(AtomicUsize::new(0));
    domain.call(|| panic!("callback panics on purpose"));
    let r = Arc::clone(&ran);
    domain.call(move || {
        r.fetch_add(1, SeqCst);
    });
    domain.barrier();
    assert_eq!(ran.load(SeqCst), 1);
}

struct Dropped(Arc<AtomicUsize>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

#[test]
fn dropping_a_domain_with_a_raw_section_open_runs_callbacks_without_hanging() {
    let ran = Arc::new(AtomicUsize::new(0));
    let domain = Srcu::new();
    // Never ended: once the domain is dropped it cannot be (unlocking needs
    // the domain), and no guard can exist, so it is forgotten.
    let _forgotten = domain.read_lock_raw();
    let r = Arc::clone(&ran);
    domain.call(move || {
        r.fetch_add(1, SeqCst);
    });
    // Let the reclaimer start its grace period (which waits for the open
    // section) before the domain dies: the case that must not hang.
    std::thread::sleep(Duration::from_millis(20));
    drop(domain);
    assert_eq!(ran.load(SeqCst), 1);
}

/// The reported race: one thread keeps queueing callbacks while another
/// replaces a cell's value and calls `barrier`, which must not return
/// before the old value (two grace periods) has been dropped. Bounded in
/// rounds (the deterministic version is a unit test of the reclaimer).
#[test]
fn barrier_waits_for_replaced_values_while_callbacks_keep_coming() {
    static DOMAIN: Srcu = Srcu::new();
    let stop = AtomicBool::new(false);
    let queued = AtomicUsize::new(0);
    let cell = srcu::SrcuCell::new(&DOMAIN, Some(Dropped(Arc::new(AtomicUsize::new(0)))));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(SeqCst) {
                DOMAIN.call(|| {});
                queued.fetch_add(1, SeqCst);
            }
        });
        while queued.load(SeqCst) == 0 {
            std::thread::yield_now();
        }
        let rounds = test_support::scaled(3000);
        let early = (0..rounds)
            .filter(|_| {
                let drops = Arc::new(AtomicUsize::new(0));
                cell.replace(Some(Dropped(Arc::clone(&drops))));
                // Retire it: dropped after two grace periods.
                cell.replace(None);
                DOMAIN.barrier();
                drops.load(SeqCst) != 1
            })
            .count();
        stop.store(true, SeqCst);
        assert_eq!(
            early, 0,
            "barrier returned before the replaced value was dropped ({early} of {rounds} rounds)"
        );
    });
}
