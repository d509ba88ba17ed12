//! Deferred owner releases: recorded lock-free wherever an account of
//! [`Release::Deferred`](crate::Release::Deferred) goes 1 -> 0 (a signal
//! handler, say), carried out by [`release_deferred`] in ordinary context.
//!
//! Each account has an `owed` count and a link. The first release owed
//! (`owed` 0 -> 1) takes a strong reference on the account and pushes it
//! on a global Treiber stack; later ones only count. `release_deferred`
//! takes the whole stack with one swap (so no pop ever races a push: no
//! ABA), and for each account reads its link, takes its `owed` count, runs
//! that many releases and drops the list's reference.

use std::sync::Arc;

use pcpu::sync::atomic::{AtomicPtr, Ordering};

use crate::Account;

/// Accounts owing releases, linked through `Account::next_owed`.
#[cfg(not(loom))]
static OWING: AtomicPtr<Account> = AtomicPtr::new(core::ptr::null_mut());

// Under loom, a static that each model execution starts afresh.
#[cfg(loom)]
loom::lazy_static! {
    static ref OWING: AtomicPtr<Account> = AtomicPtr::new(core::ptr::null_mut());
}

/// Records one owed release of `account`'s owner. Lock-free, no
/// allocation: async-signal-safe.
pub(crate) fn defer(account: &Account) {
    if account.owed.fetch_add(1, Ordering::AcqRel) != 0 {
        return; // already listed; the drain will run this one too
    }
    let ptr = core::ptr::from_ref(account).cast_mut();
    // SAFETY: every `Account` lives in an `Arc` (its constructors return
    // one, and charging takes `&Arc<Account>`; parents are `Arc`s): the
    // list keeps the account alive with a strong count of its own.
    unsafe { Arc::increment_strong_count(ptr) };
    let mut head = OWING.load(Ordering::Relaxed);
    loop {
        account.next_owed.store(head, Ordering::Relaxed);
        match OWING.compare_exchange_weak(head, ptr, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(now) => head = now,
        }
    }
}

/// Carries out every owner release deferred so far (by accounts with
/// [`Release::Deferred`](crate::Release::Deferred)); returns how many ran.
///
/// Call it from ordinary context: a release may drop the owner, and
/// dropping an account here may free it. **Not** async-signal-safe.
/// Concurrent calls are fine (each takes what was listed when it started).
pub fn release_deferred() -> usize {
    let mut ptr = OWING.swap(core::ptr::null_mut(), Ordering::Acquire);
    let mut released = 0;
    while !ptr.is_null() {
        // SAFETY: the list holds a strong count on every listed account.
        let account = unsafe { &*ptr };
        // Read the link before clearing `owed`: from then on the account
        // may be listed again, which rewrites it.
        let next = account.next_owed.load(Ordering::Relaxed);
        let owed = account.owed.swap(0, Ordering::AcqRel);
        account.run_owed(owed);
        released += owed;
        // SAFETY: the list's strong count, taken in `defer`.
        unsafe { Arc::decrement_strong_count(ptr) };
        ptr = next;
    }
    released
}
