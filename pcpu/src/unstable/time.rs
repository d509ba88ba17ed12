//! The monotonic clock, read the one way the family reads it.

/// Nanoseconds of `clock` (a `CLOCK_MONOTONIC*` id) since an unspecified
/// start, wrapping. `clock_gettime` is async-signal-safe (a vDSO call
/// where the kernel offers one, a system call otherwise).
#[must_use]
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes one `timespec`, which `ts` is; the
    // monotonic clocks always exist on Linux, so it cannot fail.
    unsafe { libc::clock_gettime(clock, &raw mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// Nanoseconds of `CLOCK_MONOTONIC`. Async-signal-safe.
#[must_use]
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_never_goes_back() {
        let a = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = monotonic_ns();
        assert!(b - a >= 2_000_000, "{a} then {b}");
        // Miri knows CLOCK_MONOTONIC, not the raw clock.
        if cfg!(not(miri)) {
            assert!(clock_ns(libc::CLOCK_MONOTONIC_RAW) > 0);
        }
    }
}
