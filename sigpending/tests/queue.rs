//! The pending queue: FIFO order, refusals with reasons, charges balanced.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sigpending::{Account, ChargeError, Owner, PendingQueue, Refusal, Release};

#[test]
fn fifo_with_charges() {
    let account = Account::new(16, Owner::none());
    let q = PendingQueue::new(4, account.clone());
    assert!(q.is_empty());
    for v in 0..4 {
        q.enqueue(v).unwrap();
    }
    assert_eq!((q.len(), account.charged()), (4, 4));
    let full = q.enqueue(4).unwrap_err();
    assert_eq!(
        (full.value, full.reason),
        (4, Refusal::Full { capacity: 4 })
    );
    assert!(full.to_string().contains("queue full"));
    assert_eq!(account.charged(), 4, "a full queue undoes its charge");
    assert_eq!(
        std::iter::from_fn(|| q.dequeue()).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!((account.charged(), q.dropped()), (0, 1));
}

#[test]
fn refusals_are_counted_and_say_why() {
    let account = Account::new(1, Owner::none());
    let q = PendingQueue::new(8, account.clone());
    q.enqueue("first").unwrap();
    let r = q.enqueue("second").unwrap_err();
    assert_eq!(
        r.reason,
        Refusal::Charge(ChargeError::OverLimit { depth: 0, limit: 1 })
    );
    assert!(r.to_string().contains("limit of 1"), "{r}");
    assert_eq!(q.dropped(), 1);
    let empty: PendingQueue<u8> = PendingQueue::new(0, Account::new(1, Owner::none()));
    assert!(matches!(
        empty.enqueue(1).unwrap_err().reason,
        Refusal::Full { capacity: 0 }
    ));
}

#[test]
fn dropping_the_queue_uncharges_what_is_left() {
    let owner = Arc::new(());
    let account = Account::new(8, Owner::arc(&owner));
    let q = PendingQueue::new(8, account.clone());
    q.enqueue(String::from("left behind")).unwrap();
    assert_eq!(Arc::strong_count(&owner), 2);
    drop(q);
    assert_eq!((account.charged(), Arc::strong_count(&owner)), (0, 1));
}

#[test]
fn producers_and_consumers_keep_every_item_once() {
    let owner = Arc::new(());
    let account = Account::with_release(48, Owner::arc(&owner), Release::Deferred);
    let q = PendingQueue::new(32, account.clone());
    let (sum_in, sum_out) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (q, sum_in, sum_out) = (&q, &sum_in, &sum_out);
            s.spawn(move || {
                for i in 0..test_support::scaled(50_000u64) {
                    let v = t * 1_000_000 + i;
                    if q.enqueue(v).is_ok() {
                        sum_in.fetch_add(v, Ordering::Relaxed);
                    }
                    if let Some(v) = q.dequeue() {
                        sum_out.fetch_add(v, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    while let Some(v) = q.dequeue() {
        sum_out.fetch_add(v, Ordering::Relaxed);
    }
    assert_eq!(
        sum_in.load(Ordering::Relaxed),
        sum_out.load(Ordering::Relaxed)
    );
    sigpending::release_deferred();
    assert_eq!((account.charged(), Arc::strong_count(&owner)), (0, 1));
}

static IN_HANDLER: std::sync::OnceLock<PendingQueue<u32>> = std::sync::OnceLock::new();

extern "C" fn on_usr2(_: libc::c_int) {
    let q = IN_HANDLER.get().expect("queue built first");
    // Enqueue and dequeue (a 1 -> 0 transition: the release is deferred).
    let _ = q.enqueue(7);
    let _ = q.dequeue();
}

#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn a_signal_handler_charges_and_uncharges_with_deferred_release() {
    // Its own process: the deferred list is process-wide, and another test
    // releases what is on it (the count before release_deferred is exact
    // here).
    test_support::in_own_process(
        "a_signal_handler_charges_and_uncharges_with_deferred_release",
        || {
            let owner = Arc::new(());
            let account = Account::with_release(4, Owner::arc(&owner), Release::Deferred);
            let q = IN_HANDLER.get_or_init(|| PendingQueue::new(4, account.clone()));
            // SAFETY: the handler only uses the queue's signal-safe operations on a
            // deferred account; raised on this thread, it runs before `raise`
            // returns.
            unsafe {
                libc::signal(libc::SIGUSR2, on_usr2 as *const () as libc::sighandler_t);
                libc::raise(libc::SIGUSR2);
            }
            assert!(q.is_empty());
            assert_eq!(Arc::strong_count(&owner), 2, "the handler's release waits");
            sigpending::release_deferred();
            assert_eq!((account.charged(), Arc::strong_count(&owner)), (0, 1));
        },
    );
}
