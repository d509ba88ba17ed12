//! Test-only hooks (feature `test-hooks`): a function called at each step
//! of the write side, so a test can run a signal handler at exactly that
//! point. Not part of the public API.

use pcpu::unstable::hook::HookSlot;

/// Where a hook is called: between two steps of a write-side operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Point {
    /// Inside `write_lock`/`try_write`, after step `n` (0: the writer
    /// mutex is held).
    WriteLock(u8),
    /// Inside the release of the write side, after step `n` (0: nothing
    /// released yet).
    WriteUnlock(u8),
    /// Inside `WriteGuard::downgrade`, after step `n` (0: nothing done yet).
    Downgrade(u8),
}

static HOOK: HookSlot<Point> = HookSlot::new();

/// Installs `hook` (or removes it with `None`). It runs on whichever
/// thread reaches a [`Point`], for every semaphore.
pub fn set(hook: Option<fn(Point)>) {
    HOOK.set(hook);
}

pub(crate) fn at(point: Point) {
    HOOK.call(point);
}
