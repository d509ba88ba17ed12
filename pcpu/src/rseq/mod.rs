//! Per-CPU operations through restartable sequences (rseq), with atomic
//! fallbacks.
//!
//! A restartable sequence is a short critical section that the kernel
//! aborts (and this crate restarts) if the thread is preempted, migrated or
//! interrupted by a signal before its final store, the *commit*. That makes
//! "read my CPU id, then update that CPU's slot" atomic with respect to
//! every other rseq operation **on the same CPU**, with plain loads and
//! stores: no `lock` prefix, no fence, so a per-CPU `add` costs a fraction
//! of an uncontended atomic `fetch_add` (the workspace's `bench` measures
//! both on a host).
//!
//! What this module offers:
//! - [`add`]: add to the current CPU's counter (for counters and the
//!   read-side counts of percpu-rwsem and srcu);
//! - [`PerCpuStack`](crate::PerCpuStack): push and pop on the current
//!   CPU's intrusive LIFO, the pop loading the next pointer inside the
//!   critical section (so no ABA), and a lock-plus-fence protocol for
//!   touching *another* CPU's list (see its docs).
//!
//! **When the rseq path runs**: on x86-64, when glibc registered an rseq
//! area ([`available()`]). Everywhere else (aarch64, where relaxed LSE
//! atomics already cost close to a plain add; glibc without rseq; qemu-user;
//! `GLIBC_TUNABLES=glibc.pthread.rseq=0`; loom models) the same functions
//! use atomic read-modify-write instead, with the same results.
//!
//! **Other CPUs' slots**: an rseq operation is atomic only against rseq
//! operations of the same CPU. Reading another CPU's slot (summing) is
//! fine; *writing* it needs a protocol: the slot's writers must check a
//! lock word inside their critical section, and the remote writer takes the
//! lock and then calls [`fence_cpu`], which restarts any critical section
//! running on that CPU (`MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ` aimed at
//! it). [`PerCpuStack`](crate::PerCpuStack) implements exactly that.
//!
//! This module owns the per-CPU operations and their fences
//! ([`fence_all`], [`fence_cpu`]) and registers rseq fences at load time;
//! it builds on [`PerCpu`], the rseq area and the
//! `membarrier()` commands of [`crate::fence`]. The x86-64 critical
//! sections are its `x86_64` submodule.

#[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
mod x86_64;

use crate::PerCpu;
use crate::sync::atomic::{AtomicU64, Ordering};

/// Registers rseq fences at load time where the critical sections run
/// (while the process is still single-threaded, where the registration is
/// cheap), so that gated adds and [`fence_cpu`] work from the first call.
#[cfg(not(pcpu_loom))]
#[used]
#[unsafe(link_section = ".init_array")]
static REGISTER_FENCES_AT_LOAD: extern "C" fn() = {
    extern "C" fn register_fences_at_load() {
        if available() {
            let _ = crate::fence::register_rseq_fence();
        }
    }
    register_fences_at_load
};

/// Whether the rseq critical sections run in this process (x86-64 and a
/// glibc-registered rseq area). When `false`, every operation of this
/// module takes its atomic fallback. Async-signal-safe.
#[inline]
#[must_use]
pub fn available() -> bool {
    #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
    {
        crate::rseq_area::registered()
    }
    #[cfg(pcpu_loom)]
    {
        crate::loom_cpu::rseq_modelled()
    }
    #[cfg(all(not(pcpu_loom), not(pcpu_arch = "x86_64")))]
    {
        false
    }
}

/// Adds `delta` (wrapping) to the current CPU's counter in `counters`.
///
/// With rseq: one plain `add` to the CPU's slot inside a critical section.
/// Without (or for a CPU id beyond the possible count, or a thread whose
/// rseq registration failed): `fetch_add(Relaxed)` on the current slot when
/// rseq is off process-wide, and on the overflow slot when rseq is on (so a
/// CPU slot is never written by both a plain and a locked instruction).
///
/// The counts carry no ordering: pair with fences (see [`crate::fence`])
/// where the counter publishes something. Sum with
/// `counters.iter().map(|c| c.load(..))`, wrapping.
///
/// **Async-signal-safe**: yes (a signal arriving inside the critical section
/// restarts it when the handler returns; a handler that itself calls `add`
/// runs its own section to completion first).
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
/// let c = pcpu::PerCpu::<AtomicU64>::default();
/// pcpu::rseq::add(&c, 5);
/// pcpu::rseq::add(&c, 2u64.wrapping_neg());
/// assert_eq!(c.iter().fold(0u64, |s, v| s.wrapping_add(v.load(Relaxed))), 3);
/// ```
#[inline]
pub fn add(counters: &PerCpu<AtomicU64>, delta: u64) {
    #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
    if let Some(area) = crate::rseq_area::offset() {
        let (base, _) = counters.raw_layout();
        // SAFETY: `area` is glibc's `__rseq_offset`, so `%fs:area` is this
        // thread's registered rseq area; CPU slots
        // are `CachePadded<AtomicU64>` (aligned u64 at offset 0) that, while
        // rseq is registered process-wide, are written only by rseq
        // operations of their CPU (the fallback below uses the overflow
        // slot).
        let rc = unsafe { x86_64::add(area, base, counters.cpus() as u32, delta) };
        if rc != x86_64::DONE {
            add_overflow(counters, delta);
        }
        return;
    }
    #[cfg(pcpu_loom)]
    if crate::loom_cpu::rseq_modelled() {
        // A plain add inside the CPU's critical section.
        let slot = counters.current_index();
        crate::loom_cpu::critical_section(slot, || {
            let c = &counters.get(slot).expect("slot");
            c.store(
                c.load(Ordering::Relaxed).wrapping_add(delta),
                Ordering::Relaxed,
            );
        });
        return;
    }
    counters.current().fetch_add(delta, Ordering::Relaxed);
}

/// What [`add_if_zero`] did. (The discriminants are the critical
/// sections' own return codes, so mapping them costs nothing.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum GatedAdd {
    /// The gate was 0 and the delta was added, in one critical section.
    Added = 0,
    /// The gate was not 0; nothing was written.
    Gated = 1,
    /// No critical section could run here (rseq not available, or this
    /// thread's CPU id is beyond the possible count or unregistered):
    /// nothing was written; use a fallback protocol (see below).
    Unavailable = 2,
}

/// Proof that gated adds run as rseq critical sections in this process
/// (x86-64, a glibc-registered rseq area, registered rseq fences), carrying
/// what they need. Get it once with [`GatedAdder::get`] and keep it next to
/// the counters: its [`add_if_zero`](Self::add_if_zero) then skips the
/// process-wide availability check that the free function makes on every
/// call (a measurable part of a read lock).
#[derive(Clone, Copy, Debug)]
pub struct GatedAdder {
    /// `__rseq_offset`, never 0 (the area is not the thread control
    /// block), which gives `Option<GatedAdder>` a niche: one word, one load.
    offset: core::num::NonZeroIsize,
}

impl GatedAdder {
    /// The token, or `None` where gated adds are unavailable (then
    /// [`add_if_zero`] always answers [`GatedAdd::Unavailable`]).
    /// Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn get() -> Option<Self> {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if let Some(offset) =
            crate::rseq_area::gated_offset().and_then(core::num::NonZeroIsize::new)
        {
            return Some(Self { offset });
        }
        #[cfg(pcpu_loom)]
        if crate::loom_cpu::rseq_modelled() {
            return Some(Self {
                offset: core::num::NonZeroIsize::MIN,
            });
        }
        None
    }

    /// Where the calling thread's rseq area lies relative to the thread
    /// pointer (glibc's `__rseq_offset`; on x86-64 `%fs:offset` addresses
    /// it), for code that writes its own critical sections in assembly
    /// and relies on what this token proves: [`fence_all`] restarts them.
    /// Such a section follows the kernel's ABI as this module's do (a
    /// `struct rseq_cs` descriptor stored at `%fs:offset+8`, the CPU id
    /// read at `%fs:offset+4` inside the section, one committing store,
    /// an abort handler after the registered signature `0x53053053`).
    /// Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn area_offset(self) -> isize {
        self.offset.get()
    }

    /// [`add_if_zero`] without the availability check. Never returns
    /// [`GatedAdd::Unavailable`] except for a thread whose CPU id is beyond
    /// the possible count or whose rseq registration failed.
    /// **Async-signal-safe.**
    #[allow(clippy::inline_always)] // a call would cost more than the section
    #[inline(always)]
    pub fn add_if_zero(
        self,
        counters: &PerCpu<AtomicU64>,
        gate: &crate::sync::atomic::AtomicU32,
        delta: u64,
    ) -> GatedAdd {
        self.add_if_zero_in(Counters::new(counters), gate, delta)
    }

    /// [`add_if_zero`](Self::add_if_zero) on counters whose layout the
    /// caller read once ([`Counters`]). **Async-signal-safe.**
    #[allow(clippy::inline_always)] // a call would cost more than the section
    #[inline(always)]
    pub fn add_if_zero_in(
        self,
        counters: Counters<'_>,
        gate: &crate::sync::atomic::AtomicU32,
        delta: u64,
    ) -> GatedAdd {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        {
            // SAFETY: as in `add`; the token exists only with rseq fences
            // registered; `gate` is a live, aligned `AtomicU32`.
            let rc = unsafe {
                x86_64::add_if_zero(
                    self.offset.get(),
                    counters.base,
                    counters.cpus,
                    gate.as_ptr(),
                    delta,
                )
            };
            match rc {
                x86_64::DONE => GatedAdd::Added,
                x86_64::EMPTY => GatedAdd::Gated,
                _ => GatedAdd::Unavailable,
            }
        }
        #[cfg(pcpu_loom)]
        {
            let counters = counters.per_cpu;
            // Gate check and plain add inside the CPU's critical section.
            let slot = counters.current_index();
            crate::loom_cpu::critical_section(slot, || {
                if gate.load(Ordering::Relaxed) != 0 {
                    return GatedAdd::Gated;
                }
                let c = counters.get(slot).expect("slot");
                c.store(
                    c.load(Ordering::Relaxed).wrapping_add(delta),
                    Ordering::Relaxed,
                );
                GatedAdd::Added
            })
        }
        #[cfg(all(not(pcpu_loom), not(pcpu_arch = "x86_64")))]
        {
            let _ = (counters, gate, delta);
            GatedAdd::Unavailable
        }
    }
}

/// A [`PerCpu`] of counters with its layout read once, for a caller that
/// adds to the same counters twice in a row (a lock and its unlock): kept
/// in registers, it spares the second add reloading the layout after the
/// first one's critical section. `Copy`; borrows the counters.
#[derive(Clone, Copy, Debug)]
pub struct Counters<'a> {
    #[cfg_attr(not(pcpu_loom), allow(dead_code))]
    per_cpu: &'a PerCpu<AtomicU64>,
    #[cfg_attr(not(all(pcpu_arch = "x86_64", not(pcpu_loom))), allow(dead_code))]
    base: *const u8,
    #[cfg_attr(not(all(pcpu_arch = "x86_64", not(pcpu_loom))), allow(dead_code))]
    cpus: u32,
}

// SAFETY: a shared borrow of `PerCpu<AtomicU64>` (which is `Sync`) and
// its layout, read from it: what `&PerCpu<AtomicU64>` may do on any thread.
unsafe impl Send for Counters<'_> {}
// SAFETY: as above.
unsafe impl Sync for Counters<'_> {}

impl<'a> Counters<'a> {
    /// The layout of `per_cpu`. Async-signal-safe.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use]
    pub fn new(per_cpu: &'a PerCpu<AtomicU64>) -> Self {
        Self {
            per_cpu,
            base: per_cpu.raw_layout().0,
            cpus: per_cpu.cpus() as u32,
        }
    }
}

/// Adds `delta` to the current CPU's counter **only if `*gate == 0`**,
/// reading the gate inside the same restartable sequence as the add.
///
/// This is the userspace form of the kernel's "if `rcu_sync_is_idle()` then
/// `this_cpu_inc()`" under disabled preemption: a writer that stores a
/// non-zero gate and then calls [`fence_all`] knows that from then on no
/// `add_if_zero` commits having seen the gate open, and that every add that
/// did commit is visible to it. The reader pays no fence at all.
///
/// Returns [`GatedAdd::Unavailable`] where rseq cannot run; callers then
/// use [`add`] (which routes to atomics) together with the asymmetric
/// fences of [`crate::fence`]. Never `Unavailable` on x86-64 with a
/// glibc-registered rseq area, registered rseq fences (Linux 5.10+) and a
/// thread on a CPU below the possible count.
///
/// **Async-signal-safe**: yes.
#[inline]
pub fn add_if_zero(
    counters: &PerCpu<AtomicU64>,
    gate: &crate::sync::atomic::AtomicU32,
    delta: u64,
) -> GatedAdd {
    // Without rseq fences a writer could not restart a section that read
    // the gate as open, so the gated add is only offered with them
    // (`GatedAdder::get` is `None` until they are registered).
    match GatedAdder::get() {
        Some(adder) => adder.add_if_zero(counters, gate, delta),
        None => GatedAdd::Unavailable,
    }
}

/// Proof that [`add`] runs as an rseq critical section in this process
/// (x86-64, a glibc-registered rseq area), carrying the area's offset, so
/// that code keeping it next to its counters skips the process-wide check
/// the free function makes on every call.
#[derive(Clone, Copy, Debug)]
pub struct Adder {
    #[cfg_attr(not(all(pcpu_arch = "x86_64", not(pcpu_loom))), allow(dead_code))]
    offset: core::num::NonZeroIsize,
}

impl Adder {
    /// The token, or `None` where [`add`] takes its atomic fallback.
    /// Async-signal-safe.
    #[inline]
    #[must_use]
    pub fn get() -> Option<Self> {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if let Some(offset) = crate::rseq_area::offset().and_then(core::num::NonZeroIsize::new) {
            return Some(Self { offset });
        }
        None
    }

    /// [`add`] without the availability check (a CPU id beyond the
    /// possible count or an unregistered thread still falls back to an
    /// atomic add on the overflow slot). **Async-signal-safe.**
    #[allow(clippy::inline_always)] // a call would cost more than the section
    #[inline(always)]
    pub fn add(self, counters: &PerCpu<AtomicU64>, delta: u64) {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        {
            let (base, _) = counters.raw_layout();
            // SAFETY: as in `add`.
            let rc = unsafe { x86_64::add(self.offset.get(), base, counters.cpus() as u32, delta) };
            if rc != x86_64::DONE {
                add_overflow(counters, delta);
            }
        }
        #[cfg(not(all(pcpu_arch = "x86_64", not(pcpu_loom))))]
        add(counters, delta);
    }
}

impl Adder {
    /// Adds `delta` to word `word` of the current CPU's slot of
    /// `counters`, for structures that keep several per-CPU counters in one
    /// cache line (the SRCU lock and unlock counts of both banks, say).
    /// Falls back like [`add`] (atomic add on the overflow slot).
    /// **Async-signal-safe.**
    ///
    /// # Panics
    /// If `word >= N`.
    #[allow(clippy::inline_always)] // a call would cost more than the section
    #[inline(always)]
    pub fn add_word<const N: usize>(
        self,
        counters: &PerCpu<[AtomicU64; N]>,
        word: usize,
        delta: u64,
    ) {
        assert!(word < N, "counter word out of range");
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        {
            const {
                assert!(
                    size_of::<crossbeam_utils::CachePadded<[core::sync::atomic::AtomicU64; N]>>()
                        == 128,
                    "the counter sections assume one 128-byte line per CPU",
                );
            }
            let (base, _) = counters.raw_layout();
            // SAFETY: as in `add`, for the aligned `u64` at word `word` of
            // each slot (in bounds: checked above; one line per slot:
            // checked at compile time).
            let rc = unsafe {
                x86_64::add_word(self.offset.get(), base, counters.cpus() as u32, word, delta)
            };
            if rc != x86_64::DONE {
                add_word_overflow(counters, word, delta);
            }
        }
        #[cfg(not(all(pcpu_arch = "x86_64", not(pcpu_loom))))]
        add_word_fallback(counters, word, delta);
    }
}

/// [`Adder::add_word`] without the token: rseq where available, else an
/// atomic add on the current slot (the overflow slot in rseq mode).
/// **Async-signal-safe.**
///
/// # Panics
/// If `word >= N`.
#[inline]
pub fn add_word<const N: usize>(counters: &PerCpu<[AtomicU64; N]>, word: usize, delta: u64) {
    match Adder::get() {
        Some(adder) => adder.add_word(counters, word, delta),
        None => add_word_fallback(counters, word, delta),
    }
}

fn add_word_fallback<const N: usize>(counters: &PerCpu<[AtomicU64; N]>, word: usize, delta: u64) {
    #[cfg(pcpu_loom)]
    if crate::loom_cpu::rseq_modelled() {
        let slot = counters.current_index();
        crate::loom_cpu::critical_section(slot, || {
            let c = &counters.get(slot).expect("slot")[word];
            c.store(
                c.load(Ordering::Relaxed).wrapping_add(delta),
                Ordering::Relaxed,
            );
        });
        return;
    }
    counters.current()[word].fetch_add(delta, Ordering::Relaxed);
}

#[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
#[cold]
fn add_word_overflow<const N: usize>(counters: &PerCpu<[AtomicU64; N]>, word: usize, delta: u64) {
    // SAFETY: the overflow slot always exists.
    let overflow = unsafe { counters.get(counters.overflow_index()).unwrap_unchecked() };
    overflow[word].fetch_add(delta, Ordering::Relaxed);
}

#[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
#[cold]
fn add_overflow(counters: &PerCpu<AtomicU64>, delta: u64) {
    // SAFETY: the overflow slot always exists.
    let overflow = unsafe { counters.get(counters.overflow_index()).unwrap_unchecked() };
    overflow.fetch_add(delta, Ordering::Relaxed);
}

/// Restarts every rseq critical section running in the process and makes
/// the caller's earlier stores visible to every thread before it continues
/// (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)`: an IPI with a full
/// barrier to each CPU running a thread of the process). This is the
/// "grace period" for [`add_if_zero`]; it also orders like
/// [`fence::heavy`](crate::fence::heavy).
///
/// Falls back to [`fence::heavy`](crate::fence::heavy) when rseq fences are
/// not registered (then no critical section runs either: see
/// [`available`]). **Async-signal-safe** after registration (one system
/// call); registers on first use, which is not.
///
/// # Panics
/// If the kernel refuses the fence after accepting the registration (it
/// never does; continuing would break every gated add's guarantee).
pub fn fence_all() {
    #[cfg(pcpu_loom)]
    if crate::loom_cpu::rseq_modelled() {
        crate::loom_cpu::fence_all_cpus();
        return;
    }
    if available() && crate::fence::register_rseq_fence() {
        // Sections that read a gate as open are restarted, and the IPI's
        // barrier orders like `fence::heavy` for the atomic fallbacks.
        let done = crate::fence::membarrier_rseq_all();
        assert!(
            done,
            "membarrier(PRIVATE_EXPEDITED_RSEQ) failed after registration"
        );
    } else {
        crate::fence::heavy();
    }
}

/// Restarts any rseq critical section running on CPU `cpu` and makes the
/// caller's earlier stores visible there before the next one starts
/// (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, MEMBARRIER_CMD_FLAG_CPU, cpu)`).
/// Returns `false` if the kernel refused (not registered: see
/// [`crate::fence::register_rseq_fence`]).
///
/// **Async-signal-safe**: yes (one system call).
#[must_use]
pub fn fence_cpu(cpu: usize) -> bool {
    crate::fence::membarrier_rseq_cpu(cpu)
}

#[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
#[allow(unused_imports)]
pub(crate) use x86_64::{
    DONE, EMPTY, LIST_STRIDE, SLOW, bare_pop as raw_bare_pop, bare_push as raw_bare_push,
    mark_empty as raw_mark_empty, pop as raw_pop, push as raw_push,
    push_clearing_flag as raw_push_clearing_flag,
};
