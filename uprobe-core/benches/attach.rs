//! The cost of attaching and detaching many probes: `attach_all` and
//! `detach_all` of N probes at distinct addresses (N = 100, 1,000,
//! 10,000), and one `attach` (alone, and with its `detach`) while 10,000
//! others stay attached; and (x86-64, where the system has libz) one
//! attach and detach at an instruction inside libz's functions while
//! every other instruction of them is probed: each takes a jump, and
//! takes back and plans again the neighbours whose punned jumps end in
//! its bytes:
//!
//! ```sh
//! cargo bench -p uprobe-core --bench attach
//! ```
//!
//! The many-probe targets are one-byte `nop`s in fresh executable memory:
//! each is an instruction boundary, emulated on a hit, so the figures are
//! the engine's own bookkeeping and patching, not the decoder's or the
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
        drop(others);
        #[cfg(target_arch = "x86_64")]
        libz_interior(&mut g);
        g.finish();
    }

    /// One attach and detach at a time over libz's interior instructions,
    /// cycling over one in ten of them, while every other instruction of
    /// libz's exported functions stays probed.
    #[cfg(target_arch = "x86_64")]
    fn libz_interior(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
        let name = c"libz.so.1";
        // SAFETY: dlopen of a system library by name (kept loaded).
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        if handle.is_null() {
            println!("libz.so.1 is not on this system: its interior case is skipped");
            return;
        }
        // SAFETY: a symbol lookup on a live handle; dladdr fills `info`.
        let (path, bias) = unsafe {
            let any = libc::dlsym(handle, c"compress2".as_ptr());
            let mut info: libc::Dl_info = std::mem::zeroed();
            assert!(libc::dladdr(any, &raw mut info) != 0, "dladdr");
            let path = std::ffi::CStr::from_ptr(info.dli_fname).to_string_lossy();
            (path.into_owned(), info.dli_fbase as usize)
        };
        let bytes = std::fs::read(&path).expect("libz's file");
        let sites: Vec<usize> = uprobe_core::testing::objects::exported_instructions(&bytes)
            .iter()
            .filter(|(_, offset, _)| *offset > 0)
            .map(|&(_, _, addr)| bias + addr as usize)
            .collect();
        let held_out: Vec<usize> = sites.iter().skip(5).step_by(10).copied().collect();
        let others = sites.iter().enumerate().filter(|(k, _)| k % 10 != 5);
        // SAFETY: every address starts one of libz's instructions.
        let probe = |addr: usize| unsafe { Uprobe::address(addr) };
        let others =
            Uprobe::attach_all(others.map(|(_, &a)| probe(a))).expect("attach libz's interior");
        let mut next = 0;
        let mut one = || {
            next += 1;
            probe(held_out[next % held_out.len()])
        };
        let id = format!(
            "attach+detach one libz interior site, {} attached",
            others.len()
        );
        g.bench_function(id, |b| {
            b.iter(|| one().attach().expect("attach").detach().expect("detach"));
        });
        let id = format!("attach one libz interior site, {} attached", others.len());
        g.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let probe = one();
                    let start = Instant::now();
                    let p = probe.attach().expect("attach");
                    spent += start.elapsed();
                    p.detach().expect("detach");
                }
                spent
            });
        });
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
