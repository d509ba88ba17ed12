//! Executable memory the engine makes: regions mapped within reach of
//! the probed code, for out-of-line [`slots`], per-probe
//! [`trampolines`] and the [`return_stubs`], stubs at addresses the
//! probed code chooses ([`pinned`]), and where each lies (the fault
//! handler asks). Code here is written once and never changed or
//! freed while a thread may run it. Nothing here knows about sites.

pub(crate) mod pinned;
mod regions;
pub(crate) mod return_stubs;
pub(crate) mod slots;
pub(crate) mod trampolines;

use crate::AttachError;
use crate::arch::REACH_LIMIT;
use crate::base::error::os_error;

/// Bytes per region of slots or trampolines.
pub(crate) const REGION_SIZE: usize = 64 * 1024;
/// How far from the probed code a region may start: every byte of it
/// stays within the architecture's reach.
pub(crate) const REACH: usize = REACH_LIMIT - 2 * REGION_SIZE;

/// Whether any region of relocated code (slots, trampolines) exists: the
/// fault handlers are needed from then on. Async-signal-safe.
pub(crate) fn relocated_code_exists() -> bool {
    slots::any_region() || trampolines::any_region()
}

/// Writes fresh generated code at `at` (inside one page of a region of
/// ours, not yet run by any thread), keeping the page executable
/// throughout: other code on it may be running. Not async-signal-safe.
pub(crate) fn write_code(at: usize, code: &[u8]) -> Result<(), AttachError> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let base = at & !(page - 1);
    let rx = libc::PROT_READ | libc::PROT_EXEC;
    // SAFETY: `base` is a page of a region we mapped; the code does not
    // straddle pages (slots are 64 bytes, trampolines 128, aligned).
    if unsafe { libc::mprotect(base as *mut libc::c_void, page, rx | libc::PROT_WRITE) } != 0 {
        return Err(os_error("mprotect (generated code)"));
    }
    // SAFETY: the code's place is ours, unused so far, and writable now.
    unsafe { core::ptr::copy_nonoverlapping(code.as_ptr(), at as *mut u8, code.len()) };
    crate::arch::flush_code(at, code.len());
    // SAFETY: as above.
    if unsafe { libc::mprotect(base as *mut libc::c_void, page, rx) } != 0 {
        return Err(os_error("mprotect (generated code)"));
    }
    Ok(())
}

/// Stores `value` at `at` (8-byte aligned, in a region of generated code
/// this module mapped) in one atomic store: a word that running code
/// reads as data (a trampoline's entry pointer) changes with no reader
/// seeing half of it. The page stays executable throughout. Not
/// async-signal-safe.
pub(crate) fn write_word(at: usize, value: u64) -> Result<(), AttachError> {
    assert_eq!(at % 8, 0, "an aligned word");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let base = at & !(page - 1);
    let rx = libc::PROT_READ | libc::PROT_EXEC;
    // SAFETY: `base` is a page of a region we mapped.
    if unsafe { libc::mprotect(base as *mut libc::c_void, page, rx | libc::PROT_WRITE) } != 0 {
        return Err(os_error("mprotect (generated code)"));
    }
    // SAFETY: an aligned word of our region, writable now; readers load
    // it whole.
    let word = unsafe { &*(at as *const core::sync::atomic::AtomicU64) };
    word.store(value, core::sync::atomic::Ordering::Release);
    // SAFETY: as above.
    if unsafe { libc::mprotect(base as *mut libc::c_void, page, rx) } != 0 {
        return Err(os_error("mprotect (generated code)"));
    }
    Ok(())
}

/// Maps `size` bytes (a power of two, at least a page) readable and
/// executable, aligned to `size`, within reach of `addr`: in the free gap
/// of the address space nearest to it, away from where the main stack
/// and the `brk` heap grow. Not async-signal-safe.
pub(crate) fn map_near(addr: usize, size: usize) -> Result<usize, AttachError> {
    let mut taken: Vec<(usize, usize)> = crate::process::maps::taken_ranges();
    taken.sort_unstable();
    let lo = addr.saturating_sub(REACH);
    let hi = addr.saturating_add(REACH);
    // Candidate region bases: just below each mapping and just above it.
    let mut candidates: Vec<usize> = taken
        .iter()
        .flat_map(|&(start, end)| {
            [
                start.saturating_sub(size) & !(size - 1),
                (end + size - 1) & !(size - 1),
            ]
        })
        .filter(|&b| b >= lo && b + size <= hi && b >= 0x10000)
        .filter(|&b| !taken.iter().any(|&(s, e)| b < e && s < b + size))
        .collect();
    candidates.sort_unstable_by_key(|&b| b.abs_diff(addr));
    for base in candidates {
        if map_fixed(base, size) {
            return Ok(base);
        }
    }
    Err(AttachError::Os {
        what: "no room for generated code within reach of the probed code",
        errno: crate::base::error::Errno::new(libc::ENOMEM),
    })
}

/// Maps `size` bytes, readable and executable, wherever the kernel likes;
/// `what` names them in the error. Not async-signal-safe.
pub(crate) fn map_anywhere(size: usize, what: &'static str) -> Result<usize, AttachError> {
    // SAFETY: a fresh anonymous mapping.
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error(what));
    }
    Ok(p as usize)
}

/// Maps `size` bytes at `base`, readable and executable, never over
/// anything (`MAP_FIXED_NOREPLACE`); whether it did. Not
/// async-signal-safe.
pub(crate) fn map_fixed(base: usize, size: usize) -> bool {
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
    let p = unsafe {
        libc::mmap(
            base as *mut libc::c_void,
            size,
            libc::PROT_READ | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p as usize == base {
        return true;
    }
    if p != libc::MAP_FAILED {
        // An old kernel ignoring the flag put it elsewhere.
        // SAFETY: unmapping what this call mapped.
        unsafe { libc::munmap(p, size) };
    }
    false
}
