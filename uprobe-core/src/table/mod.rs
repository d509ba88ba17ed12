//! The probe table: probed sites by address, an open-addressing hash
//! table that grows.
//!
//! **Readers** (the hit path, inside a read section of the engine's SRCU
//! domain [`DOMAIN`], entered through [`lookup`]) load the current table
//! with one acquire load and probe it: no lock, no allocation, no write. **Writers** (attach and detach,
//! serialised by the engine's writer lock) insert into free or tombstoned
//! slots and tombstone removed ones. When live entries and tombstones
//! together pass half the slots, the writer builds a table twice the
//! live size, complete before it is published with one release store;
//! the old table is freed after a grace period, like an unpublished
//! site, so a reader that loaded it before the swap still walks valid
//! memory. A reader always sees a whole table: the old one or the new
//! one, each holding every site published before it was loaded.
//!
//! A site is published before its breakpoint is written (and the write
//! is followed by `membarrier(SYNC_CORE)`), so a thread that traps on it
//! loads a table that holds it.

pub(crate) mod lookup;

use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::site::Site;

/// Guards the table and the sites' consumer lists against readers: every
/// unpublished site or list, and every outgrown table, is freed only
/// after a grace period of it.
pub(crate) static DOMAIN: srcu::Srcu = srcu::Srcu::new();

/// Slots of the first table.
const INITIAL_SLOTS: usize = 1024;
/// A removed entry: lookups continue past it.
const TOMBSTONE: *mut Site = core::ptr::dangling_mut::<Site>();

/// One generation of the table.
pub(crate) struct Table {
    slots: Box<[AtomicPtr<Site>]>,
    /// Occupied slots: live sites plus tombstones (writer only).
    used: AtomicUsize,
    /// Live sites (writer only).
    live: AtomicUsize,
}

impl Table {
    fn with_slots(n: usize) -> Self {
        Self {
            slots: (0..n)
                .map(|_| AtomicPtr::new(core::ptr::null_mut()))
                .collect(),
            used: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slots `addr`'s probe sequence visits, in order.
    fn sequence(&self, addr: usize) -> impl Iterator<Item = usize> + '_ {
        // Fibonacci hashing; code addresses differ in their low bits.
        let start = (addr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) & self.mask();
        (0..self.slots.len()).map(move |i| (start + i) & self.mask())
    }
}

/// The current table (null until the first insert).
static CURRENT: AtomicPtr<Table> = AtomicPtr::new(core::ptr::null_mut());

/// The table slot holding the site at `addr`, and the site. Call inside
/// a read section of the engine's domain (or holding the writer lock).
/// Async-signal-safe: loads only.
pub(crate) fn find(addr: usize) -> Option<(usize, &'static Site)> {
    let table = CURRENT.load(Ordering::Acquire);
    if table.is_null() {
        return None;
    }
    // SAFETY: a published table is freed only after it was replaced and
    // a grace period passed; the caller is in a read section (or holds
    // the writer lock, so it is the current one).
    let table = unsafe { &*table };
    for slot in table.sequence(addr) {
        let p = table.slots[slot].load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        if p != TOMBSTONE {
            // SAFETY: published sites are freed only after being replaced
            // by a tombstone and a grace period; as above.
            let site = unsafe { &*p };
            if site.addr() == addr {
                return Some((slot, site));
            }
        }
    }
    None
}

/// The site at `addr`, if any; call inside a read section (or holding
/// the writer lock). Async-signal-safe.
pub(crate) fn site_at(addr: usize) -> Option<&'static Site> {
    find(addr).map(|(_, site)| site)
}

/// Publishes `site` (whose address is not in the table). Returns the
/// table it replaced if it had to grow, to free after a grace period.
/// The writer lock is held.
pub(crate) fn insert(site: *mut Site) -> Option<*mut Table> {
    let mut retired = None;
    let mut table = CURRENT.load(Ordering::Acquire);
    // SAFETY: the writer lock is held: the current table stays.
    let needs_room = table.is_null() || unsafe { full_after_one_more(&*table) };
    if needs_room {
        let grown = Box::into_raw(Box::new(rebuilt(table)));
        CURRENT.store(grown, Ordering::Release);
        retired = (!table.is_null()).then_some(table);
        table = grown;
    }
    // SAFETY: as above.
    let t = unsafe { &*table };
    // SAFETY: `site` is a valid site the caller owns until it is removed.
    let addr = unsafe { (*site).addr() };
    let slot = t
        .sequence(addr)
        .find(|&s| {
            let p = t.slots[s].load(Ordering::Relaxed);
            p.is_null() || p == TOMBSTONE
        })
        .expect("a table at most half full has a free slot");
    if t.slots[slot].load(Ordering::Relaxed).is_null() {
        t.used.fetch_add(1, Ordering::Relaxed);
    }
    t.live.fetch_add(1, Ordering::Relaxed);
    t.slots[slot].store(site, Ordering::Release);
    retired
}

/// Unpublishes the site in `slot` of the current table (as returned by
/// [`find`]). The writer lock is held; the site is freed by the caller
/// after a grace period.
pub(crate) fn remove(slot: usize) {
    // SAFETY: the writer lock is held; `find` returned `slot` from the
    // current table, so it exists.
    let t = unsafe { &*CURRENT.load(Ordering::Acquire) };
    t.slots[slot].store(TOMBSTONE, Ordering::Release);
    t.live.fetch_sub(1, Ordering::Relaxed);
}

/// Every published site. The writer lock is held.
pub(crate) fn sites() -> Vec<&'static Site> {
    let table = CURRENT.load(Ordering::Acquire);
    if table.is_null() {
        return Vec::new();
    }
    // SAFETY: the writer lock is held: the current table and its sites
    // stay.
    let t = unsafe { &*table };
    t.slots
        .iter()
        .map(|s| s.load(Ordering::Acquire))
        .filter(|&p| !p.is_null() && p != TOMBSTONE)
        // SAFETY: as above.
        .map(|p| unsafe { &*p })
        .collect()
}

/// Frees a table [`insert`] retired. No reader may still use it.
///
/// # Safety
/// `t` came from [`insert`], once, and a grace period has passed since
/// (or every reader is excluded).
pub(crate) unsafe fn free(t: *mut Table) {
    // SAFETY: the caller's contract; the sites it points to are not
    // owned by it.
    drop(unsafe { Box::from_raw(t) });
}

fn full_after_one_more(t: &Table) -> bool {
    (t.used.load(Ordering::Relaxed) + 1) * 2 > t.slots.len()
}

/// A table with room for the live sites of `old` (none if null) and as
/// many again, holding them all, without tombstones.
fn rebuilt(old: *mut Table) -> Table {
    let live = if old.is_null() {
        0
    } else {
        // SAFETY: the writer lock is held: `old` is the current table.
        unsafe { (*old).live.load(Ordering::Relaxed) }
    };
    // At most a quarter full after the move: the next growth is as far
    // off as this table is big.
    let slots = ((live + 1) * 4).next_power_of_two().max(INITIAL_SLOTS);
    let new = Table::with_slots(slots);
    for site in sites() {
        let slot = new
            .sequence(site.addr())
            .find(|&s| new.slots[s].load(Ordering::Relaxed).is_null())
            .expect("the new table has room");
        new.slots[slot].store(core::ptr::from_ref(site).cast_mut(), Ordering::Relaxed);
        new.used.fetch_add(1, Ordering::Relaxed);
        new.live.fetch_add(1, Ordering::Relaxed);
    }
    new
}
