//! Readers follow an `SrcuCell` while writers replace its value: a value
//! is never dropped while a reader can see it (canary), and every value is
//! dropped eventually (drop counter). Bounded in iterations.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use srcu::{Srcu, SrcuCell};

static CREATED: AtomicU64 = AtomicU64::new(0);
static DROPPED: AtomicU64 = AtomicU64::new(0);

struct Canary {
    alive: AtomicBool,
    serial: u64,
    check: u64,
}

impl Canary {
    fn new(serial: u64) -> Self {
        CREATED.fetch_add(1, SeqCst);
        Self {
            alive: AtomicBool::new(true),
            serial,
            check: !serial,
        }
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        assert!(self.alive.swap(false, SeqCst), "dropped twice");
        DROPPED.fetch_add(1, SeqCst);
    }
}

fn run(threads: usize, writes: u64) {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Canary::new(0)));
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while !stop.load(SeqCst) {
                    let guard = domain.read_lock();
                    let c = cell.load(&guard).expect("cell never empty");
                    let serial = c.serial;
                    // Hold the section long enough for a broken grace
                    // period to free the value under us; a freed value
                    // shows as dead, or (memory reused) as another serial.
                    for _ in 0..test_support::scaled(2_000) {
                        assert!(c.alive.load(SeqCst), "value freed under a reader");
                        assert_eq!(
                            (c.serial, c.check),
                            (serial, !serial),
                            "value freed and reused under a reader"
                        );
                        std::hint::spin_loop();
                    }
                }
            });
        }
        for i in 1..=writes {
            cell.replace(Some(Canary::new(i)));
            if i % 16 == 0 {
                // Drops happen now, while readers are inside.
                domain.barrier();
            }
        }
        stop.store(true, SeqCst);
    });
    drop(cell);
    domain.barrier();
}

#[test]
fn retired_values_outlive_their_readers_and_are_all_freed() {
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    run(cpus, test_support::scaled(800));
    run(4 * cpus, test_support::scaled(200));
    assert_eq!(DROPPED.load(SeqCst), CREATED.load(SeqCst), "values leaked");
}
