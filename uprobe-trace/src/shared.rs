//! The report the agent writes and the tool reads: a file in shared
//! memory, mapped by both. It outlives whatever the traced program does
//! to its own file descriptors (the mapping stays when the file is
//! closed), is shared with its fork children (every process adds into
//! the same counters) and is mapped again by programs it execs (the
//! agent travels in the environment), and every count is in it the
//! moment it happens, so even `_exit` loses nothing.

use std::fs::OpenOptions;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

/// Marks a report file (and its layout version).
pub const MAGIC: u64 = 0x7570_7472_6163_6501;
/// Probes a report holds at most.
pub const MAX_PROBES: usize = 256;
/// Latency buckets: bucket `k` counts latencies in `[2^(k-1), 2^k)`
/// nanoseconds (bucket 0: 0 ns).
pub const BUCKETS: usize = 64;
/// Bytes of an error message kept per probe.
const ERROR_LEN: usize = 240;

/// The start of the report.
#[repr(C)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: AtomicU64,
    /// Probes in the report.
    pub probes: AtomicU64,
    /// Agents (processes) that started tracing.
    pub agents: AtomicU64,
    /// Lines of `--print` output that could not be written.
    pub lost_lines: AtomicU64,
    /// An agent's error that concerns no single probe (length, text).
    pub error_len: AtomicU32,
    _pad: u32,
    /// See `error_len`.
    pub error: [AtomicU8; ERROR_LEN],
}

impl core::fmt::Debug for Header {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Header")
            .field("probes", &self.probes.load(Ordering::Relaxed))
            .field("agents", &self.agents.load(Ordering::Relaxed))
            .field("error", &self.error())
            .finish_non_exhaustive()
    }
}

/// One probe's counts.
#[repr(C)]
pub struct Slot {
    /// Sites attached (a USDT probe can have several), over every process.
    pub sites: AtomicU64,
    /// Of those, sites on the trap path (no jump).
    pub trap_sites: AtomicU64,
    /// Calls (hits of the entry probe).
    pub hits: AtomicU64,
    /// Returns seen (latency probes).
    pub returns: AtomicU64,
    /// Latencies by log2 bucket (latency probes).
    pub histogram: [AtomicU64; BUCKETS],
    /// Why the probe is not attached (length, text); 0 once attached.
    pub error_len: AtomicU32,
    _pad: u32,
    /// See `error_len`.
    pub error: [AtomicU8; ERROR_LEN],
}

impl core::fmt::Debug for Slot {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Slot")
            .field("sites", &self.sites.load(Ordering::Relaxed))
            .field("hits", &self.hits.load(Ordering::Relaxed))
            .field("returns", &self.returns.load(Ordering::Relaxed))
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
            .field("probes", &self.header().probes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Report {
    fn size(probes: usize) -> usize {
        size_of::<Header>() + probes * size_of::<Slot>()
    }

    /// Creates the report file at `path` for `probes` probes and maps it.
    pub fn create(path: &Path, probes: usize) -> io::Result<Self> {
        if probes > MAX_PROBES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("at most {MAX_PROBES} probes"),
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        file.set_len(Self::size(probes) as u64)?;
        let report = Self::map(&file, Self::size(probes))?;
        report
            .header()
            .probes
            .store(probes as u64, Ordering::Relaxed);
        report.header().magic.store(MAGIC, Ordering::Release);
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
        let probes = report.header().probes.load(Ordering::Relaxed) as usize;
        if report.header().magic.load(Ordering::Acquire) != MAGIC || len < Self::size(probes) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a report"));
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

    /// Probe `i`'s slot, if the report has one.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // page-aligned, 8-byte multiples
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        let at = size_of::<Header>() + i * size_of::<Slot>();
        // SAFETY: inside the mapping (checked), aligned (the header and
        // slots are multiples of 8 bytes).
        (at + size_of::<Slot>() <= self.len).then(|| unsafe { &*self.base.add(at).cast::<Slot>() })
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Writes an error message into a header's or slot's error field (bytes,
/// then the length that publishes them). Async-signal-safe.
fn set_error(len: &AtomicU32, field: &[AtomicU8; ERROR_LEN], text: &str) {
    let n = text.len().min(ERROR_LEN);
    for (dst, &b) in field.iter().zip(&text.as_bytes()[..n]) {
        dst.store(b, Ordering::Relaxed);
    }
    len.store(n as u32, Ordering::Release);
}

fn get_error(len: &AtomicU32, field: &[AtomicU8; ERROR_LEN]) -> Option<String> {
    let n = (len.load(Ordering::Acquire) as usize).min(ERROR_LEN);
    let bytes: Vec<u8> = field[..n]
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .collect();
    (n > 0).then(|| String::from_utf8_lossy(&bytes).into_owned())
}

impl Header {
    /// Records an error that concerns no single probe.
    pub fn set_error(&self, text: &str) {
        set_error(&self.error_len, &self.error, text);
    }

    /// The error recorded, if any.
    #[must_use]
    pub fn error(&self) -> Option<String> {
        get_error(&self.error_len, &self.error)
    }
}

impl Slot {
    /// Records why the probe is not attached (or clears it with `""`).
    pub fn set_error(&self, text: &str) {
        set_error(&self.error_len, &self.error, text);
    }

    /// Why the probe is not attached, if it is not.
    #[must_use]
    pub fn error(&self) -> Option<String> {
        get_error(&self.error_len, &self.error)
    }

    /// Records one latency. Async-signal-safe.
    pub fn record_latency(&self, nanos: u64) {
        let bucket = (u64::BITS - nanos.leading_zeros()) as usize;
        self.histogram[bucket.min(BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
        self.returns.fetch_add(1, Ordering::Relaxed);
    }
}
