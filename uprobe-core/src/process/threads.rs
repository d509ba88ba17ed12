//! Places a breakpoint must never go, and threads it must never meet.

use std::collections::HashMap;
use std::sync::Mutex;

use object::{Object as _, ObjectSection as _};

use crate::AttachError;

/// The threads of this process that block SIGTRAP (from
/// `/proc/self/task/*/status`, `SigBlk`). A trap on such a thread is turned
/// by the kernel into the default action: the whole process dies.
///
/// glibc blocks every signal for a moment while it starts or ends a
/// thread, so only threads seen blocking SIGTRAP at every look over about
/// a quarter of a second count (rescans 1, 2, 4, ... 128 ms apart: on a
/// loaded machine a thread's start can take milliseconds, and the wait is
/// only paid while some thread blocks).
///
/// Under an emulator (qemu-user) `/proc/self/task` shows the emulator's
/// own threads and masks, not the program's: then nothing is reported
/// (there is no way to know other threads' masks; the emulator delivers
/// the program's SIGTRAP itself).
pub(crate) fn threads_blocking_sigtrap() -> Vec<i32> {
    if !proc_shows_real_masks() {
        return Vec::new();
    }
    let mut blocking = scan_sigtrap_blockers();
    for shift in 0..8 {
        if blocking.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1 << shift));
        let now = scan_sigtrap_blockers();
        blocking.retain(|tid| now.contains(tid));
    }
    blocking
}

/// The ids of this process's threads now (`/proc/self/task`). Not
/// async-signal-safe.
pub(crate) fn thread_ids() -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

fn scan_sigtrap_blockers() -> Vec<i32> {
    let bit = 1u64 << (libc::SIGTRAP - 1);
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| {
            let tid: i32 = t.file_name().to_str()?.parse().ok()?;
            let blocked = blocked_mask(&t.path().join("status"))?;
            (blocked & bit != 0).then_some(tid)
        })
        .collect()
}

/// The `SigBlk` mask (signals 1 to 64) of a task's `status` file.
fn blocked_mask(status: &std::path::Path) -> Option<u64> {
    crate::process::maps::read_proc(status.to_str()?)?
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// Whether `/proc/self/task` describes this program, not an emulator
/// running it: qemu-user answers `/proc/self/exe` (and `maps`, ...) for
/// the program it runs, while the per-task entries it does not intercept
/// show the emulator itself, whose signal masks are its own.
fn proc_shows_real_masks() -> bool {
    let task = format!("/proc/self/task/{}/exe", crate::base::thread::current_tid());
    std::fs::read_link("/proc/self/exe").ok() == std::fs::read_link(task).ok()
}

/// The restartable sequences' critical sections of every loaded object
/// (their `__rseq_cs` descriptors), gathered once for a batch of attaches.
pub(crate) struct RseqSections(Vec<(usize, usize)>);

impl RseqSections {
    /// The sections of the objects loaded now: read again only when an
    /// object was loaded or unloaded since the last time (the dynamic
    /// linker's load and unload counts say so).
    pub(crate) fn read() -> Self {
        type Cached = Option<((u64, u64), Vec<(usize, usize)>)>;
        static CACHE: Mutex<Cached> = Mutex::new(None);
        let generation = crate::process::symbols::load_generation();
        let mut cache = CACHE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((seen, sections)) = cache.as_ref()
            && Some(*seen) == generation
        {
            return Self(sections.clone());
        }
        let sections: Vec<(usize, usize)> = crate::process::symbols::loaded_objects()
            .iter()
            .flat_map(rseq_sections)
            .collect();
        *cache = generation.map(|g| (g, sections.clone()));
        Self(sections)
    }

    /// Refuses `addr` if it lies in a critical section: on signal
    /// delivery the kernel moves the instruction pointer of a thread
    /// inside one to the section's abort handler, so a trap there could
    /// never be handled.
    pub(crate) fn refuse(&self, addr: usize) -> Result<(), AttachError> {
        match self
            .0
            .iter()
            .find(|(start, end)| (*start..*end).contains(&addr))
        {
            Some(&(start, end)) => Err(AttachError::RseqCriticalSection { addr, start, end }),
            None => Ok(()),
        }
    }
}

/// The critical sections read so far, by file and load bias.
type SectionsCache = HashMap<(std::path::PathBuf, usize), Vec<(usize, usize)>>;

/// See [`SectionsCache`].
static CACHE: Mutex<Option<SectionsCache>> = Mutex::new(None);

/// Forgets the critical sections read so far.
pub(crate) fn forget_rseq_sections() {
    *CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
}

/// The critical sections `[start, end)` of loaded object `l`, read once
/// per (file, load bias) and cached.
fn rseq_sections(l: &crate::process::symbols::Loaded) -> Vec<(usize, usize)> {
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    cache
        .get_or_insert_with(HashMap::new)
        .entry((l.path.clone(), l.bias))
        .or_insert_with(|| read_rseq_sections(l))
        .clone()
}

fn read_rseq_sections(l: &crate::process::symbols::Loaded) -> Vec<(usize, usize)> {
    let Ok(data) = crate::process::file::Mapped::open(&l.path) else {
        return Vec::new();
    };
    let Ok(file) = object::File::parse(data.bytes()) else {
        return Vec::new();
    };
    let Some(section) = file.section_by_name("__rseq_cs") else {
        return Vec::new();
    };
    // The descriptors as loaded (relocated): version, flags, start_ip,
    // post_commit_offset, abort_ip; 32 bytes each.
    let base = l.bias.wrapping_add(section.address() as usize);
    (0..section.size() as usize / 32)
        .map(|i| {
            let d = (base + 32 * i) as *const u64;
            // SAFETY: `__rseq_cs` is an allocated section of a loaded
            // object, mapped readable at `bias + address`.
            let (start, len) = unsafe { (d.add(1).read(), d.add(2).read()) };
            (start as usize, start.wrapping_add(len) as usize)
        })
        .collect()
}
