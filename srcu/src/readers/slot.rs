//! A thread's slot of a domain (its outermost and nested guard sections),
//! the table geometry that a slot's words encode, and [`Section`], where
//! a guard section is counted.

use pcpu::unstable::sync::atomic::{AtomicU64, Ordering};

use super::step::{Step, step};

/// Slots per table; threads beyond this many count per CPU instead.
#[cfg(not(pcpu_loom))]
pub(super) const CAPACITY: usize = 1024;
/// Slots per table in the loom models (small state space).
#[cfg(pcpu_loom)]
pub(super) const CAPACITY: usize = 3;

/// A table's size in bytes: a cached slot address `a` is this domain's
/// when `a - base < TABLE_BYTES`.
pub(super) const TABLE_BYTES: usize = CAPACITY * core::mem::size_of::<Slot>();

/// Tables are aligned to this power of two (at least their size), so a
/// slot's address and its table's base agree above bit
/// `TABLE_ALIGN.trailing_zeros()`; the bits below hold, in the domain's
/// [`hot`](super::Readers::hot) word, a bank and a mark.
pub(super) const TABLE_ALIGN: usize = TABLE_BYTES.next_power_of_two();

/// Where a domain's hot word (and so a slot's `outer` word) keeps its
/// bank: the highest bit below the table's alignment.
pub(super) const BANK_SHIFT: u32 = TABLE_ALIGN.trailing_zeros() - 1;

/// One thread's guard sections in one domain.
#[repr(C, align(128))] // its own pair of cache lines (adjacent-line prefetch)
pub(crate) struct Slot {
    /// The owner's outermost open guard section: the domain's hot word
    /// it stored (its bank at bit [`BANK_SHIFT`], the table's base
    /// above, bit 0 set), or 0 when none is open. Written by the owner
    /// only (and by a signal handler of the owner, whose sections end
    /// before it returns), read by grace periods. First in the slot: a
    /// ticket on it is the slot's (aligned) address.
    outer: AtomicU64,
    /// Guard sections begun while `outer` was taken (nested ones, and
    /// any begun while the outermost one's guard lived after it ended
    /// out of order), open per bank, each counted on the bank it began
    /// on. Written by the owner only, one indivisible add each.
    nested: [AtomicU64; 2],
    /// The owning thread's [`thread_id`](super::thread::thread_id) (0: free).
    pub(super) owner: AtomicU64,
    /// The owner's kernel thread id (0: not yet known), for telling an
    /// exited owner's slot from a live one.
    pub(super) tid: AtomicU64,
}

/// A slot's alignment: a ticket on its `outer` word is a multiple of it,
/// one on a `nested` word is not.
const SLOT_ALIGN: usize = core::mem::align_of::<Slot>();

impl Slot {
    #[cfg(pcpu_loom)]
    pub(super) fn new() -> Self {
        Self {
            outer: AtomicU64::new(0),
            nested: [AtomicU64::new(0), AtomicU64::new(0)],
            owner: AtomicU64::new(0),
            tid: AtomicU64::new(0),
        }
    }

    /// Counts a section begun (owner only; `hot` is the domain's
    /// [`hot`](super::Readers::hot) word for its active bank) and returns where.
    /// Async-signal-safe for handlers whose sections end before they
    /// return (see the module docs).
    #[allow(clippy::inline_always)] // the read side must inline
    #[inline(always)]
    pub(crate) fn enter(&self, hot: u64) -> Section {
        if self.outer.load(Ordering::Relaxed) == 0 {
            // The outermost section: a store of a value that does not
            // depend on the word's old one (see the module docs).
            self.outer.store(hot, Ordering::Relaxed);
            return Section(core::ptr::from_ref(&self.outer) as usize);
        }
        self.nest(hot)
    }

    /// A section begun while `outer` is taken: counted on its own bank
    /// (out of line: the outermost store stays on the straight path).
    #[cold]
    #[inline(never)]
    fn nest(&self, hot: u64) -> Section {
        let word = &self.nested[(hot >> BANK_SHIFT) as usize & 1];
        step(word, Step::Up);
        Section(core::ptr::from_ref(word) as usize)
    }

    /// Whether every section counted here has ended.
    pub(super) fn balanced(&self) -> bool {
        self.outer.load(Ordering::Relaxed) == 0
            && self.nested.iter().all(|n| n.load(Ordering::Relaxed) == 0)
    }

    /// Whether a section counted here is open on `bank`.
    pub(super) fn open_on(&self, bank: usize) -> bool {
        let outer = self.outer.load(Ordering::Relaxed);
        (outer != 0 && (outer >> BANK_SHIFT) & 1 == bank as u64 & 1)
            || self.nested[bank & 1].load(Ordering::Relaxed) != 0
    }

    pub(super) fn clear_counts(&self) {
        for word in core::iter::once(&self.outer).chain(&self.nested) {
            word.store(0, Ordering::Relaxed);
        }
    }
}

/// Where a guard section is counted, in one word (a raw address, so
/// neither `Send` nor `Sync`: the section ends on the thread that began
/// it): a slot's `outer` word (its address, a multiple of
/// [`SLOT_ALIGN`]: the usual case, tested with one instruction), one of
/// its `nested` words (an address that is not), or per CPU on a bank
/// (`bank + 1`: the thread found no free slot).
#[derive(Clone, Copy)]
pub(crate) struct Section(usize);

impl Section {
    /// A section counted per CPU on `bank`.
    pub(crate) fn per_cpu(bank: usize) -> Self {
        Self((bank & 1) + 1)
    }

    /// Whether the section is a slot's outermost one.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn is_outer(self) -> bool {
        self.0.is_multiple_of(SLOT_ALIGN)
    }

    /// The bank of a section counted per CPU, if it is.
    pub(crate) fn per_cpu_bank(self) -> Option<usize> {
        (self.0 <= 2).then(|| self.0 - 1)
    }

    /// The bank the section is counted on.
    pub(crate) fn bank(self) -> usize {
        if let Some(bank) = self.per_cpu_bank() {
            return bank;
        }
        let slot = self.0 & !(SLOT_ALIGN - 1);
        // SAFETY: a slot's word (slots are never freed); its slot starts
        // at the alignment below it.
        let slot = unsafe { &*(slot as *const Slot) };
        if self.is_outer() {
            (slot.outer.load(Ordering::Relaxed) >> BANK_SHIFT) as usize & 1
        } else {
            usize::from(self.0 != core::ptr::from_ref(&slot.nested[0]) as usize)
        }
    }

    /// Counts the outermost section of a slot ended (on the thread that
    /// began it; `is_outer`): one store of 0. Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn leave_outer(self) {
        debug_assert!(self.is_outer());
        // SAFETY: a slot's `outer` word (slots are never freed).
        unsafe { &*(self.0 as *const AtomicU64) }.store(0, Ordering::Relaxed);
    }

    /// Counts a nested section of a slot ended (on the thread that began
    /// it; neither outer nor per CPU). Async-signal-safe.
    pub(crate) fn leave_nested(self) {
        debug_assert!(!self.is_outer() && self.per_cpu_bank().is_none());
        // SAFETY: one of a slot's `nested` words (slots are never freed).
        step(unsafe { &*(self.0 as *const AtomicU64) }, Step::Down);
    }
}
