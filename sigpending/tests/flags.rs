//! Task flags: deny/restore against remote posts, the current-thread
//! registry, and use from a signal handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use sigpending::TaskFlags;

const SIGPENDING: u32 = 1;
const RESCHED: u32 = 2;

#[test]
fn deny_restore_take() {
    let f = TaskFlags::new();
    assert_eq!(f.deny(SIGPENDING), 0, "nothing to deny");
    f.set(SIGPENDING | RESCHED);
    assert_eq!(f.deny(SIGPENDING), SIGPENDING);
    assert_eq!((f.pending(), f.denied()), (RESCHED, SIGPENDING));
    f.set(SIGPENDING); // posted while denied: set again at once
    assert_eq!(f.deny(SIGPENDING), SIGPENDING, "denied again");
    assert_eq!(f.restore(), SIGPENDING);
    assert_eq!(f.restore(), 0, "nothing left to restore");
    assert_eq!(f.take(SIGPENDING | RESCHED), SIGPENDING | RESCHED);
    assert_eq!(f.pending(), 0);
}

/// A poster sets a flag and waits until the owner has taken it, over and
/// over, while the owner denies and restores in a loop: a lost request
/// would leave both waiting (and the test runner's timeout would fail the
/// test), so finishing proves none was lost.
#[test]
fn no_request_is_lost_to_deny_and_restore() {
    let rounds: u32 = test_support::scaled(20_000);
    let flags = Arc::new(TaskFlags::new());
    let taken = AtomicU32::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            for round in 1..=rounds {
                flags.set(SIGPENDING);
                while taken.load(Ordering::Acquire) < round {
                    std::hint::spin_loop();
                    std::thread::yield_now();
                }
            }
        });
        let mut i = 0u32;
        while taken.load(Ordering::Relaxed) < rounds {
            i = i.wrapping_add(1);
            flags.deny(SIGPENDING);
            std::hint::spin_loop();
            flags.restore();
            if i.is_multiple_of(4) && flags.take(SIGPENDING) != 0 {
                taken.fetch_add(1, Ordering::Release);
            }
        }
    });
    assert_eq!(flags.pending(), 0);
}

#[test]
fn each_thread_finds_its_own_word() {
    assert!(TaskFlags::with_current(|_| ()).is_none(), "none installed");
    let mine = Arc::new(TaskFlags::new());
    TaskFlags::install_current(&mine);
    let theirs = std::thread::spawn(|| {
        let f = Arc::new(TaskFlags::new());
        TaskFlags::install_current(&f);
        TaskFlags::with_current(|c| c.set(RESCHED));
        f
    })
    .join()
    .unwrap();
    assert_eq!(Arc::strong_count(&theirs), 1, "released at thread exit");
    assert_eq!(theirs.pending(), RESCHED);
    TaskFlags::with_current(|c| c.set(SIGPENDING));
    assert_eq!(mine.pending(), SIGPENDING);
}

static HANDLER_DENIED: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    // What uprobe-core does around an out-of-line step: deny, then restore.
    let denied = TaskFlags::with_current(|f| f.deny(SIGPENDING)).unwrap_or(99);
    HANDLER_DENIED.store(denied, Ordering::SeqCst);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn deny_from_a_signal_handler_restore_after() {
    let flags = Arc::new(TaskFlags::new());
    TaskFlags::install_current(&flags);
    flags.set(SIGPENDING);
    // SAFETY: a handler that only uses atomics and a thread-local load;
    // raised on this thread, so it runs before `raise` returns.
    unsafe {
        libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t);
        libc::raise(libc::SIGUSR1);
    }
    assert_eq!(HANDLER_DENIED.load(Ordering::SeqCst), SIGPENDING);
    assert_eq!(flags.pending(), 0);
    assert_eq!(flags.restore(), SIGPENDING);
    assert_eq!(flags.pending(), SIGPENDING);
}
