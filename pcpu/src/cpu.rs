//! Which CPU the calling thread runs on, and how many CPUs can ever exist.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The CPU the calling thread is running on right now.
///
/// Reads the `cpu_id` field of glibc's registered rseq area (one load);
/// where glibc registered no rseq area (glibc older than 2.35,
/// `GLIBC_TUNABLES=glibc.pthread.rseq=0`, qemu-user) or this thread's
/// registration failed, it calls `sched_getcpu()` (a vDSO call, several
/// times slower).
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
        rseq_cpu().unwrap_or_else(sched_getcpu)
    }
}

/// The CPU id from this thread's rseq area, if glibc registered one.
/// Async-signal-safe.
#[cfg(not(pcpu_loom))]
#[inline]
fn rseq_cpu() -> Option<usize> {
    let id = crate::rseq_area::read_cpu_id(crate::rseq_area::offset()?);
    // -1 (not registered yet) and -2 (registration failed) are negative:
    // the caller takes its slow path for those.
    (id < 0x8000_0000).then_some(id as usize)
}

/// The CPU id [`PerCpu`](crate::PerCpu) picks the calling thread's slot
/// by: [`current_cpu()`] wherever that costs a load or a vDSO call. Where
/// it would cost a system call (no rseq area, on an architecture without
/// a vDSO `getcpu`: aarch64 among them), the id this thread read last,
/// read again every 64 calls: a slot is then "its CPU's" only
/// approximately, which costs contention at worst (every slot is written
/// atomically on that path), never correctness. Async-signal-safe (a
/// `const`-initialised thread-local without a destructor).
#[inline]
pub(crate) fn slot_cpu() -> usize {
    #[cfg(any(pcpu_loom, target_arch = "x86_64"))]
    {
        current_cpu()
    }
    #[cfg(not(any(pcpu_loom, target_arch = "x86_64")))]
    {
        rseq_cpu().unwrap_or_else(cached_cpu)
    }
}

/// How many calls of [`slot_cpu`] reuse the id it read with a system call.
#[cfg(not(any(pcpu_loom, target_arch = "x86_64")))]
const HINT_USES: u64 = 64;

/// [`sched_getcpu()`], asked once every `HINT_USES` calls per thread.
/// A signal handler that runs between the load and the store below only
/// makes the id it stored be replaced: a hint either way.
/// Async-signal-safe.
#[cfg(not(any(pcpu_loom, target_arch = "x86_64")))]
fn cached_cpu() -> usize {
    use std::cell::Cell;
    std::thread_local! {
        /// The id read last (high half) and the uses it has left (low).
        static HINT: Cell<u64> = const { Cell::new(0) };
    }
    HINT.with(|hint| {
        let v = hint.get();
        if v & 0xffff_ffff != 0 {
            hint.set(v - 1);
            return (v >> 32) as usize;
        }
        let cpu = sched_getcpu();
        hint.set((cpu as u64) << 32 | (HINT_USES - 1));
        cpu
    })
}

/// `sched_getcpu()`, or CPU 0 where the call fails (it cannot on Linux
/// with a vDSO; the fallback keeps callers' indexing total).
/// Async-signal-safe.
#[cfg(not(any(pcpu_loom, miri)))]
#[inline]
#[must_use]
pub fn sched_getcpu() -> usize {
    // SAFETY: sched_getcpu has no preconditions.
    let id = unsafe { libc::sched_getcpu() };
    usize::try_from(id).unwrap_or(0)
}

/// Under Miri, which has no `sched_getcpu`: a thread that migrates at
/// every call, to a CPU of its affinity mask (Miri's CPUs,
/// `-Zmiri-num-cpus`, narrowed by `sched_setaffinity`) drawn from a
/// per-thread sequence. A thread may be moved between any two
/// instructions, and the generic paths must hold when it is; a thread
/// pinned to one CPU stays there.
#[cfg(all(miri, not(pcpu_loom)))]
#[must_use]
pub fn sched_getcpu() -> usize {
    use core::cell::Cell;
    std::thread_local! {
        static NEXT: Cell<u64> = const { Cell::new(0) };
    }
    let draw = NEXT.with(|next| {
        let mut x = next.get();
        if x == 0 {
            // A different start for each thread: where its cell is.
            x = (core::ptr::from_ref(next) as u64) | 1;
        }
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        next.set(x);
        x
    });
    // SAFETY: `cpu_set_t` is plain data, which the call only writes.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    // SAFETY: the calling thread's mask, into `set`, of the size passed.
    let got = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &raw mut set) };
    // SAFETY: ids below `CPU_SETSIZE` are within `set`.
    let allowed = |cpu: &usize| got == 0 && unsafe { libc::CPU_ISSET(*cpu, &set) };
    // Miri's CPUs, which are all there are (see `possible_cpus`).
    let cpus: Vec<usize> = (0..possible_cpus().min(libc::CPU_SETSIZE as usize))
        .filter(allowed)
        .collect();
    if cpus.is_empty() {
        return (draw % possible_cpus() as u64) as usize;
    }
    cpus[(draw % cpus.len() as u64) as usize]
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
    // Under Miri, its own CPUs (`-Zmiri-num-cpus`), not the host's.
    let possible = if cfg!(miri) {
        None
    } else {
        std::fs::read_to_string("/sys/devices/system/cpu/possible").ok()
    };
    let n = possible
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
