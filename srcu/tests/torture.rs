//! A torture test after the kernel's rcutorture: objects that know when
//! they were freed, readers (threads and SIGUSR1 handlers) that check them
//! for their whole read section, writers mixing `replace`, `synchronize`,
//! `call` and `barrier`, lease holders that outlive the lease timeout, and
//! a `fork()` in the middle whose child queues a callback, waits for it
//! with `barrier` and reports through its exit status.
//!
//! Fails if an object is freed while a reader can see it, freed twice, or
//! leaked, if the child fails, or if no lease held past the timeout was
//! ever expired, or if a grace period outlasts the lease timeout by more
//! than the bound justified at `GP_BOUND` (a stall detector with a
//! second of slack for a loaded machine, below the time a lease that
//! failed to expire would hold a grace period).
//!
//! Duration: `SRCU_TORTURE_SECS` (default 10 s, clamped to 1..=60), so the
//! whole test stays bounded; it prints what it did.
//!
//! Under Miri (default 1 s): without the signal handlers' readers and the
//! signal storms (Miri has no signals), without the fork (Miri cannot
//! fork), and without the grace-period stall bound (a timing promise,
//! which an interpreter's pace says nothing about); every check of the
//! objects, and the leases' expiry, stay.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use srcu::{Held, LeaseSet, Srcu, SrcuCell};

static DOMAIN: Srcu = Srcu::new();

/// The cell everybody reads (null outside the run: signal handlers then do
/// nothing).
static CELL: AtomicPtr<SrcuCell<'static, Obj>> = AtomicPtr::new(core::ptr::null_mut());

static CREATED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);
static FREED_TWICE: AtomicU64 = AtomicU64::new(0);
static FREED_EARLY: AtomicU64 = AtomicU64::new(0);
static READS: AtomicU64 = AtomicU64::new(0);
static SIGNAL_READS: AtomicU64 = AtomicU64::new(0);
static STOP: AtomicBool = AtomicBool::new(false);

/// The lease timeout of the run.
const LEASE_TIMEOUT: Duration = Duration::from_millis(50);

/// The longest a `synchronize` call may take. While readers' own sections
/// are short (microseconds), what can hold a grace period is a lease: it
/// is expired between `timeout` and `timeout * 1.25` after it was taken
/// (the expiry thread ticks every `timeout / 4` and expires leases four
/// ticks old); the grace period notices within its polling delay (at most
/// 1 ms) and has two banks to wait for, each of which a lease can hold for
/// at most that long: 2.5x the timeout for one grace period, within the
/// leases' promise of 3x. A call also waits for the grace period in
/// progress when it starts (two writers and the reclaimer share the
/// grace-period lock, which is not fair, so we allow one more): 6x in all,
/// plus 1 s for a loaded 2-core machine on which the expiry thread or the
/// writer may not be scheduled for many scheduler periods (signal storms,
/// debug builds, other test binaries beside this one: an idle machine
/// sees about 320 ms in all). One lease holder keeps its leases for
/// `LONG_HOLD`, well past the bound, so a lease that failed to expire
/// would hold a grace period past it.
const GP_BOUND: Duration = Duration::from_millis(6 * 50 + 1000);
/// How long the second lease holder keeps its leases: 40x the timeout.
const LONG_HOLD: Duration = Duration::from_secs(2);

/// An object that knows whether it is alive; `check` is `!generation`, so
/// a freed and reused object shows up as a mismatch too.
struct Obj {
    alive: AtomicBool,
    generation: u64,
    check: u64,
}

impl Obj {
    fn new(generation: u64) -> Self {
        CREATED.fetch_add(1, SeqCst);
        Self {
            alive: AtomicBool::new(true),
            generation,
            check: !generation,
        }
    }

    /// Checks the object `rounds` times (a whole read section's worth).
    fn check(&self, rounds: u32) {
        let generation = self.generation;
        for _ in 0..rounds {
            if !self.alive.load(SeqCst) || self.check != !generation {
                FREED_EARLY.fetch_add(1, SeqCst);
                return;
            }
            std::hint::spin_loop();
        }
    }
}

impl Drop for Obj {
    fn drop(&mut self) {
        if self.alive.swap(false, SeqCst) {
            FREED.fetch_add(1, SeqCst);
        } else {
            FREED_TWICE.fetch_add(1, SeqCst);
        }
    }
}

fn cell() -> &'static SrcuCell<'static, Obj> {
    // SAFETY: set before any thread starts and cleared after they end.
    unsafe { &*CELL.load(SeqCst) }
}

/// SIGUSR1: a read section inside a signal handler (async-signal-safe:
/// an SRCU read, atomics).
#[cfg_attr(miri, allow(dead_code))]
extern "C" fn on_sigusr1(_: libc::c_int) {
    let p = CELL.load(SeqCst);
    if p.is_null() {
        return;
    }
    // SAFETY: the cell outlives every thread that is sent the signal.
    if let Some(obj) = unsafe { &*p }.read() {
        obj.check(50);
        SIGNAL_READS.fetch_add(1, SeqCst);
    }
}

fn duration() -> Duration {
    let secs = std::env::var("SRCU_TORTURE_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(if cfg!(miri) { 1 } else { 10 })
        .clamp(1, 60);
    Duration::from_secs(secs)
}

/// Forks; the child queues a callback, waits for it with `barrier`, runs a
/// grace period and exits 0 on success (under a watchdog: a hang is a
/// SIGALRM death). Returns the raw wait status.
fn fork_child() -> i32 {
    static CHILD_RAN: AtomicBool = AtomicBool::new(false);
    // SAFETY: the child uses srcu and atomics only, then `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: plain syscalls in the child.
        unsafe { libc::alarm(30) };
        let generation = u64::MAX / 2;
        cell().replace(Some(Obj::new(generation)));
        DOMAIN.call(|| CHILD_RAN.store(true, SeqCst));
        DOMAIN.barrier();
        let ran = CHILD_RAN.load(SeqCst);
        let read_ok = cell().read().is_some_and(|o| o.generation == generation);
        let synced = DOMAIN.synchronize_timeout(Duration::from_secs(20));
        let code = i32::from(!ran) | i32::from(!read_ok) << 1 | i32::from(!synced) << 2;
        // SAFETY: leave the child at once.
        unsafe { libc::_exit(code) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: our own child.
    unsafe { libc::waitpid(pid, &raw mut status, 0) };
    status
}

#[test]
#[allow(clippy::too_many_lines)] // one scenario, its threads side by side
fn torture() {
    let run_for = duration();
    let started = Instant::now();
    DOMAIN.prepare();
    CELL.store(
        Box::into_raw(Box::new(SrcuCell::new(&DOMAIN, Some(Obj::new(0))))),
        SeqCst,
    );
    // SAFETY: installing a handler that only does async-signal-safe work.
    #[cfg(not(miri))]
    unsafe {
        let mut sa: libc::sigaction = core::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &raw const sa, core::ptr::null_mut()),
            0
        );
    }
    let set = LeaseSet::with_timeout(&DOMAIN, LEASE_TIMEOUT);
    let grace_periods = AtomicU64::new(0);
    let longest_gp_us = AtomicU64::new(0);
    let leases_taken = AtomicU64::new(0);
    let leases_stable = AtomicU64::new(0);
    let signals = AtomicU64::new(0);
    let readers_tids: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
    let mut child_status = None;

    std::thread::scope(|s| {
        // Readers: sections checked for their whole length.
        for (i, tid) in readers_tids.iter().enumerate() {
            s.spawn(move || {
                // SAFETY: pthread_self has no preconditions.
                tid.store(unsafe { libc::pthread_self() } as u64, SeqCst);
                let mut n = 0u64;
                while !STOP.load(SeqCst) {
                    if let Some(obj) = cell().read() {
                        obj.check(if i == 0 { 200 } else { 2_000 });
                    }
                    n += 1;
                }
                READS.fetch_add(n, SeqCst);
            });
        }
        // Writers: replace / synchronize / call / barrier, mixed.
        for w in 0..2u64 {
            let (grace_periods, longest_gp_us) = (&grace_periods, &longest_gp_us);
            s.spawn(move || {
                let mut generation = w << 40;
                let mut op = 0u64;
                while !STOP.load(SeqCst) {
                    generation += 1;
                    op += 1;
                    match op % 5 {
                        0 | 1 => cell().replace(Some(Obj::new(generation))),
                        2 => {
                            let t = Instant::now();
                            DOMAIN.synchronize();
                            let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                            longest_gp_us.fetch_max(us, SeqCst);
                            grace_periods.fetch_add(1, SeqCst);
                        }
                        3 => {
                            let obj = Obj::new(generation);
                            DOMAIN.call(move || obj.check(1));
                        }
                        _ => {
                            cell().replace(Some(Obj::new(generation)));
                            DOMAIN.barrier();
                        }
                    }
                }
            });
        }
        // Lease holders: each lease held beyond the timeout, in fresh and
        // reused slots alike (one block per thread).
        for hold in [LEASE_TIMEOUT * 2, LONG_HOLD] {
            let (set, leases_taken, leases_stable) = (&set, &leases_taken, &leases_stable);
            s.spawn(move || {
                let block = set.block(4);
                while !STOP.load(SeqCst) {
                    let leases: Vec<_> = (0..3).filter_map(|_| block.lease(cell()).ok()).collect();
                    leases_taken.fetch_add(leases.len() as u64, SeqCst);
                    std::thread::sleep(hold);
                    for lease in leases {
                        // None: retired before it expired.
                        if let Some(held) = lease.consume() {
                            if matches!(held, Held::Stable(_)) {
                                leases_stable.fetch_add(1, SeqCst);
                            }
                            held.check(10);
                        }
                    }
                }
            });
        }
        // SIGUSR1 storms at the readers.
        #[cfg(not(miri))]
        {
            let (readers_tids, signals) = (&readers_tids, &signals);
            s.spawn(move || {
                while !STOP.load(SeqCst) {
                    for tid in readers_tids {
                        let t = tid.load(SeqCst);
                        if t != 0 {
                            for _ in 0..20 {
                                // SAFETY: a live reader thread (they run
                                // until STOP, which we check first).
                                unsafe { libc::pthread_kill(t as libc::pthread_t, libc::SIGUSR1) };
                                signals.fetch_add(1, SeqCst);
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
        }
        // The fork in the middle, from this (reader-free) thread.
        std::thread::sleep(run_for / 2);
        if cfg!(not(miri)) {
            child_status = Some(fork_child());
        }
        std::thread::sleep(run_for.saturating_sub(started.elapsed()));
        STOP.store(true, SeqCst);
    });

    // Tear down: every object must be freed exactly once.
    let cell = CELL.swap(core::ptr::null_mut(), SeqCst);
    // SAFETY: made by Box::into_raw above; no thread uses it any more.
    drop(unsafe { Box::from_raw(cell) });
    let leases_expired = set.expired();
    drop(set);
    DOMAIN.barrier();

    let status = child_status.unwrap_or(0);
    let longest = Duration::from_micros(longest_gp_us.load(SeqCst));
    println!(
        "srcu torture, {:.1} s: {} reads ({} in signal handlers, {} signals sent), \
         {} grace periods (longest {:.1} ms, bound {} ms), {} leases taken, \
         {} expired ({} consumed as references), {} objects created, {} freed; \
         fork child status {status}",
        started.elapsed().as_secs_f64(),
        READS.load(SeqCst) + SIGNAL_READS.load(SeqCst),
        SIGNAL_READS.load(SeqCst),
        signals.load(SeqCst),
        grace_periods.load(SeqCst),
        longest.as_secs_f64() * 1e3,
        GP_BOUND.as_millis(),
        leases_taken.load(SeqCst),
        leases_expired,
        leases_stable.load(SeqCst),
        CREATED.load(SeqCst),
        FREED.load(SeqCst),
    );
    assert_eq!(
        FREED_EARLY.load(SeqCst),
        0,
        "an object was freed under a reader"
    );
    assert_eq!(FREED_TWICE.load(SeqCst), 0, "an object was freed twice");
    assert_eq!(FREED.load(SeqCst), CREATED.load(SeqCst), "objects leaked");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "fork child failed (bit0 callback, bit1 read, bit2 grace period; signalled: hung): {status}"
    );
    assert!(
        leases_stable.load(SeqCst) > 0,
        "no lease held beyond the timeout was ever expired"
    );
    assert!(
        cfg!(miri) || longest <= GP_BOUND,
        "a grace period took {longest:?}, more than {GP_BOUND:?}"
    );
}
