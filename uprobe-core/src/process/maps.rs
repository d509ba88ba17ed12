//! The process's memory map (`/proc/self/maps`) and writing to code.

use std::sync::atomic::{AtomicU64, Ordering};

use super::vma;

/// One mapping: `[start, end)` and its protection (`PROT_*` bits, with
/// `PROT_BTI` for a BTI-guarded arm64 mapping, so that patching it keeps
/// it guarded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) prot: i32,
}

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug)]
struct Entry {
    start: usize,
    end: usize,
    /// `PROT_*` bits.
    prot: i32,
    /// The file offset of `start`.
    offset: u64,
    /// The file, or the pseudo-name (`[stack]`, `[heap]`, ...), if any.
    name: Option<String>,
}

impl Entry {
    fn exec(&self) -> bool {
        self.prot & libc::PROT_EXEC != 0
    }

    /// The file it maps (a pseudo-name like `[heap]` is not a file).
    fn path(&self) -> Option<std::path::PathBuf> {
        self.name
            .as_deref()
            .filter(|n| n.starts_with('/'))
            .map(Into::into)
    }
}

/// A `/proc` file, read in large chunks: procfs files report no size, so
/// `read_to_string` starts with a 32-byte read and doubles, a dozen
/// system calls for a file that two reads take.
pub(crate) fn read_proc(path: &str) -> Option<String> {
    use std::io::Read as _;
    let mut text = String::with_capacity(16 * 1024);
    std::fs::File::open(path)
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// The process's memory map, read from `/proc/self/maps` (the one parser
/// of it in the crate). Not async-signal-safe.
fn entries() -> Vec<Entry> {
    let Some(maps) = read_proc("/proc/self/maps") else {
        return Vec::new();
    };
    maps.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Entry> {
    let mut f = line.split_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let perms = f.next()?.as_bytes();
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let bit = |i: usize, c: u8, p: i32| if perms.get(i) == Some(&c) { p } else { 0 };
    Some(Entry {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        prot: bit(0, b'r', libc::PROT_READ)
            | bit(1, b'w', libc::PROT_WRITE)
            | bit(2, b'x', libc::PROT_EXEC),
        offset,
        name: name_field(line),
    })
}

/// The sixth field to the end of the line (a path may contain spaces).
fn name_field(line: &str) -> Option<String> {
    let mut rest = line;
    for _ in 0..5 {
        rest = rest.trim_start();
        rest = &rest[rest.find(char::is_whitespace)?..];
    }
    let name = rest.trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// The memory map for a batch of look-ups. Where the kernel answers
/// `PROCMAP_QUERY` ([`super::vma`]), each look-up asks it for the one
/// mapping it needs (the map as it is then); elsewhere the whole map is
/// read once, at the first need, and kept for the batch.
pub(crate) struct Snapshot {
    all: std::cell::OnceCell<Vec<Entry>>,
    /// `/proc/self/maps` open for queries, if the kernel answers them.
    queries: std::cell::OnceCell<Option<std::fs::File>>,
}

impl Snapshot {
    /// A snapshot for a batch of look-ups (it reads nothing yet).
    pub(crate) fn read() -> Self {
        Self {
            all: std::cell::OnceCell::new(),
            queries: std::cell::OnceCell::new(),
        }
    }

    fn all(&self) -> &[Entry] {
        self.all.get_or_init(entries)
    }

    /// The kernel's answer for `addr` (`which` mapping, its name too if
    /// `name`); an error where it gives none (or the whole map was read
    /// already), and the map is to be used instead.
    fn ask(
        &self,
        addr: usize,
        which: vma::Which,
        name: bool,
    ) -> Result<Option<vma::Vma>, vma::Unsupported> {
        if self.all.get().is_some() {
            return Err(vma::Unsupported);
        }
        let maps = self.queries.get_or_init(|| vma::open().ok());
        vma::query(maps.as_ref().ok_or(vma::Unsupported)?, addr, which, name)
    }

    /// The mapping that contains `addr` (its name too if `name`), or the
    /// first above it (`which`).
    fn entry(&self, addr: usize, which: vma::Which, name: bool) -> Option<Entry> {
        if let Ok(found) = self.ask(addr, which, name) {
            return found.map(|v| Entry {
                start: v.start,
                end: v.end,
                prot: v.prot,
                offset: v.offset,
                name: v.name,
            });
        }
        let all = self.all();
        // The kernel lists mappings in address order.
        let i = all.partition_point(|e| e.end <= addr);
        let e = all.get(i)?;
        match which {
            vma::Which::Covering if e.start > addr => None,
            _ => Some(e.clone()),
        }
    }

    /// The mapping that contains `addr`, if any.
    pub(crate) fn mapping_of(&self, addr: usize) -> Option<Mapping> {
        let e = self.entry(addr, vma::Which::Covering, false)?;
        let mut found = Mapping {
            start: e.start,
            end: e.end,
            prot: e.prot,
        };
        if cfg!(uprobe_arch = "aarch64") && bti_guarded(found.start) {
            found.prot |= PROT_BTI;
        }
        Some(found)
    }

    /// The file mapped at `addr`, if any.
    pub(crate) fn path_of(&self, addr: usize) -> Option<std::path::PathBuf> {
        self.entry(addr, vma::Which::Covering, true)?.path()
    }

    /// The executable mapping that contains `addr`, if any.
    pub(crate) fn code_mapping_of(&self, addr: usize) -> Option<Mapping> {
        self.mapping_of(addr)
            .filter(|m| m.prot & libc::PROT_EXEC != 0)
    }

    /// Where the executable code that contains `addr` ends: the end of its
    /// mapping, or of the run of executable mappings that directly follow
    /// it (patching a page splits its segment's mapping in two, and an
    /// instruction may straddle the cut). `None` if `addr` is not in
    /// executable code.
    pub(crate) fn code_end(&self, addr: usize) -> Option<usize> {
        let mut end = self
            .entry(addr, vma::Which::Covering, false)
            .filter(Entry::exec)?
            .end;
        while let Some(next) = self
            .entry(end, vma::Which::CoveringOrNext, false)
            .filter(|e| e.start == end && e.exec())
        {
            end = next.end;
        }
        Some(end)
    }
}

/// [`Snapshot::code_end`] of the map as it is now.
pub(crate) fn code_end(addr: usize) -> Option<usize> {
    Snapshot::read().code_end(addr)
}

/// arm64's `PROT_BTI`.
const PROT_BTI: i32 = 0x10;

/// Whether the mapping starting at `start` is BTI-guarded (`bt` among its
/// `VmFlags` in `/proc/self/smaps`). qemu-user's `smaps` does not show the
/// flag: there a guarded page that is patched loses its guard.
fn bti_guarded(start: usize) -> bool {
    let Some(smaps) = read_proc("/proc/self/smaps") else {
        return false;
    };
    let header = format!("{start:x}-");
    smaps
        .lines()
        .skip_while(|l| !l.starts_with(&header))
        .find_map(|l| l.strip_prefix("VmFlags:"))
        .is_some_and(|flags| flags.split_whitespace().any(|f| f == "bt"))
}

/// One patch of code: `bytes` at `addr`, inside mapping `map`: one byte
/// on x86-64 or one aligned 4-byte instruction on aarch64 (a single store
/// either way, so a thread running the code sees the old or the new
/// instruction, never a mix), or the tail of an x86-64 jump, which a
/// breakpoint on the byte before it keeps every thread away from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Patch<'a> {
    pub(crate) map: Mapping,
    pub(crate) addr: usize,
    pub(crate) bytes: &'a [u8],
}

/// Batches of code writes begun so far.
static WRITES: AtomicU64 = AtomicU64::new(0);

/// How many batches of code writes ([`write_patches`]) have begun: a
/// reader that saw the same count before and after looking at the code
/// knows that no write of the engine's changed it in between (the count
/// rises before the first byte of a batch is written). Async-signal-safe.
pub(crate) fn code_writes() -> u64 {
    WRITES.load(Ordering::SeqCst)
}

/// Writes `patches`, keeping the code executable the whole time (other
/// threads may be running it): for each page, adds write permission,
/// stores that page's patches, makes them visible to instruction fetch
/// (aarch64: cache maintenance) and restores the original protection;
/// then, once for all of them, makes every thread serialise its
/// instruction stream before it runs the code again
/// (`membarrier(PRIVATE_EXPEDITED_SYNC_CORE)`). A batch of patches on few
/// pages thus costs a few system calls, not three per patch.
///
/// On an error, returns the patches (their indexes in `patches`, in
/// order) of each page that could not be made writable, with the error;
/// every patch on the other pages was written.
///
/// # Safety
/// Each `addr` is inside its `map`, and writing its `bytes` there is what
/// the caller wants every thread to execute from now on (a breakpoint
/// over the start of an instruction, or the instruction restored).
pub(crate) unsafe fn write_patches(
    patches: &[Patch<'_>],
) -> Result<(), Vec<(usize, crate::AttachError)>> {
    if patches.is_empty() {
        // Nothing written: no thread has anything to resynchronise.
        return Ok(());
    }
    // Before any byte changes (see `code_writes`).
    WRITES.fetch_add(1, Ordering::SeqCst);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut order: Vec<usize> = (0..patches.len()).collect();
    order.sort_by_key(|&i| patches[i].addr);
    let mut failed: Vec<(usize, crate::AttachError)> = Vec::new();
    for group in order.chunk_by(|&a, &b| patches[a].addr / page == patches[b].addr / page) {
        let first = &patches[group[0]];
        let base = first.addr & !(page - 1);
        // A jump's tail may run onto the next page (of the same mapping).
        let end = group
            .iter()
            .map(|&i| patches[i].addr + patches[i].bytes.len())
            .max()
            .unwrap_or(base);
        let span = (end - base).div_ceil(page) * page;
        let writable = first.map.prot | libc::PROT_WRITE | libc::PROT_EXEC;
        // SAFETY: `base` is a page of a live mapping; execute stays on,
        // so threads running it meanwhile are unaffected.
        if unsafe { libc::mprotect(base as *mut libc::c_void, span, writable) } != 0 {
            let e = crate::base::error::os_error("mprotect (add write)");
            failed.extend(group.iter().map(|&i| (i, e.clone())));
            continue;
        }
        for &i in group {
            let Patch { addr, bytes, .. } = patches[i];
            match *bytes {
                // SAFETY: the page is writable now; one byte can never
                // tear an instruction for a concurrent reader.
                [b] => unsafe { core::ptr::write_volatile(addr as *mut u8, b) },
                // SAFETY: as above; an aligned 4-byte store is
                // single-copy atomic.
                [a, b, c, d] if addr.is_multiple_of(4) => unsafe {
                    core::ptr::write_volatile(addr as *mut u32, u32::from_le_bytes([a, b, c, d]));
                },
                // The tail of a jump, behind a breakpoint on its first
                // byte (the caller's contract): no thread runs these
                // bytes while they are written.
                _ => {
                    for (k, &b) in bytes.iter().enumerate() {
                        // SAFETY: the page(s) are writable now.
                        unsafe { core::ptr::write_volatile((addr + k) as *mut u8, b) };
                    }
                }
            }
            crate::arch::flush_code(addr, bytes.len());
        }
        // SAFETY: as above, back to the mapping's own protection. A
        // failure leaves the page writable as well as executable; the
        // patches stand, and nothing is reported for them (the code is
        // what the caller wanted).
        unsafe { libc::mprotect(base as *mut libc::c_void, span, first.map.prot) };
    }
    // Cross-modifying code: every thread serialises before running it.
    // Where the kernel lacks SYNC_CORE, the mprotect calls above have
    // already sent each CPU running us a TLB-shootdown IPI, which
    // serialises on x86 (aarch64 has the kernel's own maintenance).
    let _ = pcpu::fence::sync_core();
    failed.sort_by_key(|&(i, _)| i);
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed)
    }
}

/// Every mapping's `[start, end)`, plus the room the main thread's stack
/// and the `brk` heap may still grow into (a mapping placed there would
/// make a deep recursion fault, or `malloc` fall back to `mmap`).
pub(crate) fn taken_ranges() -> Vec<(usize, usize)> {
    taken_of(&entries(), HEAP_ROOM)
}

impl Snapshot {
    /// Whether `[start, end)` is free for code of the engine's own:
    /// nothing mapped there, and not in the room the main thread's stack
    /// and the `brk` heap (`heap_room` above its end) may grow into; or
    /// else where the range that takes part of it ends. Asks the kernel
    /// for the one mapping at or above `start` where it answers
    /// (`PROCMAP_QUERY`), else reads the whole map, once for the batch.
    pub(crate) fn free(&self, start: usize, end: usize, heap_room: usize) -> Result<(), usize> {
        let taken_to = |ranges: Vec<(usize, usize)>| {
            ranges
                .into_iter()
                .filter(|&(s, e)| start < e && s < end)
                .map(|(_, e)| e)
                .max()
                .map_or(Ok(()), Err)
        };
        match self.ask(start, vma::Which::CoveringOrNext, false) {
            Ok(Some(v)) if v.start < end => Err(v.end),
            Ok(_) => taken_to(self.growth_rooms(heap_room)),
            Err(vma::Unsupported) => taken_to(taken_of(self.all(), heap_room)),
        }
    }

    /// The rooms the `brk` heap (`heap_room` above its end, `sbrk(0)`)
    /// and the main thread's stack (below its lowest page, which the
    /// kernel's query gives for the stack's start from `/proc/self/stat`)
    /// keep to grow into, as they are now: what [`taken_of`] adds to the
    /// mappings.
    fn growth_rooms(&self, heap_room: usize) -> Vec<(usize, usize)> {
        let mut rooms = Vec::new();
        // SAFETY: sbrk(0) moves nothing; it returns the current break.
        let brk = unsafe { libc::sbrk(0) } as usize;
        if brk != usize::MAX {
            rooms.push((brk, brk.saturating_add(heap_room)));
        }
        if let Some(stack) = main_stack()
            && let Ok(Some(v)) = self.ask(stack, vma::Which::Covering, false)
        {
            rooms.push((v.start.saturating_sub(stack_room()), v.start));
        }
        rooms
    }
}

/// An address in the main thread's stack: `startstack`, field 28 of
/// `/proc/self/stat` (read once; the fields after the command's closing
/// parenthesis start at field 3).
fn main_stack() -> Option<usize> {
    static AT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *AT.get_or_init(|| {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after = &stat[stat.rfind(')')? + 1..];
        after.split_whitespace().nth(28 - 3)?.parse().ok()
    })
}

/// The ranges `entries` take, with the room the stack and the heap keep.
fn taken_of(entries: &[Entry], heap_room: usize) -> Vec<(usize, usize)> {
    let mut taken = Vec::new();
    for e in entries {
        taken.push((e.start, e.end));
        match e.name.as_deref() {
            Some("[stack]") => taken.push((e.start.saturating_sub(stack_room()), e.start)),
            Some("[heap]") => taken.push((e.end, e.end.saturating_add(heap_room))),
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
    Snapshot::read().path_of(addr)
}

/// Where byte `offset` of file `path` is mapped executable in this process,
/// if it is. (Segments may share a page, so the same file offset can be
/// mapped twice, once read-only; code is what probes want.)
pub(crate) fn address_of_file_offset(path: &std::path::Path, offset: u64) -> Option<usize> {
    let want = std::fs::canonicalize(path).ok()?;
    entries().into_iter().find_map(|e| {
        let len = (e.end - e.start) as u64;
        (e.exec() && e.path()? == want && (e.offset..e.offset + len).contains(&offset))
            .then(|| e.start + (offset - e.offset) as usize)
    })
}

/// The file and the byte of it that executable address `addr` was mapped
/// from, if any (the inverse of [`address_of_file_offset`]).
#[cfg(feature = "test-hooks")]
pub(crate) fn file_offset_of(addr: usize) -> Option<(std::path::PathBuf, u64)> {
    let e = entries()
        .into_iter()
        .find(|e| e.exec() && (e.start..e.end).contains(&addr))?;
    Some((e.path()?, e.offset + (addr - e.start) as u64))
}

#[cfg(test)]
mod tests {
    use super::{entries, vma};

    /// One pass of the comparison: the first difference, if any.
    fn compare() -> Result<(), String> {
        let maps = vma::open().map_err(|_| "unsupported")?;
        let all = entries();
        for (i, e) in all.iter().enumerate() {
            // `[vsyscall]`, the gate page, is listed but is no mapping of
            // the process: the query does not find it.
            if e.name.as_deref() == Some("[vsyscall]") {
                continue;
            }
            let found = vma::query(&maps, e.start, vma::Which::Covering, true)
                .map_err(|_| "unsupported")?
                .ok_or(format!("line {i} not found: {e:?}"))?;
            let (got, want) = (
                (found.start, found.end, found.prot, found.offset, found.name),
                (e.start, e.end, e.prot, e.offset, e.name.clone()),
            );
            if got != want {
                return Err(format!("line {i}: {got:x?} for {want:x?}"));
            }
            if let Some(next) = all
                .get(i + 1)
                .filter(|n| n.start > e.end && n.name.as_deref() != Some("[vsyscall]"))
            {
                if vma::query(&maps, e.end, vma::Which::Covering, false)
                    .map_err(|_| "unsupported")?
                    .is_some()
                {
                    return Err(format!("a mapping in the gap at {:#x}", e.end));
                }
                let above = vma::query(&maps, e.end, vma::Which::CoveringOrNext, false)
                    .map_err(|_| "unsupported")?
                    .map(|v| v.start);
                if above != Some(next.start) {
                    return Err(format!(
                        "{above:x?} above {:#x}, not {:#x}",
                        e.end, next.start
                    ));
                }
            }
        }
        Ok(())
    }

    /// The kernel's answer for one address (`PROCMAP_QUERY`) agrees with
    /// the line `/proc/self/maps` has for it: every mapping by its start,
    /// with its name; an address in a gap has no mapping, and the next one
    /// above it is the next line. (Other tests of this binary may map or
    /// unmap memory between the two reads: a difference is checked again,
    /// and only one that stays fails.)
    #[test]
    fn a_query_agrees_with_the_map() {
        let supported = vma::open()
            .and_then(|maps| vma::query(&maps, entries()[0].start, vma::Which::Covering, false));
        if supported.is_err() {
            return; // an older kernel: the map is read instead
        }
        let mut last = Ok(());
        for _ in 0..5 {
            last = compare();
            if last.is_ok() {
                return;
            }
        }
        panic!("{}", last.unwrap_err());
    }
}
