//! The clock timing probes read at a call's entry and at its return
//! ([`Uprobe::time_into`](crate::Uprobe::time_into)), in *ticks*, and
//! how a difference of ticks converts to nanoseconds.
//!
//! On x86-64, where the kernel itself keeps time with the TSC (its
//! clocksource is `tsc`: constant, non-stop, synchronised between CPUs),
//! a tick is a TSC cycle, read with `rdtsc` by the trampolines as well
//! as here, and converted as `ticks * mult >> 32` (`mult` measured once
//! against `CLOCK_MONOTONIC_RAW`, as [`Scale`]). On aarch64 a tick is a
//! count of the generic timer's virtual counter (`CNTVCT_EL0`, which the
//! kernel keeps time with and lets user code read: its vDSO does), at
//! the frequency `CNTFRQ_EL0` gives, converted the same way. Elsewhere a
//! tick is a nanosecond of `CLOCK_MONOTONIC` (`clock_gettime`, a system
//! call where there is no vDSO).
//!
//! The choice is made once, at the first attach of a timing probe
//! ([`init`]), before any hit reads the clock.

use std::sync::OnceLock;

use pcpu::unstable::time::clock_ns;

/// How counter ticks (TSC cycles, generic timer counts) convert to
/// nanoseconds: `ns = ticks * mult >> 32`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scale {
    pub(crate) mult: u64,
}

/// The counter's scale, where ticks are counter ticks (x86-64: where the
/// TSC is the kernel's clocksource; aarch64: always); `None` until
/// [`init`], or where ticks are nanoseconds.
static COUNTER: OnceLock<Option<Scale>> = OnceLock::new();

/// Decides the clock, once (x86-64: measures the TSC against
/// `CLOCK_MONOTONIC_RAW` for about a millisecond). Not async-signal-safe.
pub(crate) fn init() {
    COUNTER.get_or_init(measure_counter);
}

/// The counter's scale, when ticks are TSC cycles or generic timer
/// counts (after [`init`]). Async-signal-safe.
pub(crate) fn counter() -> Option<Scale> {
    COUNTER.get().copied().flatten()
}

/// Now, in ticks. Async-signal-safe.
#[inline]
pub(crate) fn now() -> u64 {
    #[cfg(target_arch = "x86_64")]
    if counter().is_some() {
        // SAFETY: `rdtsc` has no preconditions (user mode may run it
        // wherever the kernel keeps time with it).
        return unsafe { core::arch::x86_64::_rdtsc() };
    }
    #[cfg(target_arch = "aarch64")]
    if counter().is_some() {
        let ticks: u64;
        // SAFETY: the kernel lets EL0 read the virtual counter (or
        // emulates the read where an erratum makes it trap).
        unsafe {
            core::arch::asm!("mrs {}, cntvct_el0", out(reg) ticks, options(nomem, nostack, preserves_flags));
        }
        return ticks;
    }
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `ticks` in nanoseconds. Async-signal-safe.
#[inline]
pub(crate) fn nanos(ticks: u64) -> u64 {
    match counter() {
        Some(s) => ((u128::from(ticks) * u128::from(s.mult)) >> 32) as u64,
        None => ticks,
    }
}

#[cfg(target_arch = "x86_64")]
fn measure_counter() -> Option<Scale> {
    let source =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .ok()?;
    if source.trim() != "tsc" {
        return None;
    }
    // SAFETY: as in `now`.
    let tsc = || unsafe { core::arch::x86_64::_rdtsc() };
    let (t0, c0) = (clock_ns(libc::CLOCK_MONOTONIC_RAW), tsc());
    let (mut t1, mut c1) = (t0, c0);
    while t1.wrapping_sub(t0) < 1_000_000 {
        (t1, c1) = (clock_ns(libc::CLOCK_MONOTONIC_RAW), tsc());
    }
    let (ns, cycles) = (t1 - t0, c1.checked_sub(c0)?);
    (cycles > 0).then(|| Scale {
        mult: ((u128::from(ns) << 32) / u128::from(cycles)) as u64,
    })
}

/// The generic timer's frequency, from `CNTFRQ_EL0` (set by firmware,
/// which the kernel's own timekeeping trusts too).
#[cfg(target_arch = "aarch64")]
fn measure_counter() -> Option<Scale> {
    let hz: u64;
    // SAFETY: `CNTFRQ_EL0` is readable at EL0.
    unsafe {
        core::arch::asm!("mrs {}, cntfrq_el0", out(reg) hz, options(nomem, nostack, preserves_flags));
    }
    (hz > 0).then(|| Scale {
        mult: ((1_000_000_000u128 << 32) / u128::from(hz)) as u64,
    })
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn measure_counter() -> Option<Scale> {
    None
}
