//! Backing off while waiting (for readers, or for the grace-period lock):
//! spin, then yield, then sleep with a growing delay.

#[cfg(not(pcpu_loom))]
use std::time::Duration;

/// Waiting for readers: spin, then yield, then sleep with a growing delay
/// (1 us to 1 ms; `expedited`: never sleep).
#[cfg(not(pcpu_loom))]
pub(super) fn backoff(round: u32, expedited: bool) {
    if round < 64 {
        for _ in 0..1u32 << round.min(6) {
            std::hint::spin_loop();
        }
    } else if expedited || round < 128 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(1u64 << (round - 128).min(10)));
    }
}

/// loom: a waiting loop must let the model run other threads.
#[cfg(pcpu_loom)]
pub(super) fn backoff(_round: u32, _expedited: bool) {
    loom::thread::yield_now();
}
