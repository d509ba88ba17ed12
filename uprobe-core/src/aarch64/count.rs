//! Counting in trampolines (see `crate::site::count`): not on aarch64,
//! where every hit of a counting probe runs the common entry.

/// Never: no aarch64 trampoline counts by itself. Async-signal-safe.
pub(crate) fn enabled() -> bool {
    false
}

/// Never used (no trampoline counts here).
pub(crate) fn fits(_stride: usize, _cpus: usize) -> bool {
    false
}
