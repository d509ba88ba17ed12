//! What a consumed lease hands over: the value under the lease's read
//! section, or under the strong reference the lease expired into.

use std::ops::Deref;
use std::ptr::NonNull;

use crate::cell::{Node, Strong};
use crate::domain::Inner;

/// What a consumed lease hands over; derefs to the value.
pub enum Held<'b, T> {
    /// The lease had not expired: the value, under the lease's read
    /// section, which ends when this is dropped (async-signal-safe).
    Leased(LeasedValue<'b, T>),
    /// The lease had expired into a strong reference (dropping it may free
    /// the value: not async-signal-safe).
    Stable(Strong<T>),
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Self::Leased(v) => v,
            Self::Stable(s) => s,
        }
    }
}

/// A value under a read section inherited from a lease.
pub struct LeasedValue<'b, T> {
    pub(super) domain: &'b Inner,
    pub(super) bank: usize,
    pub(super) node: NonNull<Node<T>>,
}

impl<T> Deref for LeasedValue<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the read section is still held (ended in `drop`).
        unsafe { &self.node.as_ref().value }
    }
}

impl<T> Drop for LeasedValue<'_, T> {
    fn drop(&mut self) {
        crate::fork::held_add(-1);
        self.domain.read_unlock(self.bank);
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Held<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Leased(v) => f.debug_tuple("Leased").field(&**v).finish(),
            Self::Stable(s) => f.debug_tuple("Stable").field(&**s).finish(),
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for LeasedValue<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LeasedValue").field(&**self).finish()
    }
}
