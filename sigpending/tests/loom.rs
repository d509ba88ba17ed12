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
