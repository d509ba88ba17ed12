//! Many threads charge and release across a hierarchy of accounts, and
//! signal handlers interrupting them do the same, for a bounded time
//! (`SIGPENDING_STRESS_MS`, default 2000 ms). Checked throughout: no level
//! ever holds more than its limit, a level's owner is pinned whenever a
//! charge is held, and an `Arc` owner dropped midway is never charged once
//! it is gone. Checked at the end: every charge was released once (all
//! counts 0), every pin was released (callback pins back to 0, the dropped
//! owner freed). Prints its counts.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use sigpending::{Account, ChargeError, Owner, Release};

/// Accounts 0..4 (charged from threads and handlers, deferred release):
/// 0 root, 1 and 2 children of 0, 3 child of 1. Account 4: a root whose
/// owner is an `Arc` dropped midway (immediate release, threads only).
const N: usize = 5;
const PARENT: [Option<usize>; N] = [None, Some(0), Some(0), Some(1), None];
const LIMIT: [usize; N] = [8, 5, 4, 3, 3];
const DOOMED: usize = 4;

struct World {
    accounts: Vec<Arc<Account>>,
    doomed: Weak<String>,
}

static WORLD: OnceLock<World> = OnceLock::new();
/// Charges held right now per level, counted after a charge succeeds and
/// before it is released: never above the level's limit.
static IN_USE: [AtomicUsize; N] = [const { AtomicUsize::new(0) }; N];
/// Pins of the callback owners of accounts 0, 1 and 3.
static PINS: [AtomicUsize; N] = [const { AtomicUsize::new(0) }; N];
static VIOLATIONS: AtomicUsize = AtomicUsize::new(0);
static FIRST_VIOLATION: AtomicUsize = AtomicUsize::new(0);

static CHARGED: AtomicU64 = AtomicU64::new(0);
static RELEASED: AtomicU64 = AtomicU64::new(0);
static OVER_LIMIT: AtomicU64 = AtomicU64::new(0);
static OWNER_GONE: AtomicU64 = AtomicU64::new(0);
static IN_HANDLERS: AtomicU64 = AtomicU64::new(0);
static HANDLED: AtomicU64 = AtomicU64::new(0);
static DOOMED_AFTER_DROP: AtomicU64 = AtomicU64::new(0);
static DOOMED_CHARGED: AtomicU64 = AtomicU64::new(0);

const V_LIMIT: usize = 1;
const V_UNPINNED: usize = 2;
const V_GONE_CHARGED: usize = 3;
const V_UNPIN_UNDERFLOW: usize = 4;

fn violation(kind: usize) {
    VIOLATIONS.fetch_add(1, SeqCst);
    let _ = FIRST_VIOLATION.compare_exchange(0, kind, SeqCst, SeqCst);
}

unsafe fn pin(ctx: *const ()) {
    PINS[ctx as usize].fetch_add(1, SeqCst);
}

unsafe fn unpin(ctx: *const ()) {
    if PINS[ctx as usize].fetch_sub(1, SeqCst) == 0 {
        violation(V_UNPIN_UNDERFLOW);
    }
}

fn levels(i: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(i), |&l| PARENT[l])
}

/// Charges account `i`, checks the invariants while holding the charge,
/// and returns it (or `None` if refused). Async-signal-safe.
fn charge(w: &'static World, i: usize) -> Option<sigpending::Charge<'static>> {
    let gone_before = i == DOOMED && w.doomed.strong_count() == 0;
    match w.accounts[i].charge() {
        Ok(c) => {
            CHARGED.fetch_add(1, SeqCst);
            if i == DOOMED {
                DOOMED_CHARGED.fetch_add(1, SeqCst);
            }
            if gone_before {
                violation(V_GONE_CHARGED);
            }
            for l in levels(i) {
                if IN_USE[l].fetch_add(1, SeqCst) >= LIMIT[l] {
                    violation(V_LIMIT);
                }
                let pinned = match l {
                    DOOMED => w.doomed.strong_count() > 0,
                    2 => true, // `Owner::none`
                    _ => PINS[l].load(SeqCst) > 0,
                };
                if !pinned {
                    violation(V_UNPINNED);
                }
            }
            Some(c)
        }
        Err(ChargeError::OverLimit { .. }) => {
            OVER_LIMIT.fetch_add(1, SeqCst);
            None
        }
        Err(ChargeError::OwnerGone { .. }) => {
            OWNER_GONE.fetch_add(1, SeqCst);
            None
        }
        Err(_) => None,
    }
}

fn release(i: usize, c: sigpending::Charge<'static>) {
    for l in levels(i) {
        IN_USE[l].fetch_sub(1, SeqCst);
    }
    RELEASED.fetch_add(1, SeqCst);
    drop(c);
}

thread_local! {
    static RNG: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// xorshift on a const thread-local (no lazy initialisation).
fn next() -> u64 {
    RNG.with(|r| {
        let mut x = r.get();
        if x == 0 {
            x = 0x9e37_79b9_7f4a_7c15 ^ (core::ptr::from_ref(r) as u64);
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        r.set(x);
        x
    })
}

extern "C" fn on_usr1(_: libc::c_int) {
    HANDLED.fetch_add(1, SeqCst);
    let Some(world) = WORLD.get() else { return };
    // Two nested charges on deferred-release accounts, released here.
    let (i, j) = ((next() % 4) as usize, (next() % 4) as usize);
    let a = charge(world, i);
    let b = charge(world, j);
    IN_HANDLERS.fetch_add(u64::from(a.is_some()) + u64::from(b.is_some()), SeqCst);
    if let Some(b) = b {
        release(j, b);
    }
    if let Some(a) = a {
        release(i, a);
    }
}

fn duration() -> Duration {
    let ms = std::env::var("SIGPENDING_STRESS_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    Duration::from_millis(ms)
}

#[test]
#[allow(clippy::too_many_lines)]
#[cfg_attr(
    miri,
    ignore = "signals: Miri has no signal handlers (sigaction, raise, pthread_kill)"
)]
fn charges_from_threads_and_handlers_stay_within_limits_and_pins() {
    let user = Arc::new(String::from("doomed owner"));
    let mut accounts: Vec<Arc<Account>> = Vec::new();
    for i in 0..N {
        let owner = match i {
            DOOMED => Owner::arc(&user),
            2 => Owner::none(),
            // SAFETY: the context is an index into `PINS`; the callbacks
            // are atomic and async-signal-safe.
            _ => unsafe { Owner::from_fns(i as *const (), pin, unpin) },
        };
        let release = if i == DOOMED {
            Release::Immediate
        } else {
            Release::Deferred
        };
        let account = match PARENT[i] {
            Some(p) => accounts[p].child(LIMIT[i], owner, release),
            None => Account::with_release(LIMIT[i], owner, release),
        };
        accounts.push(account);
    }
    let world = WORLD.get_or_init(|| World {
        accounts,
        doomed: Arc::downgrade(&user),
    });
    let mut user = Some(user);

    // SAFETY: a handler that only uses async-signal-safe operations
    // (atomics, lock-free charges of deferred-release accounts).
    unsafe {
        let mut sa: libc::sigaction = core::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &raw const sa, core::ptr::null_mut()),
            0
        );
    }

    let threads = (2 * std::thread::available_parallelism().map_or(2, usize::from)).max(4);
    let period = duration();
    let start = Instant::now();
    let deadline = start + period;
    let tids: Vec<AtomicU64> = (0..threads).map(|_| AtomicU64::new(0)).collect();
    let started = AtomicUsize::new(0);
    let signals_done = AtomicBool::new(false);
    let signals_sent = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (tids, started, signals_done) = (&tids, &started, &signals_done);
            s.spawn(move || {
                // SAFETY: pthread_self has no preconditions.
                tids[t].store(unsafe { libc::pthread_self() } as u64, SeqCst);
                started.fetch_add(1, SeqCst);
                let mut held: Vec<(usize, sigpending::Charge<'static>)> = Vec::new();
                let mut round = 0u64;
                while Instant::now() < deadline {
                    round += 1;
                    let r = next();
                    if held.len() < 3 && !r.is_multiple_of(3) {
                        // Mostly the deferred hierarchy, now and then the
                        // account whose owner is dropped midway.
                        let i = if r.is_multiple_of(7) {
                            DOOMED
                        } else {
                            ((r >> 8) % 4) as usize
                        };
                        if let Some(c) = charge(world, i) {
                            held.push((i, c));
                        }
                    } else if !held.is_empty() {
                        let (i, c) = held.swap_remove((r >> 16) as usize % held.len());
                        release(i, c);
                    }
                    if round.is_multiple_of(256) {
                        let _ = sigpending::release_deferred();
                    }
                }
                for (i, c) in held {
                    release(i, c);
                }
                // Stay alive until no more signals are sent to this thread.
                while !signals_done.load(SeqCst) {
                    std::thread::yield_now();
                }
            });
        }
        // The signaller: SIGUSR1 to every worker, round after round.
        let (tids, started, signals_done, signals_sent) =
            (&tids, &started, &signals_done, &signals_sent);
        s.spawn(move || {
            while started.load(SeqCst) < threads {
                std::thread::yield_now();
            }
            while Instant::now() < deadline {
                for tid in tids {
                    // SAFETY: the workers stay alive until `signals_done`.
                    unsafe {
                        libc::pthread_kill(tid.load(SeqCst) as libc::pthread_t, libc::SIGUSR1)
                    };
                    signals_sent.fetch_add(1, SeqCst);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            signals_done.store(true, SeqCst);
        });
        // Midway, the creator drops the doomed account's owner: from then
        // on it lives only while pinned, and once gone it stays gone.
        while Instant::now() < start + period / 3 {
            let _ = sigpending::release_deferred();
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(user.take());
        let dropped_at = DOOMED_CHARGED.load(SeqCst);
        while Instant::now() < deadline {
            let _ = sigpending::release_deferred();
            std::thread::sleep(Duration::from_millis(1));
        }
        DOOMED_AFTER_DROP.store(DOOMED_CHARGED.load(SeqCst) - dropped_at, SeqCst);
    });
    let deferred = sigpending::release_deferred();

    let counts: Vec<usize> = world.accounts.iter().map(|a| a.charged()).collect();
    let pins: Vec<usize> = PINS.iter().map(|p| p.load(SeqCst)).collect();
    println!(
        "stress: {threads} threads, {period:?}: {} charged ({} in handlers), {} released, \
         {} refused over a limit, {} refused owner gone; {} signals sent, {} handled; \
         {} of its account ({} after the owner's drop); owner freed: {}; {} deferred at the end; \
         violations: {}",
        CHARGED.load(SeqCst),
        IN_HANDLERS.load(SeqCst),
        RELEASED.load(SeqCst),
        OVER_LIMIT.load(SeqCst),
        OWNER_GONE.load(SeqCst),
        signals_sent.load(SeqCst),
        HANDLED.load(SeqCst),
        DOOMED_CHARGED.load(SeqCst),
        DOOMED_AFTER_DROP.load(SeqCst),
        world.doomed.strong_count() == 0,
        deferred,
        VIOLATIONS.load(SeqCst),
    );
    assert_eq!(
        VIOLATIONS.load(SeqCst),
        0,
        "first violation: kind {} (1 over a limit, 2 charged while unpinned, \
         3 charged after the owner was gone, 4 unpinned more than pinned)",
        FIRST_VIOLATION.load(SeqCst)
    );
    assert_eq!(
        CHARGED.load(SeqCst),
        RELEASED.load(SeqCst),
        "a charge was not released"
    );
    assert_eq!(counts, [0; N], "counts left charged");
    assert_eq!(pins, [0; N], "callback pins left");
    assert_eq!(
        world.doomed.strong_count(),
        0,
        "the dropped owner is still pinned"
    );
    assert!(
        world.accounts[DOOMED].charge().is_err(),
        "charged after the owner was gone"
    );
    assert!(CHARGED.load(SeqCst) > 0 && HANDLED.load(SeqCst) > 0);
}
