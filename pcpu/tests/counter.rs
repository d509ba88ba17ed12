//! Per-CPU counters stay exact while threads migrate freely.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use pcpu::{PerCpu, PerCpuCounter};

fn threads() -> usize {
    // More threads than CPUs, unpinned: the scheduler moves them around
    // and preempts them inside critical sections.
    4 * std::thread::available_parallelism().map_or(2, usize::from)
}

#[test]
fn sum_of_adds_is_exact_under_migration() {
    let counter = PerCpuCounter::new();
    let per_thread = test_support::scaled(200_000u64);
    std::thread::scope(|s| {
        for _ in 0..threads() {
            s.spawn(|| {
                for i in 0..per_thread {
                    counter.add(1);
                    if i % 4096 == 0 {
                        std::thread::yield_now();
                    }
                }
            });
        }
    });
    assert_eq!(counter.sum(), per_thread * threads() as u64);
}

#[test]
fn wrapping_subtraction_balances() {
    let counts = PerCpu::<AtomicU64>::default();
    std::thread::scope(|s| {
        for t in 0..threads() {
            let counts = &counts;
            s.spawn(move || {
                for _ in 0..test_support::scaled(50_000) {
                    pcpu::rseq::add(counts, 3);
                    // Release on whatever CPU we are on now: only the sum matters.
                    if t % 2 == 0 {
                        std::thread::yield_now();
                    }
                    pcpu::rseq::add(counts, 3u64.wrapping_neg());
                }
            });
        }
    });
    let sum = counts
        .iter()
        .fold(0u64, |a, c| a.wrapping_add(c.load(Relaxed)));
    assert_eq!(sum, 0);
}

#[test]
fn ids_beyond_the_possible_count_use_the_overflow_slot() {
    let slots = PerCpu::new(|i| i);
    let n = slots.cpus();
    assert_eq!(n, pcpu::possible_cpus());
    assert_eq!(slots.index_of(n - 1), n - 1);
    assert_eq!(slots.index_of(n), slots.overflow_index());
    assert_eq!(slots.index_of(usize::MAX), slots.overflow_index());
    assert_eq!(slots.get(slots.overflow_index()), Some(&n));
    assert_eq!(slots.get(n + 1), None);
    assert_eq!(slots.iter().count(), n + 1);
}

/// Pins the calling thread to `cpu` and lets the scheduler move it
/// there; false if the thread may not run on it.
fn pin_to(cpu: usize) -> bool {
    // SAFETY: cpu_set_t is plain data.
    let pinned = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set) == 0
    };
    if pinned {
        std::thread::yield_now();
    }
    pinned
}

#[test]
fn current_cpu_is_within_the_affinity_mask() {
    // Pin to each allowed CPU in turn and check the id follows.
    for cpu in 0..pcpu::possible_cpus() {
        if pin_to(cpu) {
            assert_eq!(pcpu::current_cpu(), cpu);
            assert_eq!(pcpu::sched_getcpu(), cpu);
        }
    }
}

#[test]
fn a_threads_slot_follows_it_to_another_cpu() {
    // Where reading the CPU id costs a system call (aarch64 without an
    // rseq area, qemu-user), the slot is the CPU read at most 64 uses ago:
    // after 64 uses on a CPU it is that CPU's.
    let slots = PerCpu::<AtomicU64>::default();
    std::thread::spawn(move || {
        for cpu in (0..pcpu::possible_cpus()).rev() {
            if pin_to(cpu) {
                for _ in 0..64 {
                    slots.current().fetch_add(1, Relaxed);
                }
                assert_eq!(slots.current_index(), slots.index_of(cpu));
            }
        }
        let total: u64 = slots.iter().map(|c| c.load(Relaxed)).sum();
        assert!(total > 0, "pinned to no CPU");
    })
    .join()
    .unwrap();
}

#[test]
fn gated_adds_stop_once_the_gate_is_set_and_fenced() {
    use pcpu::rseq::{GatedAdd, add_if_zero, fence_all};
    use std::sync::atomic::{AtomicBool, AtomicU32};

    let counts = PerCpu::<AtomicU64>::default();
    let gate = AtomicU32::new(1);
    assert_ne!(
        add_if_zero(&counts, &gate, 1),
        GatedAdd::Added,
        "added through a closed gate"
    );
    gate.store(0, Relaxed);
    if add_if_zero(&counts, &gate, 1) == GatedAdd::Unavailable {
        // No rseq here (aarch64, qemu, old glibc): nothing may be written.
        assert_eq!(counts.iter().map(|c| c.load(Relaxed)).sum::<u64>(), 0);
        return;
    }
    let stop = AtomicBool::new(false);
    let sum = || counts.iter().map(|c| c.load(Relaxed)).sum::<u64>();
    std::thread::scope(|s| {
        for _ in 0..threads() {
            s.spawn(|| {
                while !stop.load(Relaxed) {
                    let _ = add_if_zero(&counts, &gate, 1);
                }
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        gate.store(1, Relaxed);
        fence_all();
        // The grace period is over: no add can commit any more.
        let frozen = sum();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(sum(), frozen, "an add committed after the gate closed");
        stop.store(true, Relaxed);
    });
    assert!(sum() > 1, "the adders never ran");
}
