//! Deferred owner releases: recorded lock-free wherever an account of
//! [`Release::Deferred`](crate::Release::Deferred) goes 1 -> 0 (a signal
//! handler, say), carried out by [`release_deferred`] in ordinary context.
//!
//! Each account has an `owed` count and a link (`pcpu::unstable::owed`, shared with
//! `srcu`'s deferred drops). The first release owed (`owed` 0 -> 1) takes
//! a strong reference on the account and lists it; later ones only count.
//! `release_deferred` takes the whole list with one swap, runs each
//! account's owed releases and drops the list's reference.

use std::sync::Arc;

use pcpu::unstable::owed::{Owing, drain, owe};
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicUsize};

use super::Account;

/// Accounts owing releases, linked through `Account::next_owed`.
#[cfg(not(pcpu_loom))]
static OWING: AtomicPtr<Account> = AtomicPtr::new(core::ptr::null_mut());

// Under loom, a static that each model execution starts afresh.
#[cfg(pcpu_loom)]
loom::lazy_static! {
    static ref OWING: AtomicPtr<Account> = AtomicPtr::new(core::ptr::null_mut());
}

impl Owing for Account {
    fn owed(&self) -> &AtomicUsize {
        &self.owed
    }
    fn next_owed(&self) -> &AtomicPtr<Self> {
        &self.next_owed
    }
}

/// Records one owed release of `account`'s owner. Lock-free, no
/// allocation: async-signal-safe.
///
/// The pointer listed is the `Arc`'s own ([`Arc::as_ptr`]), not one made
/// from a `&Account`: the strong count it increments (and `release_deferred`
/// decrements) lies in front of the account, outside what a reference to
/// the account may reach (Miri reported that as undefined behaviour under
/// Stacked Borrows).
pub(crate) fn defer(account: &Arc<Account>) {
    let ptr = Arc::as_ptr(account);
    // SAFETY: the list keeps the account alive with a strong count of its
    // own, taken before it is listed.
    unsafe { owe(&OWING, ptr, || Arc::increment_strong_count(ptr)) };
}

/// Carries out every owner release deferred so far (by accounts with
/// [`Release::Deferred`](crate::Release::Deferred)); returns how many ran.
///
/// Call it from ordinary context: a release may drop the owner, and
/// dropping an account here may free it. **Not** async-signal-safe.
/// Concurrent calls are fine (each takes what was listed when it started).
#[allow(clippy::must_use_candidate)] // the count is informational
pub fn release_deferred() -> usize {
    let mut released = 0;
    drain(&OWING, |ptr, owed| {
        // SAFETY: the list holds a strong count on every listed account.
        let account = unsafe { &*ptr };
        account.run_owed(owed);
        released += owed;
        // SAFETY: the list's strong count, taken in `defer`.
        unsafe { Arc::decrement_strong_count(ptr.cast_const()) };
    });
    released
}
