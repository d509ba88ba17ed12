//! `PercpuRwSem<T>`: the raw semaphore plus the data it protects.

use core::cell::UnsafeCell;
use core::marker::PhantomData;
use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;

use crate::raw::{RawPercpuRwSem, ReadRefused, Reading, Wait, thread_token};

/// Taking the read side would deadlock: the calling thread holds the write
/// side of the same semaphore (typically a signal handler interrupted the
/// writer). Returned by [`PercpuRwSem::read_checked`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WouldDeadlock;

impl core::fmt::Display for WouldDeadlock {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(
            "this thread holds the write side of this PercpuRwSem; waiting for the read side would deadlock \
             (was the writer interrupted by a signal handler that reads?)",
        )
    }
}

impl std::error::Error for WouldDeadlock {}

/// A reader-writer semaphore whose readers only touch their own CPU's cache
/// line: the userspace version of the kernel's `percpu_rw_semaphore`.
///
/// Readers increment a per-CPU count inside a restartable sequence that
/// also checks the writer gate: no atomic read-modify-write, no fence, no
/// shared cache line. Writers are rare and expensive: the first of a burst
/// pays a `membarrier` grace period, every writer waits for the per-CPU
/// sum to drain.
///
/// - Constructible in `const` context (a `static` needs no `LazyLock`).
/// - A [`ReadGuard`] may be dropped on another thread or CPU.
/// - A waiting writer stops new readers (no writer starvation); blocked
///   readers and writers sleep in `FUTEX_WAIT` (no spinning).
/// - Reads nest: a thread that already reads (or is taking the read side,
///   when a signal handler interrupts it) takes it again with
///   [`read`](Self::read) or [`read_checked`](Self::read_checked) even
///   while a writer waits, since that writer may be waiting for this very thread.
///   The thread's reads are counted in a per-thread depth (a plain
///   thread-local, `const`-initialised, without a destructor); it waits
///   only for a writer that is already inside. A guard released on another
///   thread than the one that took it leaves the taker counted: its later
///   reads may then pass waiting writers (never one that is inside).
/// - Otherwise not reentrant: a thread that holds the read side must not
///   ask for the write side (it would wait for itself forever), and a
///   thread holding the write side that asks for the read side gets
///   [`WouldDeadlock`] from [`read_checked`](Self::read_checked) and a
///   panic from [`read`](Self::read). A writer can turn its write side
///   into a read side with [`WriteGuard::downgrade`].
///
/// # Async-signal safety
///
/// | operation | from a signal handler |
/// |---|---|
/// | [`try_read`](Self::try_read), dropping a [`ReadGuard`] | yes (never blocks, never allocates) |
/// | [`read_checked`](Self::read_checked) | yes: never waits for the interrupted thread itself. If that thread holds (or is taking, or releasing) a read of any semaphore, it takes the read side past a waiting writer, waiting only for one that is inside; if it is this semaphore's writer, from the instruction that closes the gate to the one that reopens it, it reports [`WouldDeadlock`]; otherwise it may block in `FUTEX_WAIT` while another thread writes |
/// | [`read`](Self::read) | as `read_checked`, but panics on self-deadlock (do not use in handlers) |
/// | [`try_write`](Self::try_write), [`write`](Self::write), [`WriteGuard::downgrade`] | no (a writer may wait for readers, including the interrupted thread) |
/// | [`prepare`](Self::prepare) | no (allocates); call it before handlers use the lock |
///
/// The first lock operation allocates the per-CPU counts unless
/// [`prepare`](Self::prepare) ran: call it in ordinary context before a
/// signal handler may take the lock.
///
/// # Fork
///
/// A hold by another thread at `fork()` never ends in the child (that
/// thread does not exist there). In the child, [`try_read`](Self::try_read)
/// and [`try_write`](Self::try_write) never hang: they fail where the
/// parent's holders are in the way. Blocking calls may wait forever; give
/// the child a fresh semaphore instead.
///
/// # Example
/// ```
/// use percpu_rwsem::PercpuRwSem;
///
/// static ROUTES: PercpuRwSem<Vec<u32>> = PercpuRwSem::new(Vec::new());
///
/// ROUTES.write().push(7);
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| assert_eq!(ROUTES.read()[0], 7));
///     }
/// });
/// ```
pub struct PercpuRwSem<T: ?Sized> {
    raw: RawPercpuRwSem,
    data: UnsafeCell<T>,
}

// SAFETY: like `RwLock`: moving the semaphore moves the `T`.
unsafe impl<T: ?Sized + Send> Send for PercpuRwSem<T> {}
// SAFETY: like `RwLock`: readers share `&T` across threads (needs `Sync`),
// a writer hands `&mut T` to another thread (needs `Send`).
unsafe impl<T: ?Sized + Send + Sync> Sync for PercpuRwSem<T> {}

impl<T> PercpuRwSem<T> {
    /// A new unlocked semaphore around `value`. Allocates nothing: the
    /// per-CPU counts come on first use (see [`prepare`](Self::prepare)).
    #[cfg(not(pcpu_loom))]
    pub const fn new(value: T) -> Self {
        Self {
            raw: RawPercpuRwSem::new(),
            data: UnsafeCell::new(value),
        }
    }

    /// A new unlocked semaphore around `value` (loom build: not `const`).
    #[cfg(pcpu_loom)]
    pub fn new(value: T) -> Self {
        Self {
            raw: RawPercpuRwSem::new(),
            data: UnsafeCell::new(value),
        }
    }

    /// A new unlocked semaphore around `value`, as if the machine had
    /// `cpus` CPUs ([`RawPercpuRwSem::with_cpus`]): for measuring what a
    /// writer costs on a bigger machine.
    pub fn with_cpus(value: T, cpus: usize) -> Self {
        Self {
            raw: RawPercpuRwSem::with_cpus(cpus),
            data: UnsafeCell::new(value),
        }
    }

    /// Consumes the semaphore, returning the data.
    pub fn into_inner(self) -> T {
        self.data.into_inner()
    }
}

impl<T: Default> Default for PercpuRwSem<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T: ?Sized> PercpuRwSem<T> {
    /// Allocates the per-CPU counts now, so that no later operation
    /// allocates (required before use from a signal handler). Idempotent.
    pub fn prepare(&self) {
        self.raw.prepare();
    }

    /// Takes the read side, sleeping while a writer holds or waits for it.
    ///
    /// # Panics
    /// If the calling thread holds the write side (it would deadlock); use
    /// [`read_checked`](Self::read_checked) to get an error instead.
    #[allow(clippy::inline_always)] // the read path must inline (see raw.rs)
    #[inline(always)]
    pub fn read(&self) -> ReadGuard<'_, T> {
        match self.read_checked() {
            Ok(g) => g,
            Err(e) => panic!("{e}"),
        }
    }

    /// Takes the read side, sleeping while a writer holds or waits for it,
    /// unless the writer is the calling thread. Async-signal-safe (after
    /// [`prepare`](Self::prepare)).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn read_checked(&self) -> Result<ReadGuard<'_, T>, WouldDeadlock> {
        match self.raw.read_lock(Wait::Block) {
            Ok(reading) => Ok(self.read_guard(reading)),
            Err(ReadRefused::HeldByThisThread) => Err(WouldDeadlock),
            Err(ReadRefused::WouldBlock) => unreachable!("blocking read gave up"),
        }
    }

    /// Takes the read side if no writer holds or waits for it (even on a
    /// thread that already reads); never blocks. Async-signal-safe (after
    /// [`prepare`](Self::prepare)).
    #[inline]
    pub fn try_read(&self) -> Option<ReadGuard<'_, T>> {
        self.raw
            .read_lock(Wait::Never)
            .ok()
            .map(|reading| self.read_guard(reading))
    }

    /// The guard of a read side just taken on this thread.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn read_guard<'a>(&'a self, reading: Reading<'a>) -> ReadGuard<'a, T> {
        ReadGuard {
            // SAFETY: `UnsafeCell::get` is never null.
            data: unsafe { NonNull::new_unchecked(self.data.get()) },
            raw: &self.raw,
            reading,
            taker: thread_token(),
        }
    }

    /// Takes the write side: waits for other writers, then closes the gate
    /// to new readers and sleeps until the current ones leave. Not
    /// async-signal-safe.
    pub fn write(&self) -> WriteGuard<'_, T> {
        self.raw.write_lock(Wait::Block);
        WriteGuard {
            sem: self,
            _not_send: PhantomData,
        }
    }

    /// Takes the write side if no writer holds it and no reader is inside;
    /// never waits for them (it may issue one `membarrier`). Not
    /// async-signal-safe.
    pub fn try_write(&self) -> Option<WriteGuard<'_, T>> {
        self.raw.write_lock(Wait::Never).then(|| WriteGuard {
            sem: self,
            _not_send: PhantomData,
        })
    }

    /// Mutable access without locking: `&mut self` proves no guard exists.
    pub fn get_mut(&mut self) -> &mut T {
        self.data.get_mut()
    }

    /// The raw semaphore (for [`RawPercpuRwSem::set_linger`] and state
    /// snapshots).
    pub fn raw(&self) -> &RawPercpuRwSem {
        &self.raw
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for PercpuRwSem<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut d = f.debug_struct("PercpuRwSem");
        match self.try_read() {
            Some(g) => d.field("data", &&*g),
            None => d.field("data", &format_args!("<write-locked>")),
        };
        d.finish_non_exhaustive()
    }
}

/// Shared access to a [`PercpuRwSem`]'s data; releases the read side when
/// dropped, on whichever thread that happens (async-signal-safe).
///
/// Covariant in `T`, like `std`'s read guard (a guard of
/// `PercpuRwSem<&'static U>` is usable as one of `&'a U`): it holds a
/// pointer to the data, not a reference to the (invariant) semaphore.
#[must_use = "the read side is released as soon as the guard is dropped"]
pub struct ReadGuard<'a, T: ?Sized> {
    data: NonNull<T>,
    raw: &'a RawPercpuRwSem,
    /// The counts the read was counted in.
    reading: Reading<'a>,
    /// The thread that took the read side (it counts the read in its read
    /// depth until the guard is dropped there).
    taker: usize,
}

// SAFETY: the guard gives `&T` (sound on another thread for `T: Sync`) and
// releases a read side, which may happen on any thread.
unsafe impl<T: ?Sized + Sync> Send for ReadGuard<'_, T> {}
// SAFETY: sharing the guard shares only `&T`.
unsafe impl<T: ?Sized + Sync> Sync for ReadGuard<'_, T> {}

impl<T: ?Sized> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the read side is held for `'a`, the lifetime of the
        // semaphore borrow the pointer came from: no `&mut T` exists.
        unsafe { self.data.as_ref() }
    }
}

impl<T: ?Sized> Drop for ReadGuard<'_, T> {
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn drop(&mut self) {
        self.raw
            .read_unlock_counted(self.reading, self.taker == thread_token());
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for ReadGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// Exclusive access to a [`PercpuRwSem`]'s data; releases the write side
/// when dropped. Not `Send`: the semaphore remembers the writer's thread to
/// detect self-deadlock.
#[must_use = "the write side is released as soon as the guard is dropped"]
pub struct WriteGuard<'a, T: ?Sized> {
    sem: &'a PercpuRwSem<T>,
    _not_send: PhantomData<*const ()>,
}

// SAFETY: sharing `&WriteGuard` only gives `&T`.
unsafe impl<T: ?Sized + Sync> Sync for WriteGuard<'_, T> {}

impl<T: ?Sized> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the write side is held: we are the only accessor.
        unsafe { &*self.sem.data.get() }
    }
}

impl<T: ?Sized> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the write side is held: we are the only accessor.
        unsafe { &mut *self.sem.data.get() }
    }
}

impl<'a, T: ?Sized> WriteGuard<'a, T> {
    /// Turns the write side into a read side without letting another
    /// writer in between (`lock_api`'s `RwLockDowngrade`): the thread keeps
    /// seeing its own write, other readers may enter from now on, the next
    /// writer waits for the returned guard. Not async-signal-safe (it
    /// releases the writer mutex, which may wake a writer). An associated
    /// function, so it does not shadow a method of `T`.
    pub fn downgrade(guard: Self) -> ReadGuard<'a, T> {
        let sem = guard.sem;
        core::mem::forget(guard);
        let reading = sem.raw.downgrade();
        sem.read_guard(reading)
    }
}

impl<T: ?Sized> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        self.sem.raw.write_unlock();
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for WriteGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}
