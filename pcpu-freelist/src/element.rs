//! `Element`: the owned handle to one value taken from the pool, and the
//! pool's operations in handles ([`FreeList::pop`], [`FreeList::push`] and
//! their kin), over the node-level lists of `freelist`.

use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;

use crate::freelist::FreeList;
use crate::node::Node;

/// Exclusive access to one value of a [`FreeList`], from
/// [`pop`](FreeList::pop) until it is pushed back.
///
/// Dereferences to the value. Pushing it back consumes it
/// ([`FreeList::push`], [`FreeList::try_push`]); **dropping it pushes it
/// back too**, without waiting (the `try_push` path, so dropping is
/// async-signal-safe). [`into_index`](Self::into_index) trades it for its
/// index, keeping the element out of the pool until
/// [`FreeList::from_index`] turns the index back into a handle.
///
/// ```
/// let pool = pcpu_freelist::FreeList::new([0u64; 8]);
/// let mut e = pool.pop().unwrap();
/// *e += 1;
/// let i = e.into_index(); // out of the pool, held as a plain index
/// // SAFETY: `i` came from `into_index` on this pool and is turned back once.
/// let e = unsafe { pool.from_index(i) };
/// assert_eq!(*e, 1);
/// ```
pub struct Element<'a, T> {
    pool: &'a FreeList<T>,
    /// One of `pool`'s nodes (a pointer, not an index: popping and pushing
    /// convert nothing).
    node: NonNull<Node<T>>,
}

// SAFETY: the handle is the value's only access path: sending it sends the
// value.
unsafe impl<T: Send> Send for Element<'_, T> {}
// SAFETY: a shared handle gives only `&T`.
unsafe impl<T: Sync> Sync for Element<'_, T> {}

impl<'a, T> Element<'a, T> {
    /// A handle for `node`, one of `pool`'s nodes that no list holds.
    #[inline]
    fn new(pool: &'a FreeList<T>, node: NonNull<Node<T>>) -> Self {
        Self { pool, node }
    }

    /// Gives up the handle for its node, which stays out of the pool.
    #[inline]
    fn into_node(self) -> NonNull<Node<T>> {
        let node = self.node;
        core::mem::forget(self);
        node
    }

    /// The element's index in its pool (`0..capacity()`), stable for the
    /// pool's life. Async-signal-safe.
    #[must_use]
    pub fn index(&self) -> usize {
        self.pool.index_of(self.node)
    }

    /// The pool this element belongs to.
    #[must_use]
    pub fn pool(&self) -> &'a FreeList<T> {
        self.pool
    }

    /// Gives up the handle for its index; the element stays taken (out of
    /// the pool) until [`FreeList::from_index`] makes a handle of it again.
    /// Forgetting the index leaks the element (the pool shrinks by one; it
    /// is never handed out again). Async-signal-safe.
    #[must_use]
    pub fn into_index(self) -> usize {
        let index = self.index();
        core::mem::forget(self);
        index
    }

    fn value(&self) -> *mut T {
        // SAFETY: the node is one of the pool's, which outlives `'a`.
        let node = unsafe { self.node.as_ref() };
        // The pointer escapes the closure: loom checks the access when the
        // handle is dereferenced, which is when the value is touched.
        node.value.with_mut(|p| p)
    }
}

// The pool's operations in element handles: a handle made for each node
// taken, consumed for each node put back.
impl<T> FreeList<T> {
    /// Takes a free element: the current CPU's list first, then the other
    /// CPUs' lists in turn (skipping those the hint says are empty), then
    /// the extralist. `None` when the pool has no free element: a pop never
    /// waits for an element to come back.
    ///
    /// May wait for another CPU's list lock, held for a few instructions
    /// by another pop (longer if that thread is descheduled): **not**
    /// async-signal-safe; use [`try_pop`](Self::try_pop) there.
    #[must_use]
    #[inline]
    pub fn pop(&self) -> Option<Element<'_, T>> {
        self.take(true).map(|node| self.element(node))
    }

    /// Like [`pop`](Self::pop) but never waits for a lock: a list that
    /// another thread has locked is skipped, so `None` may also mean "only
    /// locked lists had elements". **Async-signal-safe.**
    #[must_use]
    #[inline]
    pub fn try_pop(&self) -> Option<Element<'_, T>> {
        self.take(false).map(|node| self.element(node))
    }

    /// Returns `element` to the pool, on the current CPU's list. May wait
    /// briefly for that list's lock (only while another thread's pop holds
    /// it): **not** async-signal-safe; use [`try_push`](Self::try_push)
    /// there.
    ///
    /// # Panics
    /// If `element` came from another pool.
    pub fn push(&self, element: Element<'_, T>) {
        let node = self.reclaim(element);
        // SAFETY: the node is one of ours, held by no list (its element
        // handle was just consumed).
        unsafe { self.put(node) };
    }

    /// Returns `element` to the pool on list `list` (`0..lists()`: the
    /// list of CPU `list`), whichever CPU the caller runs on, taking that
    /// list's lock as a pop that steals from it does. For putting elements
    /// where they belong rather than where they were freed: back on the
    /// list of the CPU that will use them, or spread over the lists of a
    /// pool built [`with_lists`](Self::with_lists) for more CPUs than this
    /// machine has. May wait for the list's lock: **not**
    /// async-signal-safe.
    ///
    /// ```
    /// use pcpu_freelist::{EmptyHint, FreeList};
    ///
    /// // A pool built for 8 CPUs, its elements all moved to list 7.
    /// let pool = FreeList::with_lists(0..4u32, EmptyHint::Summary, 8);
    /// let all: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
    /// for e in all {
    ///     pool.push_to(e, 7);
    /// }
    /// // A pop on this machine's CPUs finds them there.
    /// assert!(pool.pop().is_some());
    /// ```
    ///
    /// # Panics
    /// If `element` came from another pool, or `list >= self.lists()`.
    pub fn push_to(&self, element: Element<'_, T>, list: usize) {
        assert!(
            list < self.lists(),
            "list {list} of a pool of {} lists",
            self.lists()
        );
        let node = self.reclaim(element);
        // SAFETY: as in `push`; `list` is one of the pool's lists.
        unsafe { self.put_on(list, node) };
    }

    /// Returns `element` to the pool without ever waiting: on the current
    /// CPU's list if its lock is free, else on the lock-free extralist. It
    /// always succeeds. **Async-signal-safe** (dropping an [`Element`]
    /// does this).
    ///
    /// # Panics
    /// If `element` came from another pool.
    pub fn try_push(&self, element: Element<'_, T>) {
        let node = self.reclaim(element);
        // SAFETY: as in `push`.
        unsafe { self.put_nowait(node) };
    }

    /// The element at `index`, as handed out before by
    /// [`Element::into_index`]. Async-signal-safe.
    ///
    /// # Safety
    /// `index` came from `into_index` on an element of **this** pool, and
    /// no other handle for it exists (each `into_index` is turned back at
    /// most once).
    ///
    /// # Panics
    /// If `index >= self.capacity()`.
    #[must_use]
    pub unsafe fn from_index(&self, index: usize) -> Element<'_, T> {
        assert!(index < self.capacity(), "element index out of range");
        self.element(self.node_ptr(index))
    }

    /// The handle for `node`, one of ours that no list holds.
    #[inline]
    fn element(&self, node: NonNull<u8>) -> Element<'_, T> {
        Element::new(self, node.cast())
    }

    /// Consumes a handle, checking that it belongs here.
    fn reclaim(&self, element: Element<'_, T>) -> NonNull<u8> {
        assert!(
            core::ptr::eq(element.pool(), self),
            "pushed an element into a FreeList it did not come from"
        );
        element.into_node().cast()
    }
}

impl<T> Deref for Element<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: the handle owns the element exclusively (the lists do not
        // hold it; no other handle exists), and `&self` borrows the handle.
        unsafe { &*self.value() }
    }
}

impl<T> DerefMut for Element<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, with `&mut self` borrowing exclusively.
        unsafe { &mut *self.value() }
    }
}

impl<T> Drop for Element<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the node is ours (this handle owned it) and goes back once.
        unsafe { self.pool.put_nowait(self.node.cast()) };
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for Element<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Element")
            .field("index", &self.index())
            .field("value", &**self)
            .finish()
    }
}
