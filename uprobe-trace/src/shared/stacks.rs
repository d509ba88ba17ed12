//! `--stacks`: the report's table of user stacks, each with its count,
//! and of the objects their addresses lie in, for the tool to symbolize
//! once tracing ends.
//!
//! A hit finds its stack's entry by a hash of the stack (and its probe)
//! with open addressing: an entry is claimed by a compare-and-swap of its
//! hash from 0, filled in, and published by storing its depth; a hit of
//! the same stack adds to its count. Nothing locks, nothing allocates:
//! async-signal-safe, and shared by every process the report is mapped in.
//! Each agent lists the objects loaded in its process (their range and
//! load bias) under its own number, which its fork children share.

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use super::{Report, get_text, set_text};

/// Marks a slot number in the stack table as a `--by` key's entry (its
/// one frame is the key), not a stack.
pub const KEY_BIT: u32 = 1 << 31;

/// Frames kept per stack.
pub const MAX_FRAMES: usize = 32;
/// Distinct stacks a report holds.
pub(super) const STACKS: usize = 8192;
/// Objects a report lists, over every process.
pub(super) const OBJECTS: usize = 2048;
/// Entries a hit tries before counting its stack as lost.
const PROBES: usize = 64;
/// Bytes of an object's path.
const PATH_LEN: usize = 232;

/// One distinct stack of one probe.
#[repr(C)]
pub struct StackEntry {
    /// Its hash; 0 while the entry is free.
    pub hash: AtomicU64,
    /// Hits with this stack.
    pub count: super::Sharded,
    /// The report slot of the probe hit.
    pub slot: AtomicU32,
    /// The agent (process) whose objects the addresses are in.
    pub agent: AtomicU32,
    /// Frames, innermost first; 0 until the entry is filled in.
    pub depth: AtomicU32,
    _pad: u32,
    /// The addresses.
    pub frames: [AtomicU64; MAX_FRAMES],
}

impl core::fmt::Debug for StackEntry {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StackEntry")
            .field("count", &self.count.sum())
            .field("depth", &self.depth.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// An object loaded in an agent's process.
#[repr(C)]
pub struct ObjectEntry {
    /// The agent that listed it.
    pub agent: AtomicU32,
    /// The path's length; 0 until the entry is filled in.
    pub path_len: AtomicU32,
    /// Its mapped range and load bias.
    pub start: AtomicU64,
    /// See `start`.
    pub end: AtomicU64,
    /// See `start`.
    pub bias: AtomicU64,
    /// Its file.
    pub path: [AtomicU8; PATH_LEN],
}

impl core::fmt::Debug for ObjectEntry {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ObjectEntry")
            .field("path", &self.path())
            .finish_non_exhaustive()
    }
}

impl ObjectEntry {
    /// The object's file (`None` until filled in).
    #[must_use]
    pub fn path(&self) -> Option<String> {
        get_text(&self.path_len, &self.path)
    }
}

/// A hash of the words of a stack and its slot (a multiply and a rotate
/// per word, then a final mix); never 0.
fn hash(slot: u32, frames: &[usize]) -> u64 {
    // The slot mixed in on its own first: (slot a, frame x) and (slot b,
    // frame y) with a ^ x == b ^ y must not meet (small keys of `--by`
    // would, all the time).
    let mut h: u64 = (0x9e37_79b9_7f4a_7c15 ^ u64::from(slot))
        .wrapping_mul(0xbf58_476d_1ce4_e5b9)
        .rotate_left(31);
    for &f in frames {
        h = (h ^ f as u64)
            .wrapping_mul(0xbf58_476d_1ce4_e5b9)
            .rotate_left(31);
    }
    h ^= h >> 29;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    (h ^ (h >> 32)).max(1)
}

impl Report {
    /// The stack table.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // page-aligned, cache-line multiples
    pub fn stacks(&self) -> &[StackEntry] {
        let at = super::STACKS_AT;
        // SAFETY: inside the base mapping (its size was checked at open),
        // aligned, atomics only.
        unsafe { core::slice::from_raw_parts(self.base.add(at).cast::<StackEntry>(), STACKS) }
    }

    /// The object table.
    #[must_use]
    #[allow(clippy::cast_ptr_alignment)] // page-aligned, cache-line multiples
    pub fn objects(&self) -> &[ObjectEntry] {
        let at = super::STACKS_AT + STACKS * size_of::<StackEntry>();
        // SAFETY: as in `stacks`.
        unsafe { core::slice::from_raw_parts(self.base.add(at).cast::<ObjectEntry>(), OBJECTS) }
    }

    /// Counts one hit of slot `slot` with `frames` (innermost first, at
    /// most [`MAX_FRAMES`] kept) in agent `agent`'s process.
    /// Async-signal-safe.
    pub fn record_stack(&self, slot: u32, agent: u32, frames: &[usize]) {
        let frames = &frames[..frames.len().min(MAX_FRAMES)];
        if frames.is_empty() {
            return;
        }
        let h = hash(slot, frames);
        let table = self.stacks();
        let start = (h % table.len() as u64) as usize;
        for k in 0..PROBES {
            let e = &table[(start + k) % table.len()];
            match e
                .hash
                .compare_exchange(0, h, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    e.slot.store(slot, Ordering::Relaxed);
                    e.agent.store(agent, Ordering::Relaxed);
                    for (dst, &f) in e.frames.iter().zip(frames) {
                        dst.store(f as u64, Ordering::Relaxed);
                    }
                    e.depth.store(frames.len() as u32, Ordering::Release);
                    e.count.add(1);
                    return;
                }
                Err(found) if found == h => {
                    e.count.add(1);
                    return;
                }
                Err(_) => {}
            }
        }
        self.header().lost_stacks.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one hit of slot `slot` under `--by` key `key` (a thread id,
    /// a caller's return address, an argument or a return value), in the
    /// stack table as a stack of one frame. Async-signal-safe.
    pub fn record_key(&self, slot: u32, agent: u32, key: u64) {
        self.record_stack(slot | KEY_BIT, agent, &[key as usize]);
    }

    /// The `--by` keys counted: (slot, agent, key, count).
    pub fn keys(&self) -> impl Iterator<Item = (u32, u32, u64, u64)> + '_ {
        self.stacks().iter().filter_map(|e| {
            let slot = e.slot.load(Ordering::Relaxed);
            (e.depth.load(Ordering::Acquire) == 1 && slot & KEY_BIT != 0).then(|| {
                (
                    slot & !KEY_BIT,
                    e.agent.load(Ordering::Relaxed),
                    e.frames[0].load(Ordering::Relaxed),
                    e.count.sum(),
                )
            })
        })
    }

    /// Lists an object loaded in agent `agent`'s process. Not
    /// async-signal-safe only in that it may be slow.
    pub fn record_object(&self, agent: u32, path: &str, start: u64, end: u64, bias: u64) {
        let i = self.header().objects_used.fetch_add(1, Ordering::Relaxed) as usize;
        let Some(e) = self.objects().get(i) else {
            return;
        };
        e.agent.store(agent, Ordering::Relaxed);
        e.start.store(start, Ordering::Relaxed);
        e.end.store(end, Ordering::Relaxed);
        e.bias.store(bias, Ordering::Relaxed);
        set_text(
            &e.path_len,
            &e.path,
            if path.is_empty() { "?" } else { path },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_are_counted_by_content() {
        let path = std::env::temp_dir().join(format!("uprobe-trace-stacks-{}", std::process::id()));
        let report = Report::create(&path, &["malloc".into()]).unwrap();
        let _ = std::fs::remove_file(&path);
        for _ in 0..3 {
            report.record_stack(0, 1, &[0x10, 0x20, 0x30]);
        }
        report.record_stack(0, 1, &[0x10, 0x20, 0x31]);
        report.record_stack(1, 1, &[0x10, 0x20, 0x30]);
        report.record_stack(0, 1, &[]);
        // Slot and frame that XOR alike are two entries.
        report.record_stack(1, 1, &[0x11]);
        report.record_stack(0x11, 1, &[1]);
        let filled: Vec<(u64, u32, Vec<u64>)> = report
            .stacks()
            .iter()
            .filter(|e| e.depth.load(Ordering::Acquire) > 0)
            .map(|e| {
                let depth = e.depth.load(Ordering::Acquire) as usize;
                (
                    e.count.sum(),
                    e.slot.load(Ordering::Relaxed),
                    e.frames[..depth]
                        .iter()
                        .map(|f| f.load(Ordering::Relaxed))
                        .collect(),
                )
            })
            .collect();
        assert_eq!(filled.len(), 5);
        assert!(filled.contains(&(3, 0, vec![0x10, 0x20, 0x30])));
        assert!(filled.contains(&(1, 0, vec![0x10, 0x20, 0x31])));
        assert!(filled.contains(&(1, 1, vec![0x10, 0x20, 0x30])));
        report.record_object(1, "/lib/libc.so.6", 0x1000, 0x2000, 0x1000);
        assert_eq!(
            report.objects()[0].path().as_deref(),
            Some("/lib/libc.so.6")
        );
    }
}
