//! A signal handler that reads, run on the writer's own thread at every
//! step of `write_lock`, `try_write`, `write_unlock` and `downgrade` (through the
//! crate's test hooks): `read_checked` must return at once, with the
//! read (where the write side is not yet, or no longer, closed to this
//! thread) or with `WouldDeadlock`, never wait for the writer that is the
//! thread itself.
//!
//! A hang is the failure this test looks for: the writer runs on its own
//! thread and the test thread gives up after a minute (a watchdog, not a
//! timing assertion: a correct run takes milliseconds).

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc;
use std::time::Duration;

use percpu_rwsem::hooks::{self, Point};
use percpu_rwsem::{PercpuRwSem, WouldDeadlock, WriteGuard};

static SEM: PercpuRwSem<u64> = PercpuRwSem::new(7);
/// 1: `read_checked` read; 2: it reported `WouldDeadlock`.
static OUTCOME: AtomicI32 = AtomicI32::new(0);
/// The thread the hook raises the signal on (its `gettid`).
static WRITER_TID: AtomicI32 = AtomicI32::new(0);
static POINTS: AtomicUsize = AtomicUsize::new(0);
static LOG: [AtomicI32; 64] = [const { AtomicI32::new(0) }; 64];

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

extern "C" fn on_usr1(_: libc::c_int) {
    let outcome = match SEM.read_checked() {
        Ok(g) => {
            let _ = *g;
            1
        }
        Err(WouldDeadlock) => 2,
    };
    OUTCOME.store(outcome, SeqCst);
}

/// At every hook point reached on the writer's thread, interrupts it with
/// a handler that reads, and logs the point and the outcome.
fn interrupt_here(point: Point) {
    if gettid() != WRITER_TID.load(SeqCst) {
        return;
    }
    OUTCOME.store(0, SeqCst);
    // SAFETY: raising a signal whose handler is installed, on this thread.
    unsafe { libc::raise(libc::SIGUSR1) };
    let code = match point {
        Point::WriteLock(n) => 100 + i32::from(n),
        Point::WriteUnlock(n) => 200 + i32::from(n),
        Point::Downgrade(n) => 300 + i32::from(n),
        _ => 900,
    };
    let i = POINTS.fetch_add(1, SeqCst);
    if let Some(slot) = LOG.get(i) {
        slot.store(code * 10 + OUTCOME.load(SeqCst), SeqCst);
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn a_handler_on_the_writers_thread_never_waits_for_it() {
    SEM.prepare();
    // SAFETY: installing a plain handler for SIGUSR1.
    unsafe { libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t) };
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        WRITER_TID.store(gettid(), SeqCst);
        hooks::set(Some(interrupt_here));
        *SEM.write() += 1;
        if let Some(mut g) = SEM.try_write() {
            *g += 1;
        }
        let mut g = SEM.write();
        *g += 1;
        let r = WriteGuard::downgrade(g);
        assert_eq!(*r, 10);
        drop(r);
        hooks::set(None);
        done.send(()).unwrap();
    });
    let log = || {
        LOG[..POINTS.load(SeqCst).min(LOG.len())]
            .iter()
            .map(|c| c.load(SeqCst))
            .collect::<Vec<_>>()
    };
    assert!(
        finished.recv_timeout(Duration::from_mins(1)).is_ok(),
        "a handler on the writer's thread hung; points passed (point*10+outcome): {:?}",
        log()
    );
    let log = log();
    println!("points (point*10+outcome): {log:?}");
    assert!(log.len() >= 8, "too few hook points: {log:?}");
    assert!(
        log.iter().all(|c| matches!(c % 10, 1 | 2)),
        "a handler did not finish: {log:?}"
    );
    assert_eq!(*SEM.read(), 10);
}
