//! Accounts: limits, owner pins, hierarchies, deferred release, and a
//! multi-threaded run that must leave every count and pin balanced.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sigpending::{Account, ChargeError, Owner, Release};

#[test]
fn pins_the_owner_only_while_charged() {
    let owner = Arc::new(());
    let account = Account::new(3, Owner::arc(&owner));
    assert_eq!(Arc::strong_count(&owner), 1, "an idle account pins nothing");
    let a = account.charge().unwrap();
    let b = account.charge().unwrap();
    assert_eq!(Arc::strong_count(&owner), 2, "one pin, whatever the count");
    assert_eq!(account.charged(), 2);
    drop(a);
    assert_eq!(Arc::strong_count(&owner), 2);
    b.uncharge();
    assert_eq!(Arc::strong_count(&owner), 1, "released on 1 -> 0");
    assert_eq!(account.charged(), 0);
}

#[test]
fn refuses_over_the_limit_and_undoes() {
    let owner = Arc::new(());
    let account = Account::new(1, Owner::arc(&owner));
    let held = account.charge().unwrap();
    let err = account.charge().unwrap_err();
    assert_eq!(err, ChargeError::OverLimit { depth: 0, limit: 1 });
    assert!(err.to_string().contains("limit of 1"));
    assert_eq!(account.charged(), 1, "the refused charge was undone");
    drop(held);
    // A zero limit refuses everything and leaves no pin behind.
    let none = Account::new(0, Owner::arc(&owner));
    assert!(none.charge().is_err());
    assert_eq!((none.charged(), Arc::strong_count(&owner)), (0, 1));
}

#[test]
fn a_dropped_owner_refuses_further_charges() {
    let owner = Arc::new(String::from("gone soon"));
    let account = Account::new(8, Owner::arc(&owner));
    drop(owner);
    assert_eq!(
        account.charge().unwrap_err(),
        ChargeError::OwnerGone { depth: 0 }
    );
    assert!(matches!(
        account.charge(),
        Err(ChargeError::OwnerGone { .. })
    ));
}

#[test]
fn hierarchy_counts_and_limits_every_level() {
    let (po, co) = (Arc::new(()), Arc::new(()));
    let parent = Account::new(2, Owner::arc(&po));
    let a = parent.child(5, Owner::arc(&co), Release::Immediate);
    let b = parent.child(5, Owner::none(), Release::Immediate);
    assert!(Arc::ptr_eq(a.parent().unwrap(), &parent));
    let x = a.charge().unwrap();
    let y = b.charge().unwrap();
    assert_eq!((a.charged(), b.charged(), parent.charged()), (1, 1, 2));
    assert_eq!(
        a.charge().unwrap_err(),
        ChargeError::OverLimit { depth: 1, limit: 2 },
        "the parent's limit refuses the child's charge"
    );
    assert_eq!(
        (a.charged(), parent.charged()),
        (1, 2),
        "undone at both levels"
    );
    assert_eq!((Arc::strong_count(&po), Arc::strong_count(&co)), (2, 2));
    drop(y);
    // The last uncharge of `a` is also the last of `parent`: both release.
    drop(x);
    assert_eq!((Arc::strong_count(&po), Arc::strong_count(&co)), (1, 1));
    assert_eq!(parent.charged(), 0);
}

#[test]
#[should_panic(expected = "levels deep")]
fn hierarchies_are_bounded() {
    let mut a = Account::new(1, Owner::none());
    for _ in 0..sigpending::MAX_DEPTH {
        a = a.child(1, Owner::none(), Release::Immediate);
    }
}

#[test]
fn callback_owners_and_forgotten_charges() {
    static PINS: AtomicUsize = AtomicUsize::new(0);
    unsafe fn pin(_: *const ()) {
        PINS.fetch_add(1, Ordering::SeqCst);
    }
    unsafe fn unpin(_: *const ()) {
        PINS.fetch_sub(1, Ordering::SeqCst);
    }
    // SAFETY: the callbacks ignore the context and are thread-safe.
    let owner = unsafe { Owner::from_fns(std::ptr::null(), pin, unpin) };
    let account = Account::new(2, owner);
    account.charge().unwrap().forget();
    assert_eq!(PINS.load(Ordering::SeqCst), 1);
    // SAFETY: balances the forgotten charge above.
    unsafe { account.uncharge_unchecked() };
    assert_eq!((PINS.load(Ordering::SeqCst), account.charged()), (0, 0));
}

#[test]
fn concurrent_charges_stay_balanced_and_within_limits() {
    let (po, co) = (Arc::new(()), Arc::new(()));
    let parent = Account::new(6, Owner::arc(&po));
    let child = parent.child(4, Owner::arc(&co), Release::Deferred);
    // Charges held right now, counted after a charge succeeds and before
    // it is dropped: never above the limits.
    let (in_parent, in_child) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let threads = 4 * std::thread::available_parallelism().map_or(2, usize::from);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (parent, child, in_parent, in_child) = (&parent, &child, &in_parent, &in_child);
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..test_support::scaled(20_000) {
                    let to_child = (i + t) % 3 != 0;
                    let account = if to_child { child } else { parent };
                    if held.len() < 2
                        && let Ok(c) = account.charge()
                    {
                        assert!(
                            in_parent.fetch_add(1, Ordering::SeqCst) < 6,
                            "parent over its limit"
                        );
                        if to_child {
                            assert!(
                                in_child.fetch_add(1, Ordering::SeqCst) < 4,
                                "child over its limit"
                            );
                        }
                        held.push((c, to_child));
                    } else if !held.is_empty() {
                        let (c, was_child) = held.swap_remove(i % held.len());
                        in_parent.fetch_sub(1, Ordering::SeqCst);
                        if was_child {
                            in_child.fetch_sub(1, Ordering::SeqCst);
                        }
                        drop(c);
                    }
                }
                for (c, was_child) in held {
                    in_parent.fetch_sub(1, Ordering::SeqCst);
                    if was_child {
                        in_child.fetch_sub(1, Ordering::SeqCst);
                    }
                    drop(c);
                }
            });
        }
    });
    sigpending::release_deferred();
    assert_eq!((parent.charged(), child.charged()), (0, 0));
    assert_eq!(
        (Arc::strong_count(&po), Arc::strong_count(&co)),
        (1, 1),
        "pins balanced"
    );
}

#[test]
fn a_held_charge_pins_once_and_releases_on_one_to_zero() {
    let user = Arc::new(String::from("alice"));
    let account = Account::new(2, Owner::arc(&user));
    let a = account.charge_holding(&user).unwrap();
    assert_eq!(Arc::strong_count(&user), 2, "one pin for the account");
    let b = account.charge_holding(&user).unwrap();
    let c = account.charge(); // mixes with the ordinary path
    assert_eq!(
        c.unwrap_err(),
        ChargeError::OverLimit { depth: 0, limit: 2 }
    );
    assert_eq!((account.charged(), Arc::strong_count(&user)), (2, 2));
    drop(a);
    b.uncharge();
    assert_eq!((account.charged(), Arc::strong_count(&user)), (0, 1));
    // A zero limit refuses a held charge and leaves no pin behind.
    let none = Account::new(0, Owner::arc(&user));
    assert!(none.charge_holding(&user).is_err());
    assert_eq!((none.charged(), Arc::strong_count(&user)), (0, 1));
}

#[test]
fn a_held_charge_outlives_every_other_holder() {
    let user = Arc::new(String::from("bob"));
    let weak = Arc::downgrade(&user);
    let account = Account::new(4, Owner::arc(&user));
    let mine = Arc::clone(&user);
    drop(user); // the creator lets go; `mine` holds it
    let c = account.charge_holding(&mine).unwrap();
    drop(mine); // now only the account's pin keeps it
    assert_eq!(weak.strong_count(), 1);
    let d = account.charge().unwrap(); // covered by the pin
    drop(c);
    drop(d);
    assert_eq!(weak.strong_count(), 0, "released on 1 -> 0");
    assert_eq!(
        account.charge().unwrap_err(),
        ChargeError::OwnerGone { depth: 0 }
    );
}

#[test]
fn a_held_charge_refuses_an_arc_that_is_not_the_owner() {
    let (user, other) = (Arc::new(1_u32), Arc::new(1_u32));
    let by_arc = Account::new(4, Owner::arc(&user));
    let bare = Account::new(4, Owner::none());
    for (account, held) in [(&by_arc, &other), (&bare, &user)] {
        let err = account.charge_holding(held).unwrap_err();
        assert_eq!(err, ChargeError::NotOwner);
        assert!(err.to_string().contains("not the account's owner"));
        assert_eq!(account.charged(), 0, "nothing charged");
    }
    assert_eq!(
        (Arc::strong_count(&user), Arc::strong_count(&other)),
        (1, 1)
    );
    // Zero-sized values: distinct `Arc`s are distinct allocations.
    let (u, v) = (Arc::new(()), Arc::new(()));
    let account = Account::new(1, Owner::arc(&u));
    assert_eq!(
        account.charge_holding(&v).unwrap_err(),
        ChargeError::NotOwner
    );
    assert!(account.charge_holding(&u).is_ok());
}

#[test]
fn a_held_charge_through_a_hierarchy() {
    let (user, group) = (Arc::new(()), Arc::new(()));
    // The parent pins another owner (its ordinary pin), the grandparent
    // the same user (the caller's reference covers it too).
    let root = Account::new(8, Owner::arc(&user));
    let parent = root.child(8, Owner::arc(&group), Release::Immediate);
    let child = parent.child(1, Owner::arc(&user), Release::Deferred);
    let c = child.charge_holding(&user).unwrap();
    assert_eq!(
        (child.charged(), parent.charged(), root.charged()),
        (1, 1, 1)
    );
    assert_eq!(
        (Arc::strong_count(&user), Arc::strong_count(&group)),
        (3, 2)
    );
    assert_eq!(
        child.charge_holding(&user).unwrap_err(),
        ChargeError::OverLimit { depth: 0, limit: 1 }
    );
    drop(c);
    sigpending::release_deferred();
    assert_eq!(
        (Arc::strong_count(&user), Arc::strong_count(&group)),
        (1, 1)
    );
    // An ancestor's owner that is gone still refuses, and the levels below
    // are undone.
    drop(group);
    assert_eq!(
        child.charge_holding(&user).unwrap_err(),
        ChargeError::OwnerGone { depth: 1 }
    );
    sigpending::release_deferred();
    assert_eq!(
        (child.charged(), root.charged(), Arc::strong_count(&user)),
        (0, 0, 1)
    );
}

#[test]
fn held_and_ordinary_charges_from_many_threads_stay_balanced() {
    let user = Arc::new(());
    let account = Account::new(3, Owner::arc(&user));
    let threads = 2 * std::thread::available_parallelism().map_or(2, usize::from);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (account, mine) = (&account, Arc::clone(&user));
            s.spawn(move || {
                for i in 0..test_support::scaled(20_000) {
                    let c = if (i + t) % 2 == 0 {
                        account.charge_holding(&mine)
                    } else {
                        account.charge()
                    };
                    if let Ok(c) = c {
                        assert!(Arc::strong_count(&mine) >= 2, "charged without a pin");
                        drop(c);
                    }
                }
            });
        }
    });
    assert_eq!((account.charged(), Arc::strong_count(&user)), (0, 1));
}
