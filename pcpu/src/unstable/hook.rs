//! A slot for one test hook: a function a crate calls at a racy point of
//! its own code when a test has installed one, so the test can park a
//! thread or run a signal handler exactly there. The crates of the family
//! keep their points (an enum each) in a `hooks` module behind their
//! `test-hooks` feature; this is the slot they share.

use core::marker::PhantomData;
use core::sync::atomic::{AtomicPtr, Ordering};

/// One hook, `fn(P)`, or none; `const`-constructible, for a `static`.
/// Plain atomics (never loom's): hooks are test scaffolding, outside any
/// model.
pub struct HookSlot<P> {
    /// The function, or null for none. A pointer rather than an integer:
    /// a function pointer rebuilt from an integer would have lost its
    /// provenance (Miri rejects the call).
    f: AtomicPtr<()>,
    _point: PhantomData<fn(P)>,
}

impl<P> HookSlot<P> {
    /// An empty slot.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            f: AtomicPtr::new(core::ptr::null_mut()),
            _point: PhantomData,
        }
    }

    /// Installs `hook`, or removes it with `None`. Async-signal-safe.
    pub fn set(&self, hook: Option<fn(P)>) {
        self.f.store(
            hook.map_or(core::ptr::null_mut(), |f| f as *mut ()),
            Ordering::SeqCst,
        );
    }

    /// Calls the installed hook with `point`, if there is one, on the
    /// calling thread and in its context. Async-signal-safe itself (the
    /// hook is whatever the test made it).
    pub fn call(&self, point: P) {
        let f = self.f.load(Ordering::SeqCst);
        if !f.is_null() {
            // SAFETY: only `set` stores a non-null value, and what it
            // stores is a `fn(P)` cast to a pointer (a function pointer is
            // never null), with its provenance.
            let f = unsafe { core::mem::transmute::<*mut (), fn(P)>(f) };
            f(point);
        }
    }
}

impl<P> core::fmt::Debug for HookSlot<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HookSlot")
            .field("installed", &!self.f.load(Ordering::Relaxed).is_null())
            .finish()
    }
}

impl<P> Default for HookSlot<P> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static SEEN: AtomicU32 = AtomicU32::new(0);

    fn record(p: u32) {
        SEEN.fetch_add(p, Ordering::SeqCst);
    }

    #[test]
    fn a_hook_runs_only_while_installed() {
        let slot = HookSlot::<u32>::new();
        slot.call(1);
        slot.set(Some(record));
        slot.call(2);
        slot.call(3);
        slot.set(None);
        slot.call(4);
        assert_eq!(SEEN.load(Ordering::SeqCst), 5);
    }
}
