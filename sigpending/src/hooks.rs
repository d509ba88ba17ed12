//! Test-only hooks (feature `test-hooks`): a function called at a racy
//! point of the charge path, so a test can park one thread exactly there
//! and run another against it. Not part of the public API.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Where a hook is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Point {
    /// A charge that found a level idle (its load read the word as 0, or
    /// its increment took the count from 0 to 1) has tried to pin the
    /// owner (`pinned` says whether it succeeded) and has not yet made the
    /// outcome visible to other chargers.
    PinTried {
        /// Whether the pin succeeded.
        pinned: bool,
    },
}

static HOOK: AtomicUsize = AtomicUsize::new(0);

/// Installs `hook` (or removes it with `None`); it runs on every thread
/// that reaches a [`Point`], in whatever context that is.
pub fn set(hook: Option<fn(Point)>) {
    HOOK.store(hook.map_or(0, |f| f as usize), Ordering::SeqCst);
}

pub(crate) fn at(point: Point) {
    let f = HOOK.load(Ordering::SeqCst);
    if f != 0 {
        // SAFETY: only `set` stores a non-zero value, and it stores a
        // `fn(Point)`.
        let f: fn(Point) = unsafe { core::mem::transmute::<usize, fn(Point)>(f) };
        f(point);
    }
}
