//! The record of a site that runs (or is about to run) through a jump:
//! the range the jump covers, its bytes and the original ones, and the
//! trampoline it goes to, whose [`JumpCell`] names the site it serves.
//! Writing and taking back jumps is `crate::patch::jump`'s.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use super::Site;
use crate::arch::JUMP_LEN;
use crate::arch::{ENTRY_PTR_AT, Moves};
use crate::base::mode::Tactic;
use std::sync::atomic::AtomicU64;

/// Which site a trampoline serves now. Never freed. `#[repr(C)]`: the
/// counting entry reads `counter` and `timed` at the offsets `crate::base::abi` declares.
#[repr(C)]
pub(crate) struct JumpCell {
    /// The probed address.
    pub(crate) addr: usize,
    /// The site (null: detached).
    pub(crate) site: AtomicPtr<Site>,
    /// The site's consumer when it is the only one and has no thread
    /// filter (null otherwise: the hit goes through the site's list).
    /// Two loads fewer on the way to the handler, which is most of what
    /// a hit waits for: each is a step of one chain of dependent loads.
    /// Set before the list holding it is published, and cleared or
    /// replaced before that list is retired, so a read section that
    /// loaded it finds it alive, like the list (see `Site::publish_list`).
    pub(crate) lone_consumer: AtomicPtr<super::consumer::Consumer>,
    /// Where a hit is counted without running the engine, when the site's
    /// only consumer is a counting probe (null: every hit runs the
    /// engine). See [`super::count`].
    pub(crate) counter: AtomicPtr<AtomicU64>,
    /// The switch of the site's only consumer when that is a timing probe
    /// the entry routine times itself (null: every hit runs the engine).
    /// See [`super::timing`].
    pub(crate) timed: AtomicPtr<super::timing::Switch>,
    /// The trampoline's address, once it is placed (0 before).
    pub(crate) trampoline: AtomicUsize,
    /// The switch of the site's only consumer when that is a return
    /// probe whose entries the return entry routine takes (no entry
    /// handler, no thread filter, returns that hold nothing); null: every
    /// hit runs the engine. See [`super::returns`].
    pub(crate) returns: AtomicPtr<super::switch::Switch>,
    /// That consumer's per-CPU hit counters (slot 0), which the routine
    /// counts its entries in; set and cleared with `returns`.
    pub(crate) return_hits: AtomicPtr<AtomicU64>,
}

// The layout the architectures' routines read (`crate::base::abi`).
const _: () = assert!(
    core::mem::offset_of!(JumpCell, addr) == 0
        && core::mem::offset_of!(JumpCell, counter) == crate::base::abi::JUMP_CELL_COUNTER_AT
        && core::mem::offset_of!(JumpCell, timed) == crate::base::abi::JUMP_CELL_TIMED_AT
        && core::mem::offset_of!(JumpCell, returns) == crate::base::abi::JUMP_CELL_RETURNS_AT
        && core::mem::offset_of!(JumpCell, return_hits)
            == crate::base::abi::JUMP_CELL_RETURN_HITS_AT
);

/// A trampoline: where it is, its cell, and where each instruction it
/// copies runs relocated. Never freed.
pub(crate) struct Trampoline {
    pub(crate) base: usize,
    pub(crate) cell: &'static JumpCell,
    /// (address of a copied instruction, its relocated copy): the range's
    /// instructions, then a punned jump's tail.
    pub(crate) moves: &'static Moves,
    /// The end of the original code it runs a copy of: the range's end,
    /// or after a punned jump, its tail's (the instructions that start
    /// inside the jump's bytes, run there so that a hit never goes back
    /// into the middle of the jump).
    pub(crate) copied_end: usize,
}

/// A site that runs through a jump: the range the jump covers and what
/// was there.
pub(crate) struct Jump {
    /// The probed address: `start`, or the landing pad before it.
    pub(crate) site: usize,
    /// Where the jump goes.
    pub(crate) start: usize,
    /// Bytes of whole instructions the trampoline runs (>= the jump,
    /// unless punned).
    pub(crate) len: usize,
    /// The bytes the patch writes (the first `written` of them) and the
    /// original bytes under them.
    pub(crate) bytes: [u8; JUMP_LEN],
    pub(crate) original: [u8; JUMP_LEN],
    /// How many bytes the patch changes: the whole jump, or (punned) the
    /// probed instruction's bytes.
    pub(crate) written: usize,
    /// A punned jump's bytes after the written ones, which its
    /// displacement takes as they are (empty otherwise). They must stay
    /// what they are while the jump is in: no other site may lie there.
    pub(crate) fixed: Vec<u8>,
    pub(crate) tactic: Tactic,
    /// Written over the original code with no breakpoint before it, and
    /// taken out the same way (a one-byte patch in code that runs with
    /// signals blocked, where a breakpoint would kill): the site never
    /// has a breakpoint, and cannot go back to one.
    pub(crate) direct: bool,
    pub(crate) trampoline: &'static Trampoline,
}

impl Jump {
    /// Whether the jump is in the code (false after an unload: other
    /// code, or nothing, is there now). `start` must be mapped.
    pub(crate) fn in_code(&self) -> bool {
        // SAFETY: the caller's contract.
        unsafe { read_code(self.start)[..self.written] == self.bytes[..self.written] }
    }

    /// Whether the range holds several instructions (a thread may be
    /// stopped between them).
    pub(crate) fn has_interior(&self) -> bool {
        let range = self.start..self.start + self.len;
        let copies = self.trampoline.moves.iter();
        copies.filter(|&&(at, _)| range.contains(&at)).count() > 1
    }

    /// Whether `addr` lies inside the range, past the probed address, or
    /// among a punned jump's fixed bytes or the tail its trampoline
    /// copies.
    pub(crate) fn covers(&self, addr: usize) -> bool {
        addr > self.site && addr < self.end()
    }

    /// The end of what the jump depends on: its range, its last fixed
    /// byte, or the end of its trampoline's tail.
    pub(crate) fn end(&self) -> usize {
        (self.start + self.len)
            .max(self.start + self.written + self.fixed.len())
            .max(self.trampoline.copied_end)
    }

    /// The original bytes the patch replaces, and where they start.
    pub(crate) fn original(&self) -> (usize, &[u8]) {
        (self.start, &self.original[..self.written])
    }

    /// Whether its bytes could change for a jump to the same trampoline
    /// through a stub elsewhere: a punned jump's displacement has bytes
    /// of its own choosing, and a jump over the probed instruction alone
    /// (not after a landing pad) can be written whole through a stub.
    /// Never a one-byte jump written with no breakpoint (`direct`).
    pub(crate) fn stub_could_move(&self) -> bool {
        !self.direct
            && (self.tactic.free_bytes() > 0
                || (self.tactic == Tactic::Replace
                    && !self.after_landing_pad()
                    && !self.has_interior()
                    && crate::arch::PUNNING.is_some()))
    }

    /// Whether the jump comes after a landing pad that stays in place
    /// (the probed address is the landing pad's).
    pub(crate) fn after_landing_pad(&self) -> bool {
        self.start != self.site
    }
}

/// Reads the `JUMP_LEN` bytes at `addr`.
///
/// # Safety
/// They are mapped.
pub(crate) unsafe fn read_code(addr: usize) -> [u8; JUMP_LEN] {
    // SAFETY: the caller's contract.
    core::array::from_fn(|i| unsafe { core::ptr::read_volatile((addr + i) as *const u8) })
}

pub(crate) use crate::arch::{Function, Pun};

/// The routines a trampoline's header may name: the engine's entry, the
/// timed entry that times a timing probe's calls itself, and the return
/// entry that tracks a return probe's calls itself (0: the architecture
/// has none, or they are off). Set by the architecture's routines when
/// they turn on ([`enable_routines`]).
static ENGINE_ENTRY: AtomicUsize = AtomicUsize::new(0);
static TIMED_ENTRY: AtomicUsize = AtomicUsize::new(0);
static RETURN_ENTRY: AtomicUsize = AtomicUsize::new(0);

/// Turns on the architecture's own entry routines, where it has them and
/// this process and processor allow them (once the clock and the return
/// stubs are ready), and names the routines [`route`] chooses between.
/// Not async-signal-safe.
pub(crate) fn enable_routines() {
    let Some(routines) = crate::arch::TIMED_ROUTINES else {
        return;
    };
    if TIMED_ENTRY.load(Ordering::Acquire) != 0 {
        return;
    }
    let first_stub = crate::code::return_stubs::FIRST_STUB_AT.load(Ordering::Acquire);
    if first_stub == 0 {
        return;
    }
    if let Some(entries) = (routines.enable)(first_stub) {
        ENGINE_ENTRY.store(crate::arch::jump_entry::routine(), Ordering::Relaxed);
        RETURN_ENTRY.store(entries.returns, Ordering::Relaxed);
        TIMED_ENTRY.store(entries.timed, Ordering::Release);
    }
}

/// Whether trampolines may time calls and track returns themselves in
/// this process.
pub(crate) fn trampolines_time() -> bool {
    TIMED_ENTRY.load(Ordering::Acquire) != 0
}

/// Which routine a trampoline's full path calls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Route {
    /// The engine's (every hit).
    Engine,
    /// The timed entry (a timing probe's calls).
    Timed,
    /// The return entry (a return probe's calls).
    Returns,
}

/// Points the trampoline of `cell` at the routine `to`: one aligned
/// store to its header's entry pointer, which its full path calls
/// through, written only if it changes. Every routine handles every hit
/// (the others send to the engine what they do not handle), so a thread
/// that read the old pointer is right too. The attach lock is held; not
/// async-signal-safe.
pub(crate) fn route(cell: &JumpCell, to: Route) {
    let base = cell.trampoline.load(Ordering::Acquire);
    let entry = match to {
        Route::Engine => &ENGINE_ENTRY,
        Route::Timed => &TIMED_ENTRY,
        Route::Returns => &RETURN_ENTRY,
    }
    .load(Ordering::Acquire);
    if base == 0 || entry == 0 {
        return;
    }
    let at = base + ENTRY_PTR_AT;
    // SAFETY: a trampoline's header, mapped and readable for as long as
    // the process runs (trampolines are never unmapped).
    let now = unsafe { (*(at as *const AtomicU64)).load(Ordering::Relaxed) };
    if now != entry as u64 {
        // A failed write leaves the old routine, which handles every hit.
        let _ = crate::code::write_word(at, entry as u64);
    }
}

/// Which routine the trampoline of `cell` calls now (for tests):
/// `None` before its trampoline is placed, or where the architecture
/// has no routines of its own.
#[cfg(feature = "test-hooks")]
pub(crate) fn route_of(cell: &JumpCell) -> Option<Route> {
    let base = cell.trampoline.load(Ordering::Acquire);
    if base == 0 || !trampolines_time() {
        return None;
    }
    // SAFETY: as in `route`.
    let now = unsafe { (*((base + ENTRY_PTR_AT) as *const AtomicU64)).load(Ordering::Relaxed) };
    [
        (&ENGINE_ENTRY, Route::Engine),
        (&TIMED_ENTRY, Route::Timed),
        (&RETURN_ENTRY, Route::Returns),
    ]
    .into_iter()
    .find(|(entry, _)| entry.load(Ordering::Acquire) as u64 == now)
    .map(|(_, route)| route)
}
