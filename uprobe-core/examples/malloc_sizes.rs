//! Counts the calls of `malloc` in this program and histograms their sizes
//! by power of two, while a few threads allocate.
//!
//! ```sh
//! cargo run --release -p uprobe-core --example malloc_sizes
//! ```

#[cfg(target_arch = "x86_64")]
fn main() -> Result<(), uprobe_core::AttachError> {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    /// Calls per size class: bucket `i` counts sizes in `[2^(i-1), 2^i)`
    /// (bucket 0: size 0).
    static BUCKETS: [AtomicU64; 65] = [const { AtomicU64::new(0) }; 65];

    // The handler runs inside the SIGTRAP handler: atomics only.
    let probe = uprobe_core::Uprobe::in_object("libc.so.6", "malloc")?
        .on_entry(|cx| {
            let size = cx.arg(0).unwrap_or(0);
            BUCKETS[(u64::BITS - size.leading_zeros()) as usize].fetch_add(1, Relaxed);
        })
        .attach()?;

    // A workload: a few threads building strings and vectors.
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                let mut keep = Vec::new();
                for i in 0..2_000usize {
                    let words: Vec<String> = (0..(i % 7)).map(|w| format!("{t}-{i}-{w}")).collect();
                    keep.push(words.join(" ").into_bytes());
                    if keep.len() > 64 {
                        keep.clear();
                    }
                }
            });
        }
    });

    let hits = probe.hits();
    drop(probe); // detach before printing the report
    println!("{hits} calls to malloc");
    for (i, b) in BUCKETS.iter().enumerate() {
        let n = b.load(Relaxed);
        if n > 0 {
            let lo = if i == 0 { 0 } else { 1u64 << (i - 1) };
            // Two marks per doubling.
            let bar = "#".repeat(2 * (u64::BITS - n.leading_zeros()) as usize);
            println!("{lo:>10} B .. : {n:>8} {bar}");
        }
    }
    Ok(())
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("uprobe-core's engine runs on x86-64 only so far");
}
