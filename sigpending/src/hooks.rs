//! Test-only hooks (feature `test-hooks`): a function called at a racy
//! point of the charge path, so a test can park one thread exactly there
//! and run another against it. Not part of the public API.

use pcpu::unstable::hook::HookSlot;

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

static HOOK: HookSlot<Point> = HookSlot::new();

/// Installs `hook` (or removes it with `None`); it runs on every thread
/// that reaches a [`Point`], in whatever context that is.
pub fn set(hook: Option<fn(Point)>) {
    HOOK.set(hook);
}

pub(crate) fn at(point: Point) {
    HOOK.call(point);
}
