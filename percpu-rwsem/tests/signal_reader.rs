//! A signal handler that reads, interrupting a thread that itself holds
//! the read side while a writer waits for it: `read_checked` must take the
//! read side again (the thread already reads, so the writer cannot be
//! inside), not wait for the writer, which waits for the interrupted
//! thread. And on the waiting writer's own thread it reports
//! `WouldDeadlock`.
//!
//! A hang is the failure this test looks for: the test thread gives up
//! after a minute (a watchdog, not a timing assertion: a correct run takes
//! milliseconds).

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use percpu_rwsem::{PercpuRwSem, WouldDeadlock};

static SEM: PercpuRwSem<u64> = PercpuRwSem::new(5);
static READ: AtomicUsize = AtomicUsize::new(0);
static DEADLOCK: AtomicUsize = AtomicUsize::new(0);
static HOLDING: AtomicUsize = AtomicUsize::new(0);
static RELEASE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    match SEM.read_checked() {
        Ok(g) if *g == 5 => READ.fetch_add(1, SeqCst),
        Ok(_) => panic!("the writer got in"),
        Err(WouldDeadlock) => DEADLOCK.fetch_add(1, SeqCst),
    };
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_mins(1);
    while !done() {
        assert!(Instant::now() < deadline, "hung waiting for {what}");
        std::thread::yield_now();
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn a_handler_on_a_reading_thread_reads_past_a_waiting_writer() {
    SEM.prepare();
    // SAFETY: installing a plain handler for SIGUSR1.
    unsafe { libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t) };
    let readers: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(|| {
                let g = SEM.read();
                HOLDING.fetch_add(1, SeqCst);
                while !RELEASE.load(SeqCst) {
                    std::thread::yield_now();
                }
                drop(g);
            })
        })
        .collect();
    wait_for("the readers", || HOLDING.load(SeqCst) == 2);
    let writer = std::thread::spawn(|| *SEM.write() += 1);
    wait_for("the writer to close the gate", || {
        SEM.raw().is_locked_exclusive()
    });
    for t in readers.iter().chain([&writer]) {
        // SAFETY: the thread is alive (it waits for `RELEASE` or for the
        // readers) and has the handler installed (process-wide).
        let sent = unsafe { libc::pthread_kill(t.as_pthread_t(), libc::SIGUSR1) };
        assert_eq!(sent, 0);
    }
    wait_for("the handlers", || {
        READ.load(SeqCst) + DEADLOCK.load(SeqCst) == 3
    });
    assert_eq!(
        (READ.load(SeqCst), DEADLOCK.load(SeqCst)),
        (2, 1),
        "the readers' handlers read, the writer's reported WouldDeadlock"
    );
    RELEASE.store(true, SeqCst);
    for t in readers {
        t.join().unwrap();
    }
    writer.join().unwrap();
    assert_eq!(*SEM.read(), 6);
}
