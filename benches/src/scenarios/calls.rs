//! `Calls`: the workload of every probe scenario, a loop calling the
//! probed function while a guard keeps the probe attached.

use crate::harness::Workload;

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
