//! loom models (`RUSTFLAGS="--cfg pcpu_loom"`): owners pinned exactly while
//! charged, through hierarchies and deferred releases; flags denied and
//! restored racing remote posts; the pending queue's ring.
#![cfg(pcpu_loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use loom::thread;
use sigpending::{Account, Owner, PendingQueue, Release, TaskFlags};

/// A modelled owner: a reference count starting at 1 (its creator's), and
/// a `freed` flag set when it reaches 0. Pinning a freed owner, or freeing
/// twice, fails the model.
struct Model {
    refs: AtomicUsize,
    freed: AtomicBool,
}

impl Model {
    fn new() -> &'static Self {
        Box::leak(Box::new(Self {
            refs: AtomicUsize::new(1),
            freed: AtomicBool::new(false),
        }))
    }

    /// A reference of the charging thread's own (the kernel's sender holds
    /// the user through its credentials while it queues a signal).
    fn get(&self) {
        assert!(!self.freed.load(SeqCst), "reference taken after free");
        self.refs.fetch_add(1, SeqCst);
    }

    fn put(&self) {
        if self.refs.fetch_sub(1, SeqCst) == 1 {
            assert!(!self.freed.swap(true, SeqCst), "owner freed twice");
        }
    }

    fn owner(&'static self) -> Owner {
        unsafe fn pin(ctx: *const ()) {
            // SAFETY: the context is a leaked `Model`.
            let m = unsafe { &*ctx.cast::<Model>() };
            assert!(!m.freed.load(SeqCst), "owner pinned after it was freed");
            m.refs.fetch_add(1, SeqCst);
        }
        unsafe fn unpin(ctx: *const ()) {
            // SAFETY: as above.
            unsafe { &*ctx.cast::<Model>() }.put();
        }
        // SAFETY: the context is leaked (valid forever); the callbacks are
        // thread-safe.
        unsafe { Owner::from_fns(core::ptr::from_ref(self).cast(), pin, unpin) }
    }
}

/// Two threads charge and uncharge (each holding the owner while it
/// charges) while the owner's creator drops its reference: the owner is
/// freed exactly once, never while charged.
#[test]
fn owner_lives_exactly_while_charged() {
    loom::model(|| {
        let owner = Model::new();
        let account = Account::new(2, owner.owner());
        let a2 = account.clone();
        // Charged while the creator still holds the owner (as the kernel's
        // sender holds the user through its credentials).
        let c1 = account.charge().unwrap();
        owner.get();
        let t = thread::spawn(move || {
            let c2 = a2.charge();
            owner.put();
            drop(c2);
        });
        owner.put(); // the creator lets go
        assert!(!owner.freed.load(SeqCst), "freed while charged");
        drop(c1);
        t.join().unwrap();
        assert!(
            owner.freed.load(SeqCst),
            "not freed after the last uncharge"
        );
        assert_eq!(account.charged(), 0);
    });
}

/// The hierarchical case the kernel once got wrong: the last uncharge of a
/// child is also the last of its parent; both owners are freed once, the
/// parent's never before the child's count is back at zero, and a charge
/// refused at the parent's limit undoes the child's.
#[test]
fn hierarchy_releases_every_level_once() {
    loom::model(|| {
        let (po, co) = (Model::new(), Model::new());
        let parent = Account::new(1, po.owner());
        let child = parent.child(2, co.owner(), Release::Immediate);
        let c2 = child.clone();
        let first = child.charge().unwrap();
        po.get();
        co.get();
        let t = thread::spawn(move || {
            // Refused by the parent's limit of 1 unless `first` is gone.
            let c = c2.charge();
            po.put();
            co.put();
            drop(c);
        });
        po.put();
        co.put();
        drop(first);
        t.join().unwrap();
        assert_eq!((child.charged(), parent.charged()), (0, 0));
        assert!(po.freed.load(SeqCst) && co.freed.load(SeqCst));
    });
}

/// A deferred release racing a re-charge and a drain: the owner ends freed
/// exactly once, after the drain.
#[test]
fn deferred_release_runs_once() {
    loom::model(|| {
        let owner = Model::new();
        let account = Account::with_release(4, owner.owner(), Release::Deferred);
        let a2 = account.clone();
        let c = account.charge().unwrap();
        owner.get();
        owner.put();
        let t = thread::spawn(move || {
            let c = a2.charge(); // 0 -> 1 -> 0 again, maybe
            owner.put();
            drop(c);
        });
        drop(c);
        sigpending::release_deferred();
        t.join().unwrap();
        sigpending::release_deferred();
        assert!(owner.freed.load(SeqCst));
    });
}

/// Two threads charge an account whose `Arc` owner was already dropped:
/// both are refused, whatever the interleaving (the second charger may see
/// a count of 2 before the first has found the owner gone).
#[test]
fn charges_after_the_owner_is_dropped_are_refused() {
    loom::model(|| {
        let user = std::sync::Arc::new(());
        let account = Account::new(2, Owner::arc(&user));
        drop(user);
        let a2 = account.clone();
        let t = thread::spawn(move || a2.charge().map(sigpending::Charge::forget));
        let here = account.charge().map(sigpending::Charge::forget);
        let there = t.join().unwrap();
        assert!(here.is_err(), "charged after the owner was dropped");
        assert!(there.is_err(), "charged after the owner was dropped");
    });
}

/// Two threads charge while the owner's creator drops it: a charge that
/// succeeds finds the owner alive for as long as it is held, and once
/// everything is uncharged the owner is freed (every pin released once).
#[test]
fn charges_racing_the_owners_drop_pin_it_exactly_while_charged() {
    loom::model(|| {
        let user = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&user);
        let account = Account::new(2, Owner::arc(&user));
        let (a2, w2) = (account.clone(), weak.clone());
        let charger = thread::spawn(move || {
            if let Ok(c) = a2.charge() {
                assert!(w2.strong_count() > 0, "owner freed while charged");
                drop(c);
            }
        });
        let dropper = thread::spawn(move || drop(user));
        if let Ok(c) = account.charge() {
            assert!(weak.strong_count() > 0, "owner freed while charged");
            drop(c);
        }
        charger.join().unwrap();
        dropper.join().unwrap();
        assert_eq!(account.charged(), 0);
        assert_eq!(weak.strong_count(), 0, "a pin was never released");
        assert!(
            account.charge().is_err(),
            "charged after the owner was dropped"
        );
    });
}

/// Runs `f` under loom with at most `preemptions` preemptions per
/// execution (the three-thread models would not finish unbounded).
fn model_bounded(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(f);
}

/// An account of `limit` charges pinning a fresh `Arc` owner (std's: the
/// model sees its counts only through the account), with the owner and a
/// `Weak` to it.
fn arc_owned(
    limit: usize,
) -> (
    std::sync::Arc<()>,
    std::sync::Weak<()>,
    std::sync::Arc<Account>,
) {
    let user = std::sync::Arc::new(());
    let weak = std::sync::Arc::downgrade(&user);
    let account = Account::new(limit, Owner::arc(&user));
    (user, weak, account)
}

/// A thread's body: one charge of `a`, refused as `OwnerGone` or holding
/// an owner that stays alive while it is charged.
fn charge_while_alive(a: std::sync::Arc<Account>, w: std::sync::Weak<()>) -> impl FnOnce() {
    move || match a.charge() {
        Ok(c) => {
            assert!(w.strong_count() > 0, "owner freed while charged");
            drop(c);
        }
        Err(e) => assert_eq!(e, sigpending::ChargeError::OwnerGone { depth: 0 }),
    }
}

/// Nothing is left charged and the owner's every reference is released.
fn assert_all_released(account: &Account, weak: &std::sync::Weak<()>) {
    assert_eq!(account.charged(), 0);
    assert_eq!(weak.strong_count(), 0, "a reference was never released");
}

/// [`assert_all_released`], and the account refuses from now on.
fn assert_released_and_refusing(account: &std::sync::Arc<Account>, weak: &std::sync::Weak<()>) {
    assert_all_released(account, weak);
    assert!(
        account.charge().is_err(),
        "charged after the owner was gone"
    );
}

/// Two charges of the idle account race: the second either increments a
/// pinned level (one `fetch_add`), or also found the level unpinned, pins
/// and publishes too, and drops its extra pin again. Both are counted, the
/// owner holds exactly the account's one reference while they are, and
/// none once both are uncharged.
#[test]
fn two_charges_of_an_idle_level_leave_one_reference() {
    loom::model(|| {
        let user = std::sync::Arc::new(());
        let account = Account::new(2, Owner::arc(&user));
        let a2 = account.clone();
        let t = thread::spawn(move || a2.charge().map(sigpending::Charge::forget).is_ok());
        let here = account.charge().map(sigpending::Charge::forget).is_ok();
        assert!(t.join().unwrap() && here, "refused under the limit");
        assert_eq!(account.charged(), 2);
        assert_eq!(
            std::sync::Arc::strong_count(&user),
            2,
            "not exactly one pin while charged"
        );
        // SAFETY: balances the two forgotten charges.
        unsafe {
            account.uncharge_unchecked();
            account.uncharge_unchecked();
        }
        assert_eq!(std::sync::Arc::strong_count(&user), 1, "pin not released");
    });
    // A callback owner: the extra pin goes through the deferred release.
    loom::model(|| {
        let owner = Model::new();
        let account = Account::with_release(2, owner.owner(), Release::Deferred);
        let a2 = account.clone();
        let t = thread::spawn(move || a2.charge().map(sigpending::Charge::forget).is_ok());
        let here = account.charge().map(sigpending::Charge::forget).is_ok();
        assert!(t.join().unwrap() && here, "refused under the limit");
        sigpending::release_deferred();
        assert_eq!(
            owner.refs.load(SeqCst),
            2,
            "not exactly one pin while charged"
        );
        // SAFETY: balances the two forgotten charges.
        unsafe {
            account.uncharge_unchecked();
            account.uncharge_unchecked();
        }
        sigpending::release_deferred();
        owner.put();
        assert!(owner.freed.load(SeqCst), "a pin was never released");
    });
}

/// Two charges race the last uncharge of a pinned level and each other:
/// each either increments the pinned level, or takes it 0 -> 1 (or
/// increments one that is being pinned) and pins for itself, publishing or
/// dropping its pin as extra. Every charge is covered, and exactly one
/// reference is left while two are charged.
#[test]
fn charges_racing_the_last_uncharge_and_each_other() {
    model_bounded(3, || {
        let user = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&user);
        let account = Account::new(4, Owner::arc(&user));
        let first = account.charge().unwrap();
        let charger = |a: std::sync::Arc<Account>, w: std::sync::Weak<()>| {
            move || {
                let c = a.charge().unwrap();
                assert!(w.strong_count() > 1, "charged without a pin");
                c.forget();
            }
        };
        let t1 = thread::spawn(charger(account.clone(), weak.clone()));
        let t2 = thread::spawn(charger(account.clone(), weak.clone()));
        drop(first);
        t1.join().unwrap();
        t2.join().unwrap();
        assert_eq!(account.charged(), 2);
        assert_eq!(weak.strong_count(), 2, "not exactly one pin while charged");
        // SAFETY: balances the two forgotten charges.
        unsafe {
            account.uncharge_unchecked();
            account.uncharge_unchecked();
        }
        assert_eq!(weak.strong_count(), 1, "pin not released");
        drop(user);
    });
}

/// The last uncharge racing a charge, while the owner's creator still
/// holds it: the charge either increments first (the uncharge's
/// compare-and-swap from `PINNED` fails and the level stays pinned for
/// the charge) or finds the level idle after it and pins for itself.
/// Either way the charge is counted with the owner pinned, and every pin
/// is released.
#[test]
fn the_last_uncharge_racing_a_charge() {
    loom::model(|| {
        let user = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&user);
        let account = Account::new(2, Owner::arc(&user));
        let held = account.charge().unwrap();
        let a2 = account.clone();
        let t = thread::spawn(move || a2.charge().map(sigpending::Charge::forget).is_ok());
        drop(held);
        assert!(t.join().unwrap(), "refused under the limit");
        assert_eq!(account.charged(), 1);
        assert_eq!(weak.strong_count(), 2, "not exactly one pin while charged");
        // SAFETY: balances the forgotten charge.
        unsafe { account.uncharge_unchecked() };
        assert_eq!(weak.strong_count(), 1, "pin not released");
        drop(user);
    });
    // Deferred, with a callback owner: the release recorded by the last
    // uncharge and the pin of the next 0 -> 1 pair up in either order.
    loom::model(|| {
        let owner = Model::new();
        let account = Account::with_release(2, owner.owner(), Release::Deferred);
        let held = account.charge().unwrap();
        let a2 = account.clone();
        let t = thread::spawn(move || {
            let c = a2.charge();
            sigpending::release_deferred();
            drop(c);
        });
        drop(held);
        t.join().unwrap();
        sigpending::release_deferred();
        assert_eq!(owner.refs.load(SeqCst), 1, "pins and releases unbalanced");
        owner.put();
        assert!(owner.freed.load(SeqCst));
    });
}

/// The last uncharge racing a charge while only the account's reference
/// keeps an `Arc` owner alive: the charge either pins before the release
/// (and finds the owner alive while charged) or after it, when the owner
/// is gone, and is refused. Either way every reference is released once
/// and later charges are refused.
#[test]
fn the_last_uncharge_racing_a_charge_and_the_owners_drop() {
    loom::model(|| {
        let (user, weak, account) = arc_owned(2);
        let held = account.charge().unwrap();
        drop(user); // from here on, only the account's reference
        let charger = thread::spawn(charge_while_alive(account.clone(), weak.clone()));
        drop(held);
        charger.join().unwrap();
        assert_released_and_refusing(&account, &weak);
    });
}

/// A pin failing in the general path while another charge races it (the
/// race `GONE` exists for): the last uncharge releases the owner's last
/// reference; a charge whose increment then took the level 0 -> 1 fails
/// to pin, and a second charge that increments on top of it before it has
/// published `GONE` must not be counted either. No charge succeeds after
/// the owner is freed, and nothing is left charged or pinned.
#[test]
fn a_failed_pin_racing_charges_refuses_them_all() {
    model_bounded(3, || {
        let (user, weak, account) = arc_owned(4);
        let held = account.charge().unwrap();
        drop(user);
        let charger = |a: std::sync::Arc<Account>, w: std::sync::Weak<()>| {
            move || {
                if let Ok(c) = a.charge() {
                    assert!(w.strong_count() > 0, "charged to an owner freed");
                    drop(c);
                }
            }
        };
        let t1 = thread::spawn(charger(account.clone(), weak.clone()));
        let t2 = thread::spawn(charger(account.clone(), weak.clone()));
        drop(held);
        t1.join().unwrap();
        t2.join().unwrap();
        assert_released_and_refusing(&account, &weak);
    });
}

/// The limit at 0 and 1: a charge that took the level 0 -> 1 but is over
/// the limit releases its pin through the 1 -> 0 path, and two charges
/// racing for the last unit leave exactly one counted and exactly one
/// reference.
#[test]
fn the_limit_at_the_transitions() {
    loom::model(|| {
        let user = std::sync::Arc::new(());
        let account = Account::new(1, Owner::arc(&user));
        let a2 = account.clone();
        let t = thread::spawn(move || a2.charge().map(sigpending::Charge::forget));
        let here = account.charge().map(sigpending::Charge::forget);
        let there = t.join().unwrap();
        assert!(here.is_ok() != there.is_ok(), "{here:?} {there:?}");
        assert_eq!(
            here.err().or(there.err()).unwrap(),
            sigpending::ChargeError::OverLimit { depth: 0, limit: 1 }
        );
        assert_eq!(account.charged(), 1);
        assert_eq!(
            std::sync::Arc::strong_count(&user),
            2,
            "a refused charge kept a pin"
        );
        // SAFETY: balances the charge that succeeded.
        unsafe { account.uncharge_unchecked() };
        assert_eq!(std::sync::Arc::strong_count(&user), 1);
    });
    loom::model(|| {
        let user = std::sync::Arc::new(());
        let account = Account::new(0, Owner::arc(&user));
        let a2 = account.clone();
        let t = thread::spawn(move || a2.charge().map(drop));
        assert!(account.charge().is_err());
        assert!(t.join().unwrap().is_err());
        assert_eq!(account.charged(), 0);
        assert_eq!(
            std::sync::Arc::strong_count(&user),
            1,
            "a pin was never released"
        );
    });
}

/// A request posted while the owner denies and restores is never lost:
/// afterwards both requested bits are set, and nothing is left denied.
#[test]
fn deny_restore_never_loses_a_posted_flag() {
    loom::model(|| {
        let flags = Arc::new(TaskFlags::new());
        flags.set(0b01);
        let f2 = flags.clone();
        let poster = thread::spawn(move || {
            f2.set(0b01);
            f2.set(0b10);
        });
        flags.deny(0b11);
        flags.restore();
        poster.join().unwrap();
        assert_eq!(flags.pending(), 0b11, "a posted flag was lost");
        assert_eq!(flags.denied(), 0);
    });
}

/// The queue's ring: concurrent enqueues and dequeues keep every item once,
/// in order per producer.
#[test]
fn queue_keeps_every_item_once() {
    loom::model(|| {
        let account = Account::new(8, Owner::none());
        let q = Arc::new(PendingQueue::new(2, account.clone()));
        let q2 = q.clone();
        let producer = thread::spawn(move || {
            let mut refused = 0;
            for v in [1, 2] {
                refused += usize::from(q2.enqueue(v).is_err());
            }
            refused
        });
        let mut got = Vec::new();
        got.extend(q.dequeue());
        let refused = producer.join().unwrap();
        got.extend(std::iter::from_fn(|| q.dequeue()));
        assert_eq!(got.len() + refused, 2);
        assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order: {got:?}");
        assert_eq!(account.charged(), 0);
    });
}

/// A held charge (the caller's own `Arc`: a plain increment that cannot
/// fail) racing an ordinary charge of the idle account while the owner's
/// creator drops its reference: the held charge always succeeds, the
/// ordinary one succeeds or is refused as `OwnerGone`, every charge finds
/// the owner alive while charged, and every reference is released once.
#[test]
fn a_held_charge_racing_a_charge_and_the_owners_drop() {
    model_bounded(3, || {
        let (user, weak, account) = arc_owned(2);
        let (a2, w2, mine) = (account.clone(), weak.clone(), user.clone());
        let holder = thread::spawn(move || {
            let c = a2.charge_holding(&mine).expect("a held charge");
            drop(mine);
            assert!(w2.strong_count() > 0, "owner freed while charged");
            drop(c);
        });
        let charger = thread::spawn(charge_while_alive(account.clone(), weak.clone()));
        drop(user);
        holder.join().unwrap();
        charger.join().unwrap();
        assert_all_released(&account, &weak);
    });
}

/// A held charge racing the last uncharge of a pinned level whose only
/// other reference is the account's (the creator dropped it): the charge
/// either increments first (the uncharge leaves the level pinned) or finds
/// the level idle and pins with its own reference. Exactly the account's
/// one reference is left while it is charged, none after.
#[test]
fn a_held_charge_racing_the_last_uncharge() {
    loom::model(|| {
        let (user, weak, account) = arc_owned(2);
        let first = account.charge().unwrap();
        let (a2, mine) = (account.clone(), user.clone());
        drop(user);
        let holder = thread::spawn(move || {
            a2.charge_holding(&mine).expect("a held charge").forget();
            drop(mine);
        });
        drop(first);
        holder.join().unwrap();
        assert_eq!(account.charged(), 1);
        assert_eq!(weak.strong_count(), 1, "not exactly one pin while charged");
        // SAFETY: balances the forgotten charge.
        unsafe { account.uncharge_unchecked() };
        assert_eq!(weak.strong_count(), 0, "pin not released");
    });
}

/// Two held charges of the idle account (each thread holding its own
/// clone) racing each other and the creator's drop, deferred release: both
/// are counted, one reference is published and any extra one dropped at
/// once, and after the last uncharge and the deferred release the owner is
/// freed.
#[test]
fn two_held_charges_racing_on_an_idle_level() {
    model_bounded(3, || {
        let user = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&user);
        let account = Account::with_release(2, Owner::arc(&user), Release::Deferred);
        let holder = |a: std::sync::Arc<Account>, mine: std::sync::Arc<()>| {
            move || {
                a.charge_holding(&mine).expect("a held charge").forget();
                drop(mine);
            }
        };
        let t1 = thread::spawn(holder(account.clone(), user.clone()));
        let t2 = thread::spawn(holder(account.clone(), user.clone()));
        drop(user);
        t1.join().unwrap();
        t2.join().unwrap();
        assert_eq!(account.charged(), 2);
        assert_eq!(weak.strong_count(), 1, "not exactly one pin while charged");
        // SAFETY: balances the two forgotten charges.
        unsafe {
            account.uncharge_unchecked();
            account.uncharge_unchecked();
        }
        sigpending::release_deferred();
        assert_eq!(weak.strong_count(), 0, "pin not released");
    });
}

/// The 1 -> 0 in one step racing a charge (which makes the level shared,
/// for good) while another uncharge of the same level takes two steps: a
/// level pinned with two charges; one thread drops one of them, another
/// charges and drops once more, and the main thread drops the other. The
/// one-step decrement, the reference it puts back, and the two-step
/// release interleave in every order (within the preemption bound):
/// every charge is covered while it is counted, and the owner's one pin
/// is released exactly once, with nothing charged.
#[test]
fn one_and_two_step_releases_racing_a_charge() {
    model_bounded(3, || {
        let user = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&user);
        let account = Account::new(4, Owner::arc(&user));
        account.charge().unwrap().forget();
        account.charge().unwrap().forget();
        let (a1, w1, a2) = (account.clone(), weak.clone(), account.clone());
        let charger = thread::spawn(move || {
            let c = a1.charge().unwrap();
            assert!(w1.strong_count() > 1, "charged without a pin");
            drop(c);
        });
        // SAFETY (both): balance the two forgotten charges.
        let dropper = thread::spawn(move || unsafe { a2.uncharge_unchecked() });
        unsafe { account.uncharge_unchecked() };
        charger.join().unwrap();
        dropper.join().unwrap();
        assert_eq!(account.charged(), 0);
        assert_eq!(weak.strong_count(), 1, "pin not released exactly once");
        drop(user);
    });
}

/// A one-step 1 -> 0 raced by charges from two other threads: its
/// decrement finds a charge that came in, so it takes the pin off with
/// the count and puts the reference back (`republish`) while the other
/// charges pin, publish and release around it (the two-step release of
/// one of them may find `PINNED` put back at count 0). Every charge is
/// covered while counted, and exactly the one pin is released once
/// nothing is charged.
#[test]
fn a_one_step_release_raced_by_two_charging_threads() {
    model_bounded(4, || {
        let user = std::sync::Arc::new(());
        let weak = std::sync::Arc::downgrade(&user);
        let account = Account::new(4, Owner::arc(&user));
        account.charge().unwrap().forget();
        let charger = |a: std::sync::Arc<Account>, w: std::sync::Weak<()>| {
            move || {
                let c = a.charge().unwrap();
                assert!(w.strong_count() > 1, "charged without a pin");
                drop(c);
            }
        };
        let t1 = thread::spawn(charger(account.clone(), weak.clone()));
        let t2 = thread::spawn(charger(account.clone(), weak.clone()));
        // SAFETY: balances the forgotten charge.
        unsafe { account.uncharge_unchecked() };
        t1.join().unwrap();
        t2.join().unwrap();
        assert_eq!(account.charged(), 0);
        assert_eq!(weak.strong_count(), 1, "pin not released exactly once");
        drop(user);
    });
}
