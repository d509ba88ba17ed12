//! `uretprobe-nop` and `uretprobe-entry`: a call to a function whose return is probed, with the
//! engine's return probe (`uprobe-core`: an entry trap, then the plain-code
//! return trampoline, with an in-flight limit whose account pins the probe
//! on 0 -> 1 only; `uprobe-core+get-put`: a reference per pending return
//! instead, seed 003's before), a kernel uretprobe (`kernel`, on its own
//! copy of the function), and unprobed (`none`). `uretprobe-lifetime`:
//! the engine's return probe, without the in-flight limit (its account is
//! one count every thread charges, seed 003's subject), with each pending
//! return holding an SRCU lease on the probe (`lease`, seed 002) or a
//! reference count (`refcount`, the kernel before the seed).
//! `uretprobe-entry`'s `uprobe-core` is the engine's default return
//! probe (a pending return holds nothing of the probe: it names its
//! switch), `uprobe-core+lease` the same probe with each pending return
//! holding an SRCU lease (the engine's default before, seed 002's
//! scheme), and `uprobe-core+time` a timing probe (`Uprobe::time_into`)
//! on the same function.

use std::num::NonZeroUsize;

use uprobe_core::testing::{Pinning, ReturnHold, set_in_flight_pinning, set_return_hold};

use super::calls::Calls;
use super::tally;
use super::uprobe::{KernelUprobe, bench_k_entry, bench_u_entry};
use crate::harness::{Scenario, Workload};

core::arch::global_asm!(
    ".text",
    ".globl bench_u_rnop",
    ".type bench_u_rnop, %function",
    "bench_u_rnop:",
    "nop",
    "ret",
    ".size bench_u_rnop, . - bench_u_rnop",
    // The kernel's copy (its uprobe writes its own int3 into the page).
    ".globl bench_k_rnop",
    ".type bench_k_rnop, %function",
    "bench_k_rnop:",
    "nop",
    "ret",
    ".size bench_k_rnop, . - bench_k_rnop",
);

unsafe extern "C" {
    fn bench_u_rnop();
    fn bench_k_rnop();
}

pub const NOP: Scenario = Scenario {
    name: "uretprobe-nop",
    about: "call a function (nop; ret) with a return probe, one counting return handler, an in-flight limit (uprobe-core: its account pins the probe on 0 -> 1, seed 003; +get-put: a reference per pending return)",
    impls: &["uprobe-core", "uprobe-core+get-put", "kernel", "none"],
    build: build_nop,
    lists: &[],
};

pub const LIFETIME: Scenario = Scenario {
    name: "uretprobe-lifetime",
    about: "uretprobe-nop without the in-flight limit, each pending return holding an SRCU lease on its probe (lease, seed 002) or a reference count (refcount)",
    impls: &["lease", "refcount"],
    build: build_lifetime,
    lists: &[],
};

pub const ENTRY: Scenario = Scenario {
    name: "uretprobe-entry",
    about: "call uprobe-entry's function (a real prologue: push rbp; mov rbp, rsp; push rbx; ...; on aarch64 a frame record pushed) with a return probe, one counting return handler: uprobe-core enters through a jump and returns through the plain-code trampoline (no signal at all), its pending return holding nothing of the probe; +lease: holding an SRCU lease on it (seed 002's scheme); +trap enters by a breakpoint; +time: a timing probe instead (no handler: each call counted and its time to return added to a log2 histogram, by the entry routine and the return trampoline themselves); the kernel's uretprobe",
    impls: &[
        "uprobe-core",
        "uprobe-core+lease",
        "uprobe-core+time",
        "uprobe-core+trap",
        "kernel",
        "none",
    ],
    build: build_entry,
    lists: &[],
};

/// A counting return probe on `target`, as implementation `imp` asks
/// (`limit`: with an in-flight account).
fn engine_probe(
    imp: &str,
    target: unsafe extern "C" fn(),
    limit: bool,
) -> Result<Box<dyn Workload>, String> {
    // Counted in a thread-local cell, as the probe scenarios' consumers
    // are (`tally`).
    let mut probe =
        super::uprobe::engine_probe(imp, target as *const () as usize)?.on_return(|_| tally::add());
    if limit {
        // Never reached: the account counts, it does not refuse.
        probe = probe.max_active(NonZeroUsize::new(1 << 20).expect("non-zero"));
    }
    let probe = probe.attach().map_err(|e| e.to_string())?;
    Ok(Box::new(Calls {
        target,
        guard: (probe, tally::ended()),
        check: |(probe, before), ops| {
            let returns = probe.returns();
            if returns >= ops && tally::ended() - before == returns && probe.missed_returns() == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{returns} returns ({} missed) for {ops} calls",
                    probe.missed_returns()
                ))
            }
        },
    }))
}

/// The kernel's uretprobe on `target`, or the unprobed call.
fn other(
    imp: &str,
    target: unsafe extern "C" fn(),
    kernels: unsafe extern "C" fn(),
) -> Result<Box<dyn Workload>, String> {
    match imp {
        "kernel" => Ok(Box::new(Calls {
            target: kernels,
            guard: KernelUprobe::attach(kernels as *const () as usize, true)?,
            check: |probe, ops| match probe.count() {
                Some(n) if n >= ops => Ok(()),
                n => Err(format!("kernel uretprobe counted {n:?} for {ops} calls")),
            },
        })),
        "none" => Ok(Box::new(Calls {
            target,
            guard: (),
            check: |(), _| Ok(()),
        })),
        _ => unreachable!("unknown implementation {imp}"),
    }
}

/// A timing probe on `target`: its calls counted, and each one's time to
/// return, into cells of its own.
fn timing_probe(target: unsafe extern "C" fn()) -> Result<Box<dyn Workload>, String> {
    use uprobe_core::{LatencyCell, latency_cells};
    let cells: &'static [LatencyCell] =
        Box::leak((0..latency_cells()).map(|_| LatencyCell::new()).collect());
    let probe = super::uprobe::engine_probe("uprobe-core", target as *const () as usize)?
        .time_into(cells)
        .attach()
        .map_err(|e| e.to_string())?;
    Ok(Box::new(Calls {
        target,
        guard: (probe, cells),
        check: |(probe, cells), ops| {
            let returns: u64 = LatencyCell::histogram(cells).iter().sum();
            if probe.hits() >= ops && returns >= ops {
                Ok(())
            } else {
                Err(format!(
                    "{} calls, {returns} timed, for {ops} calls",
                    probe.hits()
                ))
            }
        },
    }))
}

fn build_entry(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    // Set before every build: no return is pending between builds.
    set_return_hold(if imp == "uprobe-core+lease" {
        ReturnHold::Lease
    } else {
        ReturnHold::Nothing
    });
    set_in_flight_pinning(Pinning::OnTransition);
    match imp {
        "uprobe-core" | "uprobe-core+lease" | "uprobe-core+trap" => {
            engine_probe(imp, bench_u_entry, false)
        }
        "uprobe-core+time" => timing_probe(bench_u_entry),
        _ => other(imp, bench_u_entry, bench_k_entry),
    }
}

fn build_nop(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    // The in-flight limit makes every pending return hold a lease.
    set_return_hold(ReturnHold::Nothing);
    set_in_flight_pinning(if imp == "uprobe-core+get-put" {
        Pinning::PerReturn
    } else {
        Pinning::OnTransition
    });
    match imp {
        "uprobe-core" | "uprobe-core+get-put" => engine_probe(imp, bench_u_rnop, true),
        _ => other(imp, bench_u_rnop, bench_k_rnop),
    }
}

fn build_lifetime(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    set_in_flight_pinning(Pinning::OnTransition);
    // Set before every build: no return is pending between builds.
    set_return_hold(match imp {
        "lease" => ReturnHold::Lease,
        "refcount" => ReturnHold::Refcount,
        _ => unreachable!("unknown implementation {imp}"),
    });
    // No in-flight limit: its account is one count all threads charge
    // (seed 003's subject), which would hide how the holds scale.
    engine_probe(imp, bench_u_rnop, false)
}
