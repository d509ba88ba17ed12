//! The report the agent writes and the tool reads: a file in shared
//! memory, mapped by both. It outlives whatever the traced program does
//! to its own file descriptors (the mapping stays when the file is
//! closed), is shared with its fork children (every process adds into
//! the same counters) and is mapped again by programs it execs (the
//! agent travels in the environment), and every count is in it the
//! moment it happens, so even `_exit` loses nothing.

mod stacks;

pub use stacks::{MAX_FRAMES, ObjectEntry, StackEntry};

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use uprobe_core::{CountCell, LatencyCell};

/// Marks a report file (and its layout version).
pub const MAGIC: u64 = 0x7570_7472_6163_6503;
/// Slots a report holds at most: the probes asked for plus the functions
/// their patterns match.
pub const MAX_SLOTS: usize = 8192;
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
    /// Slots the file has room for.
    pub capacity: AtomicU64,
    /// The size of a slot, of a stack entry and of an object entry, as
    /// the tool that made the report lays them out (an agent of another
    /// build refuses a report it would misread).
    pub layout: AtomicU64,
    /// Slots handed out (the probes asked for first, then the functions
    /// patterns matched); may pass `capacity` when the report is full.
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
    /// Functions patterns matched that found no slot (a full report).
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

/// One probe's counts: a probe asked for, or one function a pattern
/// matched. Cache-line aligned (its counter shards are).
#[repr(C)]
pub struct Slot {
    /// The probe asked for that made this slot (itself, or the pattern).
    pub probe: AtomicU32,
    /// The label's length; 0 until the slot is filled in.
    pub label_len: AtomicU32,
    /// How the report names the slot (`malloc`, `libc.so.6:strlen`).
    pub label: [AtomicU8; LABEL_LEN],
    /// Sites attached (a USDT probe can have several), over every process.
    pub sites: AtomicU64,
    /// Of those, sites on the trap path (no jump).
    pub trap_sites: AtomicU64,
    /// Calls (hits of the entry probe) that ran a handler; a counting
    /// probe's are in the slot's count cells ([`Report::calls`] sums
    /// both).
    pub hits: Sharded,
    /// Returns seen (latency probes).
    pub returns: Sharded,
    /// Latencies in nanoseconds by log2 bucket (latency probes).
    pub histogram: [AtomicU64; BUCKETS],
    /// `--hist`: the values drawn, by log2 bucket.
    pub values: [AtomicU64; BUCKETS],
    /// `--hist`: negative values drawn.
    pub negative: AtomicU64,
    /// Why the probe is not attached (length, text); 0 once attached.
    pub error_len: AtomicU32,
    /// Why the last site on a breakpoint did not take a jump (length).
    pub trap_why_len: AtomicU32,
    /// See `error_len`.
    pub error: [AtomicU8; ERROR_LEN],
    /// See `trap_why_len`.
    pub trap_why: [AtomicU8; TRAP_WHY_LEN],
}

/// Bytes of a slot's reason for a breakpoint.
const TRAP_WHY_LEN: usize = 240;

impl core::fmt::Debug for Slot {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Slot")
            .field("label", &self.label())
            .field("sites", &self.sites.load(Ordering::Relaxed))
            .field("hits", &self.hits.sum())
            .field("returns", &self.returns.sum())
            .field("error", &self.error())
            .finish_non_exhaustive()
    }
}

/// A mapped report file.
pub struct Report {
    base: *mut u8,
    len: usize,
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
    fn size(slots: usize, cells: usize) -> usize {
        Self::latency_at(slots, cells) + slots * cells * size_of::<LatencyCell>()
    }

    /// Where the slots' latency cells start (after their count cells).
    fn latency_at(slots: usize, cells: usize) -> usize {
        (Self::cells_at(slots) + slots * cells * size_of::<CountCell>())
            .next_multiple_of(align_of::<LatencyCell>())
    }

    /// Where the slots' count cells start (after the stack and object
    /// tables), aligned as cells are.
    fn cells_at(slots: usize) -> usize {
        (Self::stacks_at(slots)
            + stacks::STACKS * size_of::<StackEntry>()
            + stacks::OBJECTS * size_of::<ObjectEntry>())
        .next_multiple_of(align_of::<CountCell>())
    }

    /// Where the stack table starts, after `slots` slots.
    fn stacks_at(slots: usize) -> usize {
        size_of::<Header>() + slots * size_of::<Slot>()
    }

    /// Creates the report file at `path` (readable and writable by its
    /// owner only) with a slot for each label (probe
    /// `i` is slot `i`) and room for `capacity` slots in all, and maps it.
    /// The file is sparse: slots never used take no memory.
    pub fn create(path: &Path, labels: &[String], capacity: usize) -> io::Result<Self> {
        if labels.len() > capacity || capacity > MAX_SLOTS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("at most {MAX_SLOTS} probes"),
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let cells = uprobe_core::count_cells();
        let size = Self::size(capacity, cells);
        file.set_len(size as u64)?;
        let report = Self::map(&file, size)?;
        let header = report.header();
        header.capacity.store(capacity as u64, Ordering::Relaxed);
        header.count_cells.store(cells as u64, Ordering::Relaxed);
        header.layout.store(layout(), Ordering::Relaxed);
        header.used.store(labels.len() as u64, Ordering::Relaxed);
        for (i, label) in labels.iter().enumerate() {
            if let Some(slot) = report.slot(i) {
                slot.fill(i, label);
            }
        }
        header.magic.store(MAGIC, Ordering::Release);
        Ok(report)
    }

    /// Maps the report file at `path` (made by [`create`](Self::create)).
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(0);
        if len < size_of::<Header>() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a report"));
        }
        let report = Self::map(&file, len)?;
        let capacity = report.header().capacity.load(Ordering::Relaxed) as usize;
        let cells = report.header().count_cells.load(Ordering::Relaxed) as usize;
        if report.header().magic.load(Ordering::Acquire) != MAGIC
            || capacity > MAX_SLOTS
            || cells > MAX_CELLS
            || len < Self::size(capacity, cells)
        {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a report"));
        }
        if report.header().layout.load(Ordering::Relaxed) != layout() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a report laid out by another build of uprobe-trace",
            ));
        }
        Ok(report)
    }

    fn map(file: &std::fs::File, len: usize) -> io::Result<Self> {
        use std::os::fd::AsRawFd as _;
        // SAFETY: a shared mapping of a file of `len` bytes; the fd may be
        // closed afterwards (the mapping stays).
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
        Ok(Self {
            base: p.cast(),
            len,
        })
    }

    /// The header.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // the mapping is page-aligned
    pub fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header (checked at open).
        unsafe { &*self.base.cast::<Header>() }
    }

    /// Slot `i`, if the report has room for it.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // page-aligned, cache-line multiples
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        let capacity = self.header().capacity.load(Ordering::Relaxed) as usize;
        let at = size_of::<Header>() + i * size_of::<Slot>();
        // SAFETY: inside the mapping (checked), aligned (the header and
        // slots are multiples of a cache line, the mapping page-aligned).
        (i < capacity && at + size_of::<Slot>() <= self.len)
            .then(|| unsafe { &*self.base.add(at).cast::<Slot>() })
    }

    /// A new slot for a function probe `probe`'s pattern matched, labelled
    /// `label`; `None` when the report is full. Not async-signal-safe
    /// only in that it may be slow (it writes the label byte by byte).
    #[must_use]
    pub fn claim(&self, probe: usize, label: &str) -> Option<(usize, &Slot)> {
        let i = self.header().used.fetch_add(1, Ordering::Relaxed) as usize;
        let Some(slot) = self.slot(i) else {
            self.header().lost_slots.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        slot.fill(probe, label);
        Some((i, slot))
    }

    /// Slot `i`'s count cells, where counting probes count its calls
    /// (`None`: the report has no room for them, or this machine's
    /// counters need more cells than the tool that made it laid out).
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // aligned by `cells_at`
    pub fn count_cells(&self, i: usize) -> Option<&[CountCell]> {
        let capacity = self.header().capacity.load(Ordering::Relaxed) as usize;
        let n = self.header().count_cells.load(Ordering::Relaxed) as usize;
        let at = Self::cells_at(capacity) + i * n * size_of::<CountCell>();
        // SAFETY: inside the mapping (checked), aligned (the mapping is
        // page-aligned, `cells_at` a multiple of the cells' alignment);
        // zero bytes are a `CountCell` at zero, and cells are atomics.
        (i < capacity
            && n >= uprobe_core::count_cells()
            && at + n * size_of::<CountCell>() <= self.len)
            .then(|| unsafe {
                core::slice::from_raw_parts(self.base.add(at).cast::<CountCell>(), n)
            })
    }

    /// Slot `i`'s latency cells, where a timing probe counts its calls
    /// and times their returns (`None` as for
    /// [`count_cells`](Self::count_cells)). The count cells' number.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // aligned by `latency_at`
    pub fn latency_cells(&self, i: usize) -> Option<&[LatencyCell]> {
        let capacity = self.header().capacity.load(Ordering::Relaxed) as usize;
        let n = self.header().count_cells.load(Ordering::Relaxed) as usize;
        let at = Self::latency_at(capacity, n) + i * n * size_of::<LatencyCell>();
        // SAFETY: as in `count_cells`; zero bytes are a `LatencyCell` at
        // zero.
        (i < capacity
            && n >= uprobe_core::latency_cells()
            && at + n * size_of::<LatencyCell>() <= self.len)
            .then(|| unsafe {
                core::slice::from_raw_parts(self.base.add(at).cast::<LatencyCell>(), n)
            })
    }

    /// Calls of slot `i`: counted by its handlers, in its count cells and
    /// in its latency cells.
    #[must_use]
    pub fn calls(&self, i: usize) -> u64 {
        let counted = self.count_cells(i).map_or(0, CountCell::sum);
        let timed = self.latency_cells(i).map_or(0, LatencyCell::total_calls);
        self.slot(i)
            .map_or(0, |s| s.hits.sum())
            .wrapping_add(counted)
            .wrapping_add(timed)
    }

    /// Returns of slot `i` and their latencies by log2 bucket (ns): those
    /// its return handlers recorded, and those its latency cells hold.
    #[must_use]
    pub fn latencies(&self, i: usize) -> (u64, [u64; BUCKETS]) {
        let mut hist = self
            .latency_cells(i)
            .map_or([0; BUCKETS], LatencyCell::histogram);
        let mut returns: u64 = hist.iter().sum();
        if let Some(slot) = self.slot(i) {
            returns = returns.wrapping_add(slot.returns.sum());
            for (h, b) in hist.iter_mut().zip(&slot.histogram) {
                *h = h.wrapping_add(b.load(Ordering::Relaxed));
            }
        }
        (returns, hist)
    }

    /// The index of `slot`, one of this report's.
    #[must_use]
    pub fn index_of(&self, slot: &Slot) -> usize {
        let at = core::ptr::from_ref(slot) as usize - self.base as usize;
        (at - size_of::<Header>()) / size_of::<Slot>()
    }

    /// The slots filled in so far, with their indexes.
    pub fn slots(&self) -> impl Iterator<Item = (usize, &Slot)> {
        let used = self.header().used.load(Ordering::Acquire) as usize;
        (0..used)
            .map_while(|i| self.slot(i).map(|s| (i, s)))
            .filter(|(_, s)| s.label_len.load(Ordering::Acquire) != 0)
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
        // SAFETY: our own mapping; the caller promises no access follows.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// The sizes of the report's records, in one word.
fn layout() -> u64 {
    ((size_of::<Header>() as u64) << 48)
        | ((size_of::<Slot>() as u64) << 32)
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

impl Slot {
    /// Fills in a fresh slot for probe `probe`.
    fn fill(&self, probe: usize, label: &str) {
        self.probe.store(probe as u32, Ordering::Relaxed);
        // A label is never empty (an empty one would read as unfilled).
        set_text(
            &self.label_len,
            &self.label,
            if label.is_empty() { "?" } else { label },
        );
    }

    /// Records why a site stays on a breakpoint.
    pub fn set_trap_why(&self, text: &str) {
        set_text(&self.trap_why_len, &self.trap_why, text);
    }

    /// Why the last site on a breakpoint did not take a jump.
    #[must_use]
    pub fn trap_why(&self) -> Option<String> {
        get_text(&self.trap_why_len, &self.trap_why)
    }

    /// How the report names the slot.
    #[must_use]
    pub fn label(&self) -> String {
        get_text(&self.label_len, &self.label).unwrap_or_default()
    }

    /// Records why the probe is not attached (or clears it with `""`).
    pub fn set_error(&self, text: &str) {
        set_text(&self.error_len, &self.error, text);
    }

    /// Why the probe is not attached, if it is not.
    #[must_use]
    pub fn error(&self) -> Option<String> {
        get_text(&self.error_len, &self.error)
    }

    /// Records one latency. Async-signal-safe.
    pub fn record_latency(&self, nanos: u64) {
        self.histogram[bucket(nanos)].fetch_add(1, Ordering::Relaxed);
        self.returns.add(1);
    }

    /// Records one value drawn for `--hist`. Async-signal-safe.
    pub fn record_value(&self, value: crate::spec::Value) {
        match value {
            crate::spec::Value::Signed(v) if v < 0 => {
                self.negative.fetch_add(1, Ordering::Relaxed);
            }
            crate::spec::Value::Signed(v) => {
                self.values[bucket(v as u64)].fetch_add(1, Ordering::Relaxed);
            }
            crate::spec::Value::Unsigned(v) => {
                self.values[bucket(v)].fetch_add(1, Ordering::Relaxed);
            }
        }
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
