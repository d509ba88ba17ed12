//! The attach lock: attach and detach serialise on it (the hit path
//! never takes it), and it is held across `fork()` by the forking thread
//! so that a child never inherits it locked by a thread that does not
//! exist there. Not async-signal-safe.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, Once};

use crate::base::thread::{current_tid, forget_tid};

/// Serialises attach and detach (never taken by the handler). Taken
/// through [`writer`]; held across `fork()` by the forking thread (see
/// [`hold_across_fork`]), so a child never inherits it locked by a
/// thread that does not exist there.
static WRITER: Mutex<()> = Mutex::new(());
/// The thread holding `WRITER` (0: none).
static WRITER_TID: AtomicI32 = AtomicI32::new(0);

/// `WRITER`, held; releases it when dropped.
pub(crate) struct Writer(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl Drop for Writer {
    fn drop(&mut self) {
        WRITER_TID.store(0, Ordering::Relaxed);
    }
}

/// Takes the writer lock. Not async-signal-safe.
pub(crate) fn writer() -> Writer {
    let guard = WRITER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    WRITER_TID.store(current_tid(), Ordering::Relaxed);
    Writer(guard)
}

/// The writer lock the forking thread holds across `fork()`.
struct ForkHold(core::cell::UnsafeCell<Option<Writer>>);
// SAFETY: touched only by the `pthread_atfork` handlers, which run on the
// forking thread (prepare, then parent or child), one fork at a time (the
// lock itself serialises forks that reach `prepare`).
unsafe impl Sync for ForkHold {}
static FORK_HOLD: ForkHold = ForkHold(core::cell::UnsafeCell::new(None));

/// Registers, once, `pthread_atfork` handlers that take the writer lock
/// before `fork()` and release it after, in the parent and in the child:
/// without them a child forked while another thread attaches inherits a
/// lock nobody will release, and its first attach or detach hangs. A
/// thread that forks while it holds the lock itself (from a probe
/// handler hit inside an attach) keeps holding it in both processes, and
/// its attach finishes there.
pub(crate) fn hold_across_fork() {
    extern "C" fn prepare() {
        if WRITER_TID.load(Ordering::Relaxed) == current_tid() {
            return;
        }
        let held = writer();
        // SAFETY: see `ForkHold`.
        unsafe { *FORK_HOLD.0.get() = Some(held) };
    }
    extern "C" fn release() {
        // SAFETY: see `ForkHold`; in the child the forking thread is the
        // one that took the lock, so it may release it.
        drop(unsafe { (*FORK_HOLD.0.get()).take() });
    }
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain functions, run by the C library around fork();
        // child handlers run in registration order, so the thread id is
        // forgotten before anything asks for it.
        unsafe {
            libc::pthread_atfork(None, None, Some(forget_tid));
            libc::pthread_atfork(Some(prepare), Some(release), Some(release));
        }
    });
}
