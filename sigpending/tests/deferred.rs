//! Deferred owner releases wait for `release_deferred`. Its own binary:
//! the deferred list is process-wide, so another test deferring releases
//! at the same time (as `cargo test` runs them, in one process) would show
//! up in the counts.

use std::sync::Arc;

use sigpending::{Account, Owner, Release};

#[test]
fn deferred_releases_wait_for_release_deferred() {
    let owner = Arc::new(());
    let account = Account::with_release(4, Owner::arc(&owner), Release::Deferred);
    for _ in 0..3 {
        drop(account.charge().unwrap()); // 0 -> 1 -> 0, deferred each time
    }
    assert_eq!(Arc::strong_count(&owner), 4, "three releases owed");
    assert!(sigpending::release_deferred() >= 3);
    assert_eq!(Arc::strong_count(&owner), 1);
    assert_eq!(sigpending::release_deferred(), 0);
}
