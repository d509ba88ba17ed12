//! The cost of attaching and detaching many probes: `attach_all` and
//! `detach_all` of N probes at distinct addresses (N = 100, 1,000,
//! 10,000), and one `attach` (alone, and with its `detach`) while 10,000
//! others stay attached:
//!
//! ```sh
//! cargo bench -p uprobe-core --bench attach
//! ```
//!
//! The targets are one-byte `nop`s in fresh executable memory: each is an
//! instruction boundary, emulated on a hit, so the figures are the
//! engine's own bookkeeping and patching, not the decoder's or the
//! out-of-line allocator's.

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod many {
    use std::time::{Duration, Instant};

    use criterion::{BenchmarkId, Criterion};
    use uprobe_core::{Probe, Uprobe};

    /// The size of one probe target: x86-64 `nop` is one byte, an A64
    /// instruction four.
    const INSN: usize = if cfg!(target_arch = "x86_64") { 1 } else { 4 };

    /// `n` nops then a return, in fresh executable memory.
    fn nop_sled(n: usize) -> usize {
        let len = (n * INSN + 4).next_multiple_of(4096);
        // SAFETY: a fresh anonymous mapping.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED, "mmap");
        let code = base.cast::<u8>();
        for i in 0..n {
            let at = i * INSN;
            // SAFETY: inside our writable mapping.
            unsafe {
                if INSN == 1 {
                    *code.add(at) = 0x90;
                } else {
                    code.add(at)
                        .copy_from_nonoverlapping(0xd503_201f_u32.to_le_bytes().as_ptr(), 4);
                }
            }
        }
        // SAFETY: as above; then read-execute only.
        unsafe {
            if INSN == 1 {
                *code.add(n) = 0xc3;
            } else {
                code.add(n * INSN)
                    .copy_from_nonoverlapping(0xd65f_03c0_u32.to_le_bytes().as_ptr(), 4);
            }
            assert_eq!(
                libc::mprotect(base, len, libc::PROT_READ | libc::PROT_EXEC),
                0
            );
        }
        base as usize
    }

    fn probes(base: usize, n: usize) -> impl Iterator<Item = Uprobe> {
        // SAFETY: every target is the start of one of the sled's nops.
        (0..n).map(move |i| unsafe { Uprobe::address(base + i * INSN) })
    }

    pub fn attach(c: &mut Criterion) {
        let mut g = c.benchmark_group("uprobe-attach");
        g.sample_size(10);
        for n in [100, 1_000, 10_000] {
            let base = nop_sled(n);
            g.bench_with_input(BenchmarkId::new("attach_all", n), &n, |b, &n| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let start = Instant::now();
                        let attached = Uprobe::attach_all(probes(base, n)).expect("attach");
                        spent += start.elapsed();
                        Probe::detach_all(attached).expect("detach");
                    }
                    spent
                });
            });
            g.bench_with_input(BenchmarkId::new("detach_all", n), &n, |b, &n| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let attached = Uprobe::attach_all(probes(base, n)).expect("attach");
                        let start = Instant::now();
                        Probe::detach_all(attached).expect("detach");
                        spent += start.elapsed();
                    }
                    spent
                });
            });
        }
        let others = Uprobe::attach_all(probes(nop_sled(10_000), 10_000)).expect("attach 10k");
        let one = nop_sled(1);
        g.bench_function("attach+detach one, 10000 attached", |b| {
            b.iter(|| {
                // SAFETY: as in `probes`.
                let p = unsafe { Uprobe::address(one) }.attach().expect("attach");
                p.detach().expect("detach");
            });
        });
        g.bench_function("attach one, 10000 attached", |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    // SAFETY: as in `probes`.
                    let p = unsafe { Uprobe::address(one) }.attach().expect("attach");
                    spent += start.elapsed();
                    p.detach().expect("detach");
                }
                spent
            });
        });
        g.finish();
        drop(others);
    }
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
criterion::criterion_group! {
    name = benches;
    config = criterion::Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = many::attach
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
criterion::criterion_main!(benches);

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn main() {}
