//! The slots: one per probe asked for, then one per function a pattern
//! matched, shared by every process that matched it (the index finds a
//! probe's slot for a label), in chunks the file grows by.
//!
//! The index is a table of words `tag << 32 | slot + 1` with open
//! addressing: a claim takes a free word by a compare-and-swap to
//! `tag << 32 | PENDING`, takes a new slot, fills it in and publishes it;
//! a claim of the same label finds the word by its tag and checks the
//! slot's label. A process killed between the two would leave a word
//! pending: claims wait a bounded time for it, then take a slot of their
//! own (the tool merges slots of one label, so nothing is lost). A full
//! table, likewise, only costs slots.
//!
//! A chunk is [`PER_CHUNK`] slots, then their count cells, then their
//! latency cells. A process maps a chunk the first time it uses one; the
//! claim that first needs it grows the file, under an exclusive `flock`
//! (a concurrent grow to a smaller size must not truncate it).

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use uprobe_core::{CountCell, LatencyCell};

use super::{
    ALIGN, BASE, BUCKETS, ERROR_LEN, INDEX_AT, LABEL_LEN, Report, Sharded, bucket, get_text,
    set_text,
};

/// Slots per chunk.
pub const PER_CHUNK: usize = 256;
/// Chunks a report may grow to (over four million slots: memory runs out
/// first).
pub(super) const MAX_CHUNKS: usize = 1 << 14;
/// Words in the index.
pub(super) const INDEX: usize = 1 << 18;
/// Index words a claim looks at before taking a slot of its own.
const PROBES: usize = 64;
/// A word taken, its slot not published yet.
const PENDING: u64 = 0xffff_ffff;

/// Where a chunk's count cells start.
const fn count_at() -> usize {
    (PER_CHUNK * size_of::<Slot>()).next_multiple_of(align_of::<CountCell>())
}

/// Where a chunk's latency cells start, with `cells` cells per slot.
const fn latency_at(cells: usize) -> usize {
    (count_at() + PER_CHUNK * cells * size_of::<CountCell>())
        .next_multiple_of(align_of::<LatencyCell>())
}

/// Bytes of a chunk with `cells` cells per slot.
pub(super) const fn chunk_bytes(cells: usize) -> usize {
    (latency_at(cells) + PER_CHUNK * cells * size_of::<LatencyCell>()).next_multiple_of(ALIGN)
}

/// One probe's counts: a probe asked for, or one function a pattern
/// matched. Cache-line aligned (its counter shards are).
#[repr(C)]
pub struct Slot {
    /// The probe asked for that made this slot (itself, or the pattern).
    pub probe: AtomicU32,
    /// The slot's own index in the report.
    pub index: AtomicU32,
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

/// A hash of a probe and a label (FNV-1a, then a final mix).
fn hash(probe: usize, label: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64 ^ probe as u64;
    for &b in label.as_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 29;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 32)
}

impl Report {
    /// The index.
    #[allow(clippy::cast_ptr_alignment)] // page-aligned, 8-byte words
    fn index(&self) -> &[AtomicU64] {
        // SAFETY: inside the base mapping, aligned, atomics only.
        unsafe { core::slice::from_raw_parts(self.base.add(INDEX_AT).cast::<AtomicU64>(), INDEX) }
    }

    /// Chunk `c`, mapped in this process (the file grown to hold it if
    /// it does not yet); `None` past the last chunk or where it cannot be
    /// mapped.
    fn chunk(&self, c: usize) -> Option<*mut u8> {
        let cell = self.chunks.get(c)?;
        let p = cell.load(Ordering::Acquire);
        if !p.is_null() {
            return Some(p);
        }
        let at = BASE + c * self.chunk_bytes;
        // SAFETY: system calls on a descriptor of our own, closed before
        // returning; the mapping is of the file's range for the chunk,
        // which the file is grown to hold first.
        let p = unsafe {
            let fd = libc::open(self.path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if fd < 0 {
                return None;
            }
            let mut st: libc::stat = core::mem::zeroed();
            let grown = libc::flock(fd, libc::LOCK_EX) == 0
                && libc::fstat(fd, &raw mut st) == 0
                && (st.st_size as usize >= at + self.chunk_bytes
                    || libc::ftruncate(fd, (at + self.chunk_bytes) as libc::off_t) == 0);
            libc::flock(fd, libc::LOCK_UN);
            let p = if grown {
                libc::mmap(
                    core::ptr::null_mut(),
                    self.chunk_bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    at as libc::off_t,
                )
            } else {
                libc::MAP_FAILED
            };
            libc::close(fd);
            if p == libc::MAP_FAILED {
                return None;
            }
            p.cast::<u8>()
        };
        match cell.compare_exchange(
            core::ptr::null_mut(),
            p,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Some(p),
            Err(won) => {
                // SAFETY: our own mapping, never handed out.
                unsafe { libc::munmap(p.cast(), self.chunk_bytes) };
                Some(won)
            }
        }
    }

    /// Slot `i` (its chunk mapped if it is not yet).
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // chunks are page-aligned
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        let chunk = self.chunk(i / PER_CHUNK)?;
        // SAFETY: inside the chunk, aligned (slots are cache-line
        // multiples); zero bytes are an empty slot, and slots are atomics.
        Some(unsafe { &*chunk.add(i % PER_CHUNK * size_of::<Slot>()).cast::<Slot>() })
    }

    /// Slot `i`'s count cells, where counting probes count its calls
    /// (`None`: its chunk cannot be mapped, or this machine's counters
    /// need more cells than the tool that made the report laid out).
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // aligned by `count_at`
    pub fn count_cells(&self, i: usize) -> Option<&[CountCell]> {
        let n = self.cells;
        if n < uprobe_core::count_cells() {
            return None;
        }
        let chunk = self.chunk(i / PER_CHUNK)?;
        let at = count_at() + i % PER_CHUNK * n * size_of::<CountCell>();
        // SAFETY: inside the chunk, aligned; zero bytes are a `CountCell`
        // at zero, and cells are atomics.
        Some(unsafe { core::slice::from_raw_parts(chunk.add(at).cast::<CountCell>(), n) })
    }

    /// Slot `i`'s latency cells, where a timing probe counts its calls
    /// and times their returns (`None` as for
    /// [`count_cells`](Self::count_cells)).
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // aligned by `latency_at`
    pub fn latency_cells(&self, i: usize) -> Option<&[LatencyCell]> {
        let n = self.cells;
        if n < uprobe_core::latency_cells() {
            return None;
        }
        let chunk = self.chunk(i / PER_CHUNK)?;
        let at = latency_at(n) + i % PER_CHUNK * n * size_of::<LatencyCell>();
        // SAFETY: as in `count_cells`; zero bytes are a `LatencyCell` at
        // zero.
        Some(unsafe { core::slice::from_raw_parts(chunk.add(at).cast::<LatencyCell>(), n) })
    }

    /// The slot of probe `probe` for a function labelled `label`: the one
    /// any process made for them before, or a new one; `None` when the
    /// report cannot grow. Not async-signal-safe only in that it may be
    /// slow (it may grow the file and map a chunk).
    #[must_use]
    pub fn claim(&self, probe: usize, label: &str) -> Option<(usize, &Slot)> {
        let h = hash(probe, label);
        let tag = (h >> 32 | 1) << 32;
        let index = self.index();
        for k in 0..PROBES {
            let word = &index[(h as usize + k) % INDEX];
            let mut waited = 0;
            loop {
                let w = word.load(Ordering::Acquire);
                if w == 0 {
                    if word
                        .compare_exchange(0, tag | PENDING, Ordering::AcqRel, Ordering::Acquire)
                        .is_err()
                    {
                        continue;
                    }
                    let claimed = self.new_slot(probe, label);
                    let published = claimed.map_or(0, |(i, _)| tag | (i as u64 + 1));
                    word.store(published, Ordering::Release);
                    return claimed;
                }
                if w & !PENDING != tag {
                    break;
                }
                if w & PENDING == PENDING {
                    // Another claim is filling it in: wait a while.
                    waited += 1;
                    if waited > 10_000 {
                        break;
                    }
                    std::thread::yield_now();
                    continue;
                }
                let i = (w & PENDING) as usize - 1;
                if let Some(slot) = self.slot(i)
                    && slot.probe.load(Ordering::Relaxed) as usize == probe
                    && slot.label() == label
                {
                    return Some((i, slot));
                }
                break;
            }
        }
        self.new_slot(probe, label)
    }

    /// A new slot for probe `probe`, labelled `label`.
    fn new_slot(&self, probe: usize, label: &str) -> Option<(usize, &Slot)> {
        let i = self.header().used.fetch_add(1, Ordering::Relaxed) as usize;
        let Some(slot) = self.slot(i) else {
            self.header().lost_slots.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        slot.fill(i, probe, label);
        Some((i, slot))
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
        slot.index.load(Ordering::Relaxed) as usize
    }

    /// The slots filled in so far, with their indexes.
    pub fn slots(&self) -> impl Iterator<Item = (usize, &Slot)> {
        let used = self.header().used.load(Ordering::Acquire) as usize;
        (0..used)
            .filter_map(|i| self.slot(i).map(|s| (i, s)))
            .filter(|(_, s)| s.label_len.load(Ordering::Acquire) != 0)
    }
}

impl Slot {
    /// Fills in fresh slot `index` for probe `probe`.
    pub(super) fn fill(&self, index: usize, probe: usize, label: &str) {
        self.probe.store(probe as u32, Ordering::Relaxed);
        self.index.store(index as u32, Ordering::Relaxed);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report(name: &str) -> Report {
        let path = std::env::temp_dir().join(format!("uprobe-trace-{name}-{}", std::process::id()));
        let report = Report::create(&path, &["a".into(), "b".into()]).unwrap();
        let _ = std::fs::remove_file(&path);
        report
    }

    #[test]
    fn a_label_has_one_slot_per_probe_and_the_report_grows() {
        let path = std::env::temp_dir().join(format!("uprobe-trace-grow-{}", std::process::id()));
        let report = Report::create(&path, &["libc.so.6:*".into()]).unwrap();
        // Far more slots than one chunk, and than the old fixed report.
        let n = 20 * PER_CHUNK + 7;
        let first: Vec<usize> = (0..n)
            .map(|k| report.claim(0, &format!("libc.so.6:f{k}")).unwrap().0)
            .collect();
        let again: Vec<usize> = (0..n)
            .map(|k| report.claim(0, &format!("libc.so.6:f{k}")).unwrap().0)
            .collect();
        assert_eq!(first, again, "a label claimed twice has one slot");
        assert_eq!(report.header().used.load(Ordering::Relaxed) as usize, n + 1);
        // Another probe's slot for the same label is its own.
        let other = report.claim(1, "libc.so.6:f0").unwrap().0;
        assert!(!first.contains(&other));
        // Counting into the last slot, read back through a mapping of its own.
        let last = *first.last().unwrap();
        report.slot(last).unwrap().hits.add(5);
        // (A reader maps chunks through the file, which must still be
        // there: the tool removes it once it has read the report.)
        let reader = Report::open(&path).unwrap();
        assert_eq!(reader.calls(last), 5);
        assert_eq!(
            reader.slot(last).unwrap().label(),
            format!("libc.so.6:f{}", n - 1)
        );
        assert_eq!(reader.slots().count(), n + 2);
        assert_eq!(reader.header().lost_slots.load(Ordering::Relaxed), 0);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    #[cfg_attr(miri, ignore = "forks")]
    fn processes_share_a_label_s_slot() {
        let report = report("share");
        let mine = report.claim(0, "libc.so.6:malloc").unwrap().0;
        // SAFETY: the child only claims, counts and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = match report.claim(0, "libc.so.6:malloc") {
                Some((i, _)) if i == mine => {
                    // A label the parent never claimed: a new slot the
                    // parent finds by claiming it after.
                    let (j, _) = report.claim(0, "libc.so.6:free").unwrap();
                    report.slot(j).unwrap().hits.add(3);
                    0
                }
                _ => 1,
            };
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: our child.
        unsafe { libc::waitpid(pid, &raw mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        let (free, _) = report.claim(0, "libc.so.6:free").unwrap();
        assert_eq!(
            report.calls(free),
            3,
            "the child's slot, found by its label"
        );
    }
}
