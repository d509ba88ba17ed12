//! Regions of per-probe trampolines: the header every trampoline starts
//! with, room for one more within reach of the code, and where each
//! trampoline's relocated instructions came from (the fault handler and
//! the thread checks ask). What a trampoline holds is the architecture's
//! `jump` (its code) and `crate::site::jump` (the record of a site's
//! jump); which trampoline serves which site is `crate::patch::jump`'s.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use super::regions::{MAX_REGIONS, Regions};
use super::{REACH, REGION_SIZE, map_near, write_code};
use crate::base::mode::NotOptimized;

pub(crate) use crate::arch::{Moves, TRAMPOLINE_SIZE};

/// Trampolines per region.
const PER_REGION: usize = REGION_SIZE / TRAMPOLINE_SIZE;
/// The regions, each with its trampolines' moves (null: no trampoline
/// there yet), for the fault handler and the thread checks.
static PUBLISHED: Regions<[AtomicPtr<Moves>; PER_REGION]> = Regions::new();

/// The regions mapped so far: `(base, bytes used)`, in the order they
/// were published.
static REGIONS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Whether new trampolines are refused as if no gap were within reach
/// (for tests; see `testing::no_trampoline_room`).
static NO_ROOM: AtomicBool = AtomicBool::new(false);

/// Makes new trampolines fail as if no gap were within reach of the code
/// (`on`), or not. Not async-signal-safe (attach-time only).
#[cfg(feature = "test-hooks")]
pub(crate) fn refuse_room(on: bool) {
    NO_ROOM.store(on, Ordering::Relaxed);
}

/// Places a new trampoline within reach of `near`: `build` makes its
/// code for the base it is given (with the moves of its relocated
/// instructions), which is written there and recorded for the fault
/// handler. Returns the base and the recorded moves. Room is taken only
/// when `build` succeeds. Not async-signal-safe.
pub(crate) fn place(
    near: usize,
    build: impl FnOnce(usize) -> Result<(Vec<u8>, Moves), NotOptimized>,
) -> Result<(usize, &'static Moves), NotOptimized> {
    if NO_ROOM.load(Ordering::Relaxed) {
        return Err(NotOptimized::NoTrampolineRoom);
    }
    let mut regions = REGIONS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let found = regions.iter().position(|&(base, used)| {
        base.abs_diff(near) < REACH && used + TRAMPOLINE_SIZE <= REGION_SIZE
    });
    let region = if let Some(k) = found {
        k
    } else {
        if regions.len() == MAX_REGIONS {
            return Err(NotOptimized::NoTrampolineRoom);
        }
        let base = map_near(near, REGION_SIZE).map_err(|_| NotOptimized::NoTrampolineRoom)?;
        PUBLISHED
            .publish(
                base,
                Box::new([const { AtomicPtr::new(core::ptr::null_mut()) }; PER_REGION]),
            )
            .ok_or(NotOptimized::NoTrampolineRoom)?;
        regions.push((base, 0));
        regions.len() - 1
    };
    let (region_base, used) = regions[region];
    let base = region_base + used;
    let (code, moves) = build(base)?;
    write_code(base, &code).map_err(|_| NotOptimized::NoTrampolineRoom)?;
    regions[region].1 += TRAMPOLINE_SIZE;
    let moves: &'static Moves = Box::leak(Box::new(moves));
    let slots = PUBLISHED.table(region).expect("published with the region");
    slots[used / TRAMPOLINE_SIZE].store(core::ptr::from_ref(moves).cast_mut(), Ordering::Release);
    Ok((base, moves))
}

/// Bytes of address space the regions take (never unmapped).
/// Async-signal-safe: loads only.
pub(crate) fn mapped_bytes() -> usize {
    PUBLISHED.mapped_bytes()
}

/// Whether a region of trampolines was mapped. Async-signal-safe.
pub(crate) fn any_region() -> bool {
    PUBLISHED.any()
}

/// If `pc` runs a relocated instruction of a trampoline: the original
/// instruction's address, and the relocated copy's. Async-signal-safe:
/// loads only.
pub(crate) fn relocated_origin(pc: usize) -> Option<(usize, usize)> {
    let (base, slots) = PUBLISHED.find(pc)?;
    let moves = slots[(pc - base) / TRAMPOLINE_SIZE].load(Ordering::Acquire);
    // SAFETY: moves are leaked once published.
    let moves = unsafe { moves.as_ref() }?;
    let mut found = None;
    for &(orig, copy) in moves {
        if copy <= pc {
            found = Some((orig, copy));
        }
    }
    found
}
