//! `--flow`: every call and return of the probed functions, as records
//! the agents append to a file of their own (every traced process maps
//! it, and the tool reads it back into each thread's nested calls).
//!
//! The records are in shards by CPU, each with its own count of records
//! taken: a hit takes the next record of its CPU's shard with one atomic
//! add (rarely contended: a thread moved between the add and the stores
//! shares the line with one other CPU at most), fills it in and publishes
//! it by storing its time last; a full shard sends it to the next. When
//! every shard is full, what is dropped is counted. Nothing
//! locks, nothing allocates: async-signal-safe.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Marks a flow file.
const MAGIC: u64 = 0x7570_7472_666c_6f01;
/// Shards (by CPU).
const SHARDS: usize = 8;

/// One call or return.
#[repr(C)]
pub struct Record {
    /// When (`CLOCK_MONOTONIC`, ns); 0 until the record is filled in.
    time: AtomicU64,
    /// The thread.
    tid: AtomicU32,
    /// The report slot of the function, shifted left once; bit 0 set for
    /// a return.
    what: AtomicU32,
}

/// The file's first cache line.
#[repr(C, align(64))]
struct Head {
    magic: AtomicU64,
    /// Records per shard.
    per_shard: AtomicU64,
    /// Records dropped (a full shard).
    lost: AtomicU64,
}

/// A shard's count of records taken, a cache line of its own.
#[repr(C, align(64))]
struct Taken(AtomicU64);

/// A call or return, as read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// When (ns).
    pub time: u64,
    /// The thread.
    pub tid: u32,
    /// The report slot of the function.
    pub slot: u32,
    /// A return (else a call).
    pub ret: bool,
}

/// A mapped flow file.
pub struct Flow {
    base: *mut u8,
    len: usize,
    per_shard: usize,
}

// SAFETY: shared memory accessed through atomics only.
unsafe impl Send for Flow {}
// SAFETY: as above.
unsafe impl Sync for Flow {}

impl core::fmt::Debug for Flow {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Flow")
            .field("per_shard", &self.per_shard)
            .finish_non_exhaustive()
    }
}

const RECORDS_AT: usize = size_of::<Head>() + SHARDS * size_of::<Taken>();

impl Flow {
    /// Creates the flow file at `path` (owner only) with room for about
    /// `records` records, and maps it. Sparse: records never taken use no
    /// memory.
    pub fn create(path: &Path, records: usize) -> io::Result<Self> {
        let per_shard = records.div_ceil(SHARDS).max(1);
        let len = RECORDS_AT + SHARDS * per_shard * size_of::<Record>();
        let file = super::create_file(path, len)?;
        let mut flow = Self::map(&file, len)?;
        flow.per_shard = per_shard;
        let head = flow.head();
        head.per_shard.store(per_shard as u64, Ordering::Relaxed);
        head.magic.store(MAGIC, Ordering::Release);
        Ok(flow)
    }

    /// Maps the flow file at `path` (made by [`create`](Self::create)).
    pub fn open(path: &Path) -> io::Result<Self> {
        let (file, len) = super::open_file(path, RECORDS_AT, "not a flow file")?;
        let mut flow = Self::map(&file, len)?;
        let per_shard = flow.head().per_shard.load(Ordering::Relaxed) as usize;
        if flow.head().magic.load(Ordering::Acquire) != MAGIC
            || RECORDS_AT + SHARDS * per_shard * size_of::<Record>() > len
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a flow file",
            ));
        }
        flow.per_shard = per_shard;
        Ok(flow)
    }

    fn map(file: &std::fs::File, len: usize) -> io::Result<Self> {
        Ok(Self {
            base: super::map_shared(file, len)?,
            len,
            per_shard: 0,
        })
    }

    #[allow(clippy::cast_ptr_alignment)] // page-aligned
    fn head(&self) -> &Head {
        // SAFETY: the mapping starts with the head; atomics only.
        unsafe { &*self.base.cast::<Head>() }
    }

    #[allow(clippy::cast_ptr_alignment)] // cache-line multiples
    fn taken(&self, shard: usize) -> &AtomicU64 {
        // SAFETY: inside the mapping (checked at open), aligned.
        unsafe {
            &(*self
                .base
                .add(size_of::<Head>() + shard * size_of::<Taken>())
                .cast::<Taken>())
            .0
        }
    }

    #[allow(clippy::cast_ptr_alignment)] // 16-byte records after 64-byte lines
    fn record(&self, shard: usize, i: usize) -> &Record {
        let at = RECORDS_AT + (shard * self.per_shard + i) * size_of::<Record>();
        // SAFETY: `i < per_shard` (the callers check), so inside the
        // mapping; aligned; zero bytes are an empty record.
        unsafe { &*self.base.add(at).cast::<Record>() }
    }

    /// Appends a call (`ret` false) or a return of the function of report
    /// slot `slot` on thread `tid` at `time` (ns, never 0).
    /// Async-signal-safe.
    pub fn append(&self, tid: u32, slot: u32, ret: bool, time: u64) {
        let cpu = pcpu::current_cpu();
        // The CPU's shard, or where it is full the next with room (a
        // program that runs on one CPU fills them all).
        for k in 0..SHARDS {
            let shard = (cpu + k) % SHARDS;
            let i = self.taken(shard).fetch_add(1, Ordering::Relaxed) as usize;
            if i < self.per_shard {
                let r = self.record(shard, i);
                r.tid.store(tid, Ordering::Relaxed);
                r.what.store(slot << 1 | u32::from(ret), Ordering::Relaxed);
                r.time.store(time.max(1), Ordering::Release);
                return;
            }
        }
        self.head().lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Records dropped because a shard was full.
    #[must_use]
    pub fn lost(&self) -> u64 {
        self.head().lost.load(Ordering::Relaxed)
    }

    /// Every record filled in, by time.
    #[must_use]
    pub fn events(&self) -> Vec<Event> {
        let mut out = Vec::new();
        for shard in 0..SHARDS {
            let n = (self.taken(shard).load(Ordering::Acquire) as usize).min(self.per_shard);
            for i in 0..n {
                let r = self.record(shard, i);
                let time = r.time.load(Ordering::Acquire);
                if time == 0 {
                    continue;
                }
                let what = r.what.load(Ordering::Relaxed);
                out.push(Event {
                    time,
                    tid: r.tid.load(Ordering::Relaxed),
                    slot: what >> 1,
                    ret: what & 1 == 1,
                });
            }
        }
        out.sort_by_key(|e| (e.time, e.tid));
        out
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_in_time_order_and_a_full_file_counts_its_losses() {
        let path = std::env::temp_dir().join(format!("uprobe-trace-flow-{}", std::process::id()));
        let flow = Flow::create(&path, 64).unwrap();
        let reader = Flow::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        flow.append(7, 3, false, 100);
        flow.append(7, 3, true, 250);
        flow.append(8, 1, false, 120);
        assert_eq!(
            reader.events(),
            [
                Event {
                    time: 100,
                    tid: 7,
                    slot: 3,
                    ret: false
                },
                Event {
                    time: 120,
                    tid: 8,
                    slot: 1,
                    ret: false
                },
                Event {
                    time: 250,
                    tid: 7,
                    slot: 3,
                    ret: true
                },
            ]
        );
        // Eight records a shard, 64 in all: every one is used (whichever
        // CPUs the thread runs on), then appends are lost.
        for t in 0..200 {
            flow.append(9, 0, false, 1000 + t);
        }
        assert_eq!(reader.lost(), 203 - 64);
        assert_eq!(reader.events().len(), 64);
    }
}
