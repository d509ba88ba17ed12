//! The cost of a probe hit and of a return-probe hit, to compare the
//! default build with one that has the `bench-variants` switches compiled
//! in (they must cost nothing on the default path):
//!
//! ```sh
//! cargo bench -p uprobe-core --bench hit -- --save-baseline plain
//! cargo bench -p uprobe-core --bench hit --features bench-variants -- --baseline plain
//! ```
//!
//! `uprobe-jump`: a trap-free hit (a 5-byte nop at the entry, one counting
//! consumer; and a counting probe, which its trampoline counts itself)
//! against the bare call of the same function, and an entry and return
//! through a jump on a real prologue (a return probe with one counting
//! handler; a timing probe):
//!
//! ```sh
//! cargo bench -p uprobe-core --bench hit -- uprobe-jump
//! ```

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    use criterion::Criterion;

    core::arch::global_asm!(
        ".text",
        ".globl hit_nop",
        "hit_nop:",
        "nop",
        "ret",
        ".globl hit_rnop",
        "hit_rnop:",
        "nop",
        "ret",
        ".globl hit_nop5",
        ".type hit_nop5, @function",
        "hit_nop5:",
        ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
        "ret",
        ".size hit_nop5, . - hit_nop5",
        ".globl hit_cnt5",
        ".type hit_cnt5, @function",
        "hit_cnt5:",
        ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
        "ret",
        ".size hit_cnt5, . - hit_cnt5",
        ".globl hit_bare5",
        ".type hit_bare5, @function",
        "hit_bare5:",
        ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
        "ret",
        ".size hit_bare5, . - hit_bare5",
        ".globl hit_entry",
        ".type hit_entry, @function",
        "hit_entry:",
        "push rbp",
        "mov rbp, rsp",
        "push rbx",
        "mov rbx, rdi",
        "lea rax, [rbx + 1]",
        "pop rbx",
        "pop rbp",
        "ret",
        ".size hit_entry, . - hit_entry",
        ".globl hit_timed",
        ".type hit_timed, @function",
        "hit_timed:",
        "push rbp",
        "mov rbp, rsp",
        "push rbx",
        "mov rbx, rdi",
        "lea rax, [rbx + 1]",
        "pop rbx",
        "pop rbp",
        "ret",
        ".size hit_timed, . - hit_timed",
    );

    unsafe extern "C" {
        fn hit_nop();
        fn hit_rnop();
        fn hit_nop5();
        fn hit_bare5();
        fn hit_cnt5();
        fn hit_entry();
        fn hit_timed();
    }

    /// Hits the trap-free consumer counted.
    static COUNT: AtomicU64 = AtomicU64::new(0);

    pub fn jumps(c: &mut Criterion) {
        let mut g = c.benchmark_group("uprobe-jump");
        // SAFETY: the asm functions take nothing and touch only the stack.
        g.bench_function("bare call", |b| b.iter(|| unsafe { hit_bare5() }));
        let probe = uprobe_core::Uprobe::at(hit_nop5 as *const () as usize)
            .expect("symbol")
            .on_entry(|_| {
                COUNT.fetch_add(1, Relaxed);
            })
            .attach()
            .expect("attach");
        assert!(probe.mode().is_jump(), "{:?}", probe.mode());
        g.bench_function("nop5 hit, one counting consumer", |b| {
            // SAFETY: as above.
            b.iter(|| unsafe { hit_nop5() });
        });
        // No handler: the trampoline counts the hit itself.
        let counting = uprobe_core::Uprobe::at(hit_cnt5 as *const () as usize)
            .expect("symbol")
            .attach()
            .expect("attach");
        g.bench_function("nop5 hit, counting probe", |b| {
            // SAFETY: as above.
            b.iter(|| unsafe { hit_cnt5() });
        });
        let ret = uprobe_core::Uprobe::at(hit_entry as *const () as usize)
            .expect("symbol")
            .on_return(|_| {
                COUNT.fetch_add(1, Relaxed);
            })
            .attach()
            .expect("attach");
        assert!(ret.mode().is_jump(), "{:?}", ret.mode());
        g.bench_function("prologue entry+return", |b| {
            // SAFETY: as above.
            b.iter(|| unsafe { hit_entry() });
        });
        // A timing probe: the call counted and timed by the trampoline's
        // routines themselves.
        let cells: &'static [uprobe_core::LatencyCell] = Box::leak(
            (0..uprobe_core::latency_cells())
                .map(|_| uprobe_core::LatencyCell::new())
                .collect(),
        );
        let timed = uprobe_core::Uprobe::at(hit_timed as *const () as usize)
            .expect("symbol")
            .time_into(cells)
            .attach()
            .expect("attach");
        assert!(timed.mode().is_jump(), "{:?}", timed.mode());
        g.bench_function("prologue entry+return, timing probe", |b| {
            // SAFETY: as above.
            b.iter(|| unsafe { hit_timed() });
        });
        g.finish();
        drop((probe, counting, ret, timed));
    }

    pub fn hits(c: &mut Criterion) {
        let mut g = c.benchmark_group("uprobe-hit");
        // SAFETY: a function's address starts an instruction.
        let entry = unsafe { uprobe_core::Uprobe::address(hit_nop as *const () as usize) }
            .on_entry(|_| {})
            .attach()
            .expect("attach the entry probe");
        // SAFETY: as above.
        let ret = unsafe { uprobe_core::Uprobe::address(hit_rnop as *const () as usize) }
            .on_return(|_| {})
            .max_active(std::num::NonZeroUsize::new(1 << 20).expect("non-zero"))
            .attach()
            .expect("attach the return probe");
        // SAFETY: the asm functions take nothing and touch only the stack.
        g.bench_function("entry", |b| b.iter(|| unsafe { hit_nop() }));
        // SAFETY: as above.
        g.bench_function("entry+return", |b| b.iter(|| unsafe { hit_rnop() }));
        g.finish();
        drop((entry, ret));
    }
}

#[cfg(target_arch = "x86_64")]
criterion::criterion_group! {
    name = benches;
    config = criterion::Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(3));
    targets = x86::hits, x86::jumps
}
#[cfg(target_arch = "x86_64")]
criterion::criterion_main!(benches);

#[cfg(not(target_arch = "x86_64"))]
fn main() {}
