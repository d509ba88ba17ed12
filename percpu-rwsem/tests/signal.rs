//! The read side from a signal handler: it works when the interrupted
//! thread is not the writer, and reports `WouldDeadlock` (instead of
//! hanging) when the handler interrupted the writer itself.

use std::sync::atomic::{AtomicI32, Ordering::SeqCst};

use percpu_rwsem::{PercpuRwSem, WouldDeadlock};

static SEM: PercpuRwSem<u64> = PercpuRwSem::new(41);
/// 1: the handler read the value; 2: it got `WouldDeadlock`; 3: `try_read` failed.
static OUTCOME: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    let checked = match SEM.read_checked() {
        Ok(g) if *g == 41 => 1,
        Ok(_) => 9,
        Err(WouldDeadlock) => 2,
    };
    let tried = if SEM.try_read().is_none() { 3 } else { 0 };
    OUTCOME.store(checked * 10 + tried, SeqCst);
}

fn raise_usr1() -> i32 {
    OUTCOME.store(0, SeqCst);
    // SAFETY: installing a plain handler for SIGUSR1 and raising it on this
    // thread (delivered synchronously before `raise` returns).
    unsafe {
        libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t);
        libc::raise(libc::SIGUSR1);
    }
    OUTCOME.load(SeqCst)
}

#[test]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn handler_reads_and_detects_an_interrupted_writer() {
    SEM.prepare(); // no allocation inside the handler
    assert_eq!(raise_usr1(), 10, "plain read from the handler");
    {
        let _r = SEM.read();
        assert_eq!(raise_usr1(), 10, "nested read while this thread reads");
    }
    let w = SEM.write();
    assert_eq!(raise_usr1(), 23, "handler on the writer's own thread");
    drop(w);
    assert_eq!(raise_usr1(), 10, "after the write");
}
