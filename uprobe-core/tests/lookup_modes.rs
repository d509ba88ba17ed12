//! The benchmark's alternative table locks (`percpu-rwsem`, `RwLock`) keep the
//! engine correct: attach/detach under concurrent callers in each mode.
//! Its own binary: the mode is process-wide.
#![cfg(target_arch = "x86_64")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use common::{call, fn_addr, probe_at};
use uprobe_core::bench_only::{Lookup, set_lookup};

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
    static RUNS: AtomicU64 = AtomicU64::new(0);
    for mode in [Lookup::PercpuRwsem, Lookup::RwLock, Lookup::Srcu] {
        set_lookup(mode);
        assert_eq!(uprobe_core::bench_only::lookup(), mode);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let stop = &stop;
                s.spawn(move || {
                    let mut x = t;
                    while !stop.load(SeqCst) {
                        assert_eq!(call(m_func, x), x + 1);
                        x = x.wrapping_add(2) % 1_000_000;
                    }
                });
            }
            for _ in 0..100 {
                let probe = probe_at(fn_addr(m_func))
                    .on_entry(|_| {
                        RUNS.fetch_add(1, SeqCst);
                    })
                    .attach()
                    .unwrap();
                assert_eq!(call(m_func, 1), 2);
                assert!(probe.hits() >= 1, "{mode:?}");
                probe.detach().unwrap();
                let after = RUNS.load(SeqCst);
                std::thread::yield_now();
                assert_eq!(
                    RUNS.load(SeqCst),
                    after,
                    "{mode:?}: a handler ran after detach"
                );
            }
            stop.store(true, SeqCst);
        });
    }
}
