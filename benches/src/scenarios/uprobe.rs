//! `uprobe-nop`, `uprobe-push`, `uprobe-ret`, `uprobe-riprel`,
//! `uprobe-nop5`, `uprobe-entry` and `uprobe-count`: a call to a probed
//! function, with the engine's probe (`uprobe-core`), with a real kernel
//! uprobe (`kernel`, on a copy of the function the engine never patches),
//! and unprobed (`none`): the trig-uprobe-* benchmarks of the kernel's
//! selftests. On aarch64, `uprobe-nop` (`nop; ret`), `uprobe-entry` and
//! `uprobe-count` (a function that pushes and pops a frame record): the
//! others probe x86-64 forms.

use std::ffi::CString;

use super::calls::Calls;
use super::tally;
use crate::harness::{Scenario, Workload};

#[cfg(target_arch = "x86_64")]
/// A sized function with a real prologue (`push rbp; mov rbp, rsp; push
/// rbx`: three instructions, 5 bytes) that returns its argument plus one.
macro_rules! prologue_function {
    ($name:literal) => {
        concat!(
            ".globl ",
            $name,
            "\n",
            ".type ",
            $name,
            ", @function\n",
            $name,
            ":\n",
            "push rbp\nmov rbp, rsp\npush rbx\nmov rbx, rdi\n",
            "lea rax, [rbx + 1]\npop rbx\npop rbp\nret\n",
            ".size ",
            $name,
            ", . - ",
            $name,
        )
    };
}

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    // The engine's targets.
    ".globl bench_u_push",
    ".type bench_u_push, @function",
    "bench_u_push:",
    "push rbp",
    "pop rbp",
    "ret",
    ".size bench_u_push, . - bench_u_push",
    ".globl bench_u_ret",
    ".type bench_u_ret, @function",
    "bench_u_ret:",
    "ret",
    ".size bench_u_ret, . - bench_u_ret",
    ".globl bench_u_riprel",
    ".type bench_u_riprel, @function",
    "bench_u_riprel:",
    "mov rax, [rip + bench_data]",
    "ret",
    ".size bench_u_riprel, . - bench_u_riprel",
    // The kernel's copies (a kernel uprobe writes its own int3 into the
    // page; removing it restores the file's bytes, which would erase ours).
    ".globl bench_k_push",
    ".type bench_k_push, @function",
    "bench_k_push:",
    "push rbp",
    "pop rbp",
    "ret",
    ".size bench_k_push, . - bench_k_push",
    ".globl bench_k_ret",
    ".type bench_k_ret, @function",
    "bench_k_ret:",
    "ret",
    ".size bench_k_ret, . - bench_k_ret",
    ".globl bench_k_riprel",
    ".type bench_k_riprel, @function",
    "bench_k_riprel:",
    "mov rax, [rip + bench_data]",
    "ret",
    ".size bench_k_riprel, . - bench_k_riprel",
    // Trap-free candidates (sized, so the engine knows each function's
    // extent): a 5-byte nop, and a real prologue of three instructions.
    ".globl bench_u_nop5",
    ".type bench_u_nop5, @function",
    "bench_u_nop5:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "ret",
    ".size bench_u_nop5, . - bench_u_nop5",
    ".globl bench_k_nop5",
    ".type bench_k_nop5, @function",
    "bench_k_nop5:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "ret",
    ".size bench_k_nop5, . - bench_k_nop5",
    prologue_function!("bench_u_entry"),
    prologue_function!("bench_k_entry"),
    ".data",
    ".balign 8",
    "bench_data:",
    ".quad 7",
    ".text",
);

// uprobe-nop's function and the kernel's copy (a kernel uprobe writes
// its own breakpoint into the page; removing it restores the file's
// bytes, which would erase the engine's): the same on both architectures.
core::arch::global_asm!(
    ".text",
    ".globl bench_u_nop",
    ".type bench_u_nop, %function",
    "bench_u_nop:",
    "nop",
    "ret",
    ".size bench_u_nop, . - bench_u_nop",
    ".globl bench_k_nop",
    ".type bench_k_nop, %function",
    "bench_k_nop:",
    "nop",
    "ret",
    ".size bench_k_nop, . - bench_k_nop",
);

// aarch64: uprobe-entry's function (a frame record pushed and popped, as
// compilers write a prologue) and the kernel's copy.
#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".text",
    ".globl bench_u_entry",
    ".type bench_u_entry, %function",
    "bench_u_entry:",
    "stp x29, x30, [sp, #-16]!",
    "mov x29, sp",
    "add x0, x0, #1",
    "ldp x29, x30, [sp], #16",
    "ret",
    ".size bench_u_entry, . - bench_u_entry",
    ".globl bench_k_entry",
    ".type bench_k_entry, %function",
    "bench_k_entry:",
    "stp x29, x30, [sp, #-16]!",
    "mov x29, sp",
    "add x0, x0, #1",
    "ldp x29, x30, [sp], #16",
    "ret",
    ".size bench_k_entry, . - bench_k_entry",
);

unsafe extern "C" {
    fn bench_u_nop();
    fn bench_k_nop();
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    fn bench_u_push();
    fn bench_k_push();
    fn bench_u_ret();
    fn bench_k_ret();
    fn bench_u_riprel();
    fn bench_k_riprel();
    fn bench_u_nop5();
    fn bench_k_nop5();
}

unsafe extern "C" {
    pub(super) fn bench_u_entry();
    pub(super) fn bench_k_entry();
}

/// The trap-free scenarios' implementations: the engine's default (a
/// jump), the same probe kept on its breakpoint, the kernel, unprobed.
const JUMP_IMPLS: &[&str] = &["uprobe-core", "uprobe-core+trap", "kernel", "none"];

/// [`JUMP_IMPLS`] with the hand-written floor (x86-64).
#[cfg(target_arch = "x86_64")]
const FLOOR_IMPLS: &[&str] = &["uprobe-core", "uprobe-core+trap", "hand", "kernel", "none"];
#[cfg(not(target_arch = "x86_64"))]
const FLOOR_IMPLS: &[&str] = JUMP_IMPLS;

#[cfg(target_arch = "x86_64")]
pub const NOP5: Scenario = Scenario {
    name: "uprobe-nop5",
    about: "call a function that starts with a 5-byte nop, probed: uprobe-core runs it through a jump into a trampoline (no signal), +trap keeps the breakpoint; the kernel (6.18+) optimizes this form itself; hand is the floor: a jump to a trampoline written by hand that saves the flags, every general-purpose register and xmm0-xmm15 and calls a handler adding to a thread-local counter",
    impls: FLOOR_IMPLS,
    build: build_nop5,
    lists: &[],
};

pub const ENTRY: Scenario = Scenario {
    name: "uprobe-entry",
    about: "call a function with a real prologue (push rbp; mov rbp, rsp; push rbx; ...), probed at its entry: uprobe-core relocates the three instructions into a trampoline and jumps there, +trap keeps the breakpoint; the kernel emulates push rbp; hand is the floor (as in uprobe-nop5); on aarch64 the function pushes a frame record (stp x29, x30, [sp, #-16]!; mov x29, sp; ...) and the probe on its first instruction takes a branch to a trampoline",
    impls: FLOOR_IMPLS,
    build: build_entry,
    lists: &[],
};

pub const COUNT: Scenario = Scenario {
    name: "uprobe-count",
    about: "call uprobe-entry's function (a real prologue), probed at its entry by a counting probe (no handler: uprobe-core+count, the trampoline adds to its CPU's counter itself, no register frame) or by one counting consumer (uprobe-core: the full register frame and the handler); the kernel's uprobe counting in a perf event; unprobed",
    impls: &["uprobe-core+count", "uprobe-core", "kernel", "none"],
    build: build_entry,
    lists: &[],
};

pub const NOP: Scenario = Scenario {
    name: "uprobe-nop",
    about: "call a function whose first instruction (a one-byte nop) is probed, one counting consumer: uprobe-core puns a jump over it (the jump's displacement runs into the bytes after it), +trap keeps the breakpoint; uprobe-core+percpu-rwsem / +rwlock: on the breakpoint, the table lookup under percpu-rwsem (seed 001) or a RwLock instead of SRCU",
    impls: &[
        "uprobe-core",
        "uprobe-core+trap",
        "uprobe-core+percpu-rwsem",
        "uprobe-core+rwlock",
        "kernel",
        "none",
    ],
    build: build_nop,
    lists: &[],
};

#[cfg(target_arch = "x86_64")]
pub const PUSH: Scenario = Scenario {
    name: "uprobe-push",
    about: "call a function whose first instruction (push rbp) is probed, one counting consumer: uprobe-core puns a jump over it, +trap keeps the breakpoint (and emulates the push); the kernel emulates it",
    impls: JUMP_IMPLS,
    build: build_push,
    lists: &[],
};

#[cfg(target_arch = "x86_64")]
pub const RET: Scenario = Scenario {
    name: "uprobe-ret",
    about: "call a function that is a lone `ret`, probed: uprobe-core puns a jump over it, +trap keeps the breakpoint (and emulates the ret); the kernel single-steps it",
    impls: JUMP_IMPLS,
    build: build_ret,
    lists: &[],
};

#[cfg(target_arch = "x86_64")]
pub const RIPREL: Scenario = Scenario {
    name: "uprobe-riprel",
    about: "call a function starting with a RIP-relative load, probed (the kernel single-steps it; the engine jumps to a trampoline that runs it relocated, no trap; +twotrap: on its breakpoint, out of line in a slot that ends in a second trap, signals deferred lock-free, or +twotrap+locked: under a process-wide lock, seed 000's before)",
    impls: &[
        "uprobe-core",
        "uprobe-core+twotrap",
        "uprobe-core+twotrap+locked",
        "kernel",
        "none",
    ],
    build: build_riprel,
    lists: &[],
};

fn build_nop(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_nop, bench_k_nop)
}

#[cfg(target_arch = "x86_64")]
fn build_push(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_push, bench_k_push)
}

#[cfg(target_arch = "x86_64")]
fn build_ret(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_ret, bench_k_ret)
}

#[cfg(target_arch = "x86_64")]
fn build_riprel(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    build(imp, bench_u_riprel, bench_k_riprel)
}

#[cfg(target_arch = "x86_64")]
fn build_nop5(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    if imp == "hand" {
        return Ok(super::hand::build(false));
    }
    build(imp, bench_u_nop5, bench_k_nop5)
}

fn build_entry(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    #[cfg(target_arch = "x86_64")]
    if imp == "hand" {
        return Ok(super::hand::build(true));
    }
    build(imp, bench_u_entry, bench_k_entry)
}

/// The engine's probe for implementation `imp` on the function at `addr`
/// (through its symbol, so a multi-instruction entry can take a jump):
/// on its breakpoint for the trap variants (`+trap`, `+twotrap...`, and
/// the seed-001 lookup variants, which measure the trap path's lookup).
pub(super) fn engine_probe(imp: &str, addr: usize) -> Result<uprobe_core::Uprobe, String> {
    let probe = uprobe_core::Uprobe::at(addr).map_err(|e| e.to_string())?;
    let trap = imp.contains("trap") || imp.contains("rwsem") || imp.contains("rwlock");
    Ok(if trap { probe.trap_only() } else { probe })
}

fn build(
    imp: &str,
    ours: unsafe extern "C" fn(),
    kernels: unsafe extern "C" fn(),
) -> Result<Box<dyn Workload>, String> {
    use uprobe_core::testing::{Lookup, force_trap_back_slots, set_locked_deferral, set_lookup};
    // Set before every build (no probe is attached between builds).
    force_trap_back_slots(imp.starts_with("uprobe-core+twotrap"));
    set_locked_deferral(imp == "uprobe-core+twotrap+locked");
    set_lookup(match imp {
        "uprobe-core+percpu-rwsem" => Lookup::PercpuRwsem,
        "uprobe-core+rwlock" => Lookup::RwLock,
        _ => Lookup::Srcu,
    });
    Ok(match imp {
        "uprobe-core+count" => {
            // No handler: the probe only counts (the trampoline does it).
            let probe = engine_probe(imp, ours as *const () as usize)?
                .attach()
                .map_err(|e| e.to_string())?;
            Box::new(Calls {
                target: ours,
                guard: probe,
                check: |probe, ops| {
                    let hits = probe.hits();
                    if hits >= ops {
                        Ok(())
                    } else {
                        Err(format!("{hits} hits for {ops} calls"))
                    }
                },
            })
        }
        _ if imp.starts_with("uprobe-core") => {
            // The consumer counts in a thread-local cell, as the `hand`
            // floor's handler does (`tally`): the rows differ only in how
            // the handler is reached.
            let probe = engine_probe(imp, ours as *const () as usize)?
                .on_entry(|_| tally::add())
                .attach()
                .map_err(|e| e.to_string())?;
            Box::new(Calls {
                target: ours,
                guard: (probe, tally::ended()),
                check: |(probe, before), ops| {
                    let (hits, counted) = (probe.hits(), tally::ended() - before);
                    if hits >= ops && counted == hits {
                        Ok(())
                    } else {
                        Err(format!("{hits} hits ({counted} counted) for {ops} calls"))
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
        let (path, offset) = uprobe_core::testing::file_offset_of(addr)
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
