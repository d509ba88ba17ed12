//! `cpu-id`: what it costs to ask which CPU we are on.

use std::hint::black_box;

use crate::harness::{Scenario, Workload};

pub const SCENARIO: Scenario = Scenario {
    name: "cpu-id",
    about: "read the current CPU id: rseq area cpu_id vs sched_getcpu() (vDSO) vs the getcpu system call",
    impls: &["rseq", "sched_getcpu", "syscall"],
    build,
    lists: &[],
};

struct Rseq;
struct SchedGetcpu;
struct Syscall;

impl Workload for Rseq {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0usize;
        for _ in 0..iters {
            acc = acc.wrapping_add(pcpu::current_cpu());
        }
        black_box(acc);
    }
}

impl Workload for SchedGetcpu {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0usize;
        for _ in 0..iters {
            acc = acc.wrapping_add(pcpu::sched_getcpu());
        }
        black_box(acc);
    }
}

impl Workload for Syscall {
    fn run(&self, _tid: usize, iters: u64) {
        let mut acc = 0u32;
        for _ in 0..iters {
            let mut cpu = 0u32;
            // SAFETY: getcpu writes one u32; the other pointers may be null.
            unsafe {
                libc::syscall(
                    libc::SYS_getcpu,
                    &raw mut cpu,
                    std::ptr::null_mut::<u32>(),
                    0usize,
                );
            }
            acc = acc.wrapping_add(cpu);
        }
        black_box(acc);
    }

    fn batch(&self, _tid: usize) -> u64 {
        64
    }
}

fn build(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    Ok(match imp {
        "rseq" if !pcpu::rseq::available() && !rseq_cpu_id_readable() => {
            return Err(
                "glibc registered no rseq area (current_cpu() would measure sched_getcpu)".into(),
            );
        }
        "rseq" => Box::new(Rseq),
        "sched_getcpu" => Box::new(SchedGetcpu),
        "syscall" => Box::new(Syscall),
        _ => unreachable!("unknown implementation {imp}"),
    })
}

/// Whether `current_cpu()` reads an rseq area on this machine (also true on
/// aarch64, where the rseq *operations* fall back but the CPU id does not).
fn rseq_cpu_id_readable() -> bool {
    // SAFETY: dlsym with a NUL-terminated name; the symbol is a u32.
    unsafe {
        let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr());
        !size.is_null() && *size.cast::<u32>() != 0
    }
}
