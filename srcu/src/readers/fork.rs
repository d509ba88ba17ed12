//! A fork child's slots: those of every thread but the forking one freed,
//! with their sections, and the forking thread's own given its new
//! kernel thread id.

use core::cell::Cell;

use pcpu::unstable::sync::atomic::Ordering;

use super::table::TABLES;
use super::thread::{CACHE, CACHE_ENTRIES, THREAD_ID, current_tid};

/// In a fork child (only the forking thread exists): frees the slots of
/// every other thread in every table, with their sections (they cannot
/// end here), and records the forking thread's new kernel thread id in
/// its own. Its own: those it owns, and those its cache holds (a signal
/// handler that interrupted the thread's first id assignment claimed one
/// under an id the thread then lost).
#[cfg(not(pcpu_loom))]
pub(crate) fn after_fork() {
    let me = THREAD_ID.with(Cell::get);
    let cached: [usize; CACHE_ENTRIES] = CACHE.with(|c| core::array::from_fn(|w| c[w].get()));
    let tid = current_tid();
    let mut t = TABLES.load(core::sync::atomic::Ordering::Acquire);
    while !t.is_null() {
        // SAFETY: tables are never freed.
        let table = unsafe { &*t };
        for i in 0..table.handed_out() {
            let slot = table.slot(i);
            let owner = slot.owner.load(Ordering::Relaxed);
            let mine =
                (owner == me && me != 0) || cached.contains(&(core::ptr::from_ref(slot) as usize));
            if mine {
                slot.tid.store(tid, Ordering::Relaxed);
            } else {
                slot.clear_counts();
                slot.tid.store(0, Ordering::Relaxed);
                slot.owner.store(0, Ordering::Relaxed);
            }
        }
        t = table.next.cast_mut();
    }
}
