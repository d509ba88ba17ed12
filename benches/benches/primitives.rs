//! Single-operation costs of the per-CPU foundation and the freelist
//! (`cargo bench -p benches`).

use std::hint::black_box;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use criterion::{Criterion, criterion_group, criterion_main};

fn cpu_id(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu-id");
    g.bench_function("current_cpu", |b| b.iter(|| black_box(pcpu::current_cpu())));
    g.bench_function("sched_getcpu", |b| {
        b.iter(|| black_box(pcpu::sched_getcpu()));
    });
    g.finish();
}

fn counter(c: &mut Criterion) {
    let mut g = c.benchmark_group("counter-add");
    let rseq = pcpu::PerCpuCounter::new();
    g.bench_function("rseq", |b| b.iter(|| rseq.add(black_box(1))));
    let percpu = pcpu::PerCpu::<AtomicU64>::default();
    g.bench_function("percpu-atomic", |b| {
        b.iter(|| percpu.current().fetch_add(black_box(1), Relaxed));
    });
    let shared = AtomicU64::new(0);
    g.bench_function("shared-atomic", |b| {
        b.iter(|| shared.fetch_add(black_box(1), Relaxed));
    });
    g.finish();
}

fn fences(c: &mut Criterion) {
    let mut g = c.benchmark_group("fence");
    g.bench_function("light", |b| b.iter(pcpu::fence::light));
    g.bench_function("heavy", |b| b.iter(pcpu::fence::heavy));
    g.bench_function("seqcst", |b| {
        b.iter(|| std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst));
    });
    g.finish();
}

fn stack(c: &mut Criterion) {
    #[repr(C)]
    struct Node {
        next: usize,
    }
    let stack = pcpu::PerCpuStack::new(0);
    let node = NonNull::from(Box::leak(Box::new(Node { next: 0 }))).cast::<u8>();
    c.bench_function("stack-push-pop", |b| {
        b.iter(|| {
            // SAFETY: the node is leaked (lives forever), and is in no list:
            // it is popped back before the next push.
            unsafe { stack.push(node) };
            let n = stack
                .pop()
                .or_else(|| (0..stack.slots()).find_map(|s| stack.pop_slot(s)));
            black_box(n)
        });
    });
}

fn freelist(c: &mut Criterion) {
    use pcpu_freelist::{EmptyHint, FreeList};
    let mut g = c.benchmark_group("freelist");
    for (name, hint) in [
        ("flag", EmptyHint::Flag),
        ("head", EmptyHint::Head),
        ("none", EmptyHint::None),
    ] {
        let pool = FreeList::with_hint(vec![0u64; 64], hint);
        g.bench_function(format!("pop-push/{name}"), |b| {
            b.iter(|| {
                let e = pool.pop().expect("a free element");
                pool.push(black_box(e));
            });
        });
        let taken: Vec<_> = std::iter::from_fn(|| pool.pop()).collect();
        g.bench_function(format!("pop-empty/{name}"), |b| {
            b.iter(|| black_box(pool.pop()).is_none());
        });
        drop(taken);
    }
    g.finish();
}

criterion_group!(benches, cpu_id, counter, fences, stack, freelist);

fn rwsem(c: &mut Criterion) {
    let mut g = c.benchmark_group("rwsem-uncontended");
    let percpu = percpu_rwsem::PercpuRwSem::new(0u64);
    let std_lock = std::sync::RwLock::new(0u64);
    let pl = parking_lot::RwLock::new(0u64);
    g.bench_function("percpu-rwsem/read", |b| {
        b.iter(|| black_box(*percpu.read()));
    });
    g.bench_function("std/read", |b| {
        b.iter(|| black_box(*std_lock.read().unwrap()));
    });
    g.bench_function("parking_lot/read", |b| b.iter(|| black_box(*pl.read())));
    g.bench_function("percpu-rwsem/write", |b| b.iter(|| *percpu.write() += 1));
    g.bench_function("std/write", |b| b.iter(|| *std_lock.write().unwrap() += 1));
    g.bench_function("parking_lot/write", |b| b.iter(|| *pl.write() += 1));
    g.finish();
}

criterion_group!(rwsem_benches, rwsem);
criterion_main!(benches, rwsem_benches);
