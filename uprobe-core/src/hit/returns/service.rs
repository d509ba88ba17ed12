//! The service thread of return probes: it gives back the stacks of
//! threads that are gone (found with `tgkill(pid, tid, 0)`), keeps spare
//! stacks in the pool, and in a fork child expires leases; it runs only
//! while consumers with a return handler are attached (counted here).

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::LEASES;
use super::pool::{POOL, Pool, thread_stack};
use crate::base::error::AttachError;
use crate::base::thread::current_tid;

/// How often the service thread looks for threads that are gone.
const SERVICE_PERIOD: Duration = Duration::from_millis(20);

/// The process the service thread runs in (0: none).
static SERVICE_PID: Mutex<i32> = Mutex::new(0);

/// The process that started the first service thread (a fork child
/// inherits the number, and is not it).
static FIRST_SERVICE: AtomicI32 = AtomicI32::new(0);

/// Consumers with a return handler attached now. While there are none, the
/// service thread and the lease expiry thread end (see
/// [`consumers_detached`]); the next attach starts them again.
static RETURN_CONSUMERS: AtomicUsize = AtomicUsize::new(0);

/// `n` consumers with a return handler are (about to be) attached.
pub(crate) fn consumers_attached(n: usize) {
    RETURN_CONSUMERS.fetch_add(n, Ordering::Relaxed);
}

/// `n` consumers with a return handler were detached (after the grace
/// period past which none of their hits takes a lease). With none left,
/// the lease set's expiry thread ends once no lease is held, and the
/// service thread at its next round: a program that detached every
/// return probe keeps no thread of the engine's.
pub(crate) fn consumers_detached(n: usize) {
    if n == 0 {
        return;
    }
    let before = RETURN_CONSUMERS
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
            Some(c.saturating_sub(n))
        })
        .unwrap_or(0);
    if before <= n
        && let Some(leases) = LEASES.get()
    {
        leases.park_expiry();
    }
}

/// Starts the service thread in this process if it has none (a fork child
/// inherits none) and return consumers are attached. Not
/// async-signal-safe.
pub(crate) fn ensure_service() -> Result<(), AttachError> {
    let Some(pool) = POOL.get() else {
        return Ok(());
    };
    if RETURN_CONSUMERS.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    if let Some(leases) = LEASES.get() {
        leases.resume_expiry().map_err(|e| AttachError::Os {
            what: "spawn the lease expiry thread of return probes",
            errno: crate::base::error::Errno::of(&e, libc::EAGAIN),
        })?;
    }
    let mut pid = SERVICE_PID.lock().unwrap_or_else(PoisonError::into_inner);
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    if *pid == me {
        return Ok(());
    }
    let first = FIRST_SERVICE.load(Ordering::Relaxed);
    let forked = first != 0 && first != me;
    if first == 0 {
        FIRST_SERVICE.store(me, Ordering::Relaxed);
        // SAFETY: registering a plain function; the handler only stores.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    }
    std::thread::Builder::new()
        .name("uprobe-returns".into())
        .spawn(move || service(pool, forked))
        .map_err(|e| AttachError::Os {
            what: "spawn the return probe service thread",
            errno: crate::base::error::Errno::of(&e, libc::EAGAIN),
        })?;
    *pid = me;
    Ok(())
}

/// In a fork child: the forking thread keeps its pending returns under its
/// new thread id. Async-signal-safe (a store).
extern "C" fn after_fork_in_child() {
    if let Some(tr) = thread_stack() {
        tr.owner.store(current_tid(), Ordering::Release);
    }
}

/// The service loop: gives back the stacks of threads that are gone. In a
/// fork child, where the lease set's expiry thread does not exist, it also
/// expires every lease each round (as the kernel expires a child's).
fn service(pool: &'static Pool, forked: bool) {
    // Its calls (frees of stacks) are not the program's.
    crate::base::thread::set_observed(false);
    loop {
        std::thread::sleep(SERVICE_PERIOD);
        reap(pool);
        // No return consumer left: end (under the lock `ensure_service`
        // takes, so an attach either sees this thread or starts another).
        // Stacks of threads that die meanwhile are reaped by the next one.
        {
            let mut pid = SERVICE_PID.lock().unwrap_or_else(PoisonError::into_inner);
            if RETURN_CONSUMERS.load(Ordering::Relaxed) == 0 {
                *pid = 0;
                return;
            }
        }
        if let Some(leases) = LEASES.get() {
            pool.keep_spare(leases);
        }
        if forked && let Some(leases) = LEASES.get() {
            let _ = leases.expire_all();
        }
    }
}

/// Releases everything held by threads that no longer exist. Ordinary
/// context.
fn reap(pool: &Pool) {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    for chunk in pool.made() {
        for tr in &chunk.all {
            let tid = tr.owner.load(Ordering::Acquire);
            if tid == 0 || thread_exists(pid, tid) {
                continue;
            }
            // The owner is gone: its stack is ours now.
            // In a read section: what holds nothing reaches its part in one.
            crate::table::lookup::with_read_side(|| tr.drop_abandoned(|_| true));
            tr.timed.clear();
            let element = tr.element.load(Ordering::Relaxed);
            tr.owner.store(0, Ordering::Release);
            pool.taken.fetch_sub(1, Ordering::Relaxed);
            // SAFETY: the element index was taken from this chunk's pool
            // by the owner and is given back once.
            chunk.free.push(unsafe { chunk.free.from_index(element) });
        }
    }
}

/// The threads of this process now (1 if `/proc` cannot tell).
pub(super) fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(1, Iterator::count)
}

fn thread_exists(pid: i32, tid: i32) -> bool {
    // SAFETY: signal 0 only checks that the thread exists.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
