//! `PerCpuStack`: intrusive per-CPU LIFO lists, pushed and popped on the
//! current CPU with rseq critical sections.
//!
//! The types and the public operations are here; the rseq critical
//! sections (push, pop, the empty flag's upkeep on the fast path) are in
//! `fast`, the lists' locks and the paths that take them in `locked`.

use core::ptr::NonNull;

use crate::PerCpu;
use crate::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

mod fast;
mod locked;

/// One CPU's list: the top node's address, the lock word that the rseq
/// critical sections check before their commit, and the empty flag (kept
/// only by stacks built [`with_empty_flags`](PerCpuStack::with_empty_flags)).
/// `repr(C)`: the assembly finds `lock` at offset 8 and `empty` at 16.
#[repr(C)]
#[derive(Default)]
struct Head {
    top: AtomicUsize,
    lock: AtomicUsize,
    empty: AtomicU32,
}

// The sections find a CPU's head at `base + (cpu << shift)`.
#[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
const _: () = assert!(size_of::<crossbeam_utils::CachePadded<Head>>() == crate::rseq::LIST_STRIDE);

/// What [`PerCpuStack::pop_local`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalPop {
    /// Popped this node from the current CPU's list.
    Popped(NonNull<u8>),
    /// List `slot`, the current CPU's, was empty (for a stack with empty
    /// flags: its flag was set, or its head was null and the flag is set
    /// now).
    Empty {
        /// The list found empty.
        slot: usize,
    },
    /// No critical section could run (no rseq, the list is locked, or the
    /// CPU is beyond the possible ones): pop through the locked path.
    Locked,
}

/// The operation would have had to wait for a lock (returned by the `try_`
/// methods, which never wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WouldBlock;

impl core::fmt::Display for WouldBlock {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("per-CPU list is locked by another thread")
    }
}

impl std::error::Error for WouldBlock {}

/// Intrusive LIFO lists of nodes, one per possible CPU plus the overflow
/// slot: the building block of per-CPU freelists.
///
/// Nodes are caller-owned memory with a `usize` link word at a fixed offset
/// (`next_offset`). The stack never allocates, so every operation works on
/// preallocated pools.
///
/// # How it synchronises
/// - **rseq mode** (x86-64 with glibc's rseq area and
///   `MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ`): [`push`](Self::push) and
///   [`pop`](Self::pop) on the current CPU's list are rseq critical sections
///   of plain loads and stores; the pop loads the top node's link word
///   *inside* the section, so another pop/push on this CPU cannot slip in
///   between (no ABA, no tagged pointers).
/// - Each list has a lock word, which the critical sections check before
///   committing. Any operation on a list other than the caller's current
///   CPU's ([`pop_slot`](Self::pop_slot), [`push_slot`](Self::push_slot)),
///   and any operation that finds the lock taken, takes the lock and then
///   calls [`rseq::fence_cpu`](crate::rseq::fence_cpu) on that CPU, which
///   restarts a critical section that read the lock as free before the lock
///   was taken. From then until the unlock, that CPU's critical sections
///   leave the list alone.
/// - **fallback mode** (no rseq, aarch64, loom): every operation takes the
///   list's lock (a test-and-set spinlock).
///
/// The lock is only held for a few instructions, but userspace cannot stop
/// preemption: a holder that is descheduled makes the others wait (they
/// yield after a short spin). The `try_` variants never wait and are the
/// ones to use from signal handlers.
///
/// # Example
/// ```
/// use std::ptr::NonNull;
/// #[repr(C)]
/// struct Node { next: usize, value: u32 }
/// let mut node = Node { next: 0, value: 7 };
/// let stack = pcpu::PerCpuStack::new(std::mem::offset_of!(Node, next));
/// // SAFETY: the node is ours, outlives the stack's use of it, and its link
/// // word is at `next_offset`.
/// unsafe { stack.push(NonNull::from(&mut node).cast()) };
/// let popped = stack.pop().or_else(|| (0..stack.slots()).find_map(|s| stack.pop_slot(s)));
/// assert_eq!(popped.map(|p| unsafe { p.cast::<Node>().as_ref().value }), Some(7));
/// ```
pub struct PerCpuStack {
    heads: PerCpu<Head>,
    /// With empty flags: the lists that may hold nodes, a bit per list
    /// (see [`summary`](Self::summary)); empty otherwise.
    summary: Box<[AtomicU64]>,
    next_offset: usize,
    use_rseq: bool,
    /// glibc's rseq area offset where the lists run on critical sections
    /// (x86-64: `use_rseq`), read once; 0 elsewhere.
    #[cfg_attr(not(all(pcpu_arch = "x86_64", not(pcpu_loom))), allow(dead_code))]
    area: isize,
    empty_flags: bool,
    /// Lists below this index are real CPUs' (a stack built for more CPUs
    /// than the machine has leaves the rest to locks alone).
    fenced: usize,
}

impl PerCpuStack {
    /// An empty stack whose nodes keep their link word at `next_offset`.
    /// Decides the mode (rseq or locks) once. Not async-signal-safe.
    ///
    /// # Panics
    /// If `next_offset` is not a multiple of `align_of::<usize>()`.
    #[must_use]
    pub fn new(next_offset: usize) -> Self {
        Self::build(next_offset, false)
    }

    /// Like [`new`](Self::new), but each list also keeps an **empty flag**
    /// (the `is_empty` hint of the kernel's BPF freelist), read with
    /// [`flagged_empty`](Self::flagged_empty) so that a pop can skip an
    /// empty list without touching its lock.
    ///
    /// The flag is written only on the list's empty <-> non-empty
    /// transitions: a push clears it before linking its node (in the same
    /// critical section, or under the lock); a pop that takes the last node
    /// sets it, in rseq mode with a second critical section that re-checks
    /// the head (so the flag is only ever set on a list that is empty at
    /// that instant). Hence, between operations, **a set flag means an empty
    /// list**; the converse may fail (a pop that migrates between its two
    /// sections, or a push restarted after clearing the flag, leaves the
    /// flag clear on an empty list), which only costs a wasted look.
    ///
    /// Such a stack also keeps a **summary** of its flags, a bit per list
    /// ([`summary`](Self::summary)), so that a look for a list that may
    /// hold nodes reads one word per 64 lists instead of one flag per
    /// list.
    ///
    /// Not async-signal-safe (allocates).
    ///
    /// # Panics
    /// As for [`new`](Self::new).
    #[must_use]
    pub fn with_empty_flags(next_offset: usize) -> Self {
        Self::build(next_offset, true)
    }

    /// [`new`](Self::new) or [`with_empty_flags`](Self::with_empty_flags)
    /// as if the machine had `cpus` possible CPUs ([`PerCpu::with_cpus`]):
    /// `cpus` lists and the overflow list. Lists beyond the machine's CPUs
    /// are only ever taken under their lock. For measuring on a small
    /// machine what a walk over a big machine's lists costs, and for
    /// tests. Not async-signal-safe (allocates).
    ///
    /// # Panics
    /// As for [`new`](Self::new).
    #[must_use]
    pub fn with_cpus(next_offset: usize, empty_flags: bool, cpus: usize) -> Self {
        Self::build_for(next_offset, empty_flags, cpus)
    }

    fn build(next_offset: usize, empty_flags: bool) -> Self {
        Self::build_for(next_offset, empty_flags, crate::possible_cpus())
    }

    fn build_for(next_offset: usize, empty_flags: bool, cpus: usize) -> Self {
        assert!(
            next_offset.is_multiple_of(align_of::<usize>()),
            "link word must be usize-aligned"
        );
        #[cfg(not(pcpu_loom))]
        let use_rseq = crate::rseq::available() && crate::fence::register_rseq_fence();
        // Under loom the critical sections are modelled (see `loom_cpu`)
        // unless the test chose the fallback world.
        #[cfg(pcpu_loom)]
        let use_rseq = crate::loom_cpu::rseq_modelled();
        // The sections' own check: where they run, the area exists (and
        // its offset never changes).
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        let area = crate::rseq_area::offset().filter(|_| use_rseq).unwrap_or(0);
        #[cfg(not(all(pcpu_arch = "x86_64", not(pcpu_loom))))]
        let area = 0;
        let lists = cpus + 1;
        Self {
            // Every list starts empty, so every flag starts set (and no
            // summary bit).
            heads: PerCpu::with_cpus(cpus, |_| Head {
                empty: AtomicU32::new(u32::from(empty_flags)),
                ..Head::default()
            }),
            summary: (0..if empty_flags { lists.div_ceil(64) } else { 0 })
                .map(|_| AtomicU64::new(0))
                .collect(),
            next_offset,
            use_rseq,
            area,
            empty_flags,
            fenced: cpus.min(crate::possible_cpus()),
        }
    }

    /// Whether pushes and pops on the current CPU use rseq critical sections.
    #[must_use]
    #[inline]
    pub fn uses_rseq(&self) -> bool {
        self.use_rseq
    }

    /// Whether the lists keep empty flags (built with
    /// [`with_empty_flags`](Self::with_empty_flags)).
    #[must_use]
    pub fn keeps_empty_flags(&self) -> bool {
        self.empty_flags
    }

    /// The number of lists (possible CPUs plus the overflow slot).
    #[must_use]
    #[inline]
    pub fn slots(&self) -> usize {
        self.heads.cpus() + 1
    }

    /// The slot index of the caller's current CPU.
    #[must_use]
    #[inline]
    pub fn current_slot(&self) -> usize {
        self.heads.current_index()
    }

    /// A racy look at whether list `slot` is empty (one load of its top
    /// pointer, the merged kernel's hint). Async-signal-safe.
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    #[must_use]
    #[inline]
    pub fn looks_empty(&self, slot: usize) -> bool {
        self.head(slot).top.load(Ordering::Relaxed) == 0
    }

    /// A racy look at list `slot`'s empty flag (one load; always `false`
    /// for a stack without flags). Between operations a set flag means an
    /// empty list (see [`with_empty_flags`](Self::with_empty_flags)).
    /// Async-signal-safe.
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    #[must_use]
    #[inline]
    pub fn flagged_empty(&self, slot: usize) -> bool {
        self.head(slot).empty.load(Ordering::Relaxed) != 0
    }

    /// Word `word` of the summary of a stack with empty flags: bit `b`
    /// stands for list `64 * word + b`, and is set whenever that list may
    /// hold nodes. Precisely: the bit is set, in the same critical section
    /// or under the same lock, before a push links a node into the empty
    /// list, and cleared only where its empty flag is set (the list is
    /// empty), so **between operations a list that holds nodes has its
    /// bit set**; a clear bit with a list being filled means the push is
    /// still in flight. A set bit on an empty list costs a wasted look.
    /// 0 past the last word, and for a stack without flags.
    /// Async-signal-safe.
    #[must_use]
    #[inline]
    pub fn summary(&self, word: usize) -> u64 {
        self.summary
            .get(word)
            .map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// How many words the summary has (`slots().div_ceil(64)` with empty
    /// flags, else 0).
    #[must_use]
    #[inline]
    pub fn summary_words(&self) -> usize {
        self.summary.len()
    }

    /// Notes in the summary that list `slot` is about to get a node (its
    /// flag just cleared); with the list held exclusively.
    pub(super) fn note_filled(&self, slot: usize) {
        self.summary[slot / 64].fetch_or(1 << (slot % 64), Ordering::SeqCst);
    }

    /// Notes in the summary that list `slot` is empty (its flag about to
    /// be set); with the list held exclusively.
    pub(super) fn note_emptied(&self, slot: usize) {
        self.summary[slot / 64].fetch_and(!(1 << (slot % 64)), Ordering::SeqCst);
    }

    #[inline]
    fn head(&self, slot: usize) -> &Head {
        self.heads.get(slot).expect("slot index out of range")
    }

    /// Pushes `node` on the current CPU's list. May wait for the list's lock
    /// (only while another thread holds it): not async-signal-safe; use
    /// [`try_push`](Self::try_push) there.
    ///
    /// # Safety
    /// `node` is valid for reads and writes of the link word at
    /// `next_offset` (a usize-aligned address), is not in any list, and stays
    /// valid until popped.
    #[inline]
    pub unsafe fn push(&self, node: NonNull<u8>) {
        // SAFETY: forwarded.
        if unsafe { self.push_fast(node) } {
            return;
        }
        // SAFETY: forwarded.
        let pushed = unsafe { self.push_locked(self.current_slot(), true, node) };
        debug_assert!(pushed.is_ok(), "a waiting push always gets the lock");
    }

    /// Like [`push`](Self::push) but never waits: returns the node back if
    /// the list is locked. **Async-signal-safe.**
    ///
    /// # Safety
    /// As for [`push`](Self::push).
    #[inline]
    pub unsafe fn try_push(&self, node: NonNull<u8>) -> Result<(), NonNull<u8>> {
        // SAFETY: forwarded.
        if unsafe { self.push_fast(node) } {
            return Ok(());
        }
        // SAFETY: forwarded.
        unsafe { self.push_locked(self.current_slot(), false, node) }
    }

    /// Pushes `node` on list `slot`, whichever CPU the caller is on (takes
    /// that list's lock). Not async-signal-safe.
    ///
    /// # Safety
    /// As for [`push`](Self::push).
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    pub unsafe fn push_slot(&self, slot: usize, node: NonNull<u8>) {
        // SAFETY: forwarded.
        let pushed = unsafe { self.push_locked(slot, true, node) };
        debug_assert!(pushed.is_ok(), "a waiting push always gets the lock");
    }

    /// Like [`push_slot`](Self::push_slot) but never waits: returns the
    /// node back if the list is locked. **Async-signal-safe.**
    ///
    /// # Safety
    /// As for [`push`](Self::push).
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    pub unsafe fn try_push_slot(&self, slot: usize, node: NonNull<u8>) -> Result<(), NonNull<u8>> {
        // SAFETY: forwarded.
        unsafe { self.push_locked(slot, false, node) }
    }

    /// Pushes `node` on list `slot` of a stack no other thread can reach
    /// (`&mut self`): no lock, no fence; for filling a pool before sharing
    /// it. Not async-signal-safe.
    ///
    /// # Safety
    /// As for [`push`](Self::push).
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    pub unsafe fn push_slot_mut(&mut self, slot: usize, node: NonNull<u8>) {
        // SAFETY: forwarded; `&mut self` excludes every other access.
        unsafe { self.link(slot, node) };
    }

    /// Pops from the current CPU's list only. May wait for the list's lock:
    /// not async-signal-safe; use [`try_pop`](Self::try_pop) there.
    #[must_use]
    #[inline]
    pub fn pop(&self) -> Option<NonNull<u8>> {
        match self.pop_fast() {
            Ok(node) => node,
            Err(()) => self.pop_locked(self.current_slot(), true).unwrap_or(None),
        }
    }

    /// Like [`pop`](Self::pop) but never waits. **Async-signal-safe.**
    #[inline]
    pub fn try_pop(&self) -> Result<Option<NonNull<u8>>, WouldBlock> {
        match self.pop_fast() {
            Ok(node) => Ok(node),
            Err(()) => self.pop_locked(self.current_slot(), false),
        }
    }

    /// The current CPU's list in one critical section and nothing else: no
    /// lock, no other list. Inlined, for callers whose own-CPU pop must not
    /// pay for their other paths (a freelist's walk over the other lists
    /// goes after [`LocalPop::Empty`] or [`LocalPop::Locked`]).
    ///
    /// With `look_first`, a plain look at the list before the section (its
    /// empty flag if the stack keeps flags, else its head) answers `Empty`
    /// without a section when it looks empty: a pop on an empty CPU then
    /// costs a load. **Async-signal-safe.**
    #[allow(clippy::inline_always)] // the own-CPU pop of a freelist
    #[inline(always)]
    #[must_use]
    pub fn pop_local(&self, look_first: bool) -> LocalPop {
        // No critical sections here (aarch64 and others): only locks.
        #[cfg(not(any(pcpu_arch = "x86_64", pcpu_loom)))]
        let _ = look_first;
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if self.area != 0 {
            let area = self.area;
            let base = self.heads.raw_layout().0;
            let cpus = self.heads.cpus() as u32;
            // The look: between operations a set flag means an empty
            // list; the CPU id read here is a hint, the section reads it
            // again.
            if look_first {
                let cpu = crate::rseq_area::read_cpu_id(area);
                // SAFETY: `cpu` is below the CPU count, so a list's.
                if cpu < cpus && unsafe { self.looks_empty_for_pop(cpu as usize) } {
                    return LocalPop::Empty { slot: cpu as usize };
                }
            }
            // SAFETY: as in `push_fast`; nodes in a list have readable link
            // words (the push contract).
            let (rc, node, next) =
                unsafe { crate::rseq::raw_pop(area, base, cpus, self.next_offset) };
            // One predicted branch for the common case (a `match` on
            // every code compiles to a jump table).
            if rc == crate::rseq::DONE {
                // SAFETY: the section commits (`DONE`) only after finding a
                // node at the top, which it returns.
                let node = unsafe { NonNull::new_unchecked(node as *mut u8) };
                self.after_local_pop(next);
                return LocalPop::Popped(node);
            }
            return self.pop_local_exit(rc);
        }
        #[cfg(pcpu_loom)]
        if self.use_rseq {
            let cpu = crate::loom_cpu::current();
            // SAFETY: `cpu` is below the CPU count, so a list's.
            if look_first && cpu < self.heads.cpus() && unsafe { self.looks_empty_for_pop(cpu) } {
                return LocalPop::Empty { slot: cpu };
            }
            let mut popped = None;
            if self.modelled_section(|slot| popped = self.unlink_top(slot)) {
                return match popped {
                    Some(node) => {
                        // SAFETY: the node is ours now; its link word holds
                        // the next pointer the pop read.
                        self.after_local_pop(unsafe { self.link_word(node).read() });
                        LocalPop::Popped(node)
                    }
                    None => {
                        self.after_local_empty();
                        LocalPop::Empty {
                            slot: self.current_slot(),
                        }
                    }
                };
            }
        }
        LocalPop::Locked
    }

    /// A pop section's exits other than a popped node.
    #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
    #[inline(never)]
    fn pop_local_exit(&self, rc: u32) -> LocalPop {
        match rc {
            crate::rseq::EMPTY => {
                self.after_local_empty();
                LocalPop::Empty {
                    slot: self.current_slot(),
                }
            }
            crate::rseq::SLOW => LocalPop::Locked,
            other => unreachable!("rseq pop returned {other}"),
        }
    }

    /// Pops from list `slot`, whichever CPU the caller is on (takes the
    /// list's lock; in rseq mode, if the list is not empty, also fences
    /// that CPU). Not async-signal-safe.
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    #[must_use]
    pub fn pop_slot(&self, slot: usize) -> Option<NonNull<u8>> {
        self.pop_locked(slot, true).unwrap_or(None)
    }

    /// Like [`pop_slot`](Self::pop_slot) but never waits.
    /// **Async-signal-safe.**
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    pub fn try_pop_slot(&self, slot: usize) -> Result<Option<NonNull<u8>>, WouldBlock> {
        self.pop_locked(slot, false)
    }
}

impl core::fmt::Debug for PerCpuStack {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PerCpuStack")
            .field("slots", &self.slots())
            .field("uses_rseq", &self.use_rseq)
            .field("empty_flags", &self.empty_flags)
            .finish_non_exhaustive()
    }
}
