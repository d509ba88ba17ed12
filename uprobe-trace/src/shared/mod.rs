//! The report the agent writes and the tool reads: a file in shared
//! memory, mapped by both. It outlives whatever the traced program does
//! to its own file descriptors (the mapping stays when the file is
//! closed), is shared with its fork children (every process adds into
//! the same counters) and is mapped again by programs it execs (the
//! agent travels in the environment), and every count is in it the
//! moment it happens, so even `_exit` loses nothing.
//!
//! The file: the [`Header`], the index of the slots by probe and label
//! (`slots`), the stack and object tables (`stacks`), then the slots
//! in chunks that the file grows by as functions are matched, each chunk
//! with its slots' counters. Every process maps the chunks it uses.

mod flow;
mod slots;
mod stacks;

pub use flow::{Event, Flow};
pub use slots::{PER_CHUNK, Slot};
pub use stacks::{KEY_BIT, MAX_FRAMES, ObjectEntry, StackEntry};

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU32, AtomicU64, Ordering};

/// Marks a report file (and its layout version).
pub const MAGIC: u64 = 0x7570_7472_6163_6504;
/// Separates a slot's label from its `--by` key (`malloc\u{1f}1234`):
/// never in a name.
pub const KEY_SEP: char = '\u{1f}';

/// A slot's label and its `--by` key, if it has one.
#[must_use]
pub fn split_key(label: &str) -> (&str, Option<&str>) {
    match label.split_once(KEY_SEP) {
        Some((l, k)) => (l, Some(k)),
        None => (label, None),
    }
}

// ---- The file's layout, before the chunks ---------------------------------

/// Mappings start at multiples of this (the largest page size).
const ALIGN: usize = 1 << 16;
/// Where the slots' index starts, after the header.
const INDEX_AT: usize = size_of::<Header>();
/// Where the stack table starts, after the index.
const STACKS_AT: usize = INDEX_AT + slots::INDEX * size_of::<u64>();
/// Where the chunks start: the size of the part every process maps.
const BASE: usize = (STACKS_AT
    + stacks::STACKS * size_of::<StackEntry>()
    + stacks::OBJECTS * size_of::<ObjectEntry>())
.next_multiple_of(ALIGN);

/// Probes a user may ask for at once (each `-f`, `-u` or `--hist`; the
/// functions their patterns match are not counted: the report grows).
pub const MAX_PROBES: usize = 4096;
/// Histogram buckets: bucket `k` counts values in `[2^(k-1), 2^k)`
/// (bucket 0: the value 0), as a timing probe's latency cells do.
pub const BUCKETS: usize = uprobe_core::LATENCY_BUCKETS;
/// Count cells per slot at most (a machine with 4096 possible CPUs).
const MAX_CELLS: usize = 4097;
/// Bytes of an error message kept per probe.
const ERROR_LEN: usize = 240;
/// Bytes of a slot's label.
const LABEL_LEN: usize = 200;

/// The start of the report (a multiple of a cache line long: the slots
/// after it hold cache-line-aligned counter shards).
#[repr(C, align(64))]
pub struct Header {
    /// [`MAGIC`].
    pub magic: AtomicU64,
    /// Bytes of a chunk of slots and their counters.
    pub chunk_bytes: AtomicU64,
    /// The size of a slot, of a stack entry and of an object entry, as
    /// the tool that made the report lays them out (an agent of another
    /// build refuses a report it would misread).
    pub layout: AtomicU64,
    /// Slots handed out (the probes asked for first, then the functions
    /// patterns matched, one per probe and label over every process).
    pub used: AtomicU64,
    /// Agents (processes) that started tracing.
    pub agents: AtomicU64,
    /// Agents that finished their first round of attaches.
    pub ready: AtomicU64,
    /// Set by the tool: the agent of an attached process (`--pid`)
    /// detaches every probe and stops.
    pub stop: AtomicU64,
    /// Set by that agent once every probe is detached and it stopped.
    pub stopped: AtomicU64,
    /// Lines of `--print` output that could not be written.
    pub lost_lines: AtomicU64,
    /// Functions patterns matched that found no slot (the report could
    /// not grow: no memory, or no file descriptor to grow it with).
    pub lost_slots: AtomicU64,
    /// Stacks (`--stacks`) that found no entry (a full table).
    pub lost_stacks: AtomicU64,
    /// Object entries handed out (may pass their capacity).
    pub objects_used: AtomicU64,
    /// Count cells per slot ([`uprobe_core::count_cells`] on this
    /// machine): where counting probes count a slot's calls.
    pub count_cells: AtomicU64,
    /// An agent's error that concerns no single probe (length, text).
    pub error_len: AtomicU32,
    _pad: u32,
    /// See `error_len`.
    pub error: [AtomicU8; ERROR_LEN],
}

impl core::fmt::Debug for Header {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Header")
            .field("used", &self.used.load(Ordering::Relaxed))
            .field("agents", &self.agents.load(Ordering::Relaxed))
            .field("error", &self.error())
            .finish_non_exhaustive()
    }
}

/// Counter shards: a counter every thread of a process adds to would
/// bounce its cache line between the CPUs on every hit.
pub const SHARDS: usize = 8;

/// One shard of a [`Sharded`] counter, a cache line of its own.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Shard(pub AtomicU64);

/// A counter in [`SHARDS`] shards, each added to by the CPUs whose number
/// picks it, summed when read.
#[repr(C)]
pub struct Sharded(pub [Shard; SHARDS]);

impl Sharded {
    /// Adds `n` on the calling CPU's shard. Async-signal-safe (the CPU
    /// is read from the thread's rseq area: one load, no call, where
    /// glibc registered one).
    pub fn add(&self, n: u64) {
        self.0[pcpu::current_cpu() % SHARDS]
            .0
            .fetch_add(n, Ordering::Relaxed);
    }

    /// The sum of the shards.
    #[must_use]
    pub fn sum(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }
}

impl core::fmt::Debug for Sharded {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        self.sum().fmt(f)
    }
}

/// A mapped report file.
pub struct Report {
    /// The mapping of everything before the chunks.
    base: *mut u8,
    len: usize,
    /// The file, to map chunks from (and grow it by them).
    path: CString,
    /// Count cells (and latency cells) per slot.
    cells: usize,
    /// Bytes of a chunk.
    chunk_bytes: usize,
    /// Each chunk's mapping in this process (null: not mapped yet).
    chunks: Box<[AtomicPtr<u8>]>,
}

// SAFETY: the mapping is shared memory accessed through atomics (and the
// error bytes, written before their length is published).
unsafe impl Send for Report {}
// SAFETY: as above.
unsafe impl Sync for Report {}

impl core::fmt::Debug for Report {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Report")
            .field("used", &self.header().used.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Report {
    /// Creates the report file at `path` (readable and writable by its
    /// owner only) with a slot for each label (probe `i` is slot `i`), and
    /// maps it. The file is sparse, and grows by a chunk of slots at a time
    /// as functions are matched.
    pub fn create(path: &Path, labels: &[String]) -> io::Result<Self> {
        if labels.len() > MAX_PROBES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("at most {MAX_PROBES} probes"),
            ));
        }
        let file = create_file(path, BASE)?;
        let cells = uprobe_core::count_cells().max(uprobe_core::latency_cells());
        let mut report = Self::map(path, &file)?;
        report.cells = cells;
        report.chunk_bytes = slots::chunk_bytes(cells);
        let header = report.header();
        header.count_cells.store(cells as u64, Ordering::Relaxed);
        header
            .chunk_bytes
            .store(report.chunk_bytes as u64, Ordering::Relaxed);
        header.layout.store(layout(), Ordering::Relaxed);
        header.used.store(labels.len() as u64, Ordering::Relaxed);
        for (i, label) in labels.iter().enumerate() {
            report
                .slot(i)
                .ok_or_else(io::Error::last_os_error)?
                .fill(i, i, label);
        }
        header.magic.store(MAGIC, Ordering::Release);
        Ok(report)
    }

    /// Maps the report file at `path` (made by [`create`](Self::create)).
    pub fn open(path: &Path) -> io::Result<Self> {
        let (file, _) = open_file(path, BASE, "not a report")?;
        let mut report = Self::map(path, &file)?;
        let header = report.header();
        let cells = header.count_cells.load(Ordering::Relaxed) as usize;
        let chunk_bytes = header.chunk_bytes.load(Ordering::Relaxed) as usize;
        if header.magic.load(Ordering::Acquire) != MAGIC
            || cells > MAX_CELLS
            || chunk_bytes != slots::chunk_bytes(cells)
        {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a report"));
        }
        if header.layout.load(Ordering::Relaxed) != layout() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a report laid out by another build of uprobe-trace",
            ));
        }
        report.cells = cells;
        report.chunk_bytes = chunk_bytes;
        Ok(report)
    }

    /// Maps the part of the file before the chunks.
    fn map(path: &Path, file: &std::fs::File) -> io::Result<Self> {
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // The file's first `BASE` bytes: its length was set or checked.
        let base = map_shared(file, BASE)?;
        Ok(Self {
            base,
            len: BASE,
            path,
            cells: 0,
            chunk_bytes: 0,
            chunks: (0..slots::MAX_CHUNKS)
                .map(|_| AtomicPtr::new(core::ptr::null_mut()))
                .collect(),
        })
    }

    /// The header.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // the mapping is page-aligned
    pub fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header (checked at open).
        unsafe { &*self.base.cast::<Header>() }
    }
}

impl Report {
    /// Unmaps the report now, as dropping it would, through a shared
    /// reference: for an owner that cannot be dropped (the agent is
    /// leaked).
    ///
    /// # Safety
    /// Nothing reads or writes the report (through any reference) after
    /// this call.
    pub unsafe fn unmap(&self) {
        for chunk in &self.chunks {
            let p = chunk.swap(core::ptr::null_mut(), Ordering::Relaxed);
            if !p.is_null() {
                // SAFETY: a chunk mapping of ours; no access follows.
                unsafe { libc::munmap(p.cast(), self.chunk_bytes) };
            }
        }
        // SAFETY: our own mapping; the caller promises no access follows.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        // SAFETY: nothing can use the report once it is dropped.
        unsafe { self.unmap() };
    }
}

/// A new file at `path`, readable and writable by its owner only,
/// `len` bytes long (sparse).
fn create_file(path: &Path, len: usize) -> io::Result<std::fs::File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.set_len(len as u64)?;
    Ok(file)
}

/// The file at `path`, opened to read and write, and its length: at
/// least `min` bytes, else `not_ours` (`InvalidData`).
fn open_file(path: &Path, min: usize, not_ours: &str) -> io::Result<(std::fs::File, usize)> {
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    let len = usize::try_from(file.metadata()?.len()).unwrap_or(0);
    if len < min {
        return Err(io::Error::new(io::ErrorKind::InvalidData, not_ours));
    }
    Ok((file, len))
}

/// A shared read-write mapping of the first `len` bytes of `file` (the
/// file may be closed afterwards: the mapping stays).
fn map_shared(file: &std::fs::File, len: usize) -> io::Result<*mut u8> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a shared mapping of a file the caller sized; no memory of
    // ours is touched.
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// The sizes of the report's records, in one word.
fn layout() -> u64 {
    ((size_of::<Header>() as u64) << 48)
        | ((size_of::<Slot>() as u64) << 32)
        | ((PER_CHUNK as u64) << 24)
        | ((size_of::<StackEntry>() as u64) << 16)
        | size_of::<ObjectEntry>() as u64
}

/// Writes a text into a header's or slot's field (bytes, then the length
/// that publishes them). Async-signal-safe.
fn set_text<const N: usize>(len: &AtomicU32, field: &[AtomicU8; N], text: &str) {
    let n = text.len().min(N);
    for (dst, &b) in field.iter().zip(&text.as_bytes()[..n]) {
        dst.store(b, Ordering::Relaxed);
    }
    len.store(n as u32, Ordering::Release);
}

fn get_text<const N: usize>(len: &AtomicU32, field: &[AtomicU8; N]) -> Option<String> {
    let n = (len.load(Ordering::Acquire) as usize).min(N);
    let bytes: Vec<u8> = field[..n]
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .collect();
    (n > 0).then(|| String::from_utf8_lossy(&bytes).into_owned())
}

impl Header {
    /// Records an error that concerns no single probe.
    pub fn set_error(&self, text: &str) {
        set_text(&self.error_len, &self.error, text);
    }

    /// The error recorded, if any.
    #[must_use]
    pub fn error(&self) -> Option<String> {
        get_text(&self.error_len, &self.error)
    }
}

/// The log2 bucket of `v`: 0 for 0, `k` for `[2^(k-1), 2^k)`, the last
/// bucket for everything above.
fn bucket(v: u64) -> usize {
    ((u64::BITS - v.leading_zeros()) as usize).min(BUCKETS - 1)
}

/// The bounds `[lo, hi)` of bucket `k`.
#[must_use]
pub fn bucket_bounds(k: usize) -> (u64, u64) {
    if k == 0 {
        (0, 1)
    } else {
        (
            1u64 << (k - 1),
            1u64.checked_shl(k as u32).unwrap_or(u64::MAX),
        )
    }
}
