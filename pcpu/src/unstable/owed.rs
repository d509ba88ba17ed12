//! An intrusive list of objects that owe work to ordinary context: what a
//! signal handler uses to hand over something it must not do itself
//! (dropping a reference that may free, releasing an owner).
//!
//! Each object carries an `owed` count and a link ([`Owing`]). [`owe`]
//! adds one to the count and, on the first one owed (`owed` 0 -> 1),
//! pushes the object on a Treiber stack; later ones only count. [`drain`]
//! takes the whole stack with one swap (so no pop ever races a push: no
//! ABA), and for each object reads its link, takes its count (from then on
//! the object may be listed again, which rewrites the link: hence the
//! order) and hands both to the caller. `owe` is lock-free and allocates
//! nothing: async-signal-safe. Used by `sigpending`'s deferred owner
//! releases and `srcu`'s deferred drops; loom models in `tests/loom.rs`.

use crate::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// An object that can be listed as owing work: its count and its link.
/// Both must be used only through this module.
pub trait Owing: Sized {
    /// Units of work owed and not yet drained.
    fn owed(&self) -> &AtomicUsize;
    /// The next object on the list it is on.
    fn next_owed(&self) -> &AtomicPtr<Self>;
}

/// Records one unit owed by `*node`; on the first unit since the last
/// drain, runs `on_listing` and then lists the object (so whatever
/// `on_listing` does, such as taking a reference for the list, happens
/// before a drain can see it). Returns whether it listed the object.
/// Async-signal-safe if `on_listing` is.
///
/// # Safety
/// `node` stays valid until a [`drain`] of `head` has handed it over for
/// every unit owed (the caller keeps it alive for the list: a reference
/// per unit, or one taken in `on_listing`).
pub unsafe fn owe<T: Owing>(
    head: &AtomicPtr<T>,
    node: *const T,
    on_listing: impl FnOnce(),
) -> bool {
    // SAFETY: the caller's contract.
    let n = unsafe { &*node };
    if n.owed().fetch_add(1, Ordering::AcqRel) != 0 {
        return false; // already listed: the drain will see this unit
    }
    on_listing();
    let ptr = node.cast_mut();
    let mut top = head.load(Ordering::Relaxed);
    loop {
        n.next_owed().store(top, Ordering::Relaxed);
        match head.compare_exchange_weak(top, ptr, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => top = now,
        }
    }
}

/// Takes every object listed on `head` so far and calls `each(node,
/// units)` once per object with the units it owed. Concurrent drains are
/// fine (each takes what was listed when it started). Not async-signal-safe
/// only insofar as `each` is not.
pub fn drain<T: Owing>(head: &AtomicPtr<T>, mut each: impl FnMut(*mut T, usize)) {
    let mut ptr = head.swap(core::ptr::null_mut(), Ordering::Acquire);
    while !ptr.is_null() {
        // SAFETY: `owe`'s contract keeps listed objects alive until they
        // are handed over here.
        let n = unsafe { &*ptr };
        // The link first: once `owed` is cleared the object may be listed
        // again, which rewrites it.
        let next = n.next_owed().load(Ordering::Relaxed);
        let units = n.owed().swap(0, Ordering::AcqRel);
        each(ptr, units);
        ptr = next;
    }
}
