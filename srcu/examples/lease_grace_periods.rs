//! How long `synchronize()` takes while only leases are held, far past
//! their timeout: in fresh slots (a block per round) and in reused ones
//! (one block whose slots were leased and consumed before), with no plain
//! read section open. Prints the durations against 3x the timeout, the
//! leases' promise.
//!
//! ```text
//! cargo run --release -p srcu --example lease_grace_periods [TIMEOUT_MS] [ROUNDS]
//! ```

use std::time::{Duration, Instant};

use srcu::{LeaseSet, Srcu, SrcuCell};

fn main() {
    let mut args = std::env::args().skip(1);
    let timeout = Duration::from_millis(args.next().map_or(20, |a| a.parse().expect("TIMEOUT_MS")));
    let rounds: usize = args.next().map_or(20, |a| a.parse().expect("ROUNDS"));
    let domain: &'static Srcu = Box::leak(Box::new(Srcu::new()));
    let cell = SrcuCell::new(domain, Some(1u64));
    let set = LeaseSet::with_timeout(domain, timeout);
    let reused = set.block(4);
    for kind in ["fresh slots", "reused slots"] {
        let mut took = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let fresh;
            let block = if kind == "fresh slots" {
                fresh = set.block(4);
                &fresh
            } else {
                // Lease and consume every slot once, so the leases below
                // reuse them.
                let once: Vec<_> = (0..4).map(|_| reused.lease(&cell).unwrap()).collect();
                drop(
                    once.into_iter()
                        .map(srcu::Lease::consume)
                        .collect::<Vec<_>>(),
                );
                &reused
            };
            let held: Vec<_> = (0..4).map(|_| block.lease(&cell).unwrap()).collect();
            let start = Instant::now();
            domain.synchronize();
            took.push(start.elapsed());
            assert!(held.iter().all(srcu::Lease::is_expired));
            drop(held);
        }
        took.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{kind}: {rounds} synchronize() calls with 4 leases held (timeout {} ms): \
             min {:.1} ms, median {:.1} ms, max {:.1} ms; 3x the timeout = {} ms; {} over",
            timeout.as_millis(),
            ms(took[0]),
            ms(took[took.len() / 2]),
            ms(took[took.len() - 1]),
            3 * timeout.as_millis(),
            took.iter().filter(|d| **d > timeout * 3).count(),
        );
    }
}
