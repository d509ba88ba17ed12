//! The owner pin of a 0 -> 1 charge racing a second charge, made
//! deterministic with the crate's test hook: the first charger is parked
//! after it tried to pin the owner and before anyone else can know the
//! outcome, and a second charge runs against it.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use sigpending::hooks::{self, Point};
use sigpending::{Account, Charge, ChargeError, Owner};

/// Tests of this file share the hook: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());
static REACHED: AtomicBool = AtomicBool::new(false);
static GO: AtomicBool = AtomicBool::new(false);

thread_local! {
    static PARK_HERE: Cell<bool> = const { Cell::new(false) };
}

/// Parks the thread that asked for it at its first `PinTried`, until `GO`.
fn park_at_pin(point: Point) {
    if matches!(point, Point::PinTried { .. }) && PARK_HERE.with(|p| p.replace(false)) {
        REACHED.store(true, SeqCst);
        while !GO.load(SeqCst) {
            std::thread::yield_now();
        }
    }
}

/// Runs `first` on a thread parked at its pin, then `second` here while it
/// is parked, then lets `first` finish; returns both results.
fn race<A: Send, B>(first: impl FnOnce() -> A + Send, second: impl FnOnce() -> B) -> (A, B) {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    REACHED.store(false, SeqCst);
    GO.store(false, SeqCst);
    hooks::set(Some(park_at_pin));
    let out = std::thread::scope(|s| {
        let t = s.spawn(|| {
            PARK_HERE.with(|p| p.set(true));
            first()
        });
        while !REACHED.load(SeqCst) {
            std::thread::yield_now();
        }
        let b = second();
        GO.store(true, SeqCst);
        (t.join().unwrap(), b)
    });
    hooks::set(None);
    out
}

#[test]
fn a_charge_racing_a_failed_pin_is_refused() {
    let user = Arc::new(());
    let account = Account::new(2, Owner::arc(&user));
    drop(user);
    let (first, second) = race(|| account.charge().map(drop), || account.charge().map(drop));
    assert_eq!(first, Err(ChargeError::OwnerGone { depth: 0 }));
    assert_eq!(
        second,
        Err(ChargeError::OwnerGone { depth: 0 }),
        "charged while the owner was already gone"
    );
    assert!(account.charge().is_err());
}

#[test]
fn a_charge_racing_a_successful_pin_keeps_the_owner_alive() {
    let user = Arc::new(());
    let weak = Arc::downgrade(&user);
    let account = Account::new(2, Owner::arc(&user));
    let mut user = Some(user);
    let (first, second) = race(
        || account.charge().map(Charge::forget),
        || {
            let c = account.charge();
            // The creator lets go while the first pin is not yet published.
            drop(user.take());
            let alive = weak.upgrade().is_some();
            c.map(|c| {
                c.forget();
                alive
            })
        },
    );
    assert_eq!(first, Ok(()));
    assert_eq!(second, Ok(true), "owner freed while charged");
    assert_eq!(account.charged(), 2);
    // SAFETY: balances the two forgotten charges above.
    unsafe {
        account.uncharge_unchecked();
        account.uncharge_unchecked();
    }
    assert_eq!(weak.strong_count(), 0, "the pins were not all released");
}
