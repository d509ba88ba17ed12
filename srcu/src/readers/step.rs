//! The add to a slot's nested count: one instruction that a signal
//! handler cannot split, and no `lock` prefix (only the owner writes it).

use pcpu::unstable::sync::atomic::AtomicU64;
#[cfg(not(all(target_arch = "x86_64", not(pcpu_loom), not(miri))))]
use pcpu::unstable::sync::atomic::Ordering;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    Up,
    Down,
}

/// Adds 1 to (`Up`) or takes 1 from (`Down`) a slot's nested count,
/// which only this thread writes: in one instruction on x86-64
/// (`inc`/`dec` on memory: no `lock` prefix is needed for a word no
/// other thread writes, and an instruction is never split by a signal
/// handler), an atomic add elsewhere. Async-signal-safe.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(super) fn step(word: &AtomicU64, step: Step) {
    #[cfg(all(target_arch = "x86_64", not(pcpu_loom), not(miri)))]
    // SAFETY: an aligned `u64` of this thread's slot, written by this
    // thread only; other threads read it with atomic loads, which see the
    // old or the new value (aligned 8-byte accesses do not tear).
    unsafe {
        if step == Step::Up {
            core::arch::asm!("inc qword ptr [{0}]", in(reg) word.as_ptr(), options(nostack));
        } else {
            core::arch::asm!("dec qword ptr [{0}]", in(reg) word.as_ptr(), options(nostack));
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(pcpu_loom), not(miri))))]
    if step == Step::Up {
        word.fetch_add(1, Ordering::Relaxed);
    } else {
        word.fetch_sub(1, Ordering::Relaxed);
    }
}
