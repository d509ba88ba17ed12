//! The benchmark's alternative table locks (`percpu-rwsem`, `RwLock`) keep the
//! engine correct: attach/detach under concurrent callers in each mode.
//! Its own binary: the mode is process-wide.
// The switches exist with the `bench-variants` feature (enabled in the
// workspace by the benches package).
#![cfg(all(target_arch = "x86_64", feature = "bench-variants"))]

mod common;

use uprobe_core::testing::{Lookup, set_lookup};

core::arch::global_asm!(
    ".text",
    ".globl m_func",
    "m_func:",
    "push rbx",
    "lea rax, [rdi + 1]",
    "pop rbx",
    "ret"
);

unsafe extern "C" {
    fn m_func(x: u64) -> u64;
}

#[test]
fn every_lookup_mode_survives_attach_and_detach_under_load() {
    for mode in [Lookup::PercpuRwsem, Lookup::RwLock, Lookup::Srcu] {
        set_lookup(mode);
        assert_eq!(uprobe_core::testing::lookup(), mode);
        common::churn_under_callers(m_func, |x| x + 1, 2, 100);
    }
}
