//! `sigpending-signal1` (seed 003) and `taskflag-deny` (seed 000): the two
//! signal-path primitives against the kernel code their patches replaced.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed};

use crossbeam_utils::CachePadded;
use sigpending::{Account, Accounting, ChargeError, Owner, PendingQueue, TaskFlags};

use crate::harness::{Scenario, Workload};

pub const SIGNAL1: Scenario = Scenario {
    name: "sigpending-signal1",
    about: "seed 003: each thread queues an item charged to one shared per-user account (limit checked) and dequeues it, will-it-scale signal1's shape; every thread holds the user, as a sender holds it through its credentials: reference on 0 -> 1 only (a plain increment, Account::charge_holding) vs a reference per item",
    impls: &["pending-ref", "get-put"],
    build: build_signal1,
    lists: &[],
};

pub const TASKFLAG: Scenario = Scenario {
    name: "taskflag-deny",
    about: "seed 000: each thread denies and restores a flag on itself (a single-step window) while another thread posts to it every 16 windows: lock-free vs under a thread-group lock",
    impls: &["lockfree", "locked"],
    build: build_taskflag,
    lists: &[],
};

/// The per-user limit (RLIMIT_SIGPENDING-like; never reached here).
const LIMIT: usize = 1 << 20;

/// The "user" that pending items pin.
struct User {
    _uid: u32,
}

/// The kernel before the seed: a reference on the user per queued item,
/// the count incremented, then read again for the limit check.
struct GetPut {
    user: Arc<User>,
    pending: CachePadded<AtomicUsize>,
}

#[derive(Clone)]
struct SharedGetPut(Arc<GetPut>);

impl Accounting for SharedGetPut {
    fn charge(&self) -> Result<(), ChargeError> {
        let a = &self.0;
        // get_uid(user); atomic_inc(&user->sigpending); atomic_read(...)
        // SAFETY: `a.user` is a live Arc; the count is dropped in uncharge.
        unsafe { Arc::increment_strong_count(Arc::as_ptr(&a.user)) };
        a.pending.fetch_add(1, Relaxed);
        if a.pending.load(Relaxed) > LIMIT {
            // SAFETY: undoes the increment above.
            unsafe { self.uncharge() };
            return Err(ChargeError::OverLimit {
                depth: 0,
                limit: LIMIT,
            });
        }
        Ok(())
    }

    unsafe fn uncharge(&self) {
        let a = &self.0;
        // atomic_dec(&user->sigpending); free_uid(user)
        a.pending.fetch_sub(1, Relaxed);
        // SAFETY: balances the increment of `charge`.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(&a.user)) };
    }
}

/// The seed's version: the account pins the user only on 0 -> 1. The
/// charging threads hold the user (as the kernel's sender does through its
/// credentials, and as `GetPut`'s threads do), so the pin is a plain
/// increment of its strong count (`Account::charge_holding`).
struct HeldUser {
    account: Arc<Account>,
    user: Arc<User>,
}

#[derive(Clone)]
struct SharedHeldUser(Arc<HeldUser>);

impl Accounting for SharedHeldUser {
    #[inline]
    fn charge(&self) -> Result<(), ChargeError> {
        let h = &self.0;
        h.account
            .charge_holding(&h.user)
            .map(sigpending::Charge::forget)
    }

    #[inline]
    unsafe fn uncharge(&self) {
        // SAFETY: forwarded (the queue holds one forgotten charge per item).
        unsafe { self.0.account.uncharge_unchecked() };
    }
}

/// One queue per thread (a task's pending list), all charging one account.
struct Signal1<A: Accounting> {
    queues: Vec<CachePadded<PendingQueue<u64, A>>>,
    check: Box<dyn Fn() -> Result<(), String> + Sync>,
}

impl<A: Accounting> Workload for Signal1<A> {
    fn run(&self, tid: usize, iters: u64) {
        let q = &self.queues[tid];
        for i in 0..iters {
            q.enqueue(i).expect("under the limit");
            std::hint::black_box(q.dequeue());
        }
    }

    fn verify(&self, _ops: &[u64]) -> Result<(), String> {
        if self
            .queues
            .iter()
            .any(|q| !q.is_empty() || q.dropped() != 0)
        {
            return Err("items left behind or refused".into());
        }
        (self.check)()
    }
}

#[allow(clippy::unnecessary_wraps)] // the harness's `Build` signature
fn build_signal1(imp: &str, threads: usize) -> Result<Box<dyn Workload>, String> {
    let user = Arc::new(User { _uid: 1000 });
    Ok(match imp {
        "pending-ref" => {
            let shared = SharedHeldUser(Arc::new(HeldUser {
                account: Account::new(LIMIT, Owner::arc(&user)),
                user: Arc::clone(&user),
            }));
            let queues = (0..threads)
                .map(|_| CachePadded::new(PendingQueue::new(4, shared.clone())))
                .collect();
            Box::new(Signal1 {
                queues,
                // One reference in `user`, one in the HeldUser.
                check: Box::new(move || balanced(shared.0.account.charged(), &user, 2)),
            })
        }
        "get-put" => {
            let shared = SharedGetPut(Arc::new(GetPut {
                user: Arc::clone(&user),
                pending: CachePadded::new(AtomicUsize::new(0)),
            }));
            let queues = (0..threads)
                .map(|_| CachePadded::new(PendingQueue::new(4, shared.clone())))
                .collect();
            Box::new(Signal1 {
                queues,
                // One reference in `user`, one in the GetPut.
                check: Box::new(move || balanced(shared.0.pending.load(Relaxed), &user, 2)),
            })
        }
        _ => unreachable!("unknown implementation {imp}"),
    })
}

/// Nothing charged and the user's references back to `refs` once every
/// item was dequeued.
fn balanced(pending: usize, user: &Arc<User>, refs: usize) -> Result<(), String> {
    if pending != 0 {
        return Err(format!("{pending} charges left after every dequeue"));
    }
    match Arc::strong_count(user) {
        n if n == refs => Ok(()),
        n => Err(format!(
            "user has {n} references with nothing pending, not {refs}"
        )),
    }
}

const SIGPENDING: u32 = 1;
/// Windows between two posts to the next thread.
const POST_EVERY: u64 = 16;

/// The seed's version: lock-free deny/restore on each thread's own word.
struct LockFree {
    flags: Vec<CachePadded<TaskFlags>>,
}

impl Workload for LockFree {
    fn run(&self, tid: usize, iters: u64) {
        let me = &self.flags[tid];
        let next = &self.flags[(tid + 1) % self.flags.len()];
        for i in 0..iters {
            me.deny(SIGPENDING);
            me.restore();
            if i % POST_EVERY == 0 {
                next.set(SIGPENDING);
            }
        }
    }
}

/// Before the seed: the flag cleared, and later recomputed from the
/// pending set, under one lock shared by the thread group (the siglock);
/// posting takes it too.
struct Locked {
    siglock: CachePadded<parking_lot::Mutex<()>>,
    threads: Vec<CachePadded<LockedThread>>,
}

struct LockedThread {
    flag: AtomicU32,
    pending: AtomicU32,
}

impl Workload for Locked {
    fn run(&self, tid: usize, iters: u64) {
        let me = &self.threads[tid];
        let next = &self.threads[(tid + 1) % self.threads.len()];
        for i in 0..iters {
            // uprobe_deny_signal(): clear TIF_SIGPENDING under the siglock.
            if me.flag.load(Relaxed) & SIGPENDING != 0 {
                let _g = self.siglock.lock();
                me.flag.fetch_and(!SIGPENDING, Relaxed);
            }
            // handle_singlestep(): recalc_sigpending() under the siglock.
            {
                let _g = self.siglock.lock();
                if me.pending.load(Relaxed) != 0 {
                    me.flag.fetch_or(SIGPENDING, Relaxed);
                }
            }
            if i % POST_EVERY == 0 {
                let _g = self.siglock.lock();
                next.pending.fetch_or(SIGPENDING, Relaxed);
                next.flag.fetch_or(SIGPENDING, Relaxed);
            }
        }
    }
}

#[allow(clippy::unnecessary_wraps)] // the harness's `Build` signature
fn build_taskflag(imp: &str, threads: usize) -> Result<Box<dyn Workload>, String> {
    Ok(match imp {
        "lockfree" => Box::new(LockFree {
            flags: (0..threads)
                .map(|_| {
                    let f = TaskFlags::new();
                    f.set(SIGPENDING);
                    CachePadded::new(f)
                })
                .collect(),
        }),
        "locked" => Box::new(Locked {
            siglock: CachePadded::new(parking_lot::Mutex::new(())),
            threads: (0..threads)
                .map(|_| {
                    CachePadded::new(LockedThread {
                        flag: AtomicU32::new(SIGPENDING),
                        pending: AtomicU32::new(SIGPENDING),
                    })
                })
                .collect(),
        }),
        _ => unreachable!("unknown implementation {imp}"),
    })
}
