//! The engine's service threads come and go with return probes: with none
//! attached (and no lease left), the return service, the lease expiry and
//! the SRCU reclaimer threads end; the next return probe starts them
//! again. Its own test binary: other tests' probes would keep them.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use uprobe_core::Uprobe;

#[unsafe(no_mangle)]
#[inline(never)]
extern "C" fn quiet_target(x: u64) -> u64 {
    core::hint::black_box(x) + 1
}

/// The engine's threads in this process, by name.
fn engine_threads() -> Vec<String> {
    let names = ["uprobe-returns", "srcu-lease-expi", "srcu-reclaim"];
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| names.contains(&c.as_str()))
        .collect()
}

/// Waits (at most 10 s) until the engine has no thread left.
fn wait_until_quiet() -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = engine_threads();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn service_threads_end_with_the_last_return_probe() {
    for round in 0..2 {
        let returns = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&returns);
        let probe = Uprobe::function("quiet_target")
            .unwrap()
            .on_return(move |_| {
                seen.fetch_add(1, SeqCst);
            })
            .attach()
            .unwrap();
        assert_eq!(quiet_target(round), round + 1);
        assert_eq!(returns.load(SeqCst), 1, "round {round}");
        assert!(
            engine_threads().iter().any(|t| t == "uprobe-returns"),
            "round {round}: {:?}",
            engine_threads()
        );
        probe.detach().unwrap();
        assert_eq!(wait_until_quiet(), Vec::<String>::new(), "round {round}");
    }
}
