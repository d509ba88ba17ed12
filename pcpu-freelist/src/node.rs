//! `Node<T>`: one element's storage in the pool, the per-CPU lists' link
//! word, the extralist's link and the user's value.

use pcpu::unstable::sync::atomic::AtomicU32;
use pcpu::unstable::sync::cell::UnsafeCell;

/// One element: the per-CPU lists' link word, the extralist's link, and
/// the user's value. `repr(C)`: the link word first, at a fixed offset.
#[repr(C)]
pub(crate) struct Node<T> {
    /// Written by the per-CPU lists (through raw pointers, also from their
    /// assembly) only while they hold the node: hence a cell, since
    /// `&Node`s exist meanwhile.
    pub(crate) link: core::cell::UnsafeCell<usize>,
    pub(crate) extra_link: AtomicU32,
    pub(crate) value: UnsafeCell<T>,
}

impl<T> Node<T> {
    /// A node holding `value`, in no list.
    pub(crate) fn new(value: T) -> Self {
        Self {
            link: core::cell::UnsafeCell::new(0),
            extra_link: AtomicU32::new(0),
            value: UnsafeCell::new(value),
        }
    }
}
