//! `uprobe-nop`, `uprobe-push`, `uprobe-ret` and `uprobe-riprel`: a call
//! to a probed function, with the
//! engine's probe (`uprobe-core`), with a real kernel uprobe (`kernel`, on
//! a copy of the function the engine never patches), and unprobed
//! (`none`): the trig-uprobe-* benchmarks of the kernel's selftests.

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::harness::{Scenario, Workload};

core::arch::global_asm!(
    ".text",
    // The engine's targets.
    ".globl bench_u_nop",
    "bench_u_nop:",
    "nop",
    "ret",
    ".globl bench_u_push",
    "bench_u_push:",
    "push rbp",
    "pop rbp",
    "ret",
    ".globl bench_u_ret",
    "bench_u_ret:",
    "ret",
    ".globl bench_u_riprel",
    "bench_u_riprel:",
    "mov rax, [rip + bench_data]",
    "ret",
    // The kernel's copies (a kernel uprobe writes its own int3 into the
    // page; removing it restores the file's bytes, which would erase ours).
    ".globl bench_k_nop",
    "bench_k_nop:",
    "nop",
    "ret",
    ".globl bench_k_push",
    "bench_k_push:",
    "push rbp",
    "pop rbp",
    "ret",
    ".globl bench_k_ret",
    "bench_k_ret:",
    "ret",
    ".globl bench_k_riprel",
    "bench_k_riprel:",
    "mov rax, [rip + bench_data]",
    "ret",
    ".data",
    ".balign 8",
    "bench_data:",
    ".quad 7",
    ".text",
);

unsafe extern "C" {
    fn bench_u_nop();
    fn bench_u_push();
    fn bench_k_nop();
    fn bench_k_push();
    fn bench_u_ret();
    fn bench_k_ret();
    fn bench_u_riprel();
    fn bench_k_riprel();
}

const IMPLS: &[&str] = &["uprobe-core", "kernel", "none"];

pub const NOP: Scenario = Scenario {
    name: "uprobe-nop",
    about: "call a function whose first instruction (a one-byte nop) is probed, one counting consumer; uprobe-core+percpu-rwsem / +rwlock: the table lookup under percpu-rwsem (seed 001) or a RwLock instead of SRCU",
    impls: &[
        "uprobe-core",
        "uprobe-core+percpu-rwsem",
        "uprobe-core+rwlock",
        "kernel",
        "none",
    ],
    build: build_nop,
};

pub const PUSH: Scenario = Scenario {
    name: "uprobe-push",
    about: "call a function whose first instruction (push rbp) is probed, one counting consumer",
    impls: IMPLS,
    build: build_push,
};

pub const RET: Scenario = Scenario {
    name: "uprobe-ret",
    about: "call a function that is a lone `ret`, probed (the kernel single-steps it; the engine emulates it)",
    impls: IMPLS,
    build: build_ret,
};

pub const RIPREL: Scenario = Scenario {
    name: "uprobe-riprel",
    about: "call a function starting with a RIP-relative load, probed (the kernel single-steps it; the engine runs it out of line, in a slot that jumps back, or +twotrap: ends in a second trap, signals deferred lock-free, or +twotrap+locked: under a process-wide lock, seed 000's before)",
    impls: &[
        "uprobe-core",
        "uprobe-core+twotrap",
        "uprobe-core+twotrap+locked",
        "kernel",
        "none",
    ],
    build: build_riprel,
};

/// Calls `target` in a loop while `guard` keeps its probe attached;
/// `check` verifies the probe saw every call.
pub(super) struct Calls<G: Send + Sync> {
    pub(super) target: unsafe extern "C" fn(),
    pub(super) guard: G,
    pub(super) check: fn(&G, u64) -> Result<(), String>,
}

impl<G: Send + Sync> Workload for Calls<G> {
    fn run(&self, _tid: usize, iters: u64) {
        for _ in 0..iters {
            // SAFETY: the asm targets take nothing and touch only rsp.
            unsafe { (self.target)() };
        }
    }

    fn batch(&self, _tid: usize) -> u64 {
        // A trap costs microseconds: check the stop flag more often.
        64
    }

    fn verify(&self, ops: &[u64]) -> Result<(), String> {
        (self.check)(&self.guard, ops.iter().sum())
    }
}

fn build_nop(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_nop, bench_k_nop)
}

fn build_push(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_push, bench_k_push)
}

fn build_ret(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_ret, bench_k_ret)
}

fn build_riprel(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_riprel, bench_k_riprel)
}

/// Hits the engine's consumer counted.
static HITS: AtomicU64 = AtomicU64::new(0);

fn build(
    imp: &str,
    ours: unsafe extern "C" fn(),
    kernels: unsafe extern "C" fn(),
) -> Result<Box<dyn Workload>, String> {
    use uprobe_core::bench_only::{Lookup, force_trap_back_slots, set_locked_deferral, set_lookup};
    // Set before every build (no probe is attached between builds).
    force_trap_back_slots(imp.starts_with("uprobe-core+twotrap"));
    set_locked_deferral(imp == "uprobe-core+twotrap+locked");
    set_lookup(match imp {
        "uprobe-core+percpu-rwsem" => Lookup::PercpuRwsem,
        "uprobe-core+rwlock" => Lookup::RwLock,
        _ => Lookup::Srcu,
    });
    Ok(match imp {
        _ if imp.starts_with("uprobe-core") => {
            HITS.store(0, Relaxed);
            // SAFETY: a function's address starts an instruction.
            let probe = unsafe { uprobe_core::Uprobe::address(ours as *const () as usize) }
                .on_entry(|_| {
                    HITS.fetch_add(1, Relaxed);
                })
                .attach()
                .map_err(|e| e.to_string())?;
            Box::new(Calls {
                target: ours,
                guard: probe,
                check: |probe, ops| {
                    let hits = probe.hits();
                    if hits >= ops && HITS.load(Relaxed) == hits {
                        Ok(())
                    } else {
                        Err(format!("{hits} hits for {ops} calls"))
                    }
                },
            })
        }
        "kernel" => Box::new(Calls {
            target: kernels,
            guard: KernelUprobe::attach(kernels as *const () as usize, false)?,
            check: |probe, ops| match probe.count() {
                Some(n) if n >= ops => Ok(()),
                n => Err(format!("kernel uprobe counted {n:?} for {ops} calls")),
            },
        }),
        "none" => Box::new(Calls {
            target: ours,
            guard: (),
            check: |(), _| Ok(()),
        }),
        _ => unreachable!("unknown implementation {imp}"),
    })
}

/// A kernel uprobe (or, with `retprobe`, uretprobe) on `addr` of this
/// process, as counting perf events of the uprobe PMU (path and file
/// offset of the function), one per CPU (a per-task event would miss the
/// worker threads, and inheriting a uprobe event makes thread creation
/// fail).
pub(super) struct KernelUprobe {
    fds: Vec<i32>,
}

impl KernelUprobe {
    pub(super) fn attach(addr: usize, retprobe: bool) -> Result<Self, String> {
        let pmu = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type")
            .map_err(|e| format!("no uprobe PMU: {e}"))?;
        let pmu: u32 = pmu
            .trim()
            .parse()
            .map_err(|e| format!("uprobe PMU type: {e}"))?;
        let (path, offset) = uprobe_core::bench_only::file_offset_of(addr)
            .ok_or_else(|| format!("{addr:#x} is not in an executable file mapping"))?;
        let path =
            CString::new(path.into_os_string().into_encoded_bytes()).map_err(|e| e.to_string())?;
        // struct perf_event_attr, PERF_ATTR_SIZE_VER5 (112 bytes): type,
        // size, config (bit 0: retprobe, the PMU's `format/retprobe`),
        // config1 = uprobe_path, config2 = probe_offset; enabled, counting.
        let mut attr = [0u8; 112];
        attr[0..4].copy_from_slice(&pmu.to_ne_bytes());
        attr[4..8].copy_from_slice(&112u32.to_ne_bytes());
        attr[8..16].copy_from_slice(&u64::from(retprobe).to_ne_bytes());
        attr[56..64].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
        attr[64..72].copy_from_slice(&offset.to_ne_bytes());
        let mut probe = Self { fds: Vec::new() };
        let mut last_error = None;
        for cpu in 0..pcpu::possible_cpus() as i32 {
            // SAFETY: perf_event_open with a valid attr buffer, every
            // process, one CPU, no group, close-on-exec.
            let fd = unsafe {
                libc::syscall(libc::SYS_perf_event_open, attr.as_ptr(), -1, cpu, -1, 8u64)
            } as i32;
            if fd >= 0 {
                probe.fds.push(fd);
            } else {
                last_error = Some(std::io::Error::last_os_error());
            }
        }
        match (probe.fds.is_empty(), last_error) {
            (true, Some(e)) => Err(format!(
                "perf_event_open(uprobe) refused: {e} (per-CPU events need perf_event_paranoid <= 0 or CAP_PERFMON)"
            )),
            _ => Ok(probe),
        }
    }

    /// Hits counted so far, over every CPU.
    pub(super) fn count(&self) -> Option<u64> {
        self.fds.iter().try_fold(0u64, |sum, &fd| {
            let mut n = 0u64;
            // SAFETY: reading the 8-byte counter of our own perf fd.
            let r = unsafe { libc::read(fd, (&raw mut n).cast(), 8) };
            (r == 8).then_some(sum + n)
        })
    }
}

impl Drop for KernelUprobe {
    fn drop(&mut self) {
        for &fd in &self.fds {
            // SAFETY: closing our own fds removes the uprobe.
            unsafe { libc::close(fd) };
        }
    }
}
