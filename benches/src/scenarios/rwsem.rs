//! `rwsem-read` and `rwsem-mixed`: seed 001, the per-CPU reader-writer
//! semaphore against the reader-writer locks Rust users pick today.
#![allow(clippy::inline_always)] // read paths are forced inline for every impl alike

use std::hint::black_box;
use std::time::Duration;

use crossbeam_utils::sync::ShardedLock;
use percpu_rwsem::PercpuRwSem;

use crate::harness::{Scenario, Workload, split_lists};

const IMPLS: &[&str] = &["percpu-rwsem", "std", "parking_lot", "sharded"];

pub const READ: Scenario = Scenario {
    name: "rwsem-read",
    about: "seed 001: each thread loops read-lock, read the value, unlock (no writer); rseq-adds is the floor: the two per-CPU rseq adds a reader's lock and unlock make (pcpu::rseq::add of +1 and -1 around the read), with no gate, no read depth and no writer to exclude",
    impls: &["percpu-rwsem", "std", "parking_lot", "sharded", "rseq-adds"],
    build: build_read,
    lists: &[],
};

pub const MIXED: Scenario = Scenario {
    name: "rwsem-mixed",
    about: "seed 001: one writer (write, then 100 us pause) while the other threads read; rows IMPL:reads and IMPL:writes",
    impls: IMPLS,
    build: build_mixed,
    lists: &[],
};

pub const WRITE: Scenario = Scenario {
    name: "rwsem-write",
    about: "seed 001: each thread loops write-lock, add, unlock (no reader): percpu-rwsem's writer sums every CPU's count to see the readers gone (the gate stays closed between writes, no grace period); +gp: each write followed by one read, with no linger, so the read reopens the fast path and every write closes it again with a full grace period (membarrier); --lists N builds percpu-rwsem's counts as if the machine had N CPUs",
    impls: &["percpu-rwsem", "percpu-rwsem+gp", "std", "parking_lot"],
    build: build_write,
    lists: &["percpu-rwsem", "percpu-rwsem+gp"],
};

/// The pause between two writes in `rwsem-mixed`, the same for every impl.
const WRITE_PAUSE: Duration = Duration::from_micros(100);

/// The lock types under test, behind one interface (reads forced inline
/// for every implementation alike, so the loop measures the lock).
trait Lock: Sync {
    fn read_value(&self) -> u64;
    fn add(&self, delta: u64);
}

impl Lock for PercpuRwSem<u64> {
    #[inline(always)]
    fn read_value(&self) -> u64 {
        *self.read()
    }
    fn add(&self, delta: u64) {
        *self.write() += delta;
    }
}

impl Lock for std::sync::RwLock<u64> {
    #[inline(always)]
    fn read_value(&self) -> u64 {
        *self.read().unwrap()
    }
    fn add(&self, delta: u64) {
        *self.write().unwrap() += delta;
    }
}

impl Lock for parking_lot::RwLock<u64> {
    #[inline(always)]
    fn read_value(&self) -> u64 {
        *self.read()
    }
    fn add(&self, delta: u64) {
        *self.write() += delta;
    }
}

impl Lock for ShardedLock<u64> {
    #[inline(always)]
    fn read_value(&self) -> u64 {
        *self.read().unwrap()
    }
    fn add(&self, delta: u64) {
        *self.write().unwrap() += delta;
    }
}

/// The floor of a per-CPU reader: `+1` to its CPU's count, the read,
/// `-1`, each add one rseq critical section (an atomic add where rseq
/// does not run), and nothing else.
struct RseqAdds {
    counts: pcpu::PerCpu<std::sync::atomic::AtomicU64>,
    value: u64,
}

impl Lock for RseqAdds {
    #[inline(always)]
    fn read_value(&self) -> u64 {
        pcpu::rseq::add(&self.counts, 1);
        let v = black_box(self.value);
        pcpu::rseq::add(&self.counts, 1u64.wrapping_neg());
        v
    }
    fn add(&self, _delta: u64) {
        unreachable!("rseq-adds has no writer")
    }
}

/// Monomorphic read loops: the lock type is known inside the loop, so the
/// benchmark measures the lock and not a virtual call per iteration.
struct ReadLoop<L>(L);

impl<L: Lock> Workload for ReadLoop<L> {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u64;
        for _ in 0..iters {
            acc = acc.wrapping_add(self.0.read_value());
        }
        black_box(acc);
    }
}

#[allow(clippy::unnecessary_wraps)] // the signature of `harness::Build`
fn build_read(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    Ok(match imp {
        "percpu-rwsem" => Box::new(ReadLoop(new_percpu())),
        "std" => Box::new(ReadLoop(std::sync::RwLock::new(0u64))),
        "parking_lot" => Box::new(ReadLoop(parking_lot::RwLock::new(0u64))),
        "sharded" => Box::new(ReadLoop(ShardedLock::new(0u64))),
        "rseq-adds" => Box::new(ReadLoop(RseqAdds {
            counts: pcpu::PerCpu::default(),
            value: 0,
        })),
        _ => unreachable!("unknown implementation {imp}"),
    })
}

fn new_percpu() -> PercpuRwSem<u64> {
    let l = PercpuRwSem::new(0u64);
    l.prepare();
    l
}

/// Worker 0 writes (then pauses), the others read.
struct Mixed<L>(L);

impl<L: Lock> Workload for Mixed<L> {
    fn run(&self, tid: usize, iters: u64) {
        if tid == 0 {
            for _ in 0..iters {
                self.0.add(1);
                std::thread::sleep(WRITE_PAUSE);
            }
        } else {
            let mut acc = 0u64;
            for _ in 0..iters {
                acc = acc.wrapping_add(self.0.read_value());
            }
            black_box(acc);
        }
    }

    fn role(&self, tid: usize) -> &'static str {
        if tid == 0 { "writes" } else { "reads" }
    }

    fn batch(&self, tid: usize) -> u64 {
        if tid == 0 { 1 } else { 1024 }
    }

    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        let value = self.0.read_value();
        if value == ops[0] {
            Ok(())
        } else {
            Err(format!("the value is {value} after {} writes", ops[0]))
        }
    }
}

/// Writes: each operation takes the write side, adds, releases (and,
/// with `read_after`, reads once).
struct WriteLoop<L> {
    lock: L,
    read_after: bool,
}

impl<L: Lock> Workload for WriteLoop<L> {
    fn run(&self, _tid: usize, iters: u64) {
        for _ in 0..iters {
            self.lock.add(1);
            if self.read_after {
                black_box(self.lock.read_value());
            }
        }
    }

    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        let (value, want) = (self.lock.read_value(), ops.iter().sum::<u64>());
        if value == want {
            Ok(())
        } else {
            Err(format!("{value} writes counted for {want}"))
        }
    }
}

#[allow(clippy::unnecessary_wraps)] // the signature of `harness::Build`
fn build_write(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    let (name, cpus) = split_lists(imp);
    Ok(match name {
        "percpu-rwsem" | "percpu-rwsem+gp" => {
            let lock = cpus.map_or_else(
                || PercpuRwSem::new(0u64),
                |n| PercpuRwSem::with_cpus(0u64, n),
            );
            lock.prepare();
            let read_after = name == "percpu-rwsem+gp";
            if read_after {
                lock.raw().set_linger(Duration::ZERO);
            }
            Box::new(WriteLoop { lock, read_after })
        }
        "std" => Box::new(WriteLoop {
            lock: std::sync::RwLock::new(0u64),
            read_after: false,
        }),
        "parking_lot" => Box::new(WriteLoop {
            lock: parking_lot::RwLock::new(0u64),
            read_after: false,
        }),
        _ => unreachable!("unknown implementation {imp}"),
    })
}

fn build_mixed(imp: &str, threads: usize) -> Result<Box<dyn Workload>, String> {
    if threads < 2 {
        return Err("needs 2 or more threads: one writer, the rest readers".into());
    }
    Ok(match imp {
        "percpu-rwsem" => Box::new(Mixed(new_percpu())),
        "std" => Box::new(Mixed(std::sync::RwLock::new(0u64))),
        "parking_lot" => Box::new(Mixed(parking_lot::RwLock::new(0u64))),
        "sharded" => Box::new(Mixed(ShardedLock::new(0u64))),
        _ => unreachable!("unknown implementation {imp}"),
    })
}
