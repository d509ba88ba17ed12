//! Times every `write` of this program with a return probe session: the
//! entry handler stores the start time as the call's cookie, the return
//! handler reads it back with the return value and histograms the latency
//! by power of two of nanoseconds.
//!
//! ```sh
//! cargo run --release -p uprobe-core --example write_latency
//! ```

#[cfg(target_arch = "x86_64")]
fn main() -> Result<(), uprobe_core::AttachError> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    /// Calls per latency class: bucket `i` counts `[2^(i-1), 2^i)` ns.
    static BUCKETS: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];
    static BYTES: AtomicU64 = AtomicU64::new(0);

    /// Monotonic nanoseconds: `clock_gettime` is async-signal-safe.
    fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: writes one timespec we own.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    // Both handlers run in signal context (and the trampoline): atomics
    // and async-signal-safe calls only.
    let probe = uprobe_core::Uprobe::in_object("libc.so.6", "write")?
        .on_entry(|cx| cx.set_cookie(now_ns()))
        .on_return(|cx| {
            let ns = now_ns().saturating_sub(cx.cookie());
            BUCKETS[(u64::BITS - ns.leading_zeros()).min(63) as usize].fetch_add(1, Relaxed);
            // write returns the byte count, or -1.
            if let Ok(n) = u64::try_from(cx.return_value() as i64) {
                BYTES.fetch_add(n, Relaxed);
            }
        })
        .attach()?;

    // A workload: writes of growing size to /dev/null.
    let mut sink = std::fs::File::create("/dev/null").expect("open /dev/null");
    let buf = vec![b'x'; 1 << 16];
    for i in 0..20_000usize {
        sink.write_all(&buf[..=(i * 37) % buf.len()])
            .expect("write to /dev/null");
    }

    let (calls, returns) = (probe.hits(), probe.returns());
    drop(probe);
    println!(
        "{calls} writes, {returns} returns seen, {} bytes",
        BYTES.load(Relaxed)
    );
    for (i, b) in BUCKETS.iter().enumerate() {
        let n = b.load(Relaxed);
        if n > 0 {
            let lo = if i == 0 { 0 } else { 1u64 << (i - 1) };
            println!("{lo:>12} ns .. : {n}");
        }
    }
    Ok(())
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("this example needs the x86-64 engine");
}
