//! `TaskFlags`: a thread's flag word, with lock-free deny and restore.

use std::cell::Cell;
use std::sync::Arc;

use pcpu::unstable::sync::atomic::{AtomicU32, Ordering};

/// One thread's flag word: other threads post requests with
/// [`set`](Self::set); the owning thread consumes them with
/// [`take`](Self::take), and can [`deny`](Self::deny) flags for a while and
/// [`restore`](Self::restore) them afterwards, **without any lock**.
///
/// This is the kernel's `signal_denied` (2025): while a uprobe single-steps,
/// the kernel clears the task's `TIF_SIGPENDING` so that no signal is
/// handled in the middle of the step, remembers that it did, and sets the
/// flag again afterwards, where it used to recompute it under the
/// process-wide siglock. Every operation is one atomic read-modify-write
/// (deny first reads, so a flag that is not set costs a load):
///
/// - `set` is `fetch_or`: a request posted while a flag is denied sets it
///   again at once, and `restore` (a `fetch_or` of what was denied) can
///   never clear it: **no request is lost**, whatever the interleaving;
/// - `deny` is `fetch_and(!mask)` and records which of those bits were set
///   in the owner's `denied` word; `restore` swaps that word to 0 and ors
///   it back in.
///
/// The deny/restore pair is the owner's (the calling thread's own word, or
/// a signal handler on that thread); `set` is anyone's. **Every operation
/// is async-signal-safe** (atomics only), and [`TaskFlags::with_current`]
/// finds the calling thread's word without allocating or initialising
/// anything lazily.
///
/// ```
/// use std::sync::Arc;
/// use sigpending::TaskFlags;
/// const SIGPENDING: u32 = 1;
/// let flags = Arc::new(TaskFlags::new());
/// flags.set(SIGPENDING);                        // another thread posts
/// assert_eq!(flags.deny(SIGPENDING), SIGPENDING); // owner: not now
/// assert_eq!(flags.pending() & SIGPENDING, 0);
/// flags.restore();                              // owner: now
/// assert_eq!(flags.take(SIGPENDING), SIGPENDING);
/// ```
#[derive(Debug, Default)]
pub struct TaskFlags {
    pending: AtomicU32,
    denied: AtomicU32,
}

impl TaskFlags {
    /// A word with no flag set.
    #[cfg(not(pcpu_loom))]
    #[must_use]
    pub const fn new() -> Self {
        Self {
            pending: AtomicU32::new(0),
            denied: AtomicU32::new(0),
        }
    }

    /// A word with no flag set (loom build: not `const`).
    #[cfg(pcpu_loom)]
    #[must_use]
    pub fn new() -> Self {
        Self {
            pending: AtomicU32::new(0),
            denied: AtomicU32::new(0),
        }
    }

    /// Posts the flags in `mask` (any thread). Release: what the poster
    /// wrote before is visible to the owner once it sees the flag.
    #[inline]
    pub fn set(&self, mask: u32) {
        self.pending.fetch_or(mask, Ordering::Release);
    }

    /// The flags set now (denied ones are not).
    #[inline]
    #[must_use]
    pub fn pending(&self) -> u32 {
        self.pending.load(Ordering::Acquire)
    }

    /// The flags denied and not yet restored.
    #[inline]
    #[must_use]
    pub fn denied(&self) -> u32 {
        self.denied.load(Ordering::Relaxed)
    }

    /// Consumes the flags of `mask` that are set, returning them (owner).
    #[inline]
    pub fn take(&self, mask: u32) -> u32 {
        if self.pending.load(Ordering::Relaxed) & mask == 0 {
            return 0;
        }
        self.pending.fetch_and(!mask, Ordering::Acquire) & mask
    }

    /// Clears the flags of `mask` that are set and remembers them for
    /// [`restore`](Self::restore); returns them (owner). Denying again
    /// before restoring adds to what is remembered.
    #[inline]
    pub fn deny(&self, mask: u32) -> u32 {
        if self.pending.load(Ordering::Relaxed) & mask == 0 {
            return 0;
        }
        let cleared = self.pending.fetch_and(!mask, Ordering::Acquire) & mask;
        if cleared != 0 {
            self.denied.fetch_or(cleared, Ordering::Relaxed);
        }
        cleared
    }

    /// Sets again every flag denied since the last restore, and forgets
    /// them; returns them (owner). A flag posted meanwhile is already set
    /// and stays set.
    #[inline]
    pub fn restore(&self) -> u32 {
        // Reading first keeps the common "nothing denied" case a load.
        if self.denied.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let denied = self.denied.swap(0, Ordering::Relaxed);
        if denied != 0 {
            self.pending.fetch_or(denied, Ordering::Release);
        }
        denied
    }

    /// Makes `flags` the calling thread's word, found from then on by
    /// [`with_current`](Self::with_current) (also in signal handlers). The
    /// thread keeps a reference until it exits. Not async-signal-safe
    /// (registers the thread-exit release).
    pub fn install_current(flags: &Arc<Self>) {
        let raw = Arc::into_raw(Arc::clone(flags));
        let old = CURRENT.replace(raw);
        // Registers the destructor now, in ordinary context.
        RELEASE_AT_EXIT.with(|_| {});
        if !old.is_null() {
            // SAFETY: `old` came from `Arc::into_raw` above, earlier.
            drop(unsafe { Arc::from_raw(old) });
        }
    }

    /// Runs `f` on the calling thread's word, if one was installed.
    /// **Async-signal-safe**: one thread-local load (a constant-initialised
    /// slot without destructor, so nothing is initialised on first use).
    pub fn with_current<R>(f: impl FnOnce(&Self) -> R) -> Option<R> {
        let ptr = CURRENT.get();
        // SAFETY: a non-null slot holds a strong reference installed by
        // `install_current`, released only at thread exit (after which no
        // code of this thread runs).
        (!ptr.is_null()).then(|| f(unsafe { &*ptr }))
    }
}

std::thread_local! {
    /// The calling thread's installed word (a leaked strong reference).
    static CURRENT: Cell<*const TaskFlags> = const { Cell::new(core::ptr::null()) };
    /// Releases `CURRENT`'s reference at thread exit.
    static RELEASE_AT_EXIT: ReleaseAtExit = const { ReleaseAtExit };
}

struct ReleaseAtExit;

impl Drop for ReleaseAtExit {
    fn drop(&mut self) {
        let ptr = CURRENT.replace(core::ptr::null());
        if !ptr.is_null() {
            // SAFETY: installed by `install_current` with `Arc::into_raw`.
            drop(unsafe { Arc::from_raw(ptr) });
        }
    }
}
