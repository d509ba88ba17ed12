//! Finding glibc's registered rseq area for the calling thread: its offset
//! from the thread pointer, the CPU id the kernel keeps in it, and whether
//! gated adds may use it (rseq fences registered). The floor of the crate:
//! [`current_cpu`](crate::current_cpu), the fences and the rseq operations
//! all read it; it uses no other module.
//!
//! glibc (2.35 and later) registers a `struct rseq` for every thread and
//! exports where it lives as `__rseq_offset` (bytes from the thread pointer)
//! and `__rseq_size` (0 when registration is off, e.g. with
//! `GLIBC_TUNABLES=glibc.pthread.rseq=0`, under qemu-user, or on a kernel
//! without rseq). Both are looked up with `dlsym` once, from a load-time
//! constructor, so that the hot path (and a signal handler) only reads a
//! cached offset.

use core::sync::atomic::{AtomicIsize, Ordering};

/// Offset of `cpu_id` in the kernel's `struct rseq`.
#[cfg_attr(not(pcpu_arch = "aarch64"), allow(dead_code))]
pub(crate) const CPU_ID_OFFSET: usize = 4;
// `rseq_cs` (the pointer to the active critical section) is at offset 8;
// the x86-64 critical sections hard-code it.

/// `__rseq_offset` once known; `UNKNOWN` before the lookup, `UNAVAILABLE`
/// when glibc registers no rseq area.
static OFFSET: AtomicIsize = AtomicIsize::new(UNKNOWN);
const UNKNOWN: isize = isize::MIN;
const UNAVAILABLE: isize = isize::MIN + 1;
// A real offset is a small distance from the thread pointer, never near
// `isize::MIN`.

/// Runs the lookup at load time, before `main` and before any signal
/// handler of the program can run, so [`offset`] never calls `dlsym` from
/// a signal handler.
#[cfg(not(pcpu_loom))]
#[used]
#[unsafe(link_section = ".init_array")]
static LOOKUP_AT_LOAD: extern "C" fn() = {
    extern "C" fn lookup_at_load() {
        let _ = lookup();
    }
    lookup_at_load
};

/// Where this crate cannot read the thread pointer (`pcpu_arch =
/// "generic"`), the rseq area is never used: every per-CPU operation
/// takes its atomic fallback.
#[cfg(pcpu_arch = "generic")]
#[cold]
fn lookup() -> isize {
    OFFSET.store(UNAVAILABLE, Ordering::Relaxed);
    UNAVAILABLE
}

#[cfg(not(pcpu_arch = "generic"))]
#[cold]
fn lookup() -> isize {
    // SAFETY: dlsym with RTLD_DEFAULT and NUL-terminated names is always
    // sound; a null result means the symbol does not exist.
    let (off, size) = unsafe {
        (
            libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr()),
            libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr()),
        )
    };
    let value = if off.is_null() || size.is_null() {
        UNAVAILABLE
    } else {
        // SAFETY: glibc defines `__rseq_offset` as a `const ptrdiff_t` and
        // `__rseq_size` as a `const unsigned int`, both set before any user
        // code runs and never changed afterwards.
        let (off, size) = unsafe { (*off.cast::<isize>(), *size.cast::<u32>()) };
        if size == 0 { UNAVAILABLE } else { off }
    };
    OFFSET.store(value, Ordering::Relaxed);
    value
}

/// The thread pointer (`TPIDR_EL0`); x86-64 addresses the area `%fs`-relative.
#[cfg(pcpu_arch = "aarch64")]
#[inline(always)]
fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: reading TPIDR_EL0 has no side effects.
    unsafe {
        core::arch::asm!("mrs {}, tpidr_el0", out(reg) tp,
            options(nostack, nomem, preserves_flags, pure));
    }
    tp
}

/// `__rseq_offset`: where the calling thread's rseq area lies relative to
/// the thread pointer (on x86-64, `%fs:off` addresses it directly), or
/// `None` when glibc registers none. Async-signal-safe (after the
/// load-time lookup; the lazy lookup only runs if the constructor did not).
#[inline]
pub(crate) fn offset() -> Option<isize> {
    let off = OFFSET.load(Ordering::Relaxed);
    // One compare on the hot path: both sentinels are below any real offset.
    if off <= UNAVAILABLE {
        return unavailable_or_lookup(off);
    }
    Some(off)
}

/// `__rseq_offset` once rseq fences are registered as well (see
/// [`crate::rseq::add_if_zero`]); one load on the hot path.
static GATED_OFFSET: AtomicIsize = AtomicIsize::new(UNAVAILABLE);

/// Called once rseq fences are registered.
pub(crate) fn enable_gated() {
    if let Some(off) = offset() {
        GATED_OFFSET.store(off, Ordering::Relaxed);
    }
}

/// [`offset`] if rseq fences are registered, else `None`. Async-signal-safe.
#[cfg_attr(not(pcpu_arch = "x86_64"), allow(dead_code))]
#[inline]
pub(crate) fn gated_offset() -> Option<isize> {
    let off = GATED_OFFSET.load(Ordering::Relaxed);
    if off <= UNAVAILABLE { None } else { Some(off) }
}

#[cold]
fn unavailable_or_lookup(off: isize) -> Option<isize> {
    if off == UNKNOWN && lookup() != UNAVAILABLE {
        return offset();
    }
    None
}

/// The calling thread's `rseq->cpu_id` (negative values, i.e. at or above
/// `0x8000_0000`, mean "not registered"). Async-signal-safe.
#[inline]
pub(crate) fn read_cpu_id(off: isize) -> u32 {
    let id: u32;
    #[cfg(pcpu_arch = "x86_64")]
    // SAFETY: `off` is glibc's `__rseq_offset`: %fs:off is this thread's
    // registered area, whose `cpu_id` the kernel updates (hence a fresh
    // load each call, which `asm!` guarantees).
    unsafe {
        core::arch::asm!("mov {id:e}, dword ptr fs:[{off} + 4]", off = in(reg) off, id = out(reg) id,
            options(nostack, readonly, preserves_flags));
    }
    #[cfg(pcpu_arch = "aarch64")]
    // SAFETY: as above, through the thread pointer.
    unsafe {
        id = (thread_pointer().wrapping_add_signed(off) as *const u8)
            .add(CPU_ID_OFFSET)
            .cast::<u32>()
            .read_volatile();
    }
    #[cfg(pcpu_arch = "generic")]
    {
        // `offset` is never `Some` here: "not registered".
        let _ = off;
        id = u32::MAX;
    }
    id
}

/// Whether glibc registered rseq areas for this process's threads.
#[cfg_attr(not(pcpu_arch = "x86_64"), allow(dead_code))]
pub(crate) fn registered() -> bool {
    offset().is_some()
}
