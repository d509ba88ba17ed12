//! Which CPU the calling thread runs on, and how many CPUs can ever exist.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The CPU the calling thread is running on right now.
///
/// Reads the `cpu_id` field of glibc's registered rseq area (one load,
/// about 0.3 ns on x86-64); where glibc registered no rseq area (glibc
/// older than 2.35, `GLIBC_TUNABLES=glibc.pthread.rseq=0`, qemu-user) or
/// this thread's registration failed, it calls `sched_getcpu()` (vDSO,
/// about 3 ns).
///
/// The answer can be stale by the time it is used: the thread may migrate
/// right after the read. Code that needs "still on that CPU" uses the
/// [`rseq`](crate::rseq) operations; code that tolerates migration uses
/// atomic operations on the slot it picked.
///
/// The id may exceed [`possible_cpus()`] on a machine whose CPU set grows
/// (hotplug beyond the boot-time possible mask): [`PerCpu`](crate::PerCpu)
/// maps such ids to its overflow slot.
///
/// **Async-signal-safe**: yes (a memory load, or the vDSO `getcpu`, which
/// takes no lock).
///
/// ```
/// let cpu = pcpu::current_cpu();
/// assert!(cpu < 1 << 20);
/// ```
#[inline]
#[must_use]
pub fn current_cpu() -> usize {
    #[cfg(pcpu_loom)]
    {
        crate::loom_cpu::current()
    }
    #[cfg(not(pcpu_loom))]
    {
        if let Some(off) = crate::rseq_area::offset() {
            let id = crate::rseq_area::read_cpu_id(off);
            // -1 (not registered yet) and -2 (registration failed) are
            // negative: take the slow path for those.
            if id < 0x8000_0000 {
                return id as usize;
            }
        }
        sched_getcpu()
    }
}

/// `sched_getcpu()`, or CPU 0 where the call fails (it cannot on Linux
/// with a vDSO; the fallback keeps callers' indexing total).
/// Async-signal-safe.
#[cfg(not(pcpu_loom))]
#[inline]
#[must_use]
pub fn sched_getcpu() -> usize {
    // SAFETY: sched_getcpu has no preconditions.
    let id = unsafe { libc::sched_getcpu() };
    usize::try_from(id).unwrap_or(0)
}

static POSSIBLE: AtomicUsize = AtomicUsize::new(0);

/// The number of CPU ids that can ever be online: one more than the highest
/// id in `/sys/devices/system/cpu/possible`, or the configured CPU count
/// (`sysconf(_SC_NPROCESSORS_CONF)`) where that file cannot be read.
///
/// This, not `num_cpus::get()` (which follows the affinity mask and the
/// cgroup quota), is the right size for per-CPU arrays: a thread confined
/// to CPUs 6-7 still reports CPU id 7.
///
/// **Async-signal-safe**: only after the first call (which reads a file and
/// allocates); [`PerCpu::new`](crate::PerCpu::new) makes that first call.
///
/// ```
/// assert!(pcpu::possible_cpus() >= 1);
/// ```
#[must_use]
pub fn possible_cpus() -> usize {
    let n = POSSIBLE.load(Ordering::Relaxed);
    if n != 0 {
        return n;
    }
    let n = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse_cpu_list_max(&s))
        .map_or_else(configured_cpus, |max| max + 1);
    POSSIBLE.store(n, Ordering::Relaxed);
    n
}

fn configured_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// The highest id in a kernel CPU list such as `0-3,8-11` or `0`.
fn parse_cpu_list_max(list: &str) -> Option<usize> {
    let mut max = None;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let upper = part.rsplit('-').next()?;
        let id: usize = upper.trim().parse().ok()?;
        max = Some(max.map_or(id, |m: usize| m.max(id)));
    }
    max
}

#[cfg(test)]
mod tests {
    use super::parse_cpu_list_max;

    #[test]
    fn parses_kernel_cpu_lists() {
        assert_eq!(parse_cpu_list_max("0\n"), Some(0));
        assert_eq!(parse_cpu_list_max("0-1\n"), Some(1));
        assert_eq!(parse_cpu_list_max("0-3,8-11"), Some(11));
        assert_eq!(parse_cpu_list_max("0,2,7"), Some(7));
        assert_eq!(parse_cpu_list_max(""), None);
        assert_eq!(parse_cpu_list_max("x-y"), None);
    }
}
