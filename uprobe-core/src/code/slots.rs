//! Out-of-line execution (XOL) slots, the architecture-independent part
//! (the relocation into them is the architecture's `xol`).
//!
//! An instruction that is not emulated runs *out of line*: at attach it is
//! relocated (by the architecture's encoder) into a slot followed by a
//! branch back to the next instruction, and each hit sets the PC to the
//! slot: one trap per hit, no single-step.
//!
//! Slots live in regions mapped within reach of the code they serve
//! (x86-64: +-2 GB, for RIP-relative operands and the 32-bit jump back;
//! aarch64: +-128 MB, for the `B` back), so a slot needs no register to
//! get back. A slot's content is a pure function of (address, original
//! bytes), and a slot is only ever reused for that same key: a thread
//! preempted inside a slot of a detached probe can never find other code
//! there, and memory is bounded by the number of distinct probed sites.
//! Free slots of a region are handed out by a `pcpu-freelist` pool;
//! running out (no region can be mapped near the code, or a region is
//! full and no other fits) is an error at attach, never a block.
//!
//! Where no region fits near the code, a slot may instead end in a
//! breakpoint anywhere ([`SlotEnd::TrapBack`]), for instructions that do
//! not address relative to the PC.

use std::collections::HashMap;
use std::sync::Mutex;
#[cfg(feature = "bench-variants")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicUsize, Ordering};

use pcpu_freelist::FreeList;

use crate::AttachError;

use super::regions::Regions;
use super::{REACH, REGION_SIZE, map_near, write_code};
use crate::arch::SLOT_SIZE;

struct Region {
    base: usize,
    free: FreeList<()>,
}

/// Slots per region.
const PER_REGION: usize = REGION_SIZE / SLOT_SIZE;
/// The regions, each with the probed address each of its slots runs
/// (an origin word; 0: unused).
static REGIONS: Regions<[AtomicUsize; PER_REGION]> = Regions::new();

/// How a slot ends: a branch back to the next instruction (one trap per
/// hit; the slot within reach of the code), or a breakpoint (two traps
/// per hit, but the slot may be anywhere for instructions that do not
/// address relative to the PC; asynchronous signals are deferred while
/// the thread is in the slot).
pub(crate) use crate::arch::SlotEnd;

/// An origin table entry: the probed address in the low 48 bits, the
/// instruction's length in the top byte, bit 55 set for a `TrapBack` slot.
const TRAP_BACK_BIT: usize = 1 << 55;
const ADDR_MASK: usize = (1 << 48) - 1;

/// What the slot containing `ip` serves: the probed address, the
/// instruction's length, and how the slot ends.
/// Async-signal-safe: loads only.
pub(crate) fn slot_info(ip: usize) -> Option<(usize, usize, SlotEnd)> {
    let word = origin_word(ip)?;
    let end = if word & TRAP_BACK_BIT == 0 {
        SlotEnd::JumpBack
    } else {
        SlotEnd::TrapBack
    };
    Some((word & ADDR_MASK, word >> 56, end))
}

/// If `ip` is inside an out-of-line slot, the probed address whose
/// instruction that slot runs (a fault raised there is reported at that
/// address, as the kernel does). Async-signal-safe: loads only.
pub(crate) fn origin_of(ip: usize) -> Option<usize> {
    slot_info(ip).map(|(addr, _, _)| addr)
}

fn origin_word(ip: usize) -> Option<usize> {
    let (base, origins) = REGIONS.find(ip)?;
    Some(origins[(ip - base) / SLOT_SIZE].load(Ordering::Acquire)).filter(|&a| a != 0)
}

#[derive(Default)]
struct Slots {
    regions: Vec<Region>,
    /// (address, original bytes, ending) -> slot address.
    by_key: HashMap<(usize, Vec<u8>, SlotEnd), usize>,
}

static SLOTS: Mutex<Option<Slots>> = Mutex::new(None);

/// The slot ending preferred for new slots (the bench-only switch):
/// `false` for `JumpBack`, `true` to force `TrapBack`.
#[cfg(feature = "bench-variants")]
static FORCE_TRAP_BACK: AtomicBool = AtomicBool::new(false);

/// Makes new slots end in a trap (two traps per hit) instead of a jump
/// back, to measure that path. Probes attached before keep their slots.
#[cfg(feature = "bench-variants")]
pub(crate) fn force_trap_back(on: bool) {
    FORCE_TRAP_BACK.store(on, Ordering::Relaxed);
}

/// The slot running the instruction at `addr` (whose bytes are `bytes`)
/// out of line, and how it ends, reusing the one made before for the same
/// key. A slot branches back when one can be had within reach of the code;
/// else, unless the instruction `needs_near` (it addresses relative to the
/// PC), it ends in a trap, anywhere. `relocate(slot, end)` makes the
/// slot's code. Not async-signal-safe.
pub(crate) fn slot_for(
    addr: usize,
    bytes: &[u8],
    needs_near: bool,
    relocate: crate::arch::SlotCode<'_>,
) -> Result<(usize, SlotEnd), AttachError> {
    let mut guard = SLOTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let slots = guard.get_or_insert_with(Slots::default);
    #[cfg(feature = "bench-variants")]
    let forced = FORCE_TRAP_BACK.load(Ordering::Relaxed);
    #[cfg(not(feature = "bench-variants"))]
    let forced = false;
    let preferred = if forced {
        SlotEnd::TrapBack
    } else {
        SlotEnd::JumpBack
    };
    if let Some(&slot) = slots.by_key.get(&(addr, bytes.to_vec(), preferred)) {
        return Ok((slot, preferred));
    }
    let (slot, end) = match take_slot(slots, addr, true) {
        Ok(slot) => (slot, preferred),
        Err(e) => {
            // Nothing within reach: a trap-ended slot made before for this
            // key, or a new one anywhere, if the instruction does not
            // address relative to the PC.
            if let Some(&slot) = slots.by_key.get(&(addr, bytes.to_vec(), SlotEnd::TrapBack)) {
                return Ok((slot, SlotEnd::TrapBack));
            }
            if needs_near {
                return Err(e);
            }
            (take_slot(slots, addr, false)?, SlotEnd::TrapBack)
        }
    };
    let code = relocate(slot, end)?;
    if code.len() > SLOT_SIZE {
        return Err(AttachError::Unsupported {
            addr,
            insn: format!("{bytes:02x?}"),
            why: "relocated, it does not fit an out-of-line slot",
        });
    }
    write_slot(slot, &code)?;
    record_origin(slot, addr, bytes.len(), end);
    slots.by_key.insert((addr, bytes.to_vec(), end), slot);
    Ok((slot, end))
}

/// A free slot, within reach of `addr` if `near`, mapping a new region if
/// needed.
fn take_slot(slots: &mut Slots, addr: usize, near: bool) -> Result<usize, AttachError> {
    let reachable = |base: usize| !near || base.abs_diff(addr) < REACH;
    let from_region = |r: &Region| r.free.pop().map(|e| r.base + e.into_index() * SLOT_SIZE);
    if let Some(slot) = slots
        .regions
        .iter()
        .filter(|r| reachable(r.base))
        .find_map(from_region)
    {
        return Ok(slot);
    }
    let region = if near {
        map_region_near(addr)?
    } else {
        map_region_anywhere()?
    };
    let slot = from_region(&region).expect("a new region has free slots");
    slots.regions.push(region);
    Ok(slot)
}

/// Notes which instruction `slot` serves, for the trap and fault handlers.
fn record_origin(slot: usize, addr: usize, len: usize, end: SlotEnd) {
    let trap = if end == SlotEnd::TrapBack {
        TRAP_BACK_BIT
    } else {
        0
    };
    let word = (addr & ADDR_MASK) | trap | (len << 56);
    if let Some((base, origins)) = REGIONS.find(slot) {
        origins[(slot - base) / SLOT_SIZE].store(word, Ordering::Release);
    }
}

/// Publishes a new region for the fault handler.
fn publish_region(base: usize) -> Result<(), AttachError> {
    REGIONS
        .publish(base, Box::new([const { AtomicUsize::new(0) }; PER_REGION]))
        .map(drop)
        .ok_or(AttachError::Os {
            what: "too many out-of-line regions",
            errno: crate::base::error::Errno::new(libc::ENOMEM),
        })
}

/// Writes a slot's code, keeping its page executable throughout (other
/// slots on it may be running).
fn write_slot(slot: usize, code: &[u8]) -> Result<(), AttachError> {
    write_code(slot, code)
}

/// Maps a region of slots wherever the kernel likes.
fn map_region_anywhere() -> Result<Region, AttachError> {
    let base = super::map_anywhere(REGION_SIZE, "mmap (out-of-line slots)")?;
    publish_region(base)?;
    Ok(Region {
        base,
        free: FreeList::new(core::iter::repeat_n((), REGION_SIZE / SLOT_SIZE)),
    })
}

/// Maps a region of slots within reach of `addr`: the free gap of the
/// address space nearest to it, away from where the main stack and the
/// `brk` heap grow.
fn map_region_near(addr: usize) -> Result<Region, AttachError> {
    let base = map_near(addr, REGION_SIZE)?;
    publish_region(base)?;
    Ok(Region {
        base,
        free: FreeList::new(core::iter::repeat_n((), REGION_SIZE / SLOT_SIZE)),
    })
}

/// Bytes of address space the regions take (never unmapped).
/// Async-signal-safe: loads only.
pub(crate) fn mapped_bytes() -> usize {
    REGIONS.mapped_bytes()
}

/// Whether a region of slots was mapped. Async-signal-safe.
pub(crate) fn any_region() -> bool {
    REGIONS.any()
}
