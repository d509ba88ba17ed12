//! One mapping of the process by address, without reading the whole
//! memory map: the `PROCMAP_QUERY` ioctl on `/proc/self/maps` (Linux
//! 6.11 and later). The engine's own code regions and stubs are mappings
//! too, so with thousands of probes attached the map runs to thousands of
//! lines; reading and parsing it for every look-up made an attach cost
//! grow with the number already attached. Where the kernel has no such
//! query, [`query`] says so ([`Unsupported`]) and the caller reads the map.

use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicBool, Ordering};

/// `_IOWR('f', 17, struct procmap_query)` (`include/uapi/linux/fs.h`).
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;
/// `PROCMAP_QUERY_COVERING_OR_NEXT_VMA`.
const COVERING_OR_NEXT: u64 = 0x10;
/// `PROCMAP_QUERY_VMA_*` bits of `vma_flags`.
const READABLE: u64 = 0x1;
const WRITABLE: u64 = 0x2;
const EXECUTABLE: u64 = 0x4;

/// `struct procmap_query`.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

const _: () = assert!(size_of::<ProcmapQuery>() == 104);

/// A mapping the query found.
pub(crate) struct Vma {
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// `PROT_*` bits.
    pub(crate) prot: i32,
    /// The file offset of `start`.
    pub(crate) offset: u64,
    /// Its file or pseudo-name, when asked for and it has one.
    pub(crate) name: Option<String>,
}

/// Which mapping to find.
#[derive(Clone, Copy)]
pub(crate) enum Which {
    /// The one that contains the address.
    Covering,
    /// That one, or else the first one above the address.
    CoveringOrNext,
}

/// Set once the kernel refused the query: every later caller reads the
/// map instead.
static UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// `/proc/self/maps`, open for queries (kept by the caller for a batch of
/// them, and closed after: the engine keeps no descriptor open in the
/// process it runs in).
pub(crate) fn open() -> Result<std::fs::File, Unsupported> {
    if UNSUPPORTED.load(Ordering::Relaxed) {
        return Err(Unsupported);
    }
    std::fs::File::open("/proc/self/maps").map_err(|_| Unsupported)
}

/// The kernel has no `PROCMAP_QUERY` (or `/proc` is not there): read the
/// map instead.
#[derive(Debug)]
pub(crate) struct Unsupported;

/// The mapping `which` names for `addr` (with its name if `name`), `None`
/// if there is none, asked through `maps` ([`open`], which refuses once a
/// query was). Not
/// async-signal-safe.
pub(crate) fn query(
    maps: &std::fs::File,
    addr: usize,
    which: Which,
    name: bool,
) -> Result<Option<Vma>, Unsupported> {
    let mut path = [0u8; libc::PATH_MAX as usize];
    let mut q = ProcmapQuery {
        size: size_of::<ProcmapQuery>() as u64,
        query_flags: match which {
            Which::Covering => 0,
            Which::CoveringOrNext => COVERING_OR_NEXT,
        },
        query_addr: addr as u64,
        vma_name_size: if name { path.len() as u32 } else { 0 },
        vma_name_addr: if name { path.as_mut_ptr() as u64 } else { 0 },
        ..ProcmapQuery::default()
    };
    // SAFETY: a `struct procmap_query` of the size it declares; the name
    // buffer (if any) is as long as `vma_name_size` says.
    let rc = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &raw mut q) };
    if rc != 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT) {
            return Ok(None);
        }
        // ENOTTY or EINVAL: no such query here (an older kernel).
        UNSUPPORTED.store(true, Ordering::Relaxed);
        return Err(Unsupported);
    }
    let bit = |b: u64, p: i32| if q.vma_flags & b != 0 { p } else { 0 };
    // The name, without its terminating NUL (a size of 0: none).
    let name = (name && q.vma_name_size > 1)
        .then(|| String::from_utf8_lossy(&path[..q.vma_name_size as usize - 1]).into_owned());
    Ok(Some(Vma {
        start: q.vma_start as usize,
        end: q.vma_end as usize,
        prot: bit(READABLE, libc::PROT_READ)
            | bit(WRITABLE, libc::PROT_WRITE)
            | bit(EXECUTABLE, libc::PROT_EXEC),
        offset: q.vma_offset,
        name,
    }))
}
