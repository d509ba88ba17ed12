//! `uretprobe-nop`: a call to a function whose return is probed, with the
//! engine's return probe (`uprobe-core`: an entry trap, then the plain-code
//! return trampoline, with an in-flight limit whose account pins the probe
//! on 0 -> 1 only; `uprobe-core+get-put`: a reference per pending return
//! instead, seed 003's before), a kernel uretprobe (`kernel`, on its own
//! copy of the function), and unprobed (`none`). `uretprobe-lifetime`: the engine's
//! return probe with each pending return holding an SRCU lease on the
//! probe (`lease`, seed 002) or a reference count (`refcount`, the kernel
//! before the seed).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use std::num::NonZeroUsize;

use uprobe_core::bench_only::{Pinning, ReturnHold, set_in_flight_pinning, set_return_hold};

use super::uprobe::{Calls, KernelUprobe};
use crate::harness::{Scenario, Workload};

core::arch::global_asm!(
    ".text",
    ".globl bench_u_rnop",
    "bench_u_rnop:",
    "nop",
    "ret",
    // The kernel's copy (its uprobe writes its own int3 into the page).
    ".globl bench_k_rnop",
    "bench_k_rnop:",
    "nop",
    "ret",
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
};

pub const LIFETIME: Scenario = Scenario {
    name: "uretprobe-lifetime",
    about: "uretprobe-nop with each pending return holding an SRCU lease on its probe (lease, seed 002) or a reference count (refcount)",
    impls: &["lease", "refcount"],
    build: build_lifetime,
};

/// Return handlers run.
static RETURNS: AtomicU64 = AtomicU64::new(0);

fn engine_probe() -> Result<Box<dyn Workload>, String> {
    RETURNS.store(0, Relaxed);
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(bench_u_rnop as *const () as usize) }
        .on_return(|_| {
            RETURNS.fetch_add(1, Relaxed);
        })
        // Never reached: the account counts, it does not refuse.
        .max_active(NonZeroUsize::new(1 << 20).expect("non-zero"))
        .attach()
        .map_err(|e| e.to_string())?;
    Ok(Box::new(Calls {
        target: bench_u_rnop,
        guard: probe,
        check: |probe, ops| {
            let returns = probe.returns();
            if returns >= ops && RETURNS.load(Relaxed) == returns && probe.missed_returns() == 0 {
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

fn build_nop(imp: &str, _threads: usize) -> Result<Box<dyn Workload>, String> {
    set_return_hold(ReturnHold::Lease);
    set_in_flight_pinning(if imp == "uprobe-core+get-put" {
        Pinning::PerReturn
    } else {
        Pinning::OnTransition
    });
    match imp {
        "uprobe-core" | "uprobe-core+get-put" => engine_probe(),
        "kernel" => Ok(Box::new(Calls {
            target: bench_k_rnop,
            guard: KernelUprobe::attach(bench_k_rnop as *const () as usize, true)?,
            check: |probe, ops| match probe.count() {
                Some(n) if n >= ops => Ok(()),
                n => Err(format!("kernel uretprobe counted {n:?} for {ops} calls")),
            },
        })),
        "none" => Ok(Box::new(Calls {
            target: bench_u_rnop,
            guard: (),
            check: |(), _| Ok(()),
        })),
        _ => unreachable!("unknown implementation {imp}"),
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
    engine_probe()
}
