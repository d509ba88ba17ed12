//! What srcu's own threads (a domain's reclaimer, a lease set's expiry
//! thread) run first: a hook the program sets, for a program that must
//! tell its own threads apart from the ones a library started (a tracer
//! that does not trace itself, a profiler that names threads).

use std::sync::{Mutex, PoisonError};

static HOOK: Mutex<Option<fn()>> = Mutex::new(None);

/// Sets `hook`, which every service thread srcu starts from now on calls
/// first, on itself, before anything else (`None`: no hook). One hook per
/// process: a later call replaces it. Threads already running are not
/// affected. Not async-signal-safe (a lock).
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
/// static STARTED: AtomicUsize = AtomicUsize::new(0);
/// srcu::set_service_thread_hook(Some(|| {
///     STARTED.fetch_add(1, Relaxed);
/// }));
/// let domain = srcu::Srcu::new();
/// // A callback starts the domain's reclaimer thread.
/// domain.call(|| {});
/// domain.barrier();
/// assert!(STARTED.load(Relaxed) >= 1);
/// srcu::set_service_thread_hook(None);
/// ```
pub fn set_service_thread_hook(hook: Option<fn()>) {
    *HOOK.lock().unwrap_or_else(PoisonError::into_inner) = hook;
}

/// Runs the hook, if one is set: the first thing a service thread does.
#[cfg_attr(pcpu_loom, allow(dead_code))]
pub(crate) fn started() {
    let hook = *HOOK.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(hook) = hook {
        hook();
    }
}
