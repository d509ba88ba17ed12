//! The cost of a probe hit and of a return-probe hit, to compare the
//! default build with one that has the `bench-variants` switches compiled
//! in (they must cost nothing on the default path):
//!
//! ```sh
//! cargo bench -p uprobe-core --bench hit -- --save-baseline plain
//! cargo bench -p uprobe-core --bench hit --features bench-variants -- --baseline plain
//! ```

#[cfg(target_arch = "x86_64")]
mod x86 {
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
    );

    unsafe extern "C" {
        fn hit_nop();
        fn hit_rnop();
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
    targets = x86::hits
}
#[cfg(target_arch = "x86_64")]
criterion::criterion_main!(benches);

#[cfg(not(target_arch = "x86_64"))]
fn main() {}
