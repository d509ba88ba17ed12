//! Asymmetric fences: a nearly free fence for the frequent side, paid for by
//! an expensive one on the rare side.
//!
//! The pattern (the userspace stand-in for the grace periods that let the
//! kernel's percpu-rwsem and SRCU readers skip barriers):
//!
//! ```text
//! reader (hot)                     writer (rare)
//! store my_count += 1              store flag = WRITER
//! light()                          heavy()
//! load flag                        load sum(counts)
//! ```
//!
//! At least one side sees the other's store, exactly as if both sides had
//! used `fence(SeqCst)`. With `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`
//! the writer interrupts every running thread of the process with a full
//! barrier, so the reader's side only has to stop the *compiler* from
//! reordering: [`light`] is a `compiler_fence`. Where membarrier is not
//! available (kernel older than 4.14, seccomp filters, or
//! `PCPU_NO_MEMBARRIER=1` in the environment at start-up, which tests use),
//! both sides fall back to `fence(SeqCst)`; [`mode`] says which is in force.
//!
//! Registration happens once, from a load-time constructor (while the
//! process is still single-threaded, where it is cheap), so the light side
//! is light from the first call.
//!
//! Under `--cfg pcpu_loom` both sides are `fence(SeqCst)`: membarrier makes the
//! light side *act* as a full fence whenever the heavy side runs, and
//! modelling only the heavy side would be unsound. Miri, which has no
//! `membarrier()` either, is given the same model, and so is a build for
//! the thread sanitizer (`--cfg pcpu_tsan`), which cannot see what
//! `membarrier()` orders (nor a plain fence: see `unstable::sync`).
//!
//! This module owns every `membarrier()` command the crate issues and
//! their registrations: the fences above, [`sync_core`], and the rseq
//! fences ([`register_rseq_fence`]), which [`rseq`](crate::rseq) builds its
//! own fences on. It uses nothing of `rseq` but the rseq area (to enable
//! the gated adds once rseq fences are registered).

use core::sync::atomic::{AtomicU8, Ordering, compiler_fence};

use crate::sync::atomic::fence;

const UNKNOWN: u8 = 0;
const MEMBARRIER: u8 = 1;
const FALLBACK: u8 = 2;

static MODE: AtomicU8 = AtomicU8::new(UNKNOWN);

const CMD_QUERY: libc::c_int = 0;
const CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;
const CMD_PRIVATE_EXPEDITED_SYNC_CORE: libc::c_int = 1 << 5;
const CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE: libc::c_int = 1 << 6;
const CMD_PRIVATE_EXPEDITED_RSEQ: libc::c_int = 1 << 7;
const CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ: libc::c_int = 1 << 8;
const CMD_FLAG_CPU: libc::c_uint = 1;

/// Which implementation the asymmetric fences use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `light()` is a compiler fence, `heavy()` is
    /// `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`.
    Membarrier,
    /// Both sides are `fence(SeqCst)`.
    SeqCstFallback,
}

#[cfg(not(miri))]
fn membarrier(cmd: libc::c_int, flags: libc::c_uint, cpu: libc::c_int) -> libc::c_long {
    // SAFETY: membarrier takes plain integers and touches no user memory.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, flags, cpu) }
}

/// Miri has no `membarrier()`: it is modelled as loom models it. The
/// query offers `PRIVATE_EXPEDITED` and its registration succeeds (so
/// [`mode`] is [`Mode::Membarrier`] unless `PCPU_NO_MEMBARRIER=1`, and
/// the code paths that rely on it run), but both sides of the fence are
/// `fence(SeqCst)` under Miri (see [`light`] and [`heavy`]): what
/// membarrier guarantees, in terms Miri checks. Every other command (the
/// rseq and sync-core ones) is refused, as by a kernel without them.
#[cfg(miri)]
fn membarrier(cmd: libc::c_int, _flags: libc::c_uint, _cpu: libc::c_int) -> libc::c_long {
    match cmd {
        CMD_QUERY => libc::c_long::from(CMD_PRIVATE_EXPEDITED | CMD_REGISTER_PRIVATE_EXPEDITED),
        CMD_REGISTER_PRIVATE_EXPEDITED => 0,
        _ => -1,
    }
}

/// Registers the fences at load time (see the module docs). rseq fences
/// are registered by `rseq`'s own constructor, where its critical sections
/// run.
#[cfg(not(pcpu_loom))]
#[used]
#[unsafe(link_section = ".init_array")]
static REGISTER_AT_LOAD: extern "C" fn() = {
    extern "C" fn register_at_load() {
        let _ = mode();
    }
    register_at_load
};

#[cold]
fn register() -> u8 {
    let disabled = std::env::var_os("PCPU_NO_MEMBARRIER").is_some_and(|v| v != "0");
    let supported = membarrier(CMD_QUERY, 0, 0);
    let ok = !disabled
        && supported >= 0
        && supported & libc::c_long::from(CMD_PRIVATE_EXPEDITED) != 0
        && membarrier(CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
    let new = if ok { MEMBARRIER } else { FALLBACK };
    // First registration wins; every caller then uses the winner's mode.
    match MODE.compare_exchange(UNKNOWN, new, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => new,
        Err(current) => current,
    }
}

/// The mode in force (registering on first use if the load-time constructor
/// did not run). Async-signal-safe after start-up.
#[must_use]
pub fn mode() -> Mode {
    let mut m = MODE.load(Ordering::Acquire);
    if m == UNKNOWN {
        m = register();
    }
    if m == MEMBARRIER {
        Mode::Membarrier
    } else {
        Mode::SeqCstFallback
    }
}

/// Whether [`light`] is only a compiler fence (membarrier mode), for code
/// that caches the answer next to its data to skip the per-call check.
/// Settled at load time; async-signal-safe.
#[must_use]
pub fn light_is_compiler_only() -> bool {
    cfg!(not(any(pcpu_loom, miri, pcpu_tsan))) && mode() == Mode::Membarrier
}

/// The frequent side's fence: a compiler fence when membarrier is
/// registered, `fence(SeqCst)` otherwise. Async-signal-safe.
#[inline]
pub fn light() {
    #[cfg(not(any(pcpu_loom, miri, pcpu_tsan)))]
    if MODE.load(Ordering::Relaxed) == MEMBARRIER {
        compiler_fence(Ordering::SeqCst);
        return;
    }
    fence(Ordering::SeqCst);
}

/// The rare side's fence: `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`
/// when registered (a few microseconds: an IPI to every CPU running a
/// thread of this process), `fence(SeqCst)` otherwise.
///
/// Async-signal-safe: yes after start-up (one system call).
///
/// # Panics
/// If the kernel refuses the barrier after accepting the registration
/// (it never does; continuing would silently break every light side).
pub fn heavy() {
    #[cfg(pcpu_loom)]
    if crate::loom_cpu::rseq_modelled() {
        crate::loom_cpu::fence_all_cpus();
        return;
    }
    #[cfg(not(any(pcpu_loom, miri, pcpu_tsan)))]
    if mode() == Mode::Membarrier {
        // The light side already relies on us: a failure here after a
        // successful registration would break every caller's ordering.
        assert!(
            membarrier(CMD_PRIVATE_EXPEDITED, 0, 0) == 0,
            "membarrier(PRIVATE_EXPEDITED) failed after registration"
        );
        return;
    }
    // Keep the compiler fence for loom and the fallback path alike.
    compiler_fence(Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

static RSEQ_FENCE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Registers the process for rseq fences ([`crate::rseq::fence_cpu`],
/// [`crate::rseq::fence_all`]: `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ`,
/// Linux 5.10+). Returns whether they are available. Runs from
/// [`rseq`](crate::rseq)'s load-time constructor where rseq is available;
/// not async-signal-safe on a first call after start-up (the kernel may
/// wait for an RCU grace period), cheap afterwards.
pub fn register_rseq_fence() -> bool {
    match RSEQ_FENCE.load(Ordering::Acquire) {
        MEMBARRIER => true,
        FALLBACK => false,
        _ => {
            let ok = membarrier(CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0) == 0;
            RSEQ_FENCE.store(if ok { MEMBARRIER } else { FALLBACK }, Ordering::Release);
            #[cfg(not(pcpu_loom))]
            if ok {
                crate::rseq_area::enable_gated();
            }
            ok
        }
    }
}

pub(crate) fn membarrier_rseq_all() -> bool {
    membarrier(CMD_PRIVATE_EXPEDITED_RSEQ, 0, 0) == 0
}

pub(crate) fn membarrier_rseq_cpu(cpu: usize) -> bool {
    let Ok(cpu) = libc::c_int::try_from(cpu) else {
        return false;
    };
    membarrier(CMD_PRIVATE_EXPEDITED_RSEQ, CMD_FLAG_CPU, cpu) == 0
}

/// Makes every other thread of the process serialise its instruction stream
/// before it next runs user code (`MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE`),
/// as cross-modifying code requires after patching live instructions.
/// Registers on first use. Returns `false` where the kernel lacks it.
///
/// Not async-signal-safe on first call; one system call afterwards.
pub fn sync_core() -> bool {
    static SYNC_CORE: AtomicU8 = AtomicU8::new(UNKNOWN);
    let state = match SYNC_CORE.load(Ordering::Acquire) {
        UNKNOWN => {
            let ok = membarrier(CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE, 0, 0) == 0;
            let s = if ok { MEMBARRIER } else { FALLBACK };
            SYNC_CORE.store(s, Ordering::Release);
            s
        }
        s => s,
    };
    state == MEMBARRIER && membarrier(CMD_PRIVATE_EXPEDITED_SYNC_CORE, 0, 0) == 0
}
