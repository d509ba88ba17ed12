//! The process's memory map (`/proc/self/maps`) and writing to code.

/// One mapping: `[start, end)` and its protection (`PROT_*` bits, with
/// `PROT_BTI` for a BTI-guarded arm64 mapping, so that patching it keeps
/// it guarded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) prot: i32,
}

/// The mapping that contains `addr`, if any.
pub(crate) fn mapping_of(addr: usize) -> Option<Mapping> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mut found = maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (range, perms) = (fields.next()?, fields.next()?);
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        if !(start..end).contains(&addr) {
            return None;
        }
        let perms = perms.as_bytes();
        let bit = |i: usize, c: u8, p: i32| if perms.get(i) == Some(&c) { p } else { 0 };
        Some(Mapping {
            start,
            end,
            prot: bit(0, b'r', libc::PROT_READ)
                | bit(1, b'w', libc::PROT_WRITE)
                | bit(2, b'x', libc::PROT_EXEC),
        })
    })?;
    if cfg!(target_arch = "aarch64") && bti_guarded(found.start) {
        found.prot |= PROT_BTI;
    }
    Some(found)
}

/// arm64's `PROT_BTI`.
const PROT_BTI: i32 = 0x10;

/// Whether the mapping starting at `start` is BTI-guarded (`bt` among its
/// `VmFlags` in `/proc/self/smaps`). qemu-user's `smaps` does not show the
/// flag: there a guarded page that is patched loses its guard.
fn bti_guarded(start: usize) -> bool {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return false;
    };
    let header = format!("{start:x}-");
    smaps
        .lines()
        .skip_while(|l| !l.starts_with(&header))
        .find_map(|l| l.strip_prefix("VmFlags:"))
        .is_some_and(|flags| flags.split_whitespace().any(|f| f == "bt"))
}

/// Writes `bytes` (one byte on x86-64, one aligned 4-byte instruction on
/// aarch64: a single store either way, so a thread running the code sees
/// the old or the new instruction, never a mix) at `addr` in mapping
/// `map`, keeping it executable the whole time (other threads may be
/// running the page): adds write permission, stores, makes the store
/// visible to instruction fetch (aarch64: cache maintenance), restores the
/// original protection, then makes every thread serialise its instruction
/// stream before it runs the page again
/// (`membarrier(PRIVATE_EXPEDITED_SYNC_CORE)`).
///
/// # Safety
/// `addr` is inside `map`, and writing `bytes` there is what the caller
/// wants every thread to execute from now on (a breakpoint over the start
/// of an instruction, or the instruction restored).
pub(crate) unsafe fn write_code(
    map: Mapping,
    addr: usize,
    bytes: &[u8],
) -> Result<(), crate::AttachError> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let base = addr & !(page - 1);
    let writable = map.prot | libc::PROT_WRITE | libc::PROT_EXEC;
    // SAFETY: `base` is a page of a live mapping; execute stays on, so
    // threads running it meanwhile are unaffected.
    if unsafe { libc::mprotect(base as *mut libc::c_void, page, writable) } != 0 {
        return Err(crate::error::os_error("mprotect (add write)"));
    }
    match *bytes {
        // SAFETY: the page is writable now; one byte can never tear an
        // instruction for a concurrent reader.
        [b] => unsafe { core::ptr::write_volatile(addr as *mut u8, b) },
        // SAFETY: as above; an aligned 4-byte store is single-copy atomic.
        [a, b, c, d] if addr.is_multiple_of(4) => unsafe {
            core::ptr::write_volatile(addr as *mut u32, u32::from_le_bytes([a, b, c, d]));
        },
        _ => unreachable!("code is patched one byte or one aligned word at a time"),
    }
    crate::arch::flush_code(addr, bytes.len());
    // SAFETY: as above, back to the mapping's own protection.
    if unsafe { libc::mprotect(base as *mut libc::c_void, page, map.prot) } != 0 {
        return Err(crate::error::os_error("mprotect (restore)"));
    }
    // Cross-modifying code: every thread serialises before running it.
    // Where the kernel lacks SYNC_CORE, the mprotect calls above have
    // already sent each CPU running us a TLB-shootdown IPI, which
    // serialises on x86 (aarch64 has the kernel's own maintenance).
    let _ = pcpu::fence::sync_core();
    Ok(())
}

/// Every mapping's `[start, end)`, plus the room the main thread's stack
/// and the `brk` heap may still grow into (a mapping placed there would
/// make a deep recursion fault, or `malloc` fall back to `mmap`).
pub(crate) fn taken_ranges() -> Vec<(usize, usize)> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut taken = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let Some((start, end)) = f.next().and_then(|r| r.split_once('-')) else {
            continue;
        };
        let (Ok(start), Ok(end)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
        ) else {
            continue;
        };
        taken.push((start, end));
        match f.nth(4) {
            Some("[stack]") => taken.push((start.saturating_sub(stack_room()), start)),
            Some("[heap]") => taken.push((end, end.saturating_add(HEAP_ROOM))),
            _ => {}
        }
    }
    taken
}

/// Address space kept free above the `brk` heap.
const HEAP_ROOM: usize = 1 << 30;

/// How far the main thread's stack may grow (its soft limit, at most
/// 1 GiB when unlimited), plus the kernel's guard gap.
fn stack_room() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_STACK, &raw mut limit) } == 0;
    let soft = if ok {
        limit.rlim_cur
    } else {
        libc::RLIM_INFINITY
    };
    let soft = if soft == libc::RLIM_INFINITY {
        1 << 30
    } else {
        soft as usize
    };
    soft.min(1 << 30) + (1 << 20)
}

/// The file mapped at `addr`, if any.
pub(crate) fn path_of(addr: usize) -> Option<std::path::PathBuf> {
    file_mappings()
        .into_iter()
        .find(|m| (m.start..m.end).contains(&addr))
        .map(|m| m.path)
}

/// Where byte `offset` of file `path` is mapped executable in this process,
/// if it is. (Segments may share a page, so the same file offset can be
/// mapped twice, once read-only; code is what probes want.)
pub(crate) fn address_of_file_offset(path: &std::path::Path, offset: u64) -> Option<usize> {
    let want = std::fs::canonicalize(path).ok()?;
    file_mappings().into_iter().find_map(|m| {
        let len = (m.end - m.start) as u64;
        (m.exec && m.path == want && (m.offset..m.offset + len).contains(&offset))
            .then(|| m.start + (offset - m.offset) as usize)
    })
}

/// The file and the byte of it that executable address `addr` was mapped
/// from, if any (the inverse of [`address_of_file_offset`]).
pub(crate) fn file_offset_of(addr: usize) -> Option<(std::path::PathBuf, u64)> {
    file_mappings()
        .into_iter()
        .find(|m| m.exec && (m.start..m.end).contains(&addr))
        .map(|m| (m.path, m.offset + (addr - m.start) as u64))
}

struct FileMapping {
    start: usize,
    end: usize,
    exec: bool,
    offset: u64,
    path: std::path::PathBuf,
}

fn file_mappings() -> Vec<FileMapping> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (start, end) = f.next()?.split_once('-')?;
            let perms = f.next()?;
            let offset = u64::from_str_radix(f.next()?, 16).ok()?;
            let _dev = f.next()?;
            let _inode = f.next()?;
            let path = f.next().filter(|p| p.starts_with('/'))?;
            Some(FileMapping {
                start: usize::from_str_radix(start, 16).ok()?,
                end: usize::from_str_radix(end, 16).ok()?,
                exec: perms.as_bytes().get(2) == Some(&b'x'),
                offset,
                path: path.into(),
            })
        })
        .collect()
}
