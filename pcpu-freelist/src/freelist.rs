//! `FreeList<T>`: the pool, its per-CPU lists, the extralist and the walk,
//! in nodes: taking a free node and putting one back. The handles that
//! hand nodes to users, and the pool's operations in handles, are
//! `element`'s.

use core::ptr::NonNull;

use pcpu::{LocalPop, PerCpuStack};

use crate::extralist::ExtraList;
use crate::node::Node;

/// How a pop decides that another CPU's list is not worth locking.
///
/// [`Summary`](Self::Summary) is the default; the other three are the
/// kernel before the patch, the patch as posted and the check that was
/// merged, kept so that the before/after stays measurable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EmptyHint {
    /// The patch's flags, summed up: a bit per list in a few shared words
    /// (one per 64 lists), set before a node goes into an empty list and
    /// cleared with its flag, so a pop looks at one word per 64 lists and
    /// then only at lists that may hold nodes. An empty pool costs a pop
    /// the same on 2 CPUs as on 256.
    #[default]
    Summary,
    /// The patch's `is_empty` flag: one flag per list, written only on
    /// empty <-> non-empty transitions, read before the lock (a pop over
    /// empty lists reads one flag per CPU).
    Flag,
    /// The merged kernel's check: a racy read of the list's head pointer
    /// before the lock.
    Head,
    /// No hint (the kernel before the patch): every list is locked to find
    /// out whether it is empty.
    None,
}

/// A fixed pool of preallocated `T`s on per-CPU free lists.
///
/// Built once from its values ([`new`](Self::new)); after that nothing
/// allocates. [`pop`](Self::pop) hands out an [`Element`](crate::Element)
/// (exclusive access to one value); pushing it back
/// ([`push`](Self::push), [`try_push`](Self::try_push), or dropping it)
/// returns it to the pool. The element handle is the only way to reach a
/// value, and pushing consumes it: through the safe API no element can be
/// pushed twice or used after it went back.
/// ([`Element::into_index`](crate::Element::into_index) and
/// [`from_index`](Self::from_index) trade the handle for a plain index and
/// back, for callers that must store it in a word.)
///
/// See the [crate docs](crate) for the structure, which operations are
/// async-signal-safe, and the hint's exact guarantee.
///
/// ```
/// use pcpu_freelist::FreeList;
/// let pool = FreeList::new((0..4).map(|i| format!("buffer {i}")));
/// let mut a = pool.pop().expect("4 free elements");
/// a.push_str(" (in use)");
/// let b = pool.pop().unwrap();
/// assert_ne!(a.index(), b.index());
/// pool.push(a);
/// drop(b); // dropping a handle pushes it back too
/// // Keep the handles: each one dropped would go straight back.
/// let all: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
/// assert_eq!(all.len(), 4);
/// ```
pub struct FreeList<T> {
    /// The elements' storage, never resized nor moved. A `Vec`, not a
    /// `Box<[_]>`: the lists keep addresses of nodes (exposed, as
    /// integers) while the pool itself is moved, and moving a `Box`
    /// asserts unique access to what it points to, which would invalidate
    /// those addresses (Miri reported the use of one afterwards as
    /// undefined behaviour under Stacked Borrows); a `Vec` asserts
    /// nothing of the kind.
    nodes: Vec<Node<T>>,
    lists: PerCpuStack,
    extra: ExtraList,
    hint: EmptyHint,
    /// Whether a pop looks at this CPU's list before its critical section
    /// (the patch's flag and the merged kernel's head do; see `take`).
    look_first: bool,
}

// SAFETY: the pool hands each value to one element handle at a time (the
// lists never hold a node twice), so sharing the pool moves `T`s between
// threads, like `Mutex<T>`.
unsafe impl<T: Send> Sync for FreeList<T> {}
// SAFETY: owning the pool owns the values.
unsafe impl<T: Send> Send for FreeList<T> {}

impl<T> FreeList<T> {
    /// A pool holding `values`, spread evenly over the CPUs' lists (in
    /// index order, so each CPU's elements are adjacent in memory), with
    /// the flag hint. Not async-signal-safe (allocates).
    ///
    /// # Panics
    /// If there are `u32::MAX` values or more (indexes are 32-bit).
    pub fn new(values: impl IntoIterator<Item = T>) -> Self {
        Self::with_hint(values, EmptyHint::default())
    }

    /// Like [`new`](Self::new) with the given hint; [`EmptyHint::Flag`],
    /// [`EmptyHint::Head`] and [`EmptyHint::None`] exist to measure the
    /// patch's before/after.
    ///
    /// # Panics
    /// As for [`new`](Self::new).
    pub fn with_hint(values: impl IntoIterator<Item = T>, hint: EmptyHint) -> Self {
        Self::build(values, hint, None)
    }

    /// Like [`with_hint`](Self::with_hint), as if the machine had `cpus`
    /// possible CPUs: `cpus` lists (and the overflow list), the values
    /// spread over them. The lists beyond the machine's CPUs are never a
    /// thread's own (threads on the machine's CPUs pop them only by the
    /// walk, under their lock). For measuring on a small machine what a
    /// pop costs on a big one: an empty pool's walk over 256 lists, or a
    /// steal from the far end. Not async-signal-safe (allocates).
    ///
    /// # Panics
    /// As for [`new`](Self::new).
    pub fn with_lists(values: impl IntoIterator<Item = T>, hint: EmptyHint, cpus: usize) -> Self {
        Self::build(values, hint, Some(cpus))
    }

    fn build(values: impl IntoIterator<Item = T>, hint: EmptyHint, lists: Option<usize>) -> Self {
        let nodes: Vec<Node<T>> = values.into_iter().map(Node::new).collect();
        assert!(
            u32::try_from(nodes.len()).is_ok_and(|n| n < u32::MAX),
            "a FreeList holds fewer than u32::MAX elements, not {}",
            nodes.len()
        );
        let next_offset = core::mem::offset_of!(Node<T>, link);
        let flags = matches!(hint, EmptyHint::Summary | EmptyHint::Flag);
        let mut lists = match lists {
            Some(cpus) => PerCpuStack::with_cpus(next_offset, flags, cpus),
            None if flags => PerCpuStack::with_empty_flags(next_offset),
            None => PerCpuStack::new(next_offset),
        };
        // Even shares per CPU list (not the overflow list, which only
        // threads on CPUs beyond the possible count use).
        let cpus = lists.slots() - 1;
        let per_cpu = nodes.len().div_ceil(cpus.max(1));
        for (i, node) in nodes.iter().enumerate().rev() {
            let slot = (i / per_cpu.max(1)).min(cpus.saturating_sub(1));
            // SAFETY: each node is pushed once; the nodes live in `nodes`,
            // which the pool owns and never moves (a boxed slice), as long
            // as the lists; the link word is at `next_offset`.
            unsafe { lists.push_slot_mut(slot, NonNull::from(node).cast()) };
        }
        Self {
            nodes,
            lists,
            extra: ExtraList::new(),
            hint,
            look_first: matches!(hint, EmptyHint::Flag | EmptyHint::Head),
        }
    }

    /// The number of elements in the pool (free or not).
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.nodes.len()
    }

    /// The number of per-CPU lists: the machine's possible CPUs, or the
    /// count given to [`with_lists`](Self::with_lists). (A thread on a
    /// CPU beyond them uses one more, shared list.)
    #[must_use]
    pub fn lists(&self) -> usize {
        self.lists.slots() - 1
    }

    /// The hint the pool was built with.
    #[must_use]
    pub fn hint(&self) -> EmptyHint {
        self.hint
    }

    /// Whether the per-CPU lists run on rseq critical sections (x86-64 with
    /// glibc's rseq area and membarrier) rather than per-list spinlocks.
    #[must_use]
    pub fn uses_rseq(&self) -> bool {
        self.lists.uses_rseq()
    }

    /// Puts `node` back on the current CPU's list, waiting for its lock
    /// if another thread's pop holds it.
    ///
    /// # Safety
    /// `node` is one of ours and in no list.
    #[inline]
    pub(crate) unsafe fn put(&self, node: NonNull<u8>) {
        // SAFETY: forwarded.
        unsafe { self.lists.push(node) };
    }

    /// Puts `node` on list `list`, waiting for its lock.
    ///
    /// # Safety
    /// `node` is one of ours and in no list; `list < self.lists()`.
    pub(crate) unsafe fn put_on(&self, list: usize, node: NonNull<u8>) {
        // SAFETY: forwarded.
        unsafe { self.lists.push_slot(list, node) };
    }

    /// The node at `index`, as a list holds it.
    ///
    /// # Panics
    /// If `index >= self.capacity()`.
    pub(crate) fn node_ptr(&self, index: usize) -> NonNull<u8> {
        NonNull::from(&self.nodes[index]).cast()
    }

    pub(crate) fn node(&self, index: u32) -> &Node<T> {
        // SAFETY: element indexes are below `capacity()` (the extralist
        // holds only indexes that `index_of` gave for our nodes).
        unsafe { self.nodes.get_unchecked(index as usize) }
    }

    /// Pushes without waiting: the current CPU's list, or the extralist.
    /// Async-signal-safe.
    ///
    /// # Safety
    /// `node` is one of ours and in no list.
    pub(crate) unsafe fn put_nowait(&self, node: NonNull<u8>) {
        // SAFETY: forwarded.
        if let Err(node) = unsafe { self.lists.try_push(node) } {
            let index = self.index_of(node.cast()) as u32;
            self.extra.push(index, |i| &self.node(i).extra_link);
        }
    }

    /// The index of `node`, one of `self.nodes` (the lists and elements
    /// hold no other).
    pub(crate) fn index_of(&self, node: NonNull<Node<T>>) -> usize {
        // SAFETY: the node is one of `self.nodes`.
        let index = unsafe { node.offset_from(NonNull::from(&self.nodes[0])) };
        index.unsigned_abs()
    }

    /// This CPU's list in one critical section (inlined: the common pop
    /// pays for nothing else), then, out of line, the walk.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn take(&self, wait: bool) -> Option<NonNull<u8>> {
        // The patch's flag and the merged kernel's head look at this CPU's
        // list before its section too; the summary's pop lets the section
        // find it empty (a full list, the common case, pays no look).
        match self.lists.pop_local(self.look_first) {
            LocalPop::Popped(node) => Some(node),
            LocalPop::Empty { slot } => self.take_elsewhere(wait, Some(slot)),
            LocalPop::Locked => self.take_elsewhere(wait, None),
        }
    }

    /// The walk: this CPU's list (unless `empty`: the list just found
    /// empty), the others in turn, the extralist.
    #[inline(never)]
    fn take_elsewhere(&self, wait: bool, empty: Option<usize>) -> Option<NonNull<u8>> {
        // One loop per hint, so the walk over empty lists is a tight run of
        // loads (the case the patch is about).
        let node = match self.hint {
            EmptyHint::Summary => self.walk_summary(wait, empty),
            EmptyHint::Flag => self.walk(wait, empty, |s| self.lists.flagged_empty(s)),
            EmptyHint::Head => self.walk(wait, empty, |s| self.lists.looks_empty(s)),
            EmptyHint::None => self.walk(wait, empty, |_| false),
        };
        node.or_else(|| {
            let index = self.extra.pop(|i| &self.node(i).extra_link)?;
            Some(NonNull::from(self.node(index)).cast())
        })
    }

    /// This CPU's list under its lock (unless `empty`: the list its
    /// critical section just found empty, then taken as this CPU's), then
    /// the others from the next one round to the one before ours,
    /// skipping lists `looks_empty` rules out.
    #[inline]
    fn walk(
        &self,
        wait: bool,
        empty: Option<usize>,
        looks_empty: impl Fn(usize) -> bool,
    ) -> Option<NonNull<u8>> {
        let lists = &self.lists;
        let here = empty.unwrap_or_else(|| lists.current_slot());
        let try_list = |slot| {
            if looks_empty(slot) {
                None
            } else {
                self.pop_list(slot, wait)
            }
        };
        // No section could run on this CPU's list (no rseq, the list
        // locked, a CPU beyond the possible ones): it is locked like the
        // others.
        if empty.is_none()
            && let Some(node) = try_list(here)
        {
            return Some(node);
        }
        // Two plain loops (a chained iterator costs a branch per step).
        for slot in here + 1..lists.slots() {
            if let Some(node) = try_list(slot) {
                return Some(node);
            }
        }
        for slot in 0..here {
            if let Some(node) = try_list(slot) {
                return Some(node);
            }
        }
        None
    }

    /// [`walk`](Self::walk) over the lists the summary says may hold
    /// nodes: this CPU's list (unless `empty`), then, a summary word at a
    /// time, the set bits from the next list round to the one before ours,
    /// each list's flag looked at before its lock.
    /// A loop of its own, beside `walk`'s: the two written as one (an
    /// iterator of candidate lists) cost the empty pop ~20% and the flag
    /// walk ~10% in `bench freelist-pop-empty`.
    fn walk_summary(&self, wait: bool, empty: Option<usize>) -> Option<NonNull<u8>> {
        let lists = &self.lists;
        let here = empty.unwrap_or_else(|| lists.current_slot());
        let try_list = |slot| {
            if lists.flagged_empty(slot) {
                None
            } else {
                self.pop_list(slot, wait)
            }
        };
        if empty.is_none()
            && let Some(node) = try_list(here)
        {
            return Some(node);
        }
        // An empty pool (the case the hint is for): the words alone.
        if (0..lists.summary_words()).all(|w| lists.summary(w) == 0) {
            return None;
        }
        for (from, to) in [(here + 1, lists.slots()), (0, here)] {
            let mut word = from / 64;
            while word * 64 < to {
                // The bits of lists `from..to` in this word.
                let mut bits = lists.summary(word) & (!0 << (from.max(word * 64) - word * 64));
                if to - word * 64 < 64 {
                    bits &= (1 << (to - word * 64)) - 1;
                }
                while bits != 0 {
                    let slot = word * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if let Some(node) = try_list(slot) {
                        return Some(node);
                    }
                }
                word += 1;
            }
        }
        None
    }

    /// Pops list `slot` under its lock (out of line: the walk over empty
    /// lists stays a short loop).
    #[cold]
    #[inline(never)]
    fn pop_list(&self, slot: usize, wait: bool) -> Option<NonNull<u8>> {
        if wait {
            self.lists.pop_slot(slot)
        } else {
            self.lists.try_pop_slot(slot).ok().flatten()
        }
    }
}

impl<T> core::fmt::Debug for FreeList<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FreeList")
            .field("capacity", &self.capacity())
            .field("hint", &self.hint)
            .field("lists", &self.lists)
            .field("extralist_empty", &self.extra.looks_empty())
            .finish_non_exhaustive()
    }
}
