//! `Element`: the owned handle to one value taken from the pool.

use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;

use crate::FreeList;
use crate::freelist::Node;

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
    pub(crate) fn new(pool: &'a FreeList<T>, node: NonNull<Node<T>>) -> Self {
        Self { pool, node }
    }

    /// Gives up the handle for its node, which stays out of the pool.
    #[inline]
    pub(crate) fn into_node(self) -> NonNull<Node<T>> {
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
