//! loom models of SRCU (`RUSTFLAGS="--cfg pcpu_loom"`), each run with rseq
//! modelled (per-CPU critical sections, membarrier as "wait out every
//! CPU's section") and in the fallback world. Shared data uses relaxed
//! accesses only, so every ordering comes from the SRCU protocol.
#![cfg(pcpu_loom)]

use std::sync::Arc;

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use loom::thread;
use srcu::{Held, LeaseSet, Srcu, SrcuCell};

fn model(f: impl Fn() + Sync + Send + 'static) {
    model_bounded(Some(2), f);
}

/// Checks `f` in both worlds (rseq modelled, fallback) with at most
/// `preemptions` preemptions per execution (`None`: exhaustive).
fn model_bounded(preemptions: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    let f = Arc::new(f);
    for rseq in [true, false] {
        pcpu::unstable::loom_cpu::set_rseq_modelled(rseq);
        let mut b = loom::model::Builder::new();
        b.preemption_bound = preemptions;
        let f = Arc::clone(&f);
        b.check(move || f());
    }
}

fn leak<T>(v: T) -> &'static T {
    Box::leak(Box::new(v))
}

/// The RCU guarantee: a reader that saw the object published cannot see
/// it freed; the writer unpublishes, synchronizes, frees.
#[test]
fn reader_that_began_before_synchronize_is_waited_for() {
    model(|| {
        let domain = leak(Srcu::new());
        let published = leak(AtomicBool::new(true));
        let freed = leak(AtomicBool::new(false));
        let reader = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            let g = domain.read_lock();
            if published.load(Relaxed) {
                assert!(
                    !freed.load(Relaxed),
                    "object freed under a reader that saw it"
                );
            }
            drop(g);
        });
        published.store(false, Relaxed);
        domain.synchronize();
        freed.store(true, Relaxed);
        reader.join().unwrap();
    });
}

/// The same with a raw section ended on a third thread.
#[test]
fn raw_section_ended_on_another_thread_is_waited_for() {
    model(|| {
        let domain = leak(Srcu::new());
        let published = leak(AtomicBool::new(true));
        let freed = leak(AtomicBool::new(false));
        let index = domain.read_lock_raw();
        let saw = published.load(Relaxed);
        let ender = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            if saw {
                assert!(!freed.load(Relaxed), "freed before the section ended");
            }
            // SAFETY: `index` came from this domain.
            unsafe { domain.read_unlock_raw(index) };
        });
        let writer = thread::spawn(move || {
            published.store(false, Relaxed);
            domain.synchronize();
            freed.store(true, Relaxed);
        });
        ender.join().unwrap();
        writer.join().unwrap();
    });
}

/// Guard sections of two threads, each claiming its slot while the other
/// does (the claim race), and a writer running two grace periods: every
/// section that saw an object published finds it alive, across the bank
/// flip of the first grace period.
#[test]
fn guard_sections_of_two_threads_across_two_grace_periods() {
    model(|| {
        let domain = leak(Srcu::new());
        domain.prepare();
        let published = leak(AtomicUsize::new(2));
        let freed = leak(AtomicUsize::new(0));
        let readers: Vec<_> = (1..=2)
            .map(|cpu| {
                thread::spawn(move || {
                    pcpu::unstable::loom_cpu::set_current(cpu);
                    let g = domain.read_lock();
                    let seen = published.load(Relaxed);
                    assert!(
                        freed.load(Relaxed) < 3 - seen,
                        "object freed under a reader that saw it"
                    );
                    drop(g);
                })
            })
            .collect();
        // Objects 2 then 1 are unpublished and freed in turn: `freed`
        // counts them, so a reader that saw `published == p` needs
        // `freed < 3 - p`.
        for p in [1, 0] {
            published.store(p, Relaxed);
            domain.synchronize();
            freed.store(2 - p, Relaxed);
        }
        for r in readers {
            r.join().unwrap();
        }
    });
}

/// A guard section nested in another one of the same thread, begun on the
/// other bank (a grace period flipped in between), keeps the grace period
/// waiting until the inner one ends, whatever order the guards drop in.
#[test]
fn nested_guards_on_both_banks_dropped_out_of_order() {
    model(|| {
        let domain = leak(Srcu::new());
        domain.prepare();
        let published = leak(AtomicBool::new(true));
        let freed = leak(AtomicBool::new(false));
        let outer = domain.read_lock();
        let writer = thread::spawn(move || {
            published.store(false, Relaxed);
            domain.synchronize();
            freed.store(true, Relaxed);
        });
        let inner = domain.read_lock();
        let saw = published.load(Relaxed);
        drop(outer);
        if saw {
            assert!(!freed.load(Relaxed), "freed under the inner section");
        }
        drop(inner);
        writer.join().unwrap();
    });
}

/// A thread's outermost guard section takes its slot's `outer` word;
/// sections begun while it is taken are counted per bank. Here an inner
/// guard begun while a writer runs two grace periods (so possibly after
/// both flips) outlives the outer one, and a new outermost guard takes
/// `outer` while the inner one is still open: each keeps the object it
/// saw alive until it drops.
#[test]
fn inner_guard_outliving_its_outer_across_two_grace_periods() {
    model(|| {
        let domain = leak(Srcu::new());
        domain.prepare();
        let published = leak(AtomicUsize::new(2));
        let freed = leak(AtomicUsize::new(0));
        let outer = domain.read_lock();
        let writer = thread::spawn(move || {
            for p in [1, 0] {
                published.store(p, Relaxed);
                domain.synchronize();
                freed.store(2 - p, Relaxed);
            }
        });
        let inner = domain.read_lock();
        let seen_inner = published.load(Relaxed);
        drop(outer);
        let again = domain.read_lock();
        let seen_again = published.load(Relaxed);
        assert!(
            freed.load(Relaxed) < 3 - seen_inner,
            "object freed under the inner section"
        );
        drop(inner);
        assert!(
            freed.load(Relaxed) < 3 - seen_again,
            "object freed under a later outermost section"
        );
        drop(again);
        writer.join().unwrap();
    });
}

struct Canary {
    alive: AtomicBool,
    drops: &'static AtomicUsize,
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.alive.store(false, Relaxed);
        self.drops.fetch_add(1, Relaxed);
    }
}

/// A domain, a cell holding a canary, and a lease set, leaked for the
/// model's threads.
struct Fixture {
    domain: &'static Srcu,
    drops: &'static AtomicUsize,
    cell: &'static SrcuCell<'static, Canary>,
    set: &'static LeaseSet<'static, Canary>,
}

fn fixture() -> Fixture {
    let domain = leak(Srcu::new());
    let drops = leak(AtomicUsize::new(0));
    let cell = leak(SrcuCell::new(
        domain,
        Some(Canary {
            alive: AtomicBool::new(true),
            drops,
        }),
    ));
    let set = leak(LeaseSet::with_timeout(
        domain,
        std::time::Duration::from_millis(100),
    ));
    Fixture {
        domain,
        drops,
        cell,
        set,
    }
}

/// Expiry racing consumption (and the value being retired): the lease's
/// read section is ended exactly once, the value is alive while held, it
/// is dropped exactly once, and grace periods complete afterwards.
#[test]
fn lease_expiry_racing_consumption_and_retirement() {
    model(|| {
        let Fixture {
            domain,
            drops,
            cell,
            set,
        } = fixture();
        let block = set.block(1);
        let lease = block.lease(cell).unwrap();
        let expirer = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            set.expire_all();
        });
        let retirer = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(2);
            cell.replace(None);
        });
        if let Some(held) = lease.consume() {
            assert!(held.alive.load(Relaxed), "value dropped while held");
        }
        expirer.join().unwrap();
        retirer.join().unwrap();
        // Exactly one end of the lease's section: otherwise this never
        // returns (one short) or returns early (one too many, caught by the
        // drop count below being reached while held above).
        domain.synchronize();
        domain.synchronize();
        domain.synchronize();
        assert_eq!(
            drops.load(Relaxed),
            1,
            "the value was not dropped exactly once"
        );
    });
}

/// Expiry against consumption alone, explored exhaustively (no preemption
/// bound): the read section is ended exactly once and the value dropped
/// exactly once, whichever side wins, on the fast (fence-free) consume path
/// and on the swap path alike.
#[test]
fn lease_expiry_versus_consumption_exhaustive() {
    model_bounded(None, || {
        let Fixture {
            domain,
            drops,
            cell,
            set,
        } = fixture();
        let block = set.block(1);
        let lease = block.lease(cell).unwrap();
        let expirer = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            set.expire_all()
        });
        let held = lease.consume();
        let expired = expirer.join().unwrap();
        let held_kind = match &held {
            Some(Held::Stable(_)) => 1,
            Some(Held::Leased(_)) => 0,
            None => 2,
        };
        drop(held);
        // Expired exactly when the consumer got the stable reference.
        assert_eq!(
            expired == 1,
            held_kind == 1,
            "expiry and consumption both (or neither) won"
        );
        // Balanced sections: a grace period completes.
        domain.synchronize();
        assert_eq!(drops.load(Relaxed), 0);
    });
}

/// References handed to `drop_later` by two threads while a third drains:
/// every reference is dropped exactly once (each value is freed once,
/// after the cells' own references and the handed-over ones are gone),
/// never while one is still owed, whatever the interleaving of a first
/// push's link, a later push's count and the drain's swap. Two values, so
/// the drain walks a list of two nodes while one of them is listed again.
#[test]
fn drop_later_racing_the_drain_drops_each_reference_once() {
    model(|| {
        let Fixture {
            domain,
            drops,
            cell,
            set,
        } = fixture();
        let other = leak(SrcuCell::new(
            domain,
            Some(Canary {
                alive: AtomicBool::new(true),
                drops,
            }),
        ));
        let a = cell.get().unwrap();
        let b = cell.get().unwrap();
        let x = other.get().unwrap();
        // The cells' own references go (after two grace periods, inline
        // under loom): only the handed-over ones keep the values now.
        cell.replace(None);
        other.replace(None);
        assert_eq!(drops.load(Relaxed), 0);
        let pusher = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            set.drop_later(a);
        });
        set.drop_later(x);
        let drainer = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(2);
            set.drop_deferred()
        });
        set.drop_later(b);
        pusher.join().unwrap();
        let drained_early = drainer.join().unwrap();
        let drained_late = set.drop_deferred();
        assert_eq!(
            drained_early + drained_late,
            3,
            "a reference was lost or dropped twice"
        );
        assert_eq!(
            drops.load(Relaxed),
            2,
            "a value was not dropped exactly once"
        );
        domain.synchronize();
    });
}

/// A slot reused while an expiry round runs: the first lease is consumed
/// and the slot leased again, racing a round that may have read either
/// generation. Every lease is expired at most once (the round's stale
/// compare-and-swap fails), the reused slot's lease is always expirable
/// afterwards (its consumer's claim did not carry over), and the sections
/// balance.
#[test]
fn lease_in_a_reused_slot_racing_expiry() {
    model(|| {
        let Fixture {
            domain,
            drops,
            cell,
            set,
        } = fixture();
        let block = set.block(1);
        let first = block.lease(cell).unwrap();
        let expirer = thread::spawn(move || {
            pcpu::unstable::loom_cpu::set_current(1);
            set.expire_all()
        });
        let first_expired = matches!(first.consume(), Some(Held::Stable(_)));
        let second = block.lease(cell).unwrap();
        let by_round = expirer.join().unwrap();
        let later = set.expire_all();
        assert!(
            second.is_expired(),
            "a lease in a reused slot never expires"
        );
        assert_eq!(
            by_round + later,
            u64::from(first_expired) + 1,
            "a lease was expired twice or not at all"
        );
        assert!(matches!(second.consume(), Some(Held::Stable(_))));
        domain.synchronize();
        assert_eq!(drops.load(Relaxed), 0);
    });
}
