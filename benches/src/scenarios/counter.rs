//! `counter`: a statistics counter incremented by every thread.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crossbeam_utils::CachePadded;
use pcpu::{PerCpu, PerCpuCounter};

use crate::harness::{Scenario, Workload};

pub const SCENARIO: Scenario = Scenario {
    name: "counter",
    about: "increment a shared statistics counter: rseq per-CPU add vs per-CPU atomics vs one shared atomic vs per-thread shards",
    impls: &["rseq", "percpu", "shared", "sharded-thread"],
    build,
    lists: &[],
};

/// `pcpu::PerCpuCounter`: a plain `add` inside an rseq critical section.
struct Rseq(PerCpuCounter);
/// `PerCpu<AtomicU64>`: `fetch_add` on the current CPU's line.
struct Percpu(PerCpu<AtomicU64>);
/// One `AtomicU64` that every thread increments.
struct Shared(CachePadded<AtomicU64>);
/// 64 cache-padded shards picked by a per-thread index (the `ShardedLock`
/// approach): no CPU id needed, but shards collide when threads outnumber
/// them and a thread's line migrates with it.
struct ShardedThread(Box<[CachePadded<AtomicU64>]>);

const SHARDS: usize = 64;

fn thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static SHARD: usize = NEXT.fetch_add(1, Relaxed) % SHARDS);
    SHARD.with(|s| *s)
}

impl Workload for Rseq {
    fn run(&self, _tid: usize, iters: u64) {
        for _ in 0..iters {
            self.0.add(1);
        }
    }
    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        check(self.0.sum(), ops)
    }
}

impl Workload for Percpu {
    fn run(&self, _tid: usize, iters: u64) {
        for _ in 0..iters {
            self.0.current().fetch_add(1, Relaxed);
        }
    }
    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        check(self.0.iter().map(|c| c.load(Relaxed)).sum(), ops)
    }
}

impl Workload for Shared {
    fn run(&self, _tid: usize, iters: u64) {
        for _ in 0..iters {
            self.0.fetch_add(1, Relaxed);
        }
    }
    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        check(self.0.load(Relaxed), ops)
    }
}

impl Workload for ShardedThread {
    fn run(&self, _tid: usize, iters: u64) {
        let shard = &self.0[thread_shard()];
        for _ in 0..iters {
            shard.fetch_add(1, Relaxed);
        }
    }
    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        check(self.0.iter().map(|c| c.load(Relaxed)).sum(), ops)
    }
}

fn check(sum: u64, ops: &[u64]) -> Result<(), String> {
    let expected: u64 = ops.iter().sum();
    if sum == expected {
        Ok(())
    } else {
        Err(format!(
            "counter sums to {sum}, but {expected} increments were made"
        ))
    }
}

fn build(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    Ok(match imp {
        "rseq" if !pcpu::rseq::available() => {
            return Err(
                "rseq operations unavailable here (not x86-64, or glibc registered no rseq area)"
                    .into(),
            );
        }
        "rseq" => Box::new(Rseq(PerCpuCounter::new())),
        "percpu" => Box::new(Percpu(PerCpu::default())),
        "shared" => Box::new(Shared(CachePadded::new(AtomicU64::new(0)))),
        "sharded-thread" => Box::new(ShardedThread(
            (0..SHARDS).map(|_| CachePadded::default()).collect(),
        )),
        _ => unreachable!("unknown implementation {imp}"),
    })
}
