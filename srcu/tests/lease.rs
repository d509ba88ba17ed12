//! Leases: expiry converts old leases so grace periods finish; exactly one
//! side ends the read section whatever the race; nothing leaks.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use srcu::{Held, LeaseError, LeaseSet, Srcu, SrcuCell};

static LATE_DROPS: AtomicU64 = AtomicU64::new(0);

std::thread_local! {
    /// Set on the thread that must not drop a `DroppedLate`.
    static NOT_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts its drops for the `drop_later` test only, and fails one on a
/// thread marked `NOT_HERE`.
struct DroppedLate;

impl Drop for DroppedLate {
    fn drop(&mut self) {
        assert!(!NOT_HERE.get(), "released in place");
        LATE_DROPS.fetch_add(1, SeqCst);
    }
}

#[derive(Debug, PartialEq)]
struct Value(u32);

/// Counts its drops (only the racing test uses it, so tests running in
/// parallel in one process do not disturb the count).
struct Counted(u32);

static COUNTED_DROPS: AtomicU64 = AtomicU64::new(0);

impl Drop for Counted {
    fn drop(&mut self) {
        COUNTED_DROPS.fetch_add(1, SeqCst);
    }
}

#[test]
fn synchronize_completes_while_a_lease_is_never_consumed() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(1)));
    let set = LeaseSet::with_timeout(&domain, Duration::from_millis(50));
    let block = set.block(4);
    let lease = block.lease(&cell).unwrap();
    // Without expiry this would wait forever; the generous bound only keeps
    // a broken build from hanging CI.
    assert!(
        domain.synchronize_timeout(Duration::from_secs(30)),
        "the lease was never expired"
    );
    assert!(lease.is_expired());
    assert!(set.expired() >= 1);
    match lease.consume() {
        Some(Held::Stable(v)) => assert_eq!(*v, Value(1)),
        other => panic!("expected a stable reference, got {}", other.is_some()),
    }
}

#[test]
fn consuming_before_expiry_hands_over_the_read_section() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(2)));
    let set = LeaseSet::new(&domain);
    let block = set.block(2);
    let lease = block.lease(&cell).unwrap();
    let held = lease.consume().unwrap();
    assert!(matches!(held, Held::Leased(_)));
    assert_eq!(*held, Value(2));
    assert!(
        !domain.synchronize_timeout(Duration::from_millis(20)),
        "held section ignored"
    );
    drop(held);
    assert!(domain.synchronize_timeout(Duration::from_secs(30)));
}

#[test]
fn a_value_retired_before_expiry_is_gone() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(3)));
    let set = LeaseSet::new(&domain);
    let block = set.block(2);
    let lease = block.lease(&cell).unwrap();
    cell.replace(None);
    assert_eq!(set.expire_all(), 1);
    assert!(
        lease.consume().is_none(),
        "a retired value was handed out after expiry"
    );
}

#[test]
fn blocks_report_full_and_empty_and_release_on_drop() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(4)));
    let empty = SrcuCell::<Value>::new(&domain, None);
    let set = LeaseSet::new(&domain);
    let block = set.block(2);
    assert_eq!(block.lease(&empty).err(), Some(LeaseError::Empty));
    let a = block.lease(&cell).unwrap();
    let b = block.lease(&cell).unwrap();
    assert_eq!(block.lease(&cell).err(), Some(LeaseError::BlockFull));
    assert_eq!(block.in_use(), 2);
    drop(a);
    drop(b); // dropping unconsumed leases ends their sections
    assert_eq!(block.in_use(), 0);
    assert!(domain.synchronize_timeout(Duration::from_secs(30)));
}

#[test]
fn expiry_racing_consumption_releases_exactly_once() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Counted(5)));
    let set = LeaseSet::new(&domain);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(SeqCst) {
                set.expire_all();
            }
        });
        let block = set.block(8);
        for i in 0..test_support::scaled(20_000u32) {
            let lease = block.lease(&cell).unwrap();
            if i % 3 == 0 {
                drop(lease);
            } else if let Some(v) = lease.consume() {
                assert_eq!(v.0, 5);
            }
        }
        stop.store(true, SeqCst);
    });
    // Every read section was ended exactly once: grace periods complete...
    assert!(domain.synchronize_timeout(Duration::from_secs(30)));
    // ...and the value was neither freed early nor leaked.
    assert_eq!(COUNTED_DROPS.load(SeqCst), 0);
    drop(cell);
    domain.barrier();
    assert_eq!(COUNTED_DROPS.load(SeqCst), 1);
}

#[test]
fn a_raw_lease_round_trips_through_its_block() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(6)));
    let set = LeaseSet::new(&domain);
    let block = set.block(4);
    let raws: Vec<_> = (0..3)
        .map(|_| block.lease(&cell).unwrap().into_raw())
        .collect();
    assert_eq!(block.in_use(), 3, "into_raw must keep the lease");
    for raw in raws.into_iter().rev() {
        // SAFETY: each raw lease came from this block and is used once.
        let lease = unsafe { block.from_raw(raw) };
        assert_eq!(lease.consume().as_deref(), Some(&Value(6)));
    }
    assert_eq!(block.in_use(), 0);
    assert!(domain.synchronize_timeout(Duration::from_secs(30)));
}

#[test]
fn an_expired_lease_released_in_place_is_dropped_by_the_expiry_thread() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(DroppedLate));
    let set = LeaseSet::with_timeout(&domain, Duration::from_millis(20));
    let block = set.block(1);
    let lease = block.lease(&cell).unwrap();
    assert_eq!(set.expire_all(), 1);
    // The cell lets go of the value; the expired lease's reference is the
    // last one.
    cell.replace(None);
    domain.barrier();
    assert_eq!(LATE_DROPS.load(SeqCst), 0);
    let held = lease.consume().expect("expired into a reference");
    assert!(matches!(held, Held::Stable(_)));
    // What a signal handler does: nothing is freed here (the expiry
    // thread may already have dropped it when `release` returns: a count
    // would not tell who did)...
    NOT_HERE.set(true);
    set.release(held);
    NOT_HERE.set(false);
    // ...the expiry thread drops it at one of its next ticks.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while LATE_DROPS.load(SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "never dropped");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(LATE_DROPS.load(SeqCst), 1);
    assert_eq!(set.drop_deferred(), 0);
}

/// A slot whose lease was consumed is reused for a new lease; that lease
/// must expire like one in a fresh slot (the consumer's claim on the old
/// lease must not carry over to the new one).
#[test]
fn leases_in_reused_slots_expire() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(8)));
    let set = LeaseSet::with_timeout(&domain, Duration::from_millis(20));
    let block = set.block(4);
    // Every slot held and consumed once (both the fence-free consume and
    // the one after an expiry round)...
    let first: Vec<_> = (0..4).map(|_| block.lease(&cell).unwrap()).collect();
    assert_eq!(set.expire_all(), 4);
    for lease in first {
        assert!(matches!(lease.consume(), Some(Held::Stable(_))));
    }
    let second: Vec<_> = (0..4).map(|_| block.lease(&cell).unwrap()).collect();
    for lease in second {
        assert!(matches!(lease.consume(), Some(Held::Leased(_))));
    }
    // ...then held again: these reuse the slots.
    let held: Vec<_> = (0..4).map(|_| block.lease(&cell).unwrap()).collect();
    assert_eq!(
        set.expire_all(),
        4,
        "leases in reused slots were not expired"
    );
    assert!(held.iter().all(srcu::Lease::is_expired));
    drop(held);
    // The expiry thread alone, for a lease in a reused slot: the bound only
    // keeps a broken build from hanging.
    let lease = block.lease(&cell).unwrap();
    assert!(
        domain.synchronize_timeout(Duration::from_secs(30)),
        "a lease in a reused slot stalled the grace period"
    );
    assert!(lease.is_expired());
}

/// Waits (at most 10 s) until `f` holds.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A parked set's expiry thread ends once no lease is held, not before
/// (a lease taken earlier still expires, and its reference is still
/// dropped); resumed, it runs again and expires what was taken meanwhile.
#[test]
fn a_parked_expiry_thread_ends_once_no_lease_is_held() {
    let domain = Srcu::new();
    let cell = SrcuCell::new(&domain, Some(Value(3)));
    let set = LeaseSet::with_timeout(&domain, Duration::from_millis(40));
    assert!(set.expiry_running());
    let block = set.block(2);
    let early = block.lease(&cell).unwrap();
    set.park_expiry();
    // The lease held keeps the thread: it expires it, and waits for the
    // reference it became to be released.
    assert!(
        eventually(|| early.is_expired()),
        "the early lease never expired"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(set.expiry_running(), "the thread ended under a held lease");
    drop(early);
    assert!(
        eventually(|| !set.expiry_running()),
        "the thread did not end"
    );
    // Resumed: a lease taken now expires again.
    set.resume_expiry().unwrap();
    assert!(set.expiry_running());
    let late = block.lease(&cell).unwrap();
    assert!(domain.synchronize_timeout(Duration::from_secs(30)));
    assert!(late.is_expired());
}
